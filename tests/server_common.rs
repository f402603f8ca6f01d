//! Helpers shared by the `server_*` end-to-end tests: start `omni-engine serve` on a free port
//! (`--port 0`, the port read back from the `listening on http://...` log line), talk HTTP to
//! it, read SSE streams and `/metrics`, find its worker processes and shared memory.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "engine_common.rs"]
mod engine_common;
#[allow(unused_imports)] // each test binary uses a different subset
pub use engine_common::{children_named, engine_bin, fixture, segments_of};

/// A ChatML-like template for the fixture models, which ship none.
pub const CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The fixture tokenizer with [`CHAT_TEMPLATE`], to count tokens the way the server does.
pub fn fixture_tokenizer() -> omni_tokenizer::Tokenizer {
    let mut t = omni_tokenizer::Tokenizer::from_hf_dir(fixture("llama")).unwrap();
    t.set_chat_template(CHAT_TEMPLATE.to_string()).unwrap();
    t
}

/// A running `omni-engine serve`; SIGTERM (then SIGKILL) on drop.
pub struct Server {
    child: Child,
    pub pid: u32,
    pub base: String,
    log: Arc<Mutex<Vec<String>>>,
    pub http: reqwest::Client,
}

impl Server {
    /// `omni-engine serve --host 127.0.0.1 --port 0 <args>`; waits for the listening line.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(engine_bin())
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_BACKTRACE", "0")
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(i) = line.find("listening on http://") {
                    let rest = &line[i + "listening on ".len()..];
                    let url = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(url);
                }
                sink.lock().unwrap().push(line);
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(url) => url,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("server did not start:\n{}", log.lock().unwrap().join("\n"));
            }
        };
        Server {
            child,
            pid,
            base,
            log,
            http: reqwest::Client::new(),
        }
    }

    /// The tiny Llama fixture with [`CHAT_TEMPLATE`], plus `extra` flags.
    pub fn tiny(extra: &[&str]) -> Server {
        let model = fixture("llama");
        let mut args = vec![model.to_str().unwrap(), "--chat-template", CHAT_TEMPLATE];
        args.extend_from_slice(&["--served-model-name", "tiny"]);
        args.extend_from_slice(extra);
        Server::start(&args)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `127.0.0.1:<port>`, for raw TCP connections.
    pub fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// POSTs JSON; returns the status and the body as JSON (`Null` if it is not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// POSTs a streaming request and returns every `data:` payload before `[DONE]`; panics if
    /// the stream does not end with `data: [DONE]`.
    pub async fn sse(&self, path: &str, body: &Value) -> Vec<Value> {
        let resp = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let text = resp.text().await.unwrap();
        parse_sse(&text)
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = self.http.get(self.url(path)).send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }

    /// The value of the first `/metrics` sample named `name` (labels ignored).
    pub async fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        metric_value(&text, name).unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }

    /// A gauge's value once it reaches `want`, or its last value after 2 s. The engine loop
    /// publishes its gauges after the step that finished a request, so a client can hold the
    /// last response a moment before `/metrics` reflects it.
    pub async fn metric_settles(&self, name: &str, want: f64) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let v = self.metric(name).await;
            if v == want || Instant::now() >= deadline {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid as i32), sig).unwrap();
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        if self.wait_exit(Duration::from_secs(10)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The payloads of an SSE body, `[DONE]` required last (and excluded).
pub fn parse_sse(text: &str) -> Vec<Value> {
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(
        data.last(),
        Some(&"[DONE]"),
        "stream did not end with [DONE]:\n{text}"
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// The value of the first sample named exactly `name` (with or without labels).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = if rest.starts_with('{') {
            &rest[rest.find('}')? + 1..]
        } else {
            rest
        };
        if !rest.starts_with(' ') {
            return None;
        }
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Polls `cond` every 20 ms until it holds or `timeout` passes; returns whether it held.
pub async fn eventually<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The concatenated text of the content deltas (chat) or text pieces (completions).
pub fn streamed_text(chunks: &[Value]) -> String {
    let mut out = String::new();
    for c in chunks {
        for choice in c["choices"].as_array().into_iter().flatten() {
            if let Some(t) = choice["delta"]["content"].as_str() {
                out.push_str(t);
            }
            if let Some(t) = choice["text"].as_str() {
                out.push_str(t);
            }
        }
    }
    out
}

/// Reads from `s` until the peer closes it (EOF or reset) or `limit` passes; when it closed.
/// Bytes that arrive first (a response) are skipped.
pub async fn closed_within(s: &mut tokio::net::TcpStream, limit: Duration) -> Option<Instant> {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(Instant::now()),
            Ok(Ok(_)) => {}
        }
    }
}

/// Sends `GET <path>` on a raw connection and reads one response (Content-Length bodies only);
/// returns the status, the header block and the body. Bounded by 10 s.
pub async fn raw_get(s: &mut tokio::net::TcpStream, path: &str) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let head = text[..end].to_string();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
                let body = text[end + 4..end + 4 + len].to_string();
                return (status, head, body);
            }
        }
        let n = tokio::time::timeout_at(deadline, s.read(&mut buf))
            .await
            .expect("no whole response within 10 s")
            .unwrap();
        assert!(n > 0, "closed before a whole response: {text:?}");
        got.extend_from_slice(&buf[..n]);
    }
}

/// Starts a long stream (8000 tokens of the fixture) and returns it after its first text.
pub async fn long_stream(
    server: &Server,
) -> impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin + use<> {
    use futures::StreamExt;
    let resp = server
        .http
        .post(server.url("/v1/completions"))
        .json(&serde_json::json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 8000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = Box::pin(resp.bytes_stream());
    let mut first = body.next().await.unwrap().unwrap().to_vec();
    while !String::from_utf8_lossy(&first).contains("text") {
        first.extend_from_slice(&body.next().await.unwrap().unwrap());
    }
    body
}

/// Reads a stream to its end: its text, and when it ended.
pub async fn rest_of(
    mut body: impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
) -> (String, Instant) {
    use futures::StreamExt;
    let mut out = Vec::new();
    while let Some(Ok(chunk)) = body.next().await {
        out.extend_from_slice(&chunk);
    }
    (String::from_utf8_lossy(&out).into_owned(), Instant::now())
}
