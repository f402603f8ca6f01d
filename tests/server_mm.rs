//! A PNG and a WAV in a chat request reach Qwen3-Omni's encoders through the real server
//! (`omni-engine serve DIR` on the tiny `qwen3-omni-mm` Thinker, no `--omni`): decoded and
//! preprocessed in the API process, sent as the request's tensors, broadcast to the CPU worker,
//! encoded there. The answer depends on the pixels (two gradients of one size, so the same
//! prompt ids, give different tokens; the same image twice gives the same tokens), and the
//! prompt counts the items' placeholder tokens.

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;
#[path = "mm_common.rs"]
mod mm_common;

use std::path::{Path, PathBuf};

use common::Server;
use serde_json::{Value, json};

/// The word-level tokenizer and chat template over the fixture's ids (`w<id>` words for text,
/// Qwen's placeholders for media), shared with `scripts/make_mm_model_dir.py`.
const TOKENIZER_SPEC: &str = include_str!("../scripts/mm_word_tokenizer.json");

/// The fixture linked into a temporary directory with a word-level tokenizer over its ids.
struct ModelDir(PathBuf);

impl ModelDir {
    /// The `qwen3-omni-mm` Thinker (both towers).
    fn new() -> Self {
        Self::of(&mm_common::mm_fixture(), "mm")
    }

    /// The fixture in `src` (its config and weights) with the word tokenizer; `tag` names the
    /// directory.
    fn of(src: &Path, tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("omni-{tag}-serve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::os::unix::fs::symlink(src.join(f), dir.join(f)).unwrap();
        }
        let spec: Value = serde_json::from_str(TOKENIZER_SPEC).unwrap();
        let specials: Vec<(u64, &str)> = spec["specials"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_str().unwrap()))
            .collect();
        let words: serde_json::Map<String, Value> = (0..spec["vocab_size"].as_u64().unwrap())
            .map(|i| match specials.iter().find(|(s, _)| *s == i) {
                Some((_, text)) => (text.to_string(), json!(i)),
                None => (format!("w{i}"), json!(i)),
            })
            .collect();
        let added: Vec<Value> = specials
            .iter()
            .map(|(id, text)| {
                json!({"id": id, "content": text, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let tok = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": words, "unk_token": spec["unk_token"]}
        });
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        let cfg = json!({"chat_template": spec["chat_template"], "eos_token": spec["eos_token"]});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                s.push(A[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// An RGB PNG (stored zlib blocks) whose pixels are `f(x, y)`.
fn png(w: u32, h: u32, f: impl Fn(u32, u32) -> [u8; 3]) -> Vec<u8> {
    let mut raw = Vec::new();
    for y in 0..h {
        raw.push(0);
        for x in 0..w {
            raw.extend_from_slice(&f(x, y));
        }
    }
    // Stored deflate blocks of at most 65535 bytes each, the last one flagged final.
    let mut z = vec![0x78, 0x01];
    let n_blocks = raw.len().div_ceil(65_535).max(1);
    for (i, block) in raw.chunks(65_535).enumerate() {
        z.push(u8::from(i + 1 == n_blocks));
        z.extend_from_slice(&(block.len() as u16).to_le_bytes());
        z.extend_from_slice(&(!(block.len() as u16)).to_le_bytes());
        z.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |kind: &[u8], data: &[u8]| {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend_from_slice(data);
        out.extend_from_slice(&body);
        out.extend_from_slice(&crc32(&body).to_be_bytes());
    };
    let mut ihdr = w.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &z);
    chunk(b"IEND", &[]);
    out
}

/// One second of a 440 Hz tone, 16 kHz mono PCM16 WAV.
fn wav() -> Vec<u8> {
    let samples: Vec<i16> = (0..16_000)
        .map(|i| ((i as f32 * 440.0 * std::f32::consts::TAU / 16_000.0).sin() * 8000.0) as i16)
        .collect();
    let data_len = samples.len() as u32 * 2;
    let mut w = b"RIFF".to_vec();
    w.extend_from_slice(&(36 + data_len).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt ");
    w.extend_from_slice(&16u32.to_le_bytes());
    w.extend_from_slice(&1u16.to_le_bytes()); // PCM
    w.extend_from_slice(&1u16.to_le_bytes()); // mono
    w.extend_from_slice(&16_000u32.to_le_bytes());
    w.extend_from_slice(&32_000u32.to_le_bytes());
    w.extend_from_slice(&2u16.to_le_bytes());
    w.extend_from_slice(&16u16.to_le_bytes());
    w.extend_from_slice(b"data");
    w.extend_from_slice(&data_len.to_le_bytes());
    samples
        .iter()
        .for_each(|s| w.extend_from_slice(&s.to_le_bytes()));
    w
}

fn image_part(png: &[u8]) -> Value {
    json!({"type": "image_url",
        "image_url": {"url": format!("data:image/png;base64,{}", base64(png))}})
}

async fn chat(server: &Server, parts: Vec<Value>) -> (String, u64) {
    chat_with(server, parts, json!({})).await
}

/// [`chat`] with `extra` fields in the body.
async fn chat_with(server: &Server, parts: Vec<Value>, extra: Value) -> (String, u64) {
    let mut body = json!({"model": "mm", "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "messages": [{"role": "user", "content": parts}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, v) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 6);
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    (text, v["usage"]["prompt_tokens"].as_u64().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_png_and_a_wav_reach_the_encoders_and_decide_the_answer() {
    let dir = ModelDir::new();
    let server = Server::start(&[
        dir.path().to_str().unwrap(),
        "--served-model-name",
        "mm",
        "--device",
        "cpu",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
    ]);
    let a = png(64, 96, |x, y| [(x * 4) as u8, (y * 2) as u8, 128]);
    let b = png(64, 96, |x, y| [255 - (y * 2) as u8, (x * 4) as u8, 0]);
    let text = json!({"type": "text", "text": "w214 w177"});
    let (ta, n) = chat(&server, vec![image_part(&a), text.clone()]).await;
    // 64x96: a 4x6 patch grid, 6 tokens, between its start and end markers.
    // `<|im_start|>w872 w198`, the two markers, the two words, `<|im_end|> w198`,
    // `<|im_start|>w77091 w198`.
    let template_tokens = 3 + 2 + 2 + 2 + 3;
    assert_eq!(n, template_tokens + 6, "{ta}");
    let (ta2, _) = chat(&server, vec![image_part(&a), text.clone()]).await;
    assert_eq!(ta2, ta, "the same image, the same answer");
    let (tb, _) = chat(&server, vec![image_part(&b), text.clone()]).await;
    assert_ne!(tb, ta, "the pixels reach the model");

    // Image, text, audio (1 s: 100 mel frames, 13 tokens) in one message.
    let audio =
        json!({"type": "input_audio", "input_audio": {"data": base64(&wav()), "format": "wav"}});
    let (t1, n) = chat(&server, vec![image_part(&a), text.clone(), audio.clone()]).await;
    assert_eq!(n, template_tokens + 6 + 2 + 13, "{t1}");
    let silence = {
        let mut w = wav();
        let len = w.len();
        w[44..len].fill(0);
        w
    };
    let quiet =
        json!({"type": "input_audio", "input_audio": {"data": base64(&silence), "format": "wav"}});
    let (t2, _) = chat(&server, vec![image_part(&a), text, quiet]).await;
    assert_ne!(t1, t2, "the audio reaches the model");
    assert!(!server.log().contains("media parts answer 400"));
}

/// With 1 MiB ring chunks over two CPU workers, a 320x352 image (440 patches, 1.35 MB of bf16
/// pixels) takes the overflow path and a 64x96 one (24 patches) the ring; `/metrics` counts both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_over_the_ring_chunk_counts_as_overflow_on_metrics() {
    let dir = ModelDir::new();
    let server = Server::start_with_env(
        &[
            dir.path().to_str().unwrap(),
            "--served-model-name",
            "mm",
            "--device",
            "cpu",
            "-tp",
            "2",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "16MiB",
        ],
        &[("VLLM_MQ_MAX_CHUNK_BYTES_MB", "1")],
    );
    let counters = async || {
        let (_, text) = server.get("/metrics").await;
        [
            "omni:engine_steps_total",
            "omni:mq_broadcast_messages_total",
            "omni:mq_overflow_messages_total",
            "omni:mq_overflow_bytes_total",
            "omni:mq_ring_bytes_total",
        ]
        .map(|n| common::metric_value(&text, n).unwrap_or_else(|| panic!("no {n} in\n{text}")))
    };
    let [steps0, msgs0, over0, over_bytes0, ring0] = counters().await;
    assert_eq!((steps0, over0, over_bytes0), (0.0, 0.0, 0.0));
    let text = json!({"type": "text", "text": "w214 w177"});
    let big = png(352, 320, |x, y| [(x % 251) as u8, (y % 241) as u8, 7]);
    chat(&server, vec![image_part(&big), text.clone()]).await;
    let pixel_bytes = 440.0 * 1536.0 * 2.0;
    let mut after = counters().await;
    for _ in 0..100 {
        if after[0] >= 6.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        after = counters().await;
    }
    let [steps1, msgs1, over1, over_bytes1, ring1] = after;
    assert!(steps1 >= 6.0, "one prefill and the decode steps: {steps1}");
    assert!(
        msgs1 - msgs0 >= steps1,
        "a broadcast per step: {msgs0} -> {msgs1}"
    );
    assert_eq!(over1, 1.0, "the image's step overflowed, no other");
    assert!(
        over_bytes1 > pixel_bytes && over_bytes1 < pixel_bytes + 65536.0,
        "{over_bytes1}"
    );
    assert!(ring1 > ring0);
    let small = png(64, 96, |x, y| [(x * 4) as u8, (y * 2) as u8, 128]);
    chat(&server, vec![image_part(&small), text]).await;
    let [_, _, over2, over_bytes2, ring2] = counters().await;
    assert_eq!(
        (over2, over_bytes2),
        (1.0, over_bytes1),
        "a small image fits a chunk"
    );
    assert!(ring2 > ring1 + 24.0 * 3072.0, "{ring1} -> {ring2}");
}

/// `serve --omni` (the Thinker, Talker and Code2Wav stage processes) of the tiny Qwen3-Omni
/// checkpoint, which has both towers: its Thinker stage encodes an image and an audio clip and
/// gives the text plain `serve` of the same checkpoint gives, and the same request with audio
/// out gives the same text and a waveform.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_omni_encodes_media_in_its_thinker_stage_as_plain_serve_does() {
    let fixture = mm_common::mm_fixture().parent().unwrap().join("qwen3-omni");
    let dir = ModelDir::of(&fixture, "omni");
    let path = dir.path().to_str().unwrap();
    let common = [
        "--served-model-name",
        "mm",
        "--device",
        "cpu",
        "--max-model-len",
        "256",
    ];
    let img = png(64, 96, |x, y| [(x * 4) as u8, (y * 2) as u8, 128]);
    let other = png(64, 96, |x, y| [255 - (y * 2) as u8, (x * 4) as u8, 0]);
    let audio =
        json!({"type": "input_audio", "input_audio": {"data": base64(&wav()), "format": "wav"}});
    let parts_of = |png: &[u8]| {
        vec![
            image_part(png),
            json!({"type": "text", "text": "w214 w177"}),
            audio.clone(),
        ]
    };
    let parts = || parts_of(&img);
    let plain = {
        let mut args = vec![path];
        args.extend(common);
        args.extend(["--kv-cache-memory", "16MiB"]);
        let server = Server::start(&args);
        let (other_text, _) = chat(&server, parts_of(&other)).await;
        let plain = chat(&server, parts()).await;
        // So that equal texts below mean the pixels reached the Thinker stage.
        assert_ne!(other_text, plain.0, "another image, another answer");
        plain
    };
    let mut args = vec![path, "--omni"];
    args.extend(common);
    let server = Server::start(&args);
    let text_only = chat_with(&server, parts(), json!({"modalities": ["text"]})).await;
    assert_eq!(text_only, plain, "the Thinker stage's text and tokens");
    let mut body = json!({"model": "mm", "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "modalities": ["text", "audio"], "audio": {"format": "wav"},
        "messages": [{"role": "user", "content": parts()}],
        "sampling_params_list": [{"temperature": 0, "max_tokens": 6, "ignore_eos": true},
            {"temperature": 0, "max_tokens": 8, "ignore_eos": true}, {}]});
    body["speaker"] = json!("ethan");
    let (status, v) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content, plain.0, "{v}");
    let wav_b64 = v["choices"][1]["message"]["audio"]["data"]
        .as_str()
        .unwrap();
    assert!(wav_b64.len() > 100, "{v}");
}
