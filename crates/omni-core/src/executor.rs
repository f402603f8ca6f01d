//! The seam between the engine core and whatever runs the model (vLLM's `Executor`).
//!
//! Implementations live elsewhere: an in-process one for tests and single-GPU runs, and the
//! multi-process one that broadcasts [`omni_protocol::WorkerCommand::ExecuteModel`] to every
//! worker and reads the output rank's [`omni_protocol::WorkerResponse::ModelRunnerOutput`].

use omni_protocol::{ModelRunnerOutput, SchedulerOutput};

/// Why the engine cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// A worker died, answered with an error, or stopped answering. Every live request fails.
    #[error("engine dead: worker {rank} failed: {cause}")]
    EngineDead {
        /// The failing worker's rank.
        rank: u32,
        /// What happened (exit status, the worker's error message, a timeout).
        cause: String,
    },
}

/// Runs one step of the model for a scheduled batch.
pub trait Executor {
    /// Computes the batch and returns the sampled tokens. The output must list every request of
    /// the batch (with no token for a partial prefill chunk). An empty batch only delivers
    /// `finished_req_ids` and returns an empty output.
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
    ) -> Result<ModelRunnerOutput, EngineError>;

    /// Checks that every worker is alive.
    fn check_health(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    /// Stops the workers. Called once, when the engine core shuts down.
    fn shutdown(&mut self) {}
}

impl<E: Executor + ?Sized> Executor for Box<E> {
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
    ) -> Result<ModelRunnerOutput, EngineError> {
        (**self).execute_model(scheduler_output)
    }

    fn check_health(&mut self) -> Result<(), EngineError> {
        (**self).check_health()
    }

    fn shutdown(&mut self) {
        (**self).shutdown()
    }
}
