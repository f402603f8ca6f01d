//! What every stage's loop drives: inputs in, one step, outputs out.

use omni_core::SchedulerConfig;
use omni_protocol::{
    BlockId, RequestId, SchedulerOutput, SchedulerStats, StageInput, StageOutputs, StageSpec,
};

use crate::StageError;
use crate::profile::StepClock;

/// One step's outputs and the buffers their tensors index.
pub type StepResult = (StageOutputs, Vec<Vec<u8>>);

/// A stage's batching and network.
pub trait Stage: Send + std::fmt::Debug {
    /// Applies one input (refusals and failures go to `out`).
    fn input(&mut self, input: StageInput, buffers: &[&[u8]], out: &mut StageOutputs);
    /// Whether a step would do something.
    fn has_work(&self) -> bool;
    /// Runs one batch, timing its phases on `clock` (and giving it the batch's size). An
    /// error here is the stage's death (its process exits with it).
    fn step(&mut self, clock: &mut StepClock) -> Result<StepResult, StageError>;
    /// Its scheduler's state (running, waiting, KV usage), if it has a scheduler.
    fn stats(&self) -> Option<SchedulerStats>;
}

/// The scheduler config of an autoregressive stage. `prefix_caching` must be off where the
/// "tokens" are placeholders (the Talker's prompt positions are embeddings).
pub(crate) fn scheduler_config(spec: &StageSpec, prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: spec.max_num_batched_tokens as usize,
        max_num_seqs: spec.max_num_seqs as usize,
        max_model_len: spec.max_model_len as usize,
        block_size: spec.block_size as usize,
        num_blocks: spec.num_blocks as usize,
        enable_prefix_caching: prefix_caching,
        enable_chunked_prefill: true,
        // A stage hands hidden states and codes on per step; it schedules synchronously.
        async_scheduling: false,
    }
}

/// One scheduled request of a step: its id, first position and token count, in batch order
/// (new requests, then cached ones, as the scheduler lists them).
pub(crate) type Scheduled = (RequestId, usize, usize);

/// The step's requests in batch order.
pub(crate) fn scheduled(so: &SchedulerOutput) -> Vec<Scheduled> {
    so.scheduled_new_reqs
        .iter()
        .map(|r| (r.req_id.clone(), r.num_computed_tokens as usize))
        .chain(
            so.scheduled_cached_reqs
                .iter()
                .map(|r| (r.req_id.clone(), r.num_computed_tokens as usize)),
        )
        .map(|(id, start)| {
            let n = so.num_scheduled_tokens.get(&id).copied().unwrap_or(0) as usize;
            (id, start, n)
        })
        .collect()
}

/// A stage's per-request state that holds the request's KV block table.
pub(crate) trait HasBlocks {
    /// The block table.
    fn blocks(&mut self) -> &mut Vec<BlockId>;
}

/// Applies a step's block changes to the requests' block tables: a preempted request loses
/// its blocks, a new or resumed one gets its list, a running one extends it.
pub(crate) fn update_block_tables<T: HasBlocks>(
    so: &SchedulerOutput,
    reqs: &mut std::collections::HashMap<RequestId, T>,
) {
    for id in &so.preempted_req_ids {
        if let Some(b) = reqs.get_mut(id).map(HasBlocks::blocks) {
            b.clear();
        }
    }
    for new in &so.scheduled_new_reqs {
        if let Some(b) = reqs.get_mut(&new.req_id).map(HasBlocks::blocks) {
            *b = new.block_ids.clone();
        }
    }
    for c in &so.scheduled_cached_reqs {
        if let Some(b) = reqs.get_mut(&c.req_id).map(HasBlocks::blocks) {
            if c.resumed_from_preemption {
                *b = c.new_block_ids.clone();
            } else {
                b.extend_from_slice(&c.new_block_ids);
            }
        }
    }
}
