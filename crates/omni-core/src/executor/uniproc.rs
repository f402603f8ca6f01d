//! [`UniprocExecutor`]: the model runs in this process, on the calling thread.

use std::collections::VecDeque;

use omni_protocol::{
    ModelRunnerOutput, SchedulerOutput, WorkerBase, WorkerCommand, WorkerResponse,
};

use super::startup::{load_model_and_init_cache, unexpected};
use super::{EngineDeadError, ExecutorStartError, StartupSpec};
use crate::Executor;

/// Drives one in-process [`WorkerBase`] (rank 0, no tensor parallelism across processes).
#[derive(Debug)]
pub struct UniprocExecutor<W> {
    worker: W,
    num_blocks: u32,
    dead: Option<EngineDeadError>,
    /// Outputs of submitted batches not yet collected, oldest first (async scheduling: a
    /// batch runs when it is submitted, since there is no other thread to run it on).
    submitted: VecDeque<ModelRunnerOutput>,
}

impl<W: WorkerBase> UniprocExecutor<W> {
    /// Loads the model, sizes the KV cache from the spec's budget and allocates it (the same
    /// start-up sequence as the multi-process executor, over one rank).
    pub fn start(mut worker: W, spec: &StartupSpec) -> Result<Self, ExecutorStartError> {
        let layout = load_model_and_init_cache(spec, |cmd| match worker.handle(cmd) {
            Some(answer) => Ok(vec![answer]),
            None => Err(EngineDeadError::Worker {
                rank: 0,
                cause: format!("no answer to {cmd:?}"),
            }),
        })?;
        Ok(Self {
            worker,
            num_blocks: layout.num_blocks,
            dead: None,
            submitted: VecDeque::new(),
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

impl<W: WorkerBase> Executor for UniprocExecutor<W> {
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> Result<ModelRunnerOutput, EngineDeadError> {
        if let Some(e) = &self.dead {
            return Err(e.clone());
        }
        match self.worker.execute_model(scheduler_output, buffers) {
            WorkerResponse::ModelRunnerOutput(out) => Ok(out),
            other => {
                let e = unexpected(0, "ExecuteModel", other);
                self.dead = Some(e.clone());
                Err(e)
            }
        }
    }

    /// The one rank samples and keeps its tokens; a submitted batch runs at once.
    fn supports_async_scheduling(&self) -> bool {
        true
    }

    fn submit(
        &mut self,
        scheduler_output: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> Result<(), EngineDeadError> {
        let out = self.execute_model(scheduler_output, buffers)?;
        self.submitted.push_back(out);
        Ok(())
    }

    fn collect(&mut self) -> Result<ModelRunnerOutput, EngineDeadError> {
        self.submitted
            .pop_front()
            .ok_or_else(|| EngineDeadError::Worker {
                rank: 0,
                cause: "collect without a submitted batch".into(),
            })
    }

    fn check_health(&mut self) -> Result<(), EngineDeadError> {
        match &self.dead {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn shutdown(&mut self) {
        self.worker.handle(&WorkerCommand::Shutdown);
    }
}
