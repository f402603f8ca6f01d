//! Logprobs as the two endpoints render them: chat's `{"content":[...]}` and completions'
//! parallel lists.

use omni_protocol::TokenLogprobs;
use serde_json::{Value, json};

fn token_text(tokenizer: &omni_tokenizer::Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// Chat `logprobs`: `{"content":[{"token","logprob","bytes","top_logprobs":[...]}]}`.
pub(crate) fn chat_logprobs(tokenizer: &omni_tokenizer::Tokenizer, lps: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let token = token_text(tokenizer, id);
        json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(lp.sampled.token_id, lp.sampled.logprob);
            e["top_logprobs"] = lp
                .top
                .iter()
                .map(|t| entry(t.token_id, t.logprob))
                .collect();
            e
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

/// Completions `logprobs`: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (one map
/// per position, sampled token included) and `text_offset`.
pub(crate) fn completion_logprobs(
    tokenizer: &omni_tokenizer::Tokenizer,
    lps: &[TokenLogprobs],
    mut offset: usize,
) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut text_offset = Vec::new();
    for lp in lps {
        let token = token_text(tokenizer, lp.sampled.token_id);
        text_offset.push(offset);
        offset += token.len();
        let mut top = serde_json::Map::new();
        for t in &lp.top {
            top.insert(token_text(tokenizer, t.token_id), json!(t.logprob));
        }
        top.insert(token.clone(), json!(lp.sampled.logprob));
        tokens.push(token);
        token_logprobs.push(lp.sampled.logprob);
        top_logprobs.push(Value::Object(top));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}
