//! What the API process sends to the engine core.

use serde::{Deserialize, Serialize};

use crate::{OmniParams, RequestId, SamplingParams, TensorRef, TokenId};

/// One tokenized request, as the engine core receives it (vLLM's `EngineCoreRequest`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreRequest {
    /// Unique among live requests.
    pub request_id: RequestId,
    /// The tokenized prompt (chat template already applied).
    pub prompt_token_ids: Vec<TokenId>,
    /// How to sample and when to stop.
    pub sampling_params: SamplingParams,
    /// The model's end-of-sequence token, if it has one.
    pub eos_token_id: Option<TokenId>,
    /// When the API process received the request, seconds since the Unix epoch.
    pub arrival_time: f64,
    /// Multimodal inputs carried as out-of-band buffers of the same message.
    pub tensors: Vec<TensorRef>,
    /// Where each multimodal item sits in the prompt and its content hash (vLLM's
    /// `PlaceholderRange` + `mm_hash`): the hash enters the prefix-cache hash of every block the
    /// item's placeholder tokens touch, so equal token ids with different media never share
    /// KV blocks.
    pub mm_placeholders: Vec<MultiModalPlaceholder>,
    /// The omni part (output modalities, voice, later stages' sampling); `None` for a text
    /// request.
    #[serde(default)]
    pub omni: Option<OmniParams>,
}

/// One multimodal item's placeholder range in the prompt, with its content hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MultiModalPlaceholder {
    /// Content hash of the item (the encoder cache key).
    pub mm_hash: u64,
    /// First placeholder token, as an index into the prompt.
    pub offset: u32,
    /// Placeholder tokens.
    pub length: u32,
}

impl EngineCoreRequest {
    /// A request with no multimodal inputs that arrived now.
    pub fn new(
        request_id: impl Into<RequestId>,
        prompt_token_ids: Vec<TokenId>,
        sampling_params: SamplingParams,
        eos_token_id: Option<TokenId>,
    ) -> Self {
        let arrival_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        Self {
            request_id: request_id.into(),
            prompt_token_ids,
            sampling_params,
            eos_token_id,
            arrival_time,
            tensors: Vec::new(),
            mm_placeholders: Vec::new(),
            omni: None,
        }
    }
}

/// A message from the API process to the engine core (vLLM's `EngineCoreRequestType`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineCoreInput {
    /// Admit a new request (boxed: the other variants are a few bytes).
    Add(Box<EngineCoreRequest>),
    /// Stop these requests now and free their KV cache (client went away, stop string hit).
    Abort(Vec<RequestId>),
    /// Finish the in-flight step, then exit.
    Shutdown,
}
