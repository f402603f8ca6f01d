//! vLLM's tokenizer endpoints: `POST /tokenize` (a text prompt, or chat messages rendered as a
//! chat completion would render them) and `POST /detokenize`, with vLLM's request and response
//! shapes ([`crate::openai::TokenizeRequest`], [`crate::openai::DetokenizeRequest`]). Clients use
//! them to count tokens as the server does (`vllm bench serve` aligns its prompts with them).
//! Pure functions of the body, the config and the tokenizer, run on a blocking thread. As in
//! vLLM, a sequence longer than the context length is a 400; an id outside the vocabulary is a
//! 400 here (vLLM drops it from the text).

use omni_tokenizer::Tokenizer;

use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::media::{ChatMedia, prompt};
use crate::openai::{
    DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest, TokenizeCompletionRequest,
    TokenizeRequest, TokenizeResponse,
};
use crate::prepare::{chat_messages, check_model};

/// Answers `POST /tokenize`. For the chat form, `media` holds the messages (the handler moved
/// them out of the request) and their preprocessed items: each placeholder counts as the
/// tokens its item takes, as in a chat completion.
pub(crate) fn tokenize(
    config: &ServerConfig,
    tokenizer: &Tokenizer,
    req: TokenizeRequest,
    media: ChatMedia,
) -> Result<TokenizeResponse, ApiError> {
    let (field, tokens, token_strs) = match req {
        TokenizeRequest::Completion(r) => (
            "prompt",
            completion_ids(config, tokenizer, &r)?,
            r.return_token_strs,
        ),
        TokenizeRequest::Chat(r) => (
            "messages",
            chat_ids(config, tokenizer, &r, media)?,
            r.return_token_strs,
        ),
    };
    check_len(config, field, tokens.len())?;
    let token_strs = token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
            .collect()
    });
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: config.max_model_len,
        tokens,
        token_strs,
    })
}

/// Answers `POST /detokenize`: the text of the ids, special tokens included (vLLM decodes with
/// `skip_special_tokens=False`).
pub fn detokenize(
    config: &ServerConfig,
    tokenizer: &Tokenizer,
    req: DetokenizeRequest,
) -> Result<DetokenizeResponse, ApiError> {
    check_model(config, &req.model)?;
    check_len(config, "tokens", req.tokens.len())?;
    let vocab = tokenizer.vocab_size();
    if let Some((i, bad)) = req
        .tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= vocab)
    {
        return Err(ApiError::bad_param(
            "tokens",
            format!("tokens[{i}] = {bad} is outside the vocabulary (size {vocab})"),
        ));
    }
    let prompt = tokenizer
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::bad_param("tokens", e.to_string()))?;
    Ok(DetokenizeResponse { prompt })
}

fn completion_ids(
    config: &ServerConfig,
    tokenizer: &Tokenizer,
    r: &TokenizeCompletionRequest,
) -> Result<Vec<u32>, ApiError> {
    check_model(config, &r.model)?;
    tokenizer
        .encode(&r.prompt, r.add_special_tokens.unwrap_or(true))
        .map_err(|e| ApiError::bad_param("prompt", e.to_string()))
}

fn chat_ids(
    config: &ServerConfig,
    tokenizer: &Tokenizer,
    r: &TokenizeChatRequest,
    media: ChatMedia,
) -> Result<Vec<u32>, ApiError> {
    check_model(config, &r.model)?;
    if media.chat.messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let continue_final = r.continue_final_message.unwrap_or(false);
    let add_generation_prompt = r.add_generation_prompt.unwrap_or(!continue_final);
    if continue_final && add_generation_prompt {
        return Err(ApiError::bad_param(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    let messages = chat_messages(config, tokenizer, &media.chat)?;
    let mut text = tokenizer
        .apply_chat_template(&messages, add_generation_prompt)
        .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
    if continue_final {
        let last = messages.last().and_then(|m| m["content"].as_str());
        text = cut_after_final_message(text, last.unwrap_or(""))?;
    }
    let ids = tokenizer
        .encode(&text, r.add_special_tokens.unwrap_or(false))
        .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
    let mut inputs = media.inputs;
    prompt::expand(ids, &mut inputs, config.multimodal.as_deref())
}

/// Ends the rendered chat right after the final message's content, dropping what the template
/// puts after it (its end-of-turn tokens), as `transformers` does for `continue_final_message`.
fn cut_after_final_message(mut text: String, last: &str) -> Result<String, ApiError> {
    let end = text
        .rfind(last)
        .map(|at| at + last.len())
        .or_else(|| {
            let trimmed = last.trim();
            text.rfind(trimmed).map(|at| at + trimmed.len())
        })
        .ok_or_else(|| {
            ApiError::bad_param(
                "continue_final_message",
                "continue_final_message is set but the final message does not appear in the chat \
                 after applying the chat template",
            )
        })?;
    text.truncate(end);
    Ok(text)
}

/// vLLM's check: a sequence may fill the context but not exceed it (it asks for no output).
fn check_len(config: &ServerConfig, field: &'static str, len: usize) -> Result<(), ApiError> {
    let max = config.max_model_len as usize;
    if len > max {
        return Err(ApiError::bad_param(
            field,
            format!(
                "You passed {len} input tokens and requested 0 output tokens. However, the \
                 model's context length is only {max} tokens, resulting in a maximum input length \
                 of {max} tokens. Please reduce the length of the input prompt."
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuing_cuts_the_chat_after_the_final_message() {
        let text = "<s>user\nHi</s>\n<s>assistant\nSure,</s>\n".to_string();
        assert_eq!(
            cut_after_final_message(text.clone(), "Sure,").unwrap(),
            "<s>user\nHi</s>\n<s>assistant\nSure,"
        );
        assert_eq!(
            cut_after_final_message(text.clone(), " Sure, ").unwrap(),
            "<s>user\nHi</s>\n<s>assistant\nSure,"
        );
        let err = cut_after_final_message(text, "absent").unwrap_err();
        assert_eq!(err.param.as_deref(), Some("continue_final_message"));
    }
}
