//! A hand-made byte-level BPE tokenizer, stored as GGUF metadata and as an HF directory:
//! encode/decode round trips, special tokens, chat templates, streaming detokenization.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on failure

use omni_gguf::{GgufFile, GgufWriter, Value, ValueType};
use omni_tokenizer::{Error, StopStrings, Tokenizer};
use serde_json::json;

/// GPT-2's reversible byte -> printable character table.
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

const MERGES: [(&str, &str); 4] = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")];
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Vocabulary: 3 specials, 256 bytes, then one token per merge.
fn tokens() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3; SPECIALS.len()];
    tokens.extend(byte_chars().iter().map(|c| c.to_string()));
    types.extend([1; 256]);
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    types.extend([1; MERGES.len()]);
    (tokens, types)
}

fn gguf(add_bos: bool, pre: &str) -> GgufFile {
    let (tokens, types) = tokens();
    let strings = |v: Vec<String>| {
        Value::Array(
            ValueType::String,
            v.into_iter().map(Value::String).collect(),
        )
    };
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()));
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.metadata("tokenizer.ggml.pre", Value::String(pre.into()));
    w.metadata("tokenizer.ggml.tokens", strings(tokens));
    w.metadata(
        "tokenizer.ggml.token_type",
        Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
    );
    w.metadata(
        "tokenizer.ggml.merges",
        strings(MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect()),
    );
    w.metadata("tokenizer.ggml.bos_token_id", Value::U32(1));
    w.metadata("tokenizer.ggml.eos_token_id", Value::U32(2));
    w.metadata("tokenizer.ggml.add_bos_token", Value::Bool(add_bos));
    w.metadata("tokenizer.chat_template", Value::String(TEMPLATE.into()));
    GgufFile::from_bytes(w.to_bytes()).unwrap()
}

fn byte_id(b: u8) -> u32 {
    3 + u32::from(b)
}

#[test]
fn gguf_tokenizer_applies_merges_and_round_trips() {
    let tok = Tokenizer::from_gguf(&gguf(false, "smollm")).unwrap();
    assert_eq!(tok.vocab_size(), 3 + 256 + 4);
    let hell = 3 + 256 + 2;
    let space_w = 3 + 256 + 3;
    let ids = tok.encode("hello world", true).unwrap();
    assert_eq!(
        ids,
        [
            hell,
            byte_id(b'o'),
            space_w,
            byte_id(b'o'),
            byte_id(b'r'),
            byte_id(b'l'),
            byte_id(b'd')
        ]
    );
    for text in [
        "hello world",
        "  tabs\tand\nnewlines ",
        "naïve café 😀",
        "123 + 4.5",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}

#[test]
fn digits_are_split_individually_for_smollm_pre_tokenizer() {
    let tok = Tokenizer::from_gguf(&gguf(false, "smollm")).unwrap();
    let ids = tok.encode("12", false).unwrap();
    assert_eq!(ids, [byte_id(b'1'), byte_id(b'2')]);
}

#[test]
fn special_tokens_are_matched_whole_and_skippable() {
    let tok = Tokenizer::from_gguf(&gguf(false, "smollm")).unwrap();
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_ids(), [2]);
    let ids = tok.encode("<|im_start|>he<|im_end|>", false).unwrap();
    assert_eq!(ids, [1, 3 + 256, 2]);
    assert!(tok.is_special(1) && !tok.is_special(3 + 256));
    assert_eq!(tok.decode(&ids, true).unwrap(), "he");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>he<|im_end|>");
}

#[test]
fn add_bos_token_prepends_bos_only_with_special_tokens() {
    let tok = Tokenizer::from_gguf(&gguf(true, "gpt2")).unwrap();
    assert_eq!(tok.encode("he", true).unwrap(), [1, 3 + 256]);
    assert_eq!(tok.encode("he", false).unwrap(), [3 + 256]);
}

#[test]
fn unknown_pre_tokenizers_are_rejected() {
    assert!(matches!(
        Tokenizer::from_gguf(&gguf(false, "mystery")),
        Err(Error::UnsupportedGguf { .. })
    ));
}

#[test]
fn chat_template_from_gguf_renders_and_encodes() {
    let tok = Tokenizer::from_gguf(&gguf(false, "smollm")).unwrap();
    let msgs = json!([{"role": "user", "content": "he"}]);
    let text = tok.apply_chat_template(&msgs, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nhe<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode_chat(&msgs, true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("omni-tokenizer-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn hf_directory_loads_tokenizer_config_and_generation_eos() {
    let dir = temp_dir("hfdir");
    let json = omni_tokenizer::tokenizer_json_from_gguf(&gguf(false, "smollm")).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec(&json).unwrap(),
    )
    .unwrap();
    let config = json!({
        "bos_token": {"content": "<|im_start|>", "special": true},
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}],
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"eos_token_id": [2, 0]}).to_string(),
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.pad_token(), Some("<|endoftext|>"));
    assert_eq!(tok.eos_token_ids(), [2, 0]);
    let text = tok
        .apply_chat_template(&json!([{"role": "user", "content": "x"}]), false)
        .unwrap();
    assert_eq!(text, "<|im_start|>user\nx<|im_end|>\n");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hf_directory_without_template_reports_it() {
    let dir = temp_dir("notemplate");
    let json = omni_tokenizer::tokenizer_json_from_gguf(&gguf(false, "gpt2")).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec(&json).unwrap(),
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert!(matches!(
        tok.apply_chat_template(&json!([]), true),
        Err(Error::NoChatTemplate)
    ));
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(
        Tokenizer::from_hf_dir(&dir),
        Err(Error::Io { .. })
    ));
}

#[test]
fn incremental_detokenizer_holds_back_partial_utf8() {
    let tok = Tokenizer::from_gguf(&gguf(false, "smollm")).unwrap();
    let prompt = tok.encode("he", false).unwrap();
    let mut d = tok.incremental_detokenizer(&prompt, true);
    // "é" is two bytes, two tokens here: nothing until the second.
    let [a, b] = "é".as_bytes() else {
        unreachable!()
    };
    assert_eq!(d.push(&tok, byte_id(*a)).unwrap(), "");
    assert_eq!(d.push(&tok, byte_id(*b)).unwrap(), "é");
    assert_eq!(d.push(&tok, 3 + 256 + 3).unwrap(), " w");
    assert_eq!(d.push(&tok, 2).unwrap(), "", "special tokens are skipped");
    assert_eq!(d.output(), "é w");
}

#[test]
fn incremental_deltas_concatenate_to_the_full_decode() {
    let tok = Tokenizer::from_gguf(&gguf(false, "smollm")).unwrap();
    let text = "hello 😀 wörld\n 42!";
    let ids = tok.encode(text, false).unwrap();
    let mut d = tok.incremental_detokenizer(&[], false);
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&d.push(&tok, id).unwrap());
    }
    streamed.push_str(&d.finish(&tok).unwrap());
    assert_eq!(streamed, text);
    // A stream cut inside a character still ends with what a full decode gives.
    let cut = &ids[..ids.len() - 12];
    let mut d = tok.incremental_detokenizer(&[], false);
    let mut streamed = String::new();
    for &id in cut {
        streamed.push_str(&d.push(&tok, id).unwrap());
    }
    streamed.push_str(&d.finish(&tok).unwrap());
    assert_eq!(streamed, tok.decode(cut, false).unwrap());
}

#[test]
fn stop_strings_work_on_streamed_text() {
    let tok = Tokenizer::from_gguf(&gguf(false, "smollm")).unwrap();
    let ids = tok.encode("hello world", false).unwrap();
    let stops = StopStrings::new(["o w".to_string()], false);
    let mut d = tok.incremental_detokenizer(&[], true);
    let mut text = String::new();
    let mut stopped = None;
    for &id in &ids {
        let delta = d.push(&tok, id).unwrap();
        text.push_str(&delta);
        if let Some(m) = stops.find(&text, delta.len()) {
            stopped = Some(m.truncate_to);
            break;
        }
        assert!(stops.safe_len(&text) <= text.len());
    }
    assert_eq!(&text[..stopped.unwrap()], "hell");
}
