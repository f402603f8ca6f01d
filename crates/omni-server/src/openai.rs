//! OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) and vLLM's tokenizer
//! endpoints (`/tokenize`, `/detokenize`, request and response), as accepted here. Unknown fields
//! are ignored, as OpenAI and vLLM do; wrong types are a 400.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StopSpec {
    /// The strings, without copying them.
    pub fn as_slice(&self) -> &[String] {
        match self {
            StopSpec::One(s) => std::slice::from_ref(s),
            StopSpec::Many(v) => v,
        }
    }

    /// As a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `"usage": null` on the others).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    /// Model name; must be one of the served names when given.
    pub model: Option<String>,
    /// Legacy name of the completion-length limit.
    pub max_tokens: Option<u32>,
    /// Softmax temperature.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Top-k; `-1` or `0` disables.
    pub top_k: Option<i64>,
    /// Min-p.
    pub min_p: Option<f32>,
    /// Per-request seed.
    pub seed: Option<i64>,
    /// Stop strings: at most 32, each at most 256 bytes of UTF-8 (more is a 400 naming `stop`).
    pub stop: Option<StopSpec>,
    /// Stop token ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Choices per prompt.
    pub n: Option<u32>,
    /// Stream with server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Presence penalty.
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Keep generating past EOS.
    pub ignore_eos: Option<bool>,
    /// Fewest tokens before a stop.
    pub min_tokens: Option<u32>,
    /// Keep the matched stop string in the output.
    pub include_stop_str_in_output: Option<bool>,
    /// Drop special tokens from the text (default true).
    pub skip_special_tokens: Option<bool>,
}

/// A chat message's `content`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts: text, and media on a model with the towers for it (see
    /// [`crate::media`]).
    Parts(Vec<ContentPart>),
}

/// One content part. The media fields stay JSON here, so that a malformed one gets a 400
/// naming its path (`messages[0].content[1].image_url`) from [`crate::media`], not serde's
/// message.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// `text`, `image_url`, `input_audio`, `audio_url`, `video_url`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a text part.
    pub text: Option<String>,
    /// `image_url`: `{"url": "data:image/png;base64,..." | "https://...", "detail": "auto"}`.
    pub image_url: Option<serde_json::Value>,
    /// `input_audio` (OpenAI): `{"data": "<base64>", "format": "wav" | "mp3" | "flac"}`.
    pub input_audio: Option<serde_json::Value>,
    /// `audio_url` (vLLM): `{"url": ...}`.
    pub audio_url: Option<serde_json::Value>,
    /// `video_url` (vLLM): `{"url": ...}`.
    pub video_url: Option<serde_json::Value>,
    /// vLLM's item id for its media cache.
    pub uuid: Option<serde_json::Value>,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// Content (may be null for assistant tool calls).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Optional participant name.
    #[serde(default)]
    pub name: Option<String>,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Shared sampling and streaming fields.
    #[serde(flatten)]
    pub common: CommonParams,
    /// Newer name of `max_tokens`.
    pub max_completion_tokens: Option<u32>,
    /// Return log-probabilities of the sampled tokens.
    pub logprobs: Option<bool>,
    /// How many alternatives per position (needs `logprobs: true`).
    pub top_logprobs: Option<u32>,
    /// Output modalities: `["text"]`, `["audio"]` or `["text","audio"]` (the last two on an omni
    /// server). Kept as JSON so a non-list gets vLLM-Omni's message.
    pub modalities: Option<serde_json::Value>,
    /// Audio output options (omni).
    pub audio: Option<AudioParams>,
    /// The voice (omni; case-insensitive, one of the model's speakers).
    pub speaker: Option<String>,
    /// Another name of `speaker` (used when `speaker` is absent).
    pub voice: Option<String>,
    /// The spoken language (omni; accepted, unused by Qwen3-Omni).
    pub language: Option<String>,
    /// One sampling object per pipeline stage (omni; element 0 the Thinker, see
    /// [`crate::OmniServerInfo`]).
    pub sampling_params_list: Option<Vec<serde_json::Value>>,
    /// End the prompt with the assistant header (default true).
    pub add_generation_prompt: Option<bool>,
}

/// `audio` of a chat request: only `format` is read (as vLLM-Omni).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AudioParams {
    /// `wav` (default), `pcm` (`pcm16`), `flac`.
    pub format: Option<String>,
}

/// `prompt` of `/v1/completions`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptSpec {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One prompt of token ids.
    Tokens(Vec<u32>),
    /// Several prompts of token ids.
    TokenBatches(Vec<Vec<u32>>),
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt(s).
    pub prompt: PromptSpec,
    /// Shared sampling and streaming fields.
    #[serde(flatten)]
    pub common: CommonParams,
    /// Number of alternatives per position to return (0..=20).
    pub logprobs: Option<u32>,
    /// Put the prompt text before the completion.
    pub echo: Option<bool>,
}

/// `POST /tokenize` with a text prompt (vLLM's `TokenizeCompletionRequest`).
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeCompletionRequest {
    /// Model name; must be one of the served names when given.
    pub model: Option<String>,
    /// The text to tokenize.
    pub prompt: String,
    /// Add the tokenizer's special tokens (BOS, ...) as a completion prompt gets them (default
    /// true).
    pub add_special_tokens: Option<bool>,
    /// Also return each token's string (default false).
    pub return_token_strs: Option<bool>,
}

/// `POST /tokenize` with chat messages (vLLM's `TokenizeChatRequest`): the prompt a chat
/// completion of these messages would get.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeChatRequest {
    /// Model name; must be one of the served names when given.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// End the prompt with the assistant header (default true, or false when
    /// `continue_final_message` is true).
    pub add_generation_prompt: Option<bool>,
    /// Leave the final message open, to be continued (default false; needs
    /// `add_generation_prompt: false`).
    pub continue_final_message: Option<bool>,
    /// Add the tokenizer's special tokens on top of the chat template's (default false: the
    /// template already holds them).
    pub add_special_tokens: Option<bool>,
    /// Also return each token's string (default false).
    pub return_token_strs: Option<bool>,
}

/// `POST /tokenize` body: the chat form when it has `messages`, else the text form (vLLM's
/// `TokenizeRequest` union).
#[derive(Debug, Clone)]
pub enum TokenizeRequest {
    /// `{"prompt": ...}`.
    Completion(TokenizeCompletionRequest),
    /// `{"messages": [...]}`.
    Chat(TokenizeChatRequest),
}

impl<'de> Deserialize<'de> for TokenizeRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        let chat = value.get("messages").is_some();
        if chat && value.get("prompt").is_some() {
            return Err(D::Error::custom(
                "give either `prompt` or `messages`, not both",
            ));
        }
        if chat {
            serde_json::from_value(value)
                .map(Self::Chat)
                .map_err(D::Error::custom)
        } else {
            serde_json::from_value(value)
                .map(Self::Completion)
                .map_err(D::Error::custom)
        }
    }
}

/// `POST /tokenize` answer (vLLM's `TokenizeResponse`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizeResponse {
    /// Number of tokens.
    pub count: usize,
    /// The server's context length.
    pub max_model_len: u32,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Each token's string in the vocabulary (`Ġthe`), when `return_token_strs` was true;
    /// `null` otherwise.
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize` body (vLLM's `DetokenizeRequest`).
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    /// Model name; must be one of the served names when given.
    pub model: Option<String>,
    /// The token ids to turn into text.
    pub tokens: Vec<u32>,
}

/// `POST /detokenize` answer (vLLM's `DetokenizeResponse`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetokenizeResponse {
    /// The text of the tokens, special tokens included.
    pub prompt: String,
}
