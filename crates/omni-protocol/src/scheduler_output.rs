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
//! - A batch may be empty (`total_num_scheduled_tokens == 0`), sent only to deliver
//!   `finished_req_ids`; the worker answers with an empty [`crate::ModelRunnerOutput`].

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::{
    BlockId, RequestId, SamplingParams, TensorBufferError, TensorRef, TensorView, TokenId,
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
    /// Multimodal inputs, as out-of-band buffers of this message.
    pub tensors: Vec<TensorRef>,
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
    /// Multimodal encoder outputs the workers may free (by content hash).
    pub free_encoder_mm_hashes: Vec<String>,
    /// Hidden states or other per-step tensors, as out-of-band buffers of this message.
    pub tensors: Vec<TensorRef>,
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
            .flat_map(|r| &r.tensors)
            .chain(&self.tensors)
            .map(|t| t.view(buffers))
            .collect()
    }
}
