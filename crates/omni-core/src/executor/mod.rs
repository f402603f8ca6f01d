//! The seam between the engine core and whatever runs the model (vLLM's `Executor`).
//!
//! - [`UniprocExecutor`]: one [`omni_protocol::WorkerBase`] in this process (tests, single-rank
//!   runs).
//! - [`MultiprocExecutor`]: one worker process per rank; broadcasts
//!   [`omni_protocol::WorkerCommand::ExecuteModel`] to every worker and reads the output rank's
//!   [`omni_protocol::WorkerResponse::ModelRunnerOutput`].
//!
//! Files: `multiproc.rs` and `uniproc.rs` (the two executors), `startup.rs` (the one start-up
//! sequence both run: `LoadModel` on every rank, which reports the KV bytes of one block; the
//! number of blocks from a byte budget or an explicit override, [`plan_num_blocks`]; then
//! `InitCache`), `workers/` (the multi-process side: `launch.rs` starts a worker and does the
//! stdin/stdout handshake, `monitor.rs` watches the processes, `mod.rs` is the group: queues
//! and RPC).

mod multiproc;
mod startup;
mod uniproc;
pub(crate) mod workers;

pub use multiproc::{MultiprocConfig, MultiprocExecutor};
pub use uniproc::UniprocExecutor;
pub use workers::headless::{HeadlessConfig, HeadlessError, run_headless};
pub use workers::nodes::NodeConfig;

use omni_protocol::{ModelRunnerOutput, SchedulerOutput};

pub use omni_protocol::EngineDeadError;

/// Runs one step of the model for a scheduled batch.
pub trait Executor {
    /// Computes the batch and returns the sampled tokens. The output must list every request of
    /// the batch (with no token for a partial prefill chunk). An empty batch only delivers
    /// `finished_req_ids` and returns an empty output.
    ///
    /// `buffers` are the batch's out-of-band tensor bytes, which the [`omni_protocol::TensorRef`]s
    /// of `scheduler_output` index; they travel beside the serde header (in place in the
    /// broadcast ring's slot when they fit, else over the overflow socket), never through serde.
    /// The output's [`ModelRunnerOutput::buffers`] come back the same way.
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> Result<ModelRunnerOutput, EngineDeadError>;

    /// How many batches may be in flight at once (vLLM's `max_concurrent_batches`): 1, or a
    /// pipeline-parallel executor's stages, whose ranks then work on different batches.
    fn max_concurrent_batches(&self) -> usize {
        1
    }

    /// Whether a batch may be sent before the previous one's output is back with requests of
    /// that batch in it again (async scheduling): every rank samples and appends its own
    /// tokens, and [`Executor::submit`] / [`Executor::collect`] work.
    fn supports_async_scheduling(&self) -> bool {
        false
    }

    /// Sends a batch without waiting for its output (only where
    /// [`Executor::max_concurrent_batches`] is above 1 or async scheduling is supported);
    /// [`Executor::collect`] returns the outputs in the order the batches were sent.
    fn submit(
        &mut self,
        _scheduler_output: &SchedulerOutput,
        _buffers: &[&[u8]],
    ) -> Result<(), EngineDeadError> {
        Err(EngineDeadError::Worker {
            rank: 0,
            cause: "this executor runs one batch at a time".into(),
        })
    }

    /// The output of the oldest batch [`Executor::submit`] sent.
    fn collect(&mut self) -> Result<ModelRunnerOutput, EngineDeadError> {
        Err(EngineDeadError::Worker {
            rank: 0,
            cause: "this executor runs one batch at a time".into(),
        })
    }

    /// Checks that every worker is alive.
    fn check_health(&mut self) -> Result<(), EngineDeadError> {
        Ok(())
    }

    /// Stops the workers. Called once, when the engine core shuts down.
    fn shutdown(&mut self) {}

    /// What the broadcast queue to the workers has sent so far; `None` without one (in-process).
    fn broadcast_stats(&self) -> Option<omni_ipc::MessageQueueStats> {
        None
    }
}

impl<E: Executor + ?Sized> Executor for Box<E> {
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> Result<ModelRunnerOutput, EngineDeadError> {
        (**self).execute_model(scheduler_output, buffers)
    }

    fn max_concurrent_batches(&self) -> usize {
        (**self).max_concurrent_batches()
    }

    fn supports_async_scheduling(&self) -> bool {
        (**self).supports_async_scheduling()
    }

    fn submit(
        &mut self,
        scheduler_output: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> Result<(), EngineDeadError> {
        (**self).submit(scheduler_output, buffers)
    }

    fn collect(&mut self) -> Result<ModelRunnerOutput, EngineDeadError> {
        (**self).collect()
    }

    fn check_health(&mut self) -> Result<(), EngineDeadError> {
        (**self).check_health()
    }

    fn shutdown(&mut self) {
        (**self).shutdown()
    }

    fn broadcast_stats(&self) -> Option<omni_ipc::MessageQueueStats> {
        (**self).broadcast_stats()
    }
}

/// Why an executor could not start.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorStartError {
    /// A worker failed or died during start-up.
    #[error(transparent)]
    Worker(#[from] EngineDeadError),
    /// The KV cache budget cannot hold a single block.
    #[error(
        "KV cache budget of {budget_bytes} bytes is smaller than one block ({kv_bytes_per_block} \
         bytes); raise --kv-cache-memory"
    )]
    KvBudgetTooSmall {
        /// The budget.
        budget_bytes: u64,
        /// Bytes of one block on the largest rank.
        kv_bytes_per_block: u64,
    },
    /// Spawning or connecting to the workers failed.
    #[error("starting workers: {0}")]
    Spawn(String),
}

/// How many KV blocks to allocate: `override_blocks` if given, else as many blocks of
/// `kv_bytes_per_block` as fit in `budget_bytes`.
pub fn plan_num_blocks(
    kv_bytes_per_block: u64,
    budget_bytes: u64,
    override_blocks: Option<u32>,
) -> Result<u32, ExecutorStartError> {
    if let Some(n) = override_blocks {
        return Ok(n);
    }
    let n = budget_bytes / kv_bytes_per_block.max(1);
    if n == 0 {
        return Err(ExecutorStartError::KvBudgetTooSmall {
            budget_bytes,
            kv_bytes_per_block,
        });
    }
    Ok(n.min(u32::MAX as u64) as u32)
}

/// The KV budget of a start-up: the configured bytes, else the least any rank reported free.
pub fn kv_budget_bytes(spec: &StartupSpec, reported_available: &[u64]) -> u64 {
    spec.kv_cache_memory_bytes
        .unwrap_or_else(|| reported_available.iter().copied().min().unwrap_or(0))
}

/// The KV cache sizing and model of an executor start-up.
#[derive(Debug, Clone, PartialEq)]
pub struct StartupSpec {
    /// What every worker loads.
    pub load: omni_protocol::LoadModelSpec,
    /// Bytes of KV cache per rank; `None` takes the smallest `available_memory_bytes` the
    /// workers report after loading (the GPU's `--gpu-memory-utilization` budget).
    pub kv_cache_memory_bytes: Option<u64>,
    /// Use exactly this many blocks instead of the budget.
    pub num_blocks_override: Option<u32>,
}

/// Default per-rank KV cache budget on the CPU backend.
pub const DEFAULT_KV_CACHE_MEMORY_BYTES: u64 = 256 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn num_blocks_follow_budget_or_override() {
        assert_eq!(plan_num_blocks(1000, 10_500, None).unwrap(), 10);
        assert_eq!(plan_num_blocks(1000, 10_500, Some(3)).unwrap(), 3);
        assert!(matches!(
            plan_num_blocks(1000, 999, None),
            Err(ExecutorStartError::KvBudgetTooSmall { .. })
        ));
    }
}
