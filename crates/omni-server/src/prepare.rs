//! Request validation and tokenization: an OpenAI body becomes a [`Prepared`] set of engine
//! requests (one per prompt and choice) or an [`ApiError`] (400/404). Pure functions of the body,
//! the config and the tokenizer, so they run on a blocking thread.

use std::sync::Arc;

use omni_protocol::{
    DType, EngineCoreRequest, MmKind, MultiModalFeatureSpec, SamplingParams, TensorRef, TokenId,
};
use omni_tokenizer::Tokenizer;
use serde_json::Value;

use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::media::parts::ParsedChat;
use crate::media::{ChatMedia, MmInput, prompt};
use crate::omni::{OmniRequest, prepare_omni};
use crate::openai::{ChatCompletionRequest, CommonParams, CompletionRequest, PromptSpec};

/// Which endpoint a request came from (decides the response shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// One tokenized prompt.
#[derive(Debug, Clone)]
pub struct PreparedPrompt {
    /// Token ids (chat template applied).
    pub ids: Vec<TokenId>,
    /// Sampling parameters for this prompt's choices (max_tokens resolved).
    pub params: SamplingParams,
    /// Prompt text to put before the completion (`echo`).
    pub echo: Option<String>,
    /// The prompt's images and audio clips, decoded and preprocessed, in prompt order, each
    /// with the offset of its pad tokens in `ids` (see [`MmInput`] for what consumes them).
    pub mm_inputs: Arc<[MmInput]>,
}

impl PreparedPrompt {
    /// Puts [`Self::mm_inputs`] on an engine request: one `MultiModalFeatureSpec` per item
    /// (placeholder range, content hash, kind, a `TensorRef` to its bf16 tensor) and the tensors
    /// as the request's out-of-band buffers (shared with this prompt, not copied: `n` choices of
    /// one prompt send the same bytes).
    pub fn attach_mm_inputs(&self, req: &mut EngineCoreRequest) {
        for i in self.mm_inputs.iter() {
            let kind = match (i.grid_thw, i.num_frames) {
                (Some(grid_thw), _) => MmKind::Image { grid_thw },
                (None, Some(num_frames)) => MmKind::Audio { num_frames },
                (None, None) => continue, // video: refused before it gets here
            };
            let buffer_index = req.mm_buffers.push(i.data.clone());
            req.mm_features.push(MultiModalFeatureSpec {
                mm_hash: i.mm_hash(),
                offset: i.offset,
                length: i.num_tokens,
                kind,
                tensor: TensorRef {
                    name: kind.modality().into(),
                    request_id: Some(req.request_id.clone()),
                    dtype: DType::Bf16,
                    shape: i.shape.map(|d| d as u64).to_vec(),
                    buffer_index,
                },
            });
        }
    }
}

/// A validated request.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Endpoint.
    pub endpoint: Endpoint,
    /// Model name to report.
    pub model: String,
    /// Prompts, in order; choice `p * n + j` is the `j`th sample of prompt `p`.
    pub prompts: Vec<PreparedPrompt>,
    /// Choices per prompt.
    pub n: u32,
    /// Stream the answer.
    pub stream: bool,
    /// Send a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// `Some(k)`: return each sampled token's logprob and `k` alternatives.
    pub logprobs: Option<u32>,
    /// Drop special tokens from text.
    pub skip_special_tokens: bool,
    /// Keep matched stop strings in the text.
    pub include_stop_str_in_output: bool,
    /// The omni part (every chat request to an omni server); `None` otherwise.
    pub omni: Option<OmniRequest>,
}

/// Largest number of alternatives per position.
const MAX_LOGPROBS: u32 = 20;
/// Largest number of engine requests (prompts x n) one HTTP request may fan out to.
const MAX_CHOICES: usize = 1024;
/// Most stop strings in one request (OpenAI allows 4; vLLM sets no bound). Every new piece of
/// text is matched against each of them, so this bounds that work per token.
const MAX_STOP_STRINGS: usize = 32;
/// Longest stop string, in bytes of UTF-8. Matching costs grow with the square of the length, and
/// text that may begin a stop string is held back from the stream until it cannot.
const MAX_STOP_STRING_BYTES: usize = 256;

pub(crate) fn check_model(
    config: &ServerConfig,
    model: &Option<String>,
) -> Result<String, ApiError> {
    match model {
        Some(m) if !config.serves(m) => Err(ApiError::model_not_found(m)),
        _ => Ok(config.model_name().to_string()),
    }
}

/// Sampling parameters common to both endpoints, without `max_tokens` (resolved per prompt):
/// the request's fields over `d` (the defaults: [`SamplingParams::default`], or an omni Thinker's
/// deploy-profile defaults).
fn base_params(
    c: &CommonParams,
    d: &SamplingParams,
    max_tokens: Option<u32>,
    logprobs: Option<u32>,
    tokenizer: &Tokenizer,
) -> Result<SamplingParams, ApiError> {
    let top_k = match c.top_k {
        None => d.top_k,
        Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
        Some(k) => {
            return Err(ApiError::bad_param(
                "top_k",
                format!("top_k must be -1 (disabled) or at least 1, got {k}"),
            ));
        }
    };
    let ignore_eos = c.ignore_eos.unwrap_or(d.ignore_eos);
    let mut stop_token_ids = c
        .stop_token_ids
        .clone()
        .unwrap_or_else(|| d.stop_token_ids.clone());
    let vocab = tokenizer.vocab_size();
    if let Some(bad) = stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_param(
            "stop_token_ids",
            format!("stop token id {bad} is outside the vocabulary (size {vocab})"),
        ));
    }
    if !ignore_eos {
        // EOS ids beyond the primary one (generation_config.json's list, GGUF's EOT).
        stop_token_ids.extend(tokenizer.eos_token_ids().iter().skip(1));
    }
    check_stop(c)?;
    let stop = c
        .stop
        .clone()
        .map(|s| s.into_vec())
        .unwrap_or_else(|| d.stop.clone());
    let params = SamplingParams {
        temperature: c.temperature.unwrap_or(d.temperature),
        top_p: c.top_p.unwrap_or(d.top_p),
        top_k,
        min_p: c.min_p.unwrap_or(d.min_p),
        seed: c.seed.map(|s| s as u64).or(d.seed),
        presence_penalty: c.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: c.frequency_penalty.unwrap_or(d.frequency_penalty),
        repetition_penalty: c.repetition_penalty.unwrap_or(d.repetition_penalty),
        max_tokens,
        min_tokens: c.min_tokens.unwrap_or(d.min_tokens),
        stop,
        stop_token_ids,
        ignore_eos,
        logprobs,
    };
    params.validate()?;
    Ok(params)
}

/// Bounds the number and length of the stop strings.
fn check_stop(c: &CommonParams) -> Result<(), ApiError> {
    let stops = c.stop.as_ref().map(|s| s.as_slice()).unwrap_or_default();
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::bad_param(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                stops.len()
            ),
        ));
    }
    if let Some((i, s)) = stops
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_STRING_BYTES)
    {
        return Err(ApiError::bad_param(
            "stop",
            format!(
                "stop string {i} is {} bytes long; a stop string may be at most \
                 {MAX_STOP_STRING_BYTES} bytes",
                s.len()
            ),
        ));
    }
    Ok(())
}

fn check_common(config: &ServerConfig, c: &CommonParams) -> Result<(), ApiError> {
    let n = c.n.unwrap_or(1);
    if n == 0 || n > config.max_n {
        return Err(ApiError::bad_param(
            "n",
            format!("n must be between 1 and {}, got {n}", config.max_n),
        ));
    }
    if c.stream_options.is_some() && !c.stream.unwrap_or(false) {
        return Err(ApiError::bad_param(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    Ok(())
}

/// Resolves `max_tokens` against the context length for one prompt. `field` is the request field
/// the prompt came from (`messages` or `prompt`): the error names it.
fn fit_prompt(
    config: &ServerConfig,
    field: &'static str,
    prompt_len: usize,
    max_tokens: Option<u32>,
    base: &SamplingParams,
) -> Result<SamplingParams, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    let max_len = u64::from(config.max_model_len);
    let requested = u64::from(max_tokens.unwrap_or(0));
    if prompt_len as u64 >= max_len || prompt_len as u64 + requested > max_len {
        return Err(ApiError::bad_param(
            field,
            format!(
                "This model's maximum context length is {max_len} tokens. However, you requested \
                 {} tokens ({prompt_len} in the {field}, {requested} in the completion). Please \
                 reduce the length of the {field} or completion.",
                prompt_len as u64 + requested
            ),
        ));
    }
    let mut params = base.clone();
    params.max_tokens = Some(max_tokens.unwrap_or((max_len - prompt_len as u64) as u32));
    Ok(params)
}

/// The messages as the chat template sees them: `{role, content, name?}`, a message's text
/// parts joined by newlines, its media parts as placeholders (see [`crate::media::prompt`]).
pub(crate) fn chat_messages(
    config: &ServerConfig,
    tokenizer: &Tokenizer,
    chat: &ParsedChat,
) -> Result<Vec<Value>, ApiError> {
    let format = prompt::content_format(tokenizer.chat_template().map(|t| t.source()));
    prompt::template_messages(chat, format, config.multimodal.as_deref(), tokenizer)
}

/// The checks of a chat request that need neither its media nor the tokenizer, made before
/// any media is fetched: the model name, `n` and `stream_options`, and that there are
/// messages. The model name to report.
pub(crate) fn check_chat(
    config: &ServerConfig,
    common: &CommonParams,
    num_messages: usize,
) -> Result<String, ApiError> {
    let model = check_model(config, &common.model)?;
    check_common(config, common)?;
    if num_messages == 0 {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    Ok(model)
}

/// Validates and tokenizes a chat request.
///
/// `media` holds the request's messages (`req.messages` is not read: the handler moved them
/// into [`crate::media::load`]) and their fetched, preprocessed items, which end up on the
/// prompt with their placeholders expanded.
pub(crate) fn prepare_chat(
    config: &ServerConfig,
    tokenizer: &Tokenizer,
    req: ChatCompletionRequest,
    media: ChatMedia,
) -> Result<Prepared, ApiError> {
    let model = check_chat(config, &req.common, media.chat.messages.len())?;
    let mut common = req.common.clone();
    let mut max_tokens = req.max_completion_tokens.or(req.common.max_tokens);
    let omni = prepare_omni(config.omni.as_ref(), &req, &mut common, &mut max_tokens)?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (_, Some(k)) if k > MAX_LOGPROBS => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                format!("top_logprobs must be between 0 and {MAX_LOGPROBS}, got {k}"),
            ));
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "top_logprobs requires logprobs to be true",
            ));
        }
        (true, k) => Some(k.unwrap_or(0)),
        (false, _) => None,
    };
    let messages = chat_messages(config, tokenizer, &media.chat)?;
    let ids = tokenizer
        .encode_chat(&messages, req.add_generation_prompt.unwrap_or(true))
        .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
    let mut mm_inputs = media.inputs;
    let ids = prompt::expand(ids, &mut mm_inputs, config.multimodal.as_deref())?;
    let defaults = &omni.thinker_defaults;
    let base = base_params(&common, defaults, max_tokens, logprobs, tokenizer)?;
    let mut params = fit_prompt(config, "messages", ids.len(), max_tokens, &base)?;
    if max_tokens.is_none()
        && let (Some(d), Some(room)) = (defaults.max_tokens, params.max_tokens)
    {
        // A profile default beyond the context left is cut to fit (vLLM's default max_tokens).
        params.max_tokens = Some(d.min(room));
    }
    Ok(Prepared {
        endpoint: Endpoint::Chat,
        model,
        prompts: vec![PreparedPrompt {
            ids,
            params,
            echo: None,
            mm_inputs: mm_inputs.into(),
        }],
        n: common.n.unwrap_or(1),
        stream: common.stream.unwrap_or(false),
        include_usage: include_usage(&common),
        logprobs,
        skip_special_tokens: common.skip_special_tokens.unwrap_or(true),
        include_stop_str_in_output: common.include_stop_str_in_output.unwrap_or(false),
        omni: omni.request,
    })
}

fn include_usage(c: &CommonParams) -> bool {
    c.stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false)
}

/// Validates and tokenizes a completions request.
pub fn prepare_completion(
    config: &ServerConfig,
    tokenizer: &Tokenizer,
    req: CompletionRequest,
) -> Result<Prepared, ApiError> {
    let model = check_model(config, &req.common.model)?;
    if config.omni.is_some() {
        // vLLM-Omni refuses completions for Thinker + Talker models too.
        return Err(ApiError::bad_request(format!(
            "model `{model}` is an omni model (text and speech); use /v1/chat/completions"
        )));
    }
    check_common(config, &req.common)?;
    if let Some(k) = req.logprobs
        && k > MAX_LOGPROBS
    {
        return Err(ApiError::bad_param(
            "logprobs",
            format!("logprobs must be between 0 and {MAX_LOGPROBS}, got {k}"),
        ));
    }
    let echo = req.echo.unwrap_or(false);
    let vocab = tokenizer.vocab_size();
    let encode = |text: &str| {
        tokenizer
            .encode(text, true)
            .map_err(|e| ApiError::bad_param("prompt", e.to_string()))
    };
    let check_ids = |ids: Vec<u32>| -> Result<(Vec<u32>, Option<String>), ApiError> {
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_param(
                "prompt",
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        let text = if echo {
            Some(
                tokenizer
                    .decode(&ids, true)
                    .map_err(|e| ApiError::bad_param("prompt", e.to_string()))?,
            )
        } else {
            None
        };
        Ok((ids, text))
    };
    let raw: Vec<(Vec<u32>, Option<String>)> = match req.prompt {
        PromptSpec::Text(t) => vec![(encode(&t)?, echo.then_some(t))],
        PromptSpec::Texts(ts) => ts
            .into_iter()
            .map(|t| Ok((encode(&t)?, echo.then_some(t))))
            .collect::<Result<_, ApiError>>()?,
        PromptSpec::Tokens(ids) => vec![check_ids(ids)?],
        PromptSpec::TokenBatches(batches) => batches
            .into_iter()
            .map(check_ids)
            .collect::<Result<_, ApiError>>()?,
    };
    if raw.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt list is empty"));
    }
    let n = req.common.n.unwrap_or(1) as usize;
    if raw.len().saturating_mul(n) > MAX_CHOICES {
        return Err(ApiError::bad_param(
            "prompt",
            format!("at most {MAX_CHOICES} choices (prompts x n) per request"),
        ));
    }
    let max_tokens = req.common.max_tokens;
    let defaults = SamplingParams::default();
    let base = base_params(&req.common, &defaults, max_tokens, req.logprobs, tokenizer)?;
    let prompts = raw
        .into_iter()
        .map(|(ids, echo)| {
            let params = fit_prompt(config, "prompt", ids.len(), max_tokens, &base)?;
            Ok(PreparedPrompt {
                ids,
                params,
                echo,
                mm_inputs: Arc::from([]),
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(Prepared {
        endpoint: Endpoint::Completion,
        model,
        prompts,
        n: req.common.n.unwrap_or(1),
        stream: req.common.stream.unwrap_or(false),
        include_usage: include_usage(&req.common),
        logprobs: req.logprobs,
        skip_special_tokens: req.common.skip_special_tokens.unwrap_or(true),
        include_stop_str_in_output: req.common.include_stop_str_in_output.unwrap_or(false),
        omni: None,
    })
}
