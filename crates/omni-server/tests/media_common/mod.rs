//! Media for the server tests: a tokenizer with Qwen's placeholder tokens, a config with both
//! encoders, hand-made PNG and WAV files, and a 127.0.0.1 HTTP origin that counts its
//! connections.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use omni_server::{ServerConfig, Tokenizer};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::byte_chars;

/// The placeholder tokens' ids in [`mm_tokenizer`] (after 3 specials and 256 bytes).
pub const VISION_START: u32 = 259;
/// `<|image_pad|>`.
pub const IMAGE_PAD: u32 = 260;
/// `<|vision_end|>`.
pub const VISION_END: u32 = 261;
/// `<|audio_start|>`.
pub const AUDIO_START: u32 = 262;
/// `<|audio_pad|>`.
pub const AUDIO_PAD: u32 = 263;
/// `<|audio_end|>`.
pub const AUDIO_END: u32 = 264;

/// A Qwen-style template that walks content parts, writing each part's placeholder.
const PARTS_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n\
    {% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}\
    {% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>\
    {% elif c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>\
    {% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\
    <|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
/// A template that only prints `content` (the server puts the placeholders in the string).
const STRING_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n\
    {{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The byte-level tokenizer of `common` plus Qwen's six placeholder tokens (ids
/// [`VISION_START`]..=[`AUDIO_END`]), with a template that walks content parts
/// (`parts_template`) or one that prints `content` as a string.
pub fn mm_tokenizer(parts_template: bool) -> Arc<Tokenizer> {
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let media = [
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
        "<|audio_start|>",
        "<|audio_pad|>",
        "<|audio_end|>",
    ];
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert(s.to_string(), json!(i));
    }
    for (b, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), json!(3 + b));
    }
    for (i, s) in media.iter().enumerate() {
        vocab.insert(s.to_string(), json!(VISION_START as usize + i));
    }
    for (s, id) in specials
        .iter()
        .zip(0..)
        .chain(media.iter().zip(VISION_START..))
    {
        added.push(
            json!({"id": id, "content": s, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}),
        );
    }
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}
    });
    let mut tok = Tokenizer::from_tokenizer_json(tj.to_string().as_bytes()).unwrap();
    let template = if parts_template {
        PARTS_TEMPLATE
    } else {
        STRING_TEMPLATE
    };
    tok.set_chat_template(template.into()).unwrap();
    Arc::new(tok)
}

/// `common::config()` with both encoders (the Qwen3-Omni fixture's layout, this tokenizer's
/// ids), room for 1000 parts in a body, and a longer context.
pub fn mm_config() -> ServerConfig {
    let config = json!({"thinker_config": {
        "vision_config": {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
        "audio_config": {"num_mel_bins": 128},
        "image_token_id": IMAGE_PAD, "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END, "audio_token_id": AUDIO_PAD,
        "audio_start_token_id": AUDIO_START, "audio_end_token_id": AUDIO_END,
        "video_token_id": 151_656,
    }});
    let model = omni_server::media::MultimodalModel::from_hf_config(&config, None)
        .unwrap()
        .unwrap();
    ServerConfig {
        max_model_len: 1024,
        max_body_bytes: 4 << 20,
        multimodal: Some(Arc::new(model)),
        ..super::common::config()
    }
}

/// Standard base64 with padding.
pub fn b64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                out.push(A[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

fn ihdr(out: &mut Vec<u8>, width: u32, height: u32) {
    out.extend_from_slice(b"\x89PNG\r\n\x1a\n");
    let mut h = Vec::new();
    h.extend_from_slice(&width.to_be_bytes());
    h.extend_from_slice(&height.to_be_bytes());
    h.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB
    chunk(out, b"IHDR", &h);
}

/// A valid RGB PNG of a gradient (zlib with stored blocks).
pub fn png(width: u32, height: u32) -> Vec<u8> {
    let mut raw = Vec::new();
    for y in 0..height {
        raw.push(0); // filter: none
        for x in 0..width {
            raw.extend_from_slice(&[(x * 4) as u8, (y * 4) as u8, ((x + y) * 2) as u8]);
        }
    }
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (k, b) in blocks.iter().enumerate() {
        z.push(u8::from(k + 1 == blocks.len()));
        z.extend_from_slice(&(b.len() as u16).to_le_bytes());
        z.extend_from_slice(&(!(b.len() as u16)).to_le_bytes());
        z.extend_from_slice(b);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut out = Vec::new();
    ihdr(&mut out, width, height);
    chunk(&mut out, b"IDAT", &z);
    chunk(&mut out, b"IEND", &[]);
    out
}

/// A PNG whose header declares `width x height` and whose data is a few bytes (a bomb's
/// header).
pub fn png_header(width: u32, height: u32) -> Vec<u8> {
    let mut out = Vec::new();
    ihdr(&mut out, width, height);
    chunk(
        &mut out,
        b"IDAT",
        &[0x78, 0x01, 0x01, 0x00, 0x00, 0xff, 0xff],
    );
    chunk(&mut out, b"IEND", &[]);
    out
}

fn wav_header(rate: u32, data_len: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(44);
    h.extend_from_slice(b"RIFF");
    h.extend_from_slice(&data_len.saturating_add(36).to_le_bytes());
    h.extend_from_slice(b"WAVEfmt ");
    h.extend_from_slice(&16u32.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes()); // PCM
    h.extend_from_slice(&1u16.to_le_bytes()); // mono
    h.extend_from_slice(&rate.to_le_bytes());
    h.extend_from_slice(&(rate * 2).to_le_bytes());
    h.extend_from_slice(&2u16.to_le_bytes());
    h.extend_from_slice(&16u16.to_le_bytes());
    h.extend_from_slice(b"data");
    h.extend_from_slice(&data_len.to_le_bytes());
    h
}

/// A mono 16-bit PCM WAV file.
pub fn wav(rate: u32, samples: &[i16]) -> Vec<u8> {
    let mut out = wav_header(rate, (samples.len() * 2) as u32);
    for s in samples {
        out.extend_from_slice(&s.to_le_bytes());
    }
    out
}

/// A WAV header claiming `seconds` of 16-bit mono audio, followed by only 1000 samples.
pub fn wav_claiming(rate: u32, seconds: u32) -> Vec<u8> {
    let mut out = wav_header(rate, seconds * rate * 2);
    out.extend(std::iter::repeat_n(0u8, 2000));
    out
}

/// An HTTP/1.1 response that closes the connection.
pub fn http_response(status: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

/// An HTTP origin on 127.0.0.1 answering each request with `route(path)` (an empty answer:
/// it holds the connection 10 s and sends nothing), counting the connections it accepts.
pub struct Origin {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
}

impl Origin {
    /// Binds port 0 and serves until the test's runtime ends.
    pub async fn start(route: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let route = Arc::new(route);
        let counter = hits.clone();
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let route = route.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    let mut n = 0;
                    // Bounded: a full buffer, EOF or 5 s end the read.
                    while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        let read =
                            tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf[n..]));
                        match read.await {
                            Ok(Ok(k)) if k > 0 => n += k,
                            _ => return,
                        }
                    }
                    let head = String::from_utf8_lossy(&buf[..n]);
                    let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                    let response = route(&path);
                    if response.is_empty() {
                        // A stalled origin: holds the connection, answers nothing.
                        tokio::time::sleep(Duration::from_secs(10)).await;
                    }
                    let _ = sock.write_all(&response).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        Self { addr, hits }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Connections accepted so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// The chat endpoint.
pub const CHAT: &str = "/v1/chat/completions";

/// The router over [`mm_tokenizer`] with a parts-walking template.
pub fn app(engine: Arc<super::common::FakeEngine>, config: ServerConfig) -> axum::Router {
    omni_server::router(config, engine, mm_tokenizer(true))
}

/// A one-message chat body of `parts`.
pub fn chat(parts: Vec<Value>) -> String {
    json!({"messages": [{"role": "user", "content": parts}], "max_tokens": 2}).to_string()
}

/// An `image_url` part.
pub fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// An `input_audio` part of `bytes`.
pub fn audio_part(format: &str, bytes: &[u8]) -> Value {
    json!({"type": "input_audio", "input_audio": {"data": b64(bytes), "format": format}})
}

/// Posts `body`, expects `status` with OpenAI's error shape naming `param` and a message
/// holding `needle`, then checks that the server still answers.
pub async fn refused(app: &axum::Router, body: &str, status: u16, param: &str, needle: &str) {
    let (got, v, text) = super::common::call(app, "POST", CHAT, Some(body), &[]).await;
    let ctx = &body[..body.len().min(160)];
    assert_eq!(got, status, "{ctx}: {text}");
    let e = &v["error"];
    assert_eq!(e["param"], param, "{ctx}: {v}");
    assert_eq!(e["type"], "invalid_request_error", "{ctx}: {v}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(needle),
        "{ctx}: {message:?} lacks {needle:?}"
    );
    let (ok, _, _) = super::common::call(app, "GET", "/health", None, &[]).await;
    assert_eq!(ok, 200, "still serving after {ctx}");
}

/// Asserts the engine got no request.
pub fn no_requests(engine: &super::common::FakeEngine) {
    assert!(
        engine.requests.lock().unwrap().is_empty(),
        "nothing reaches the engine"
    );
}
