//! [`UniprocExecutor`]: the model runs in this process, on the calling thread.

use omni_protocol::{ModelRunnerOutput, SchedulerOutput, WorkerCommand, WorkerResponse};

use super::{
    EngineError, ExecutorStartError, LocalWorker, StartupSpec, kv_budget_bytes, plan_num_blocks,
};
use crate::Executor;

/// Drives one in-process [`LocalWorker`] (rank 0, no tensor parallelism across processes).
#[derive(Debug)]
pub struct UniprocExecutor<W> {
    worker: W,
    num_blocks: u32,
    dead: Option<EngineError>,
}

fn dead(cause: impl Into<String>) -> EngineError {
    EngineError::EngineDead {
        rank: 0,
        cause: cause.into(),
    }
}

fn unexpected(resp: Option<WorkerResponse>, what: &str) -> EngineError {
    match resp {
        Some(WorkerResponse::Error { message, .. }) => dead(message),
        other => dead(format!("unexpected answer to {what}: {other:?}")),
    }
}

impl<W: LocalWorker> UniprocExecutor<W> {
    /// Loads the model, sizes the KV cache from the spec's budget and allocates it.
    pub fn start(mut worker: W, spec: &StartupSpec) -> Result<Self, ExecutorStartError> {
        let (kv_bytes_per_block, available) =
            match worker.handle(&WorkerCommand::LoadModel(spec.load.clone())) {
                Some(WorkerResponse::ModelLoaded {
                    kv_bytes_per_block,
                    available_memory_bytes,
                }) => (kv_bytes_per_block, available_memory_bytes),
                other => return Err(unexpected(other, "LoadModel").into()),
            };
        let num_blocks = plan_num_blocks(
            kv_bytes_per_block,
            kv_budget_bytes(spec, &[available]),
            spec.num_blocks_override,
        )?;
        match worker.handle(&WorkerCommand::InitCache {
            num_blocks,
            block_size: spec.load.block_size,
        }) {
            Some(WorkerResponse::Ready { .. }) => {}
            other => return Err(unexpected(other, "InitCache").into()),
        }
        Ok(Self {
            worker,
            num_blocks,
            dead: None,
        })
    }

    /// KV blocks allocated on the worker.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The worker.
    pub fn worker(&self) -> &W {
        &self.worker
    }
}

impl<W: LocalWorker> Executor for UniprocExecutor<W> {
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
    ) -> Result<ModelRunnerOutput, EngineError> {
        if let Some(e) = &self.dead {
            return Err(e.clone());
        }
        match self.worker.execute_model(scheduler_output) {
            WorkerResponse::ModelRunnerOutput(out) => Ok(out),
            other => {
                let e = unexpected(Some(other), "ExecuteModel");
                self.dead = Some(e.clone());
                Err(e)
            }
        }
    }

    fn check_health(&mut self) -> Result<(), EngineError> {
        match &self.dead {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn shutdown(&mut self) {
        self.worker.handle(&WorkerCommand::Shutdown);
    }
}
