//! One streamed OpenAI request, timed chunk by chunk, and the ready check before a run.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use super::{RequestOutcome, SampleRequest, ServeBenchError};

/// The first model the server lists.
pub async fn first_model(http: &reqwest::Client, base: &str) -> Result<String, ServeBenchError> {
    let url = format!("{base}/v1/models");
    let err = |reason: String| ServeBenchError::Server {
        url: url.clone(),
        reason,
    };
    let v: Value = http
        .get(&url)
        .send()
        .await
        .map_err(|e| err(e.to_string()))?
        .json()
        .await
        .map_err(|e| err(e.to_string()))?;
    v["data"][0]["id"]
        .as_str()
        .map(String::from)
        .ok_or_else(|| err("no model listed; pass --model".into()))
}

/// A streaming request body for either endpoint (greedy, usage requested).
pub fn request_body(model: &str, sample: &SampleRequest, chat: bool, ignore_eos: bool) -> Value {
    let mut body = if chat {
        json!({
            "model": model,
            "messages": [{"role": "user", "content": sample.prompt}],
            "max_completion_tokens": sample.output_len,
        })
    } else {
        json!({"model": model, "prompt": sample.prompt, "max_tokens": sample.output_len})
    };
    body["temperature"] = json!(0.0);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    if ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    body
}

/// What the parser has seen of one SSE stream.
#[derive(Debug, Default)]
struct StreamState {
    first: Option<Instant>,
    last: Option<Instant>,
    itl: Vec<f64>,
    chunks: usize,
    usage_prompt: Option<usize>,
    usage_completion: Option<usize>,
    done: bool,
    error: Option<String>,
}

impl StreamState {
    /// Applies one `data:` payload received at `now`.
    fn data(&mut self, payload: &str, now: Instant) {
        if payload == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(payload) else {
            self.error = Some(format!("unparsable chunk: {payload}"));
            return;
        };
        if let Some(e) = v.get("error") {
            self.error = Some(e.to_string());
            return;
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage_prompt = u["prompt_tokens"].as_u64().map(|x| x as usize);
            self.usage_completion = u["completion_tokens"].as_u64().map(|x| x as usize);
        }
        let Some(c) = v["choices"].get(0) else { return };
        let text = c["delta"]["content"]
            .as_str()
            .or_else(|| c["text"].as_str());
        if text.is_some_and(|t| !t.is_empty()) {
            match self.last {
                None => self.first = Some(now),
                Some(last) => self.itl.push((now - last).as_secs_f64()),
            }
            self.last = Some(now);
            self.chunks += 1;
        }
    }
}

/// How long to wait for the end of a body after its `[DONE]` before closing the connection.
const DRAIN_AFTER_DONE: Duration = Duration::from_secs(1);

/// Time between two attempts of the ready check (vLLM's `retry_interval`).
const READY_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// vLLM's `wait_for_endpoint`: sends the test request until it succeeds or `timeout` passes,
/// `READY_RETRY_INTERVAL` apart; returns the last outcome (an error when none succeeded).
pub async fn wait_for_endpoint(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    prompt_len: usize,
    timeout: Duration,
) -> RequestOutcome {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let attempt = tokio::time::timeout_at(deadline, send(http, url, body, prompt_len)).await;
        let outcome = match attempt {
            Ok(o) if o.success => return o,
            Ok(o) => o,
            Err(_) => RequestOutcome {
                error: Some(format!("no answer within {} s", timeout.as_secs())),
                ..RequestOutcome::default()
            },
        };
        let now = tokio::time::Instant::now();
        if now + READY_RETRY_INTERVAL >= deadline {
            return outcome;
        }
        eprintln!(
            "endpoint not ready: {}",
            outcome.error.as_deref().unwrap_or("?")
        );
        tokio::time::sleep(READY_RETRY_INTERVAL).await;
    }
}

/// Sends one request and times it; failures are outcomes, not errors.
pub async fn send(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    prompt_len: usize,
) -> RequestOutcome {
    let start = Instant::now();
    let fail = |error: String| RequestOutcome {
        error: Some(error),
        prompt_len,
        ..RequestOutcome::default()
    };
    let resp = match http.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => return fail(e.to_string()),
    };
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return fail(format!("HTTP {status}: {text}"));
    }
    let mut st = StreamState::default();
    let mut buf: Vec<u8> = Vec::new();
    let mut stream = resp.bytes_stream();
    let mut done_at = None;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => return fail(e.to_string()),
        };
        let now = Instant::now();
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(data) = line.trim().strip_prefix("data:") {
                st.data(data.trim(), now);
            }
        }
        if st.error.is_some() || st.done {
            done_at = Some(now);
            break;
        }
    }
    if let Some(e) = st.error {
        return fail(e);
    }
    let Some(done_at) = done_at else {
        return fail("stream ended without [DONE]".into());
    };
    // Read on to the end of the body, so that the connection goes back to the pool for the
    // next request instead of being closed (a body dropped unfinished closes it).
    let drain = async { while let Some(Ok(_)) = stream.next().await {} };
    let _ = tokio::time::timeout(DRAIN_AFTER_DONE, drain).await;
    let latency = (done_at - start).as_secs_f64();
    RequestOutcome {
        success: true,
        error: None,
        prompt_len: st.usage_prompt.unwrap_or(prompt_len),
        output_len: st.usage_completion.unwrap_or(st.chunks),
        ttft: st.first.map_or(latency, |f| (f - start).as_secs_f64()),
        itl: st.itl,
        latency,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn stream_parser_times_chunks_and_prefers_usage() {
        let t0 = Instant::now();
        let at = |ms| t0 + std::time::Duration::from_millis(ms);
        let mut st = StreamState::default();
        st.data(
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}],"usage":null}"#,
            at(1),
        );
        st.data(
            r#"{"choices":[{"delta":{"content":"Hel"}}],"usage":null}"#,
            at(10),
        );
        st.data(r#"{"choices":[{"text":"lo"}]}"#, at(30));
        st.data(
            r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}"#,
            at(31),
        );
        st.data("[DONE]", at(32));
        assert_eq!(st.first, Some(at(10)));
        assert_eq!(st.chunks, 2);
        assert_eq!(st.itl.len(), 1);
        assert!((st.itl[0] - 0.020).abs() < 1e-9);
        assert_eq!((st.usage_prompt, st.usage_completion), (Some(7), Some(3)));
        assert!(st.done && st.error.is_none());
        let mut bad = StreamState::default();
        bad.data(r#"{"error":{"message":"boom"}}"#, at(1));
        assert!(bad.error.unwrap().contains("boom"));
    }

    #[test]
    fn request_bodies_match_each_endpoint() {
        let s = SampleRequest {
            prompt: "hi".into(),
            prompt_len: 1,
            output_len: 4,
        };
        let chat = request_body("m", &s, true, true);
        assert_eq!(chat["messages"][0]["content"], "hi");
        assert_eq!(chat["max_completion_tokens"], 4);
        assert_eq!(chat["ignore_eos"], true);
        let cmpl = request_body("m", &s, false, false);
        assert_eq!(cmpl["prompt"], "hi");
        assert_eq!(cmpl["stream_options"]["include_usage"], true);
        assert!(cmpl.get("ignore_eos").is_none());
    }
}
