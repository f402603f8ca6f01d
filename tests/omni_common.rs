//! Shared by the omni end-to-end tests: the tiny Qwen3-Omni fixture, its transformers
//! references, and the audio Code2Wav makes of the reference frames, cut into the pipeline's
//! windows.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use omni_models::qwen3_omni::code2wav::Code2Wav;
use omni_protocol::CodecWindowing;

// The including test crate declares `mod common` (tests/server_common.rs), which brings
// engine_common's helpers: one copy of them per test crate.
#[allow(unused_imports)] // the pipeline tests start stages with it; the server tests do not
pub use crate::common::engine_bin;

pub const WINDOWS: CodecWindowing = CodecWindowing {
    initial: 4,
    chunk: 25,
    left_context: 25,
};
pub const THINKER_TOKENS: u32 = 8;
pub const FRAMES: u32 = 11;

/// The fixture (from a copy of the repository too: the GPU machine runs the binaries there).
pub fn fixture() -> PathBuf {
    crate::common::fixture("qwen3-omni")
}

pub fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
        .unwrap()
}

pub fn reference_frames(key: &str) -> Vec<u32> {
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(key).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Code2Wav over `frames` (frame-major `[T, 16]`), cut as the pipeline cuts them.
pub fn expected_audio(c2w: &Code2Wav, frames: &[u32], async_chunk: bool) -> Vec<f32> {
    let g = 16;
    let mut chunker = if async_chunk {
        omni_core::connector::CodecChunker::new(
            g,
            WINDOWS.initial as usize,
            WINDOWS.chunk as usize,
            WINDOWS.left_context as usize,
        )
    } else {
        omni_core::connector::CodecChunker::new(g, usize::MAX, usize::MAX, 0)
    };
    let mut windows: Vec<_> = frames
        .chunks_exact(g)
        .filter_map(|f| chunker.push(f))
        .collect();
    windows.extend(chunker.finish());
    let mut out = Vec::new();
    for w in windows {
        out.extend(
            c2w.decode_window(&w.codes, w.num_frames, w.left_context)
                .unwrap(),
        );
    }
    out
}

pub fn load_code2wav() -> Code2Wav {
    let dir = fixture();
    let config = omni_models::registry::read_config(&dir).unwrap();
    let ws = omni_models::hf_dir::SafetensorsDir::open(&dir).unwrap();
    Code2Wav::load(&config, &ws).unwrap()
}

/// A copy of the fixture (links) with a word-level tokenizer over its real ids (`w<id>`, the
/// ChatML specials as added tokens) and a chat template that writes exactly the fixture's
/// prompts: `{role}` and the newline are the words of their ids. The directory lives as long
/// as the returned guard.
pub fn fixture_with_tokenizer() -> (PathBuf, TempDir) {
    let src = fixture();
    let dir = TempDir::new("omni-fixture");
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::os::unix::fs::symlink(src.join(f), dir.0.join(f)).unwrap();
    }
    let config = omni_models::registry::read_config(&src).unwrap();
    let vocab = config["thinker_config"]["text_config"]["vocab_size"]
        .as_u64()
        .unwrap();
    let specials = [(151644u64, "<|im_start|>"), (151645, "<|im_end|>")];
    // The specials are in the vocabulary under their own text, so the added tokens keep
    // their real ids.
    let words: serde_json::Map<String, serde_json::Value> = (0..vocab)
        .map(|i| match specials.iter().find(|(s, _)| *s == i) {
            Some((_, content)) => (content.to_string(), serde_json::json!(i)),
            None => (format!("w{i}"), serde_json::json!(i)),
        })
        .collect();
    let added: Vec<serde_json::Value> = specials
        .iter()
        .map(|(id, content)| {
            serde_json::json!({"id": id, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"}
    });
    std::fs::write(dir.0.join("tokenizer.json"), tok.to_string()).unwrap();
    let template = "{% for m in messages %}<|im_start|>{% if m.role == 'system' %}w8948\
        {% elif m.role == 'user' %}w872{% else %}w77091{% endif %} w198 {{ m.content }}\
        <|im_end|> w198 {% endfor %}{% if add_generation_prompt %}<|im_start|>w77091 w198{% endif %}";
    let cfg = serde_json::json!({"chat_template": template, "eos_token": "<|im_end|>"});
    std::fs::write(dir.0.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    (dir.0.clone(), dir)
}

/// The chat messages whose template gives the fixture's prompt `i` (a system turn, then a
/// user turn, split at `<|im_start|>`).
pub fn messages_of(prompt: &[u32]) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let turns = prompt.split(|&t| t == 151644).filter(|t| !t.is_empty());
    for turn in turns {
        let role = match turn[0] {
            8948 => "system",
            872 => "user",
            _ => continue, // the trailing `assistant \n` is the generation prompt
        };
        // role, "\n", content..., <|im_end|>, "\n"
        let content: Vec<String> = turn[2..turn.len() - 2]
            .iter()
            .map(|t| format!("w{t}"))
            .collect();
        out.push(serde_json::json!({"role": role, "content": content.join(" ")}));
    }
    out
}

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Standard base64 to bytes (the bench client's decoder).
pub fn base64_decode(s: &str) -> Vec<u8> {
    omni_bench::serve::wav::base64_decode(s).unwrap()
}

/// The samples of a 16-bit PCM WAV file, as floats (`s / 32768`), and its sample rate.
pub fn wav_samples(file: &[u8]) -> (Vec<f32>, u32) {
    assert_eq!(&file[..4], b"RIFF");
    assert_eq!(&file[8..12], b"WAVE");
    let mut at = 12;
    let mut rate = 0;
    while at + 8 <= file.len() {
        let id = &file[at..at + 4];
        let len = u32::from_le_bytes(file[at + 4..at + 8].try_into().unwrap()) as usize;
        let body = &file[at + 8..(at + 8 + len).min(file.len())];
        if id == b"fmt " {
            assert_eq!(u16::from_le_bytes([body[0], body[1]]), 1, "PCM");
            assert_eq!(u16::from_le_bytes([body[2], body[3]]), 1, "mono");
            rate = u32::from_le_bytes(body[4..8].try_into().unwrap());
            assert_eq!(u16::from_le_bytes([body[14], body[15]]), 16, "16-bit");
        } else if id == b"data" {
            let s = body
                .chunks_exact(2)
                .map(|b| i16::from_le_bytes([b[0], b[1]]) as f32 / 32768.0)
                .collect();
            return (s, rate);
        }
        at += 8 + len + (len & 1);
    }
    panic!("no data chunk");
}
