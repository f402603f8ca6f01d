//! [`EngineCore`]: one scheduler and one executor, stepped by the process loop that owns them.

use std::collections::VecDeque;

use omni_protocol::{
    EngineCoreOutput, EngineCoreRequest, FinishReason, SchedulerOutput, SchedulerStats,
};

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
    /// Batches sent and not yet answered, oldest first (at most `depth`).
    in_flight: VecDeque<SchedulerOutput>,
    /// Most batches in flight: the executor's `max_concurrent_batches`, or 2 under async
    /// scheduling (one running, the next one waiting for the workers).
    depth: usize,
}

impl<E: Executor> EngineCore<E> {
    /// An engine core over an executor whose workers hold `config.num_blocks` KV blocks.
    ///
    /// `config.async_scheduling` takes effect only where the executor supports it (it is
    /// turned off, with a warning, where it does not).
    pub fn new(mut config: SchedulerConfig, executor: E) -> Result<Self, SchedulerConfigError> {
        if config.async_scheduling && !executor.supports_async_scheduling() {
            tracing::warn!(
                "async scheduling needs every rank to sample (no pipeline stages) and an \
                 executor that sends batches ahead; scheduling synchronously"
            );
            config.async_scheduling = false;
        }
        let depth = if config.async_scheduling {
            executor.max_concurrent_batches().max(2)
        } else {
            executor.max_concurrent_batches().max(1)
        };
        Ok(Self {
            scheduler: Scheduler::new(config)?,
            executor,
            steps: 0,
            in_flight: VecDeque::new(),
            depth,
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
    ///
    /// With an executor that takes several batches at once (pipeline parallelism; vLLM's
    /// `step_with_batch_queue`), or under async scheduling, a call sends a new batch while
    /// there is room and it has work, and otherwise waits for the oldest batch in flight and
    /// applies its output. Under async scheduling the batch sent while another runs holds the
    /// same requests again, one position on, so the workers go from one step to the next
    /// without waiting for the scheduler.
    pub fn step(&mut self) -> Result<Vec<EngineCoreOutput>, EngineDeadError> {
        if self.depth > 1 || !self.in_flight.is_empty() {
            return self.step_pipelined(self.depth);
        }
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

    fn step_pipelined(&mut self, depth: usize) -> Result<Vec<EngineCoreOutput>, EngineDeadError> {
        let has_work =
            self.scheduler.has_unfinished_requests() || self.scheduler.has_finished_requests();
        if self.in_flight.len() < depth && has_work {
            let so = self.scheduler.schedule();
            let worth_sending = !so.is_empty()
                || !so.finished_req_ids.is_empty()
                || !so.free_encoder_mm_hashes.is_empty();
            if worth_sending {
                let buffers = so.buffers.as_slices();
                self.steps += 1;
                self.executor.submit(&so, &buffers)?;
                self.scheduler.mark_in_flight(&so, true);
                let computes = !so.is_empty();
                self.in_flight.push_back(so);
                if computes && self.in_flight.len() < depth {
                    return Ok(Vec::new()); // room for another batch first
                }
            }
        }
        let Some(so) = self.in_flight.pop_front() else {
            return Ok(Vec::new());
        };
        let model_output = self.executor.collect()?;
        self.scheduler.mark_in_flight(&so, false);
        Ok(self.scheduler.update_from_output(&so, &model_output))
    }

    /// Ends every live request with [`FinishReason::Error`] (after [`EngineDeadError::Worker`]).
    pub fn fail_all(&mut self) -> Vec<EngineCoreOutput> {
        self.scheduler.finish_all_requests(FinishReason::Error)
    }

    /// Whether any request is live, or a batch is still in flight.
    pub fn has_unfinished_requests(&self) -> bool {
        self.scheduler.has_unfinished_requests() || !self.in_flight.is_empty()
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
