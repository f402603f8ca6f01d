//! What the scheduler decided for one step, broadcast to every worker (vLLM v1's
//! `SchedulerOutput`).
//!
//! The worker contract:
//!
//! - A worker keeps, per live request, its token ids (prompt, then outputs), its block table and
//!   its sampling params. It learns a request from [`NewRequestData`], updates it from
//!   [`CachedRequestData`], and drops it when its id is in [`SchedulerOutput::finished_req_ids`].
//! - For each scheduled request the worker computes the KV of positions
//!   `num_computed_tokens .. num_computed_tokens + num_scheduled_tokens[req_id]` and writes it into
//!   the request's blocks (position `p` lives in block `block_ids[p / block_size]`, slot
//!   `p % block_size`). Earlier positions are already in the cache (prefix-cache hits included).
//! - If those positions reach the end of the request's known tokens, the worker samples one token,
//!   appends it to its copy and returns it; otherwise (a partial prefill chunk) it returns no token
//!   for that request.
//! - The scheduler only lists a block as a prefix-cache hit after the step that computed it has
//!   returned, so a worker may compute the requests of one batch in any order.
//! - Multimodal items arrive once, with [`NewRequestData::mm_features`] (their tensors are this
//!   message's buffers); the worker keeps their bytes for the request's life. Before computing,
//!   it drops the encoder outputs named in [`SchedulerOutput::free_encoder_mm_hashes`], then runs
//!   the encoder of every item in [`SchedulerOutput::scheduled_encoder_inputs`] into its encoder
//!   cache (keyed by content hash). Every item whose placeholder overlaps a request's scheduled
//!   positions is then in that cache: its rows replace the placeholder tokens' embeddings.
//! - A batch may be empty (`total_num_scheduled_tokens == 0`), sent only to deliver
//!   `finished_req_ids`; the worker answers with an empty [`crate::ModelRunnerOutput`].

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::{
    BlockId, MultiModalFeatureSpec, RequestId, SamplingParams, TensorBufferError, TensorBuffers,
    TensorRef, TensorView, TokenId,
};

/// A request the workers have not seen before (first scheduling).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewRequestData {
    /// Request id.
    pub req_id: RequestId,
    /// The whole prompt.
    pub prompt_token_ids: Vec<TokenId>,
    /// Sampling parameters.
    pub sampling_params: SamplingParams,
    /// The request's EOS token (the sampler masks it until `min_tokens` outputs exist).
    pub eos_token_id: Option<TokenId>,
    /// Every block of the request so far, in position order.
    pub block_ids: Vec<BlockId>,
    /// Tokens whose KV is already cached (prefix-cache hit); computation starts here.
    pub num_computed_tokens: u32,
    /// The prompt's multimodal items, sent once, here: each one's tensor names an out-of-band
    /// buffer of this message (in place in the ring slot on a worker). The worker keeps the
    /// bytes for the request's life (a preempted request may need them encoded again).
    pub mm_features: Vec<MultiModalFeatureSpec>,
}

/// A request the workers already know (vLLM keeps these as parallel lists; one struct per request
/// is the same data, easier to keep consistent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachedRequestData {
    /// Request id.
    pub req_id: RequestId,
    /// The request was preempted (its blocks freed) and is now scheduled again: `new_block_ids`
    /// then replaces the whole block table instead of extending it.
    pub resumed_from_preemption: bool,
    /// The input token ids of this step: those at positions `num_computed_tokens ..
    /// num_computed_tokens + num_scheduled_tokens`. The worker writes them into its copy of the
    /// sequence at those positions (for a decode step, this is the token sampled last step).
    pub new_token_ids: Vec<TokenId>,
    /// Blocks appended to the request's block table this step (or the whole table when resumed).
    pub new_block_ids: Vec<BlockId>,
    /// Tokens already in the KV cache before this step.
    pub num_computed_tokens: u32,
}

/// One step's batch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SchedulerOutput {
    /// Requests scheduled for the first time.
    pub scheduled_new_reqs: Vec<NewRequestData>,
    /// Requests scheduled before (continuing prefill, decoding, or resumed after preemption).
    pub scheduled_cached_reqs: Vec<CachedRequestData>,
    /// How many tokens of each scheduled request to compute this step.
    pub num_scheduled_tokens: HashMap<RequestId, u32>,
    /// Sum of `num_scheduled_tokens`.
    pub total_num_scheduled_tokens: u32,
    /// Requests that finished or were aborted since the previous step: drop their state.
    pub finished_req_ids: Vec<RequestId>,
    /// Requests preempted this step: their blocks are gone; keep their tokens, they come back as
    /// `resumed_from_preemption`.
    pub preempted_req_ids: Vec<RequestId>,
    /// Items whose encoder runs this step: per request, indices into its `mm_features` (vLLM's
    /// `scheduled_encoder_inputs`). An item is encoded in the step its placeholder starts to
    /// be computed; a content hash already in the encoder cache, or scheduled earlier in the
    /// same step by another request, is not listed again.
    pub scheduled_encoder_inputs: HashMap<RequestId, Vec<u32>>,
    /// Encoder-cache entries (content hashes) no running request needs any more: the workers
    /// drop them before this step's encoders run.
    pub free_encoder_mm_hashes: Vec<u64>,
    /// Hidden states or other per-step tensors, as out-of-band buffers of this message.
    pub tensors: Vec<TensorRef>,
    /// The bytes of this message's out-of-band buffers, as the engine core assembled them (the
    /// new requests' item tensors). Not part of the serde header: the executor sends them as the
    /// broadcast's buffers, and a worker reads them from its `buffers` argument instead.
    #[serde(skip)]
    pub buffers: TensorBuffers,
}

impl SchedulerOutput {
    /// Whether nothing is to be computed this step.
    pub fn is_empty(&self) -> bool {
        self.total_num_scheduled_tokens == 0
    }

    /// Every tensor the batch names (the new requests' multimodal inputs, then the step's own
    /// tensors), each checked against the message's out-of-band `buffers` and borrowed from it.
    pub fn tensor_views<'a>(
        &'a self,
        buffers: &[&'a [u8]],
    ) -> Result<Vec<TensorView<'a>>, TensorBufferError> {
        self.scheduled_new_reqs
            .iter()
            .flat_map(|r| r.mm_features.iter().map(|f| &f.tensor))
            .chain(&self.tensors)
            .map(|t| t.view(buffers))
            .collect()
    }
}
