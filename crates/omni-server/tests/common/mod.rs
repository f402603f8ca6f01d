//! A fake engine and a tiny byte-level tokenizer for the server tests.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use omni_protocol::{
    AudioOutput, EngineCoreOutput, EngineCoreRequest, FinishReason, Logprob, Modality,
    SchedulerStats, TokenLogprobs,
};
use omni_server::{
    CacheInfo, EngineClient, EngineError, OmniServerInfo, OutputReceiver, ServerConfig, Tokenizer,
};
use serde_json::json;
use tokio::sync::mpsc;

pub const EOS: u32 = 2;
pub const REPLY: &str = "Hello world. STOP here";
/// The queue time the fake engine reports on each request's first output.
pub const FAKE_QUEUE_TIME: f64 = 0.4;

/// GPT-2's byte -> printable character table.
pub fn byte_chars() -> Vec<char> {
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

/// Audio outputs the fake sends for an omni request that wants audio.
pub const AUDIO_CHUNKS: usize = 4;
/// Samples per fake audio output.
pub const AUDIO_CHUNK_SAMPLES: usize = 960;
/// The fake's sample rate.
pub const SAMPLE_RATE: u32 = 24_000;
/// The text output after which the fake sends its first audio output (before the text ends, as
/// the async-chunk pipeline does).
pub const FIRST_AUDIO_AFTER_TOKEN: usize = 3;

/// The samples of fake audio output `k`: a sine sweep in [-0.9, 0.9], with the ends clipped
/// beyond [-1, 1] once per chunk.
pub fn fake_audio_chunk(k: usize) -> Vec<f32> {
    (0..AUDIO_CHUNK_SAMPLES)
        .map(|i| {
            let t = (k * AUDIO_CHUNK_SAMPLES + i) as f32;
            if i == 0 {
                1.5 // clamped to 1.0 by the encoder
            } else {
                0.9 * (t * 0.013).sin()
            }
        })
        .collect()
}

/// Every fake audio sample of one request, in order.
pub fn fake_audio() -> Vec<f32> {
    (0..AUDIO_CHUNKS).flat_map(fake_audio_chunk).collect()
}

/// Answers every request with [`REPLY`] one token per output, then EOS (or stops at
/// `max_tokens` with `length`). An omni request that wants audio gets the engine's omni
/// contract: the text outputs (the last one with `text_finish_reason` and no `finish_reason`),
/// [`AUDIO_CHUNKS`] audio outputs (the first after [`FIRST_AUDIO_AFTER_TOKEN`] text outputs),
/// and `finish_reason` on the last audio output (or on an empty output after it, with
/// `empty_final_output`).
#[derive(Default)]
pub struct FakeEngine {
    pub dead: AtomicBool,
    pub overloaded: AtomicBool,
    pub aborted: Arc<Mutex<Vec<String>>>,
    pub requests: Mutex<Vec<EngineCoreRequest>>,
    pub token_delay_ms: u64,
    /// Omni: finish with an output that has no audio.
    pub empty_final_output: bool,
    /// Omni: send no audio at all (the request still finishes).
    pub no_audio: bool,
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

fn output(req: &EngineCoreRequest, ids: Vec<u32>) -> EngineCoreOutput {
    EngineCoreOutput {
        request_id: req.request_id.clone(),
        new_token_ids: ids,
        new_logprobs: Vec::new(),
        finish_reason: None,
        stop_reason: None,
        num_cached_tokens: 0,
        queue_time: None,
        text_finish_reason: None,
        audio: None,
    }
}

fn audio_output(req: &EngineCoreRequest, k: usize) -> EngineCoreOutput {
    let mut out = output(req, Vec::new());
    out.audio = Some(AudioOutput {
        samples: fake_audio_chunk(k),
        sample_rate: SAMPLE_RATE,
        num_frames: 2,
    });
    out
}

/// Every output of one request, in order (see [`FakeEngine`]).
fn outputs(req: &EngineCoreRequest, empty_final: bool, no_audio: bool) -> Vec<EngineCoreOutput> {
    let max = req.sampling_params.max_tokens.unwrap_or(u32::MAX) as usize;
    let mut ids = text_ids(REPLY);
    if !req.sampling_params.ignore_eos {
        ids.push(EOS);
    }
    ids.truncate(max.max(1));
    let mut outs = Vec::new();
    let n = ids.len();
    for (k, &id) in ids.iter().enumerate() {
        let mut out = output(req, vec![id]);
        out.finish_reason = if id == EOS {
            Some(FinishReason::Stop)
        } else if k + 1 == n {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(n) = req.sampling_params.logprobs {
            out.new_logprobs = vec![TokenLogprobs {
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
            }];
        }
        // As the engine core does: on the first output, once scheduled.
        out.queue_time = (k == 0).then_some(FAKE_QUEUE_TIME);
        outs.push(out);
    }
    let wants_audio = req
        .omni
        .as_ref()
        .is_some_and(|o| o.modalities.contains(&Modality::Audio));
    if !wants_audio {
        return outs;
    }
    let text_end = outs.last_mut().unwrap();
    text_end.text_finish_reason = text_end.finish_reason.take();
    let audio: Vec<_> = if no_audio {
        Vec::new()
    } else {
        (0..AUDIO_CHUNKS).map(|k| audio_output(req, k)).collect()
    };
    let mut audio = audio.into_iter();
    let split = FIRST_AUDIO_AFTER_TOKEN.min(outs.len());
    let mut all: Vec<_> = outs.drain(..split).collect();
    all.extend(audio.next());
    all.extend(outs);
    all.extend(audio);
    if empty_final || no_audio || all.last().unwrap().audio.is_none() {
        all.push(output(req, Vec::new()));
    }
    all.last_mut().unwrap().finish_reason = Some(FinishReason::Stop);
    all
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
        let outs = outputs(&req, self.empty_final_output, self.no_audio);
        tokio::spawn(async move {
            for out in outs {
                if delay > 0 {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                }
                if aborted.lock().unwrap().contains(&req.request_id) {
                    return;
                }
                let last = out.finish_reason.is_some();
                if tx.send(Ok(out)).is_err() || last {
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
            ..SchedulerStats::default()
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

/// The fake omni model's speakers.
pub const SPEAKERS: [&str; 2] = ["ethan", "chelsie"];

/// [`config`] of an omni model: speakers [`SPEAKERS`], `["text", "audio"]` by default, a
/// Talker default of temperature 0.9 and Code2Wav's of 0.0.
pub fn omni_config() -> ServerConfig {
    let talker =
        omni_server::sampling_params_from_json(&json!({"temperature": 0.9, "top_k": 50})).unwrap();
    let code2wav = omni_server::sampling_params_from_json(&json!({"temperature": 0.0})).unwrap();
    ServerConfig {
        omni: Some(OmniServerInfo {
            speakers: SPEAKERS.iter().map(|s| s.to_string()).collect(),
            default_speaker: "ethan".into(),
            default_modalities: vec![Modality::Text, Modality::Audio],
            sample_rate: SAMPLE_RATE,
            thinker_sampling: omni_server::sampling_params_from_json(&json!({"temperature": 0.0}))
                .unwrap(),
            stage_sampling: vec![talker, code2wav],
        }),
        ..config()
    }
}

/// Standard base64 (RFC 4648), as a client decodes `audio.data`.
pub fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes = s.as_bytes();
    assert_eq!(bytes.len() % 4, 0, "base64 length");
    let mut out = Vec::new();
    for q in bytes.chunks(4) {
        let pad = q.iter().filter(|&&c| c == b'=').count();
        let n = q
            .iter()
            .map(|&c| if c == b'=' { 0 } else { val(c) })
            .fold(0u32, |acc, v| (acc << 6) | v);
        let three = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&three[..3 - pad]);
    }
    out
}

/// A mono 16-bit PCM WAV file: its sample rate and samples (panics on any other layout).
pub fn decode_wav(bytes: &[u8]) -> (u32, Vec<i16>) {
    assert_eq!(&bytes[..4], b"RIFF");
    assert_eq!(&bytes[8..16], b"WAVEfmt ");
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap());
    let u16_at = |i: usize| u16::from_le_bytes(bytes[i..i + 2].try_into().unwrap());
    assert_eq!(u32_at(4) as usize, bytes.len() - 8, "RIFF size");
    assert_eq!(
        (u16_at(20), u16_at(22), u16_at(34)),
        (1, 1, 16),
        "PCM mono 16-bit"
    );
    assert_eq!(&bytes[36..40], b"data");
    assert_eq!(u32_at(40) as usize, bytes.len() - 44, "data size");
    (u32_at(24), pcm_samples(&bytes[44..]))
}

/// Raw s16le samples.
pub fn pcm_samples(bytes: &[u8]) -> Vec<i16> {
    assert_eq!(bytes.len() % 2, 0);
    bytes
        .chunks_exact(2)
        .map(|b| i16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// Asserts `got` is `want` as 16-bit PCM: clamped to [-1, 1], within one step of x * 32767.
pub fn assert_pcm_matches(got: &[i16], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "sample count");
    for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
        let exact = w.clamp(-1.0, 1.0) * 32767.0;
        assert!(
            (f32::from(g) - exact).abs() <= 0.5 + 1e-3,
            "sample {k}: {g} vs {exact}"
        );
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
