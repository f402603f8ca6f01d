//! What every stage's loop drives: inputs in, one step, outputs out.

use omni_core::SchedulerConfig;
use omni_protocol::{SchedulerStats, StageInput, StageOutputs, StageSpec};

use crate::StageError;

/// One step's outputs and the buffers their tensors index.
pub type StepResult = (StageOutputs, Vec<Vec<u8>>);

/// A stage's batching and network.
pub trait Stage: Send + std::fmt::Debug {
    /// Applies one input (refusals and failures go to `out`).
    fn input(&mut self, input: StageInput, buffers: &[&[u8]], out: &mut StageOutputs);
    /// Whether a step would do something.
    fn has_work(&self) -> bool;
    /// Runs one batch. An error here is the stage's death (its process exits with it).
    fn step(&mut self) -> Result<StepResult, StageError>;
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
    }
}
