//! [`EngineCore`]: one scheduler and one executor, stepped by the process loop that owns them.

use omni_protocol::{EngineCoreOutput, EngineCoreRequest, FinishReason, SchedulerStats};

use crate::config::{SchedulerConfig, SchedulerConfigError};
use crate::executor::{EngineDeadError, Executor};
use crate::scheduler::{AddRequestError, Scheduler};

/// The engine's inner loop body (vLLM's `EngineCore`), without threads or IPC: the caller feeds
/// it requests and aborts between calls to [`EngineCore::step`].
#[derive(Debug)]
pub struct EngineCore<E> {
    scheduler: Scheduler,
    executor: E,
    /// Batches run on the executor so far.
    steps: u64,
}

impl<E: Executor> EngineCore<E> {
    /// An engine core over an executor whose workers hold `config.num_blocks` KV blocks.
    pub fn new(config: SchedulerConfig, executor: E) -> Result<Self, SchedulerConfigError> {
        Ok(Self {
            scheduler: Scheduler::new(config)?,
            executor,
            steps: 0,
        })
    }

    /// Queues a request.
    pub fn add_request(&mut self, req: EngineCoreRequest) -> Result<(), AddRequestError> {
        self.scheduler.add_request(req)
    }

    /// Aborts requests at once (their blocks are free on return); returns the ids that were live.
    pub fn abort<S: AsRef<str>>(&mut self, request_ids: &[S]) -> Vec<String> {
        self.scheduler
            .abort_requests(request_ids.iter().map(AsRef::as_ref))
    }

    /// Schedules one batch, runs it on the executor and applies its output. Returns nothing when
    /// there is nothing to do. On error the engine is dead: call [`EngineCore::fail_all`].
    pub fn step(&mut self) -> Result<Vec<EngineCoreOutput>, EngineDeadError> {
        if !self.scheduler.has_unfinished_requests() && !self.scheduler.has_finished_requests() {
            return Ok(Vec::new());
        }
        let scheduler_output = self.scheduler.schedule();
        if scheduler_output.is_empty()
            && scheduler_output.finished_req_ids.is_empty()
            && scheduler_output.free_encoder_mm_hashes.is_empty()
        {
            return Ok(Vec::new());
        }
        // The new requests' multimodal tensors, broadcast once as the message's buffers.
        let buffers = scheduler_output.buffers.as_slices();
        self.steps += 1;
        let model_output = self.executor.execute_model(&scheduler_output, &buffers)?;
        Ok(self
            .scheduler
            .update_from_output(&scheduler_output, &model_output))
    }

    /// Ends every live request with [`FinishReason::Error`] (after [`EngineDeadError::Worker`]).
    pub fn fail_all(&mut self) -> Vec<EngineCoreOutput> {
        self.scheduler.finish_all_requests(FinishReason::Error)
    }

    /// Whether any request is live.
    pub fn has_unfinished_requests(&self) -> bool {
        self.scheduler.has_unfinished_requests()
    }

    /// Scheduler state for metrics, with the engine's step count and the executor's broadcast
    /// queue counters.
    pub fn stats(&self) -> SchedulerStats {
        let mq = self.executor.broadcast_stats().unwrap_or_default();
        SchedulerStats {
            engine_steps: self.steps,
            mq_broadcast_messages: mq.messages,
            mq_overflow_messages: mq.overflow_messages,
            mq_ring_bytes: mq.ring_bytes,
            mq_overflow_bytes: mq.overflow_bytes,
            ..self.scheduler.stats()
        }
    }

    /// The scheduler.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// The executor.
    pub fn executor(&self) -> &E {
        &self.executor
    }

    /// The executor, mutably (health checks, shutdown).
    pub fn executor_mut(&mut self) -> &mut E {
        &mut self.executor
    }

    /// Shuts the executor down.
    pub fn shutdown(&mut self) {
        self.executor.shutdown();
    }
}
