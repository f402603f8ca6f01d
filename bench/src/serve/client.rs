//! One streamed OpenAI request, timed chunk by chunk, and the ready check before a run.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use super::stats::AudioOutcome;
use super::wav::{self, ChunkFormat};
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

/// How a run's requests are written: endpoint kind, flags, and what goes into every body.
#[derive(Debug, Clone, Default)]
pub struct RequestSpec {
    /// Model name.
    pub model: String,
    /// Chat completions (`messages`) rather than completions (`prompt`).
    pub chat: bool,
    /// vLLM-Omni's `openai-chat-omni`: content parts, `modalities` (default
    /// [`DEFAULT_OMNI_MODALITIES`]), `max_tokens`, `stream_options.continuous_usage_stats`.
    pub omni: bool,
    /// Send `ignore_eos: true`.
    pub ignore_eos: bool,
    /// Thinker tokens and Talker frames per request, both with `ignore_eos`, through
    /// `sampling_params_list` (the fixed-length profile for dummy weights).
    pub fixed_lengths: Option<(usize, usize)>,
    /// Keys merged into every body last (`--extra-body`); a key here replaces the client's.
    pub extra_body: serde_json::Map<String, Value>,
}

/// The user turn as content parts: the prompt's text, then its images (vLLM's order).
fn user_content(sample: &SampleRequest) -> Value {
    let mut parts = vec![json!({"type": "text", "text": sample.prompt})];
    parts.extend(
        sample
            .images
            .iter()
            .map(|url| json!({"type": "image_url", "image_url": {"url": url}})),
    );
    Value::Array(parts)
}

/// The output modalities an omni request asks for unless `--extra-body` says otherwise.
pub const DEFAULT_OMNI_MODALITIES: [&str; 2] = ["text", "audio"];

impl RequestSpec {
    /// The streaming body of one request (greedy, usage requested).
    pub fn body(&self, sample: &SampleRequest) -> Value {
        let output_len = self.fixed_lengths.map_or(sample.output_len, |(t, _)| t);
        let mut body = if self.omni {
            let part = |text: &str| json!([{"type": "text", "text": text}]);
            let mut messages = Vec::new();
            if let Some(system) = &sample.system {
                messages.push(json!({"role": "system", "content": part(system)}));
            }
            messages.push(json!({"role": "user", "content": user_content(sample)}));
            json!({
                "model": self.model,
                "messages": messages,
                "max_tokens": output_len,
                "modalities": DEFAULT_OMNI_MODALITIES,
            })
        } else if self.chat {
            let mut messages = Vec::new();
            if let Some(system) = &sample.system {
                messages.push(json!({"role": "system", "content": system}));
            }
            let content = if sample.images.is_empty() {
                json!(sample.prompt)
            } else {
                user_content(sample)
            };
            messages.push(json!({"role": "user", "content": content}));
            json!({
                "model": self.model,
                "messages": messages,
                "max_completion_tokens": output_len,
            })
        } else {
            json!({"model": self.model, "prompt": sample.prompt, "max_tokens": output_len})
        };
        body["temperature"] = json!(0.0);
        body["stream"] = json!(true);
        body["stream_options"] = if self.omni {
            json!({"include_usage": true, "continuous_usage_stats": true})
        } else {
            json!({"include_usage": true})
        };
        if self.ignore_eos || self.fixed_lengths.is_some() {
            body["ignore_eos"] = json!(true);
        }
        if let Some((tokens, frames)) = self.fixed_lengths {
            // The Talker keeps the built-in deploy profile's sampling
            // (`deploy/qwen3_omni_moe.yaml`, stage 1): `sampling_params_list` replaces the
            // stage defaults.
            body["sampling_params_list"] = json!([
                {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": true},
                {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.05,
                 "max_tokens": frames, "ignore_eos": true},
                {}
            ]);
        }
        if let Some(obj) = body.as_object_mut() {
            for (k, v) in &self.extra_body {
                obj.insert(k.clone(), v.clone());
            }
        }
        body
    }
}

/// Whether a body asks for audio (an omni body whose `modalities` include `audio`).
fn wants_audio(body: &Value) -> bool {
    body["modalities"]
        .as_array()
        .is_some_and(|m| m.iter().any(|x| x == "audio"))
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
    /// How audio chunks are encoded; `None`: the body asked for no audio.
    audio_format: Option<ChunkFormat>,
    audio_first: Option<Instant>,
    audio_last: Option<Instant>,
    audio_frames: u64,
    audio_seconds: f64,
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
        if v["modality"] == "audio" {
            // Its `usage` says `completion_tokens: 0`: text counts come from the others.
            self.audio(&v, now);
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

    /// An audio chunk: its own file, measured in sample frames (TTFP at the first non-empty
    /// one, the generation time at the last).
    fn audio(&mut self, v: &Value, now: Instant) {
        let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        if content.is_empty() {
            return;
        }
        let format = self.audio_format.unwrap_or(ChunkFormat::Wav);
        match wav::measure_chunk(content, format) {
            Ok(a) => {
                self.audio_first.get_or_insert(now);
                self.audio_last = Some(now);
                self.audio_frames += a.frames;
                self.audio_seconds += a.seconds();
            }
            Err(e) => self.error = Some(e.to_string()),
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
        let attempt =
            tokio::time::timeout_at(deadline, send(http, url, body, prompt_len, Instant::now()))
                .await;
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

/// Sends one request and times it (its start as seconds after `epoch`, the start of the run);
/// failures are outcomes, not errors. A body that asks for audio fails without any.
pub async fn send(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    prompt_len: usize,
    epoch: Instant,
) -> RequestOutcome {
    let start = Instant::now();
    let fail = |error: String| RequestOutcome {
        error: Some(error),
        prompt_len,
        ..RequestOutcome::default()
    };
    let mut st = StreamState::default();
    if wants_audio(body) {
        match ChunkFormat::of_body(body) {
            Ok(f) => st.audio_format = Some(f),
            Err(e) => return fail(e.to_string()),
        }
    }
    let resp = match http.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => return fail(e.to_string()),
    };
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return fail(format!("HTTP {status}: {text}"));
    }
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
    let since = |t: Instant| (t - start).as_secs_f64();
    let audio = st.audio_first.zip(st.audio_last).map(|(first, last)| {
        let generate_time = since(last);
        AudioOutcome {
            ttfp: since(first),
            duration: st.audio_seconds,
            frames: st.audio_frames,
            // vLLM-Omni's `compute_audio_rtf`: 0 for no audio.
            rtf: if st.audio_seconds > 0.0 {
                generate_time / st.audio_seconds
            } else {
                0.0
            },
        }
    });
    if st.audio_format.is_some() && audio.is_none() {
        return fail("the request asked for audio and the stream carried none".into());
    }
    RequestOutcome {
        success: true,
        error: None,
        prompt_len: st.usage_prompt.unwrap_or(prompt_len),
        output_len: st.usage_completion.unwrap_or(st.chunks),
        ttft: st.first.map_or(latency, since),
        itl: st.itl,
        latency,
        start: start.saturating_duration_since(epoch).as_secs_f64(),
        audio,
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
            system: None,
            images: Vec::new(),
        };
        let spec = |chat, ignore_eos| RequestSpec {
            model: "m".into(),
            chat,
            ignore_eos,
            ..RequestSpec::default()
        };
        let chat = spec(true, true).body(&s);
        assert_eq!(chat["messages"][0]["content"], "hi");
        assert_eq!(chat["max_completion_tokens"], 4);
        assert_eq!(chat["ignore_eos"], true);
        let cmpl = spec(false, false).body(&s);
        assert_eq!(cmpl["prompt"], "hi");
        assert_eq!(cmpl["stream_options"]["include_usage"], true);
        assert!(cmpl.get("ignore_eos").is_none());
        assert!(cmpl.get("modalities").is_none());
        let mm = SampleRequest {
            images: vec!["data:image/png;base64,AAAA".into()],
            ..s
        };
        let chat = spec(true, true).body(&mm);
        let parts = &chat["messages"][0]["content"];
        assert_eq!(parts[0], json!({"type": "text", "text": "hi"}));
        assert_eq!(parts[1]["type"], "image_url");
        assert_eq!(parts[1]["image_url"]["url"], "data:image/png;base64,AAAA");
    }

    #[test]
    fn omni_bodies_follow_vllm_omni_and_take_the_extra_body_last() {
        let s = SampleRequest {
            prompt: "w1 w2".into(),
            prompt_len: 2,
            output_len: 2048,
            system: Some("be a tts engine".into()),
            images: Vec::new(),
        };
        let mut spec = RequestSpec {
            model: "omni".into(),
            chat: true,
            omni: true,
            fixed_lengths: Some((64, 144)),
            ..RequestSpec::default()
        };
        let b = spec.body(&s);
        assert_eq!(b["messages"][0]["role"], "system");
        assert_eq!(b["messages"][0]["content"][0]["text"], "be a tts engine");
        assert_eq!(b["messages"][1]["content"][0]["type"], "text");
        assert_eq!(b["messages"][1]["content"][0]["text"], "w1 w2");
        assert_eq!(b["modalities"], json!(["text", "audio"]));
        assert_eq!(b["max_tokens"], 64);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["stream_options"]["continuous_usage_stats"], true);
        let list = b["sampling_params_list"].as_array().unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list[0]["max_tokens"], 64);
        assert_eq!(
            (&list[1]["max_tokens"], &list[1]["ignore_eos"]),
            (&json!(144), &json!(true))
        );
        assert_eq!(
            list[1]["top_k"], 50,
            "an integer, as the server parses top_k"
        );
        assert!(wants_audio(&b));
        spec.extra_body =
            serde_json::from_str(r#"{"modalities": ["text"], "speaker": "chelsie"}"#).unwrap();
        let b = spec.body(&s);
        assert_eq!(b["speaker"], "chelsie");
        assert!(!wants_audio(&b));
    }

    #[test]
    fn omni_stream_times_audio_apart_from_text() {
        let t0 = Instant::now();
        let at = |ms| t0 + std::time::Duration::from_millis(ms);
        let mut st = StreamState {
            audio_format: Some(ChunkFormat::Wav),
            ..StreamState::default()
        };
        let text = |t: &str| {
            json!({"choices": [{"delta": {"content": t}}], "modality": "text", "usage": null})
                .to_string()
        };
        let audio = |content: String| {
            json!({"choices": [{"delta": {"role": "assistant", "content": content}}],
                   "modality": "audio",
                   "usage": {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}})
            .to_string()
        };
        st.data(&text(""), at(1));
        st.data(&text("w5"), at(10));
        st.data(&audio(wav::test_wav_base64(7_125, 24_000)), at(40));
        st.data(&text(" w6"), at(50));
        st.data(&audio(String::new()), at(60));
        st.data(&audio(wav::test_wav_base64(12_000, 24_000)), at(90));
        st.data(
            r#"{"choices":[],"modality":"text","usage":{"prompt_tokens":9,"completion_tokens":2}}"#,
            at(91),
        );
        st.data("[DONE]", at(92));
        assert_eq!(st.first, Some(at(10)));
        assert_eq!(st.chunks, 2, "audio chunks are no text tokens");
        assert_eq!(st.itl.len(), 1);
        assert!((st.itl[0] - 0.040).abs() < 1e-9);
        assert_eq!((st.usage_prompt, st.usage_completion), (Some(9), Some(2)));
        assert_eq!(st.audio_first, Some(at(40)));
        assert_eq!(st.audio_last, Some(at(90)));
        assert_eq!(st.audio_frames, 19_125);
        assert!((st.audio_seconds - 19_125.0 / 24_000.0).abs() < 1e-12);
        assert!(st.done && st.error.is_none());
        let mut bad = StreamState::default();
        bad.data(&audio("not base64!".into()), at(1));
        assert!(bad.error.unwrap().contains("base64"));
    }
}
