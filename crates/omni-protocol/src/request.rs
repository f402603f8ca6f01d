//! What the API process sends to the engine core.

use serde::{Deserialize, Serialize};

use crate::{MultiModalFeatureSpec, OmniParams, RequestId, SamplingParams, TensorBuffers, TokenId};

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
    /// The prompt's multimodal items, sorted by placeholder offset: placeholder range, content
    /// hash (which enters the prefix-cache hash of every block the placeholder touches, so equal
    /// token ids with different media never share KV blocks), kind, and a [`crate::TensorRef`]
    /// into [`Self::mm_buffers`].
    pub mm_features: Vec<MultiModalFeatureSpec>,
    /// The bytes behind `mm_features`' tensors. Not part of the serde header: over a
    /// `MessageQueue` they are the `Add` message's out-of-band buffers, and the receiver puts
    /// them back here.
    #[serde(skip)]
    pub mm_buffers: TensorBuffers,
    /// The omni part (output modalities, voice, later stages' sampling); `None` for a text
    /// request.
    #[serde(default)]
    pub omni: Option<OmniParams>,
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
            mm_features: Vec::new(),
            mm_buffers: TensorBuffers::new(),
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
