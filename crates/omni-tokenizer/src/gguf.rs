//! A `tokenizer.json` built from GGUF metadata (`tokenizer.ggml.*`).
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with the pre-tokenizers named by
//! `tokenizer.ggml.pre` that this table knows (SmolLM/StarCoder digits-then-byte-level, GPT-2,
//! Llama 3, Qwen 2). Token types: 3 (control) become special added tokens, 4 (user-defined)
//! non-special added tokens.

use omni_gguf::GgufFile;
use serde_json::{Map, Value as Json, json};

use crate::Error;

/// llama.cpp token type of a control token (`<|im_start|>`, `<|endoftext|>`).
pub const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp token type of a user-defined token.
pub const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The pre-tokenizer split regex of Llama 3.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The pre-tokenizer split regex of Qwen 2.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_byte_level(regex: &str) -> Json {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

/// `(normalizer, pre_tokenizer)` for a `tokenizer.ggml.pre` value.
fn pre_tokenizer(pre: &str) -> Result<(Json, Json), Error> {
    Ok(match pre {
        "smollm" | "starcoder" | "refact" | "codeshell" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
        ),
        "default" | "gpt-2" | "gpt2" => (Json::Null, byte_level(true)),
        "llama3" | "llama-bpe" | "llama-v3" => (Json::Null, split_then_byte_level(LLAMA3_SPLIT)),
        "qwen2" => (json!({"type": "NFC"}), split_then_byte_level(QWEN2_SPLIT)),
        other => {
            return Err(Error::UnsupportedGguf {
                reason: format!(
                    "tokenizer.ggml.pre = {other:?} is not known (known: smollm, starcoder, refact, \
                     codeshell, default, gpt-2, llama3, llama-bpe, qwen2)"
                ),
            });
        }
    })
}

/// Builds the `tokenizer.json` document for the tokenizer described by `file`'s metadata.
pub fn tokenizer_json_from_gguf(file: &GgufFile) -> Result<Json, Error> {
    let model = file.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(Error::UnsupportedGguf {
            reason: format!(
                "tokenizer.ggml.model = {model:?} (only byte-level BPE, \"gpt2\", is supported)"
            ),
        });
    }
    let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
    let merges = file.get_str_array("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match file
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
    {
        Some(values) => values.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => Vec::new(),
    };
    let pre = file
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let (normalizer, pre_tokenizer) = pre_tokenizer(pre)?;

    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        // On duplicates the first id wins, as llama.cpp's lookup does.
        vocab.entry(token.to_string()).or_insert(json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok(json!([a, b])),
            None => Err(Error::UnsupportedGguf {
                reason: format!("merge {m:?} has no space"),
            }),
        })
        .collect::<Result<_, _>>()?;

    let token_id = |key: &str| file.get(key).and_then(|v| v.as_u64());
    let add_bos = file
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let bos = token_id("tokenizer.ggml.bos_token_id")
        .and_then(|id| Some((id, *tokens.get(id as usize)?)));
    let post_processor = match bos {
        Some((id, bos)) if add_bos => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [id], "tokens": [bos]}},
        }),
        _ => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true})
        }
    };

    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    }))
}
