//! A fake engine and a tiny byte-level tokenizer for the server tests.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use omni_protocol::{
    EngineCoreOutput, EngineCoreRequest, FinishReason, Logprob, SchedulerStats, TokenLogprobs,
};
use omni_server::{CacheInfo, EngineClient, EngineError, OutputReceiver, ServerConfig, Tokenizer};
use serde_json::json;
use tokio::sync::mpsc;

pub const EOS: u32 = 2;
pub const REPLY: &str = "Hello world. STOP here";
/// The queue time the fake engine reports on each request's first output.
pub const FAKE_QUEUE_TIME: f64 = 0.4;

/// GPT-2's byte -> printable character table.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (u32::from('!')..=u32::from('~')).collect();
    printable.extend(u32::from('¡')..=u32::from('¬'));
    printable.extend(u32::from('®')..=u32::from('ÿ'));
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            let code = if printable.contains(&b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(code).unwrap()
        })
        .collect()
}

/// Byte-level BPE without merges: 3 specials, then one token per byte (id = 3 + byte).
pub fn tokenizer() -> Arc<Tokenizer> {
    tokenizer_with(serde_json::Value::Null)
}

/// [`tokenizer`] whose post-processor puts `<|endoftext|>` (id 0) before every text encoded with
/// special tokens, as a BOS-adding checkpoint does.
pub fn tokenizer_with_bos() -> Arc<Tokenizer> {
    tokenizer_with(json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}
    }))
}

fn tokenizer_with(post_processor: serde_json::Value) -> Arc<Tokenizer> {
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut vocab = serde_json::Map::new();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert(s.to_string(), json!(i));
    }
    for (b, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(3 + b));
    }
    let added: Vec<_> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}
    });
    let mut tok = Tokenizer::from_tokenizer_json(tj.to_string().as_bytes()).unwrap();
    tok.set_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into(),
    )
    .unwrap();
    Arc::new(tok)
}

pub fn text_ids(text: &str) -> Vec<u32> {
    text.bytes().map(|b| 3 + u32::from(b)).collect()
}

/// Answers every request with [`REPLY`] one token per output, then EOS (or stops at
/// `max_tokens` with `length`).
#[derive(Default)]
pub struct FakeEngine {
    pub dead: AtomicBool,
    pub overloaded: AtomicBool,
    pub aborted: Arc<Mutex<Vec<String>>>,
    pub requests: Mutex<Vec<EngineCoreRequest>>,
    pub token_delay_ms: u64,
}

impl FakeEngine {
    pub fn slow(token_delay_ms: u64) -> Self {
        Self {
            token_delay_ms,
            ..Self::default()
        }
    }
    pub fn aborted(&self) -> Vec<String> {
        self.aborted.lock().unwrap().clone()
    }
}

impl EngineClient for FakeEngine {
    fn add_request(&self, req: EngineCoreRequest) -> Result<OutputReceiver, EngineError> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(EngineError::Dead {
                cause: "worker 0 exited".into(),
            });
        }
        if self.overloaded.load(Ordering::SeqCst) {
            return Err(EngineError::Overloaded {
                reason: "too many requests".into(),
            });
        }
        self.requests.lock().unwrap().push(req.clone());
        let (tx, rx) = mpsc::unbounded_channel();
        let aborted = self.aborted.clone();
        let delay = self.token_delay_ms;
        tokio::spawn(async move {
            let max = req.sampling_params.max_tokens.unwrap_or(u32::MAX) as usize;
            let mut ids = text_ids(REPLY);
            if !req.sampling_params.ignore_eos {
                ids.push(EOS);
            }
            for (k, &id) in ids.iter().enumerate() {
                if delay > 0 {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                if aborted.lock().unwrap().contains(&req.request_id) {
                    return;
                }
                let finish = if id == EOS {
                    Some(FinishReason::Stop)
                } else if k + 1 >= max || k + 1 == ids.len() {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                let new_logprobs = match req.sampling_params.logprobs {
                    Some(n) => vec![TokenLogprobs {
                        sampled: Logprob {
                            token_id: id,
                            logprob: -0.5,
                        },
                        rank: 1,
                        top: (0..n)
                            .map(|t| Logprob {
                                token_id: 3 + 97 + t,
                                logprob: -1.0 - t as f32,
                            })
                            .collect(),
                    }],
                    None => Vec::new(),
                };
                let out = EngineCoreOutput {
                    request_id: req.request_id.clone(),
                    new_token_ids: vec![id],
                    new_logprobs,
                    finish_reason: finish,
                    stop_reason: None,
                    num_cached_tokens: 0,
                    // As the engine core does: on the first output, once scheduled.
                    queue_time: (k == 0).then_some(FAKE_QUEUE_TIME),
                    text_finish_reason: None,
                    audio: None,
                };
                if tx.send(Ok(out)).is_err() || finish.is_some() {
                    return;
                }
            }
        });
        Ok(rx)
    }

    fn abort(&self, request_ids: &[String]) {
        self.aborted
            .lock()
            .unwrap()
            .extend(request_ids.iter().cloned());
    }

    fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running_reqs: 3,
            num_waiting_reqs: 1,
            kv_cache_usage: 0.25,
            num_preemptions: 7,
            prefix_cache_queries: 100,
            prefix_cache_hits: 40,
        }
    }

    fn is_healthy(&self) -> Result<(), String> {
        if self.dead.load(Ordering::SeqCst) {
            Err("worker 0 exited".into())
        } else {
            Ok(())
        }
    }

    fn cache_info(&self) -> CacheInfo {
        CacheInfo {
            block_size: 16,
            num_gpu_blocks: 1024,
        }
    }
}

pub fn config() -> ServerConfig {
    ServerConfig {
        served_model_names: vec!["test-model".into(), "alias".into()],
        max_model_len: 256,
        max_body_bytes: 64 * 1024,
        ..ServerConfig::default()
    }
}

pub fn app(engine: Arc<FakeEngine>, config: ServerConfig) -> axum::Router {
    omni_server::router(config, engine, tokenizer())
}

/// Sends one request through the router; returns status and body (JSON when it parses).
pub async fn call(
    app: &axum::Router,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, serde_json::Value, String) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let mut b = axum::http::Request::builder().method(method).uri(path);
    if body.is_some() {
        b = b.header("content-type", "application/json");
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b
        .body(axum::body::Body::from(body.unwrap_or("").to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).to_string();
    let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    (status, json, text)
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|s| s.trim().to_string())
        .collect()
}
