//! The engine core's busy loop ([`CoreLoop`]), and [`InprocClient`], which runs it on a thread of
//! this process.
//!
//! The loop owns the [`EngineCore`]. It takes [`EngineCoreInput`]s (add, abort, shutdown) from
//! an [`InputSource`], steps while any request is live, and blocks on the source when idle
//! (waking every [`HEALTH_CHECK_INTERVAL`] to ask the executor whether its workers are alive).
//! What each turn produced (a step's outputs, the outputs of aborts, refusals, new stats) goes
//! to an [`OutputSink`] as one [`EngineCoreOutputs`]. The same loop serves both clients: on a
//! thread here, its source is a channel and its sink hands the message straight to the client's
//! frontend; in an engine-core process ([`crate::EngineCoreProc`]) both are `MessageQueue`s.
//!
//! When the executor reports an [`EngineDeadError`], the loop shuts the executor down, says so
//! in `engine_dead` (which fails every live request with that error, naming the rank), and from
//! then on answers every new request with the same error.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use omni_protocol::{
    EngineCoreInput, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineDeadError,
    FinishReason, RequestId, SchedulerStats,
};

use crate::engine_core::EngineCore;
use crate::engine_core_client::{EngineCoreClient, Frontend, RequestError, RequestStream};
use crate::executor::Executor;

/// How often an idle loop asks the executor whether its workers are alive.
pub const HEALTH_CHECK_INTERVAL: Duration = Duration::from_millis(200);

/// One poll of an [`InputSource`]. Returned by value once per poll and matched at once, so
/// the size of `Input` costs nothing that boxing it (an allocation per request) would save.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(crate) enum Received {
    /// The next input.
    Input(EngineCoreInput),
    /// Nothing within the wait.
    Empty,
    /// The client is gone: stop.
    Closed,
}

/// Where the loop's inputs come from.
pub(crate) trait InputSource {
    /// The next input, waiting up to `timeout`.
    fn recv_timeout(&mut self, timeout: Duration) -> Received;
    /// The next input if one is there.
    fn try_recv(&mut self) -> Received;
}

/// Where the loop's outputs go.
pub(crate) trait OutputSink {
    /// Delivers one message; `Err` when nobody can receive it any more (the loop stops).
    fn send(&mut self, outputs: EngineCoreOutputs) -> Result<(), ()>;
}

impl InputSource for mpsc::Receiver<EngineCoreInput> {
    fn recv_timeout(&mut self, timeout: Duration) -> Received {
        match mpsc::Receiver::recv_timeout(self, timeout) {
            Ok(i) => Received::Input(i),
            Err(RecvTimeoutError::Timeout) => Received::Empty,
            Err(RecvTimeoutError::Disconnected) => Received::Closed,
        }
    }

    fn try_recv(&mut self) -> Received {
        match mpsc::Receiver::try_recv(self) {
            Ok(i) => Received::Input(i),
            Err(mpsc::TryRecvError::Empty) => Received::Empty,
            Err(mpsc::TryRecvError::Disconnected) => Received::Closed,
        }
    }
}

/// In-process: a message goes straight to the client's frontend.
impl OutputSink for Arc<Frontend> {
    fn send(&mut self, outputs: EngineCoreOutputs) -> Result<(), ()> {
        self.dispatch(outputs);
        Ok(())
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn abort_output(request_id: RequestId) -> EngineCoreOutput {
    EngineCoreOutput::bare(request_id, Some(FinishReason::Abort), None)
}

/// The busy loop around one [`EngineCore`] (vLLM's `EngineCore.run_busy_loop`); see the module
/// docs.
#[derive(Debug)]
pub(crate) struct CoreLoop<E: Executor> {
    core: EngineCore<E>,
    dead: Option<EngineDeadError>,
    pending: EngineCoreOutputs,
    sent_stats: Option<SchedulerStats>,
}

impl<E: Executor> CoreLoop<E> {
    pub(crate) fn new(core: EngineCore<E>) -> Self {
        Self {
            core,
            dead: None,
            pending: EngineCoreOutputs::default(),
            sent_stats: None,
        }
    }

    /// Runs until a [`EngineCoreInput::Shutdown`], a closed source or a failed sink. The
    /// executor is still up afterwards (unless the engine died): call [`Self::finish`].
    pub(crate) fn run(&mut self, inputs: &mut impl InputSource, outputs: &mut impl OutputSink) {
        if self.publish(outputs).is_err() {
            return;
        }
        loop {
            let busy = self.dead.is_none() && self.core.has_unfinished_requests();
            if !busy {
                match inputs.recv_timeout(HEALTH_CHECK_INTERVAL) {
                    Received::Input(input) => {
                        if !self.handle(input) {
                            break;
                        }
                    }
                    Received::Empty => {}
                    Received::Closed => break,
                }
                if self.dead.is_none()
                    && let Err(e) = self.core.executor_mut().check_health()
                {
                    self.die(e);
                }
            }
            let mut stop = false;
            loop {
                match inputs.try_recv() {
                    Received::Input(input) => {
                        if !self.handle(input) {
                            stop = true;
                            break;
                        }
                    }
                    Received::Empty => break,
                    Received::Closed => {
                        stop = true;
                        break;
                    }
                }
            }
            if stop {
                break;
            }
            if self.dead.is_none() && self.core.has_unfinished_requests() {
                match self.core.step() {
                    Ok(outs) => self.pending.outputs.extend(outs),
                    Err(e) => self.die(e),
                }
            }
            if self.publish(outputs).is_err() {
                break;
            }
        }
    }

    /// Shuts the executor down (its workers), unless the engine died (then it is already).
    pub(crate) fn finish(mut self) {
        if self.dead.is_none() {
            self.core.shutdown();
        }
    }

    /// Applies one input; `false` means stop.
    fn handle(&mut self, input: EngineCoreInput) -> bool {
        match input {
            EngineCoreInput::Add(req) => self.add(*req),
            EngineCoreInput::Abort(ids) => {
                for id in self.core.abort(&ids) {
                    self.pending.outputs.push(abort_output(id));
                }
            }
            EngineCoreInput::Shutdown => return false,
        }
        true
    }

    fn add(&mut self, req: EngineCoreRequest) {
        if let Some(e) = &self.dead {
            // The client may have sent this before it heard of the death: say it again.
            self.pending.engine_dead = Some(e.clone());
            return;
        }
        let id = req.request_id.clone();
        if let Err(e) = self.core.add_request(req) {
            self.pending.rejected.push((id, e));
        }
    }

    /// Sends what this turn produced, or fresh stats; nothing when nothing changed.
    fn publish(&mut self, outputs: &mut impl OutputSink) -> Result<(), ()> {
        let stats = self.core.stats();
        if self.pending.is_empty() && self.sent_stats == Some(stats) {
            return Ok(());
        }
        let mut msg = std::mem::take(&mut self.pending);
        msg.scheduler_stats = Some(stats);
        msg.timestamp = unix_now();
        self.sent_stats = Some(stats);
        outputs.send(msg)
    }

    fn die(&mut self, e: EngineDeadError) {
        let live = self.core.fail_all().len();
        tracing::error!("{e}; failing {live} live requests");
        self.core.shutdown();
        self.pending.engine_dead = Some(e.clone());
        self.dead = Some(e);
    }
}

#[derive(Debug)]
struct InprocInner {
    frontend: Arc<Frontend>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl InprocInner {
    fn shutdown(&self) {
        self.frontend.begin_shutdown();
        // Held while joining, so a second caller waits for the first.
        let mut thread = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for InprocInner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The engine core's busy loop on a thread of this process (vLLM's `InprocClient`), behind
/// [`EngineCoreClient`]. Cheap to clone; when the last clone is dropped (or on
/// [`EngineCoreClient::shutdown`]) the loop stops, the executor shuts its workers down and the
/// thread is joined.
///
/// ```
/// use omni_core::{EngineCore, EngineCoreClient, EngineDeadError, Executor, InprocClient};
/// use omni_core::SchedulerConfig;
/// use omni_protocol::{EngineCoreRequest, ModelRunnerOutput, SamplingParams, SchedulerOutput};
///
/// struct Sevens;
/// impl Executor for Sevens {
///     fn execute_model(
///         &mut self,
///         so: &SchedulerOutput,
///         _buffers: &[&[u8]],
///     ) -> Result<ModelRunnerOutput, EngineDeadError> {
///         let req_ids: Vec<String> = so.num_scheduled_tokens.keys().cloned().collect();
///         let sampled_token_ids = vec![vec![7]; req_ids.len()];
///         Ok(ModelRunnerOutput { req_ids, sampled_token_ids, ..Default::default() })
///     }
/// }
///
/// let client = InprocClient::spawn(EngineCore::new(SchedulerConfig::default(), Sevens).unwrap());
/// let mut stream = client
///     .add_request(EngineCoreRequest::new("r0", vec![1, 2], SamplingParams::greedy(2), None))
///     .unwrap();
/// let mut tokens = Vec::new();
/// while let Some(out) = stream.blocking_next() {
///     tokens.extend(out.unwrap().new_token_ids);
/// }
/// assert_eq!(tokens, vec![7, 7]);
/// client.shutdown();
/// ```
#[derive(Debug, Clone)]
pub struct InprocClient {
    inner: Arc<InprocInner>,
}

impl InprocClient {
    /// Starts the loop on a thread named `omni-engine-core`.
    pub fn spawn<E: Executor + Send + 'static>(core: EngineCore<E>) -> Self {
        let (tx, mut rx) = mpsc::channel();
        let frontend = Arc::new(Frontend::new(tx));
        let mut sink = frontend.clone();
        let thread = std::thread::Builder::new()
            .name("omni-engine-core".into())
            .spawn(move || {
                let mut core_loop = CoreLoop::new(core);
                core_loop.run(&mut rx, &mut sink);
                // Streams end before the (possibly slow) worker shutdown.
                sink.close();
                core_loop.finish();
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                frontend.die(EngineDeadError::EngineCore {
                    cause: format!("could not start the engine-core thread: {e}"),
                });
                None
            }
        };
        Self {
            inner: Arc::new(InprocInner {
                frontend,
                thread: Mutex::new(thread),
            }),
        }
    }
}

impl EngineCoreClient for InprocClient {
    fn add_request(&self, req: EngineCoreRequest) -> Result<RequestStream, RequestError> {
        self.inner.frontend.add_request(req)
    }

    fn abort(&self, request_ids: Vec<RequestId>) {
        self.inner.frontend.abort(request_ids);
    }

    fn stats(&self) -> SchedulerStats {
        self.inner.frontend.stats()
    }

    fn health(&self) -> Result<(), EngineDeadError> {
        self.inner.frontend.health()
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use omni_protocol::{AddRequestError, ModelRunnerOutput, SamplingParams, SchedulerOutput};

    use super::*;
    use crate::SchedulerConfig;

    /// Samples token 7 for `ok_steps` steps, then reports rank 1 dead.
    struct DiesAfter {
        ok_steps: usize,
    }

    impl Executor for DiesAfter {
        fn execute_model(
            &mut self,
            so: &SchedulerOutput,
            _buffers: &[&[u8]],
        ) -> Result<omni_protocol::ModelRunnerOutput, EngineDeadError> {
            if self.ok_steps == 0 {
                return Err(EngineDeadError::Worker {
                    rank: 1,
                    cause: "killed by signal 9".into(),
                });
            }
            self.ok_steps -= 1;
            std::thread::sleep(Duration::from_millis(2));
            let req_ids: Vec<String> = so.num_scheduled_tokens.keys().cloned().collect();
            let sampled_token_ids = vec![vec![7]; req_ids.len()];
            Ok(ModelRunnerOutput {
                req_ids,
                sampled_token_ids,
                ..Default::default()
            })
        }
    }

    fn engine(ok_steps: usize) -> InprocClient {
        InprocClient::spawn(
            EngineCore::new(SchedulerConfig::default(), DiesAfter { ok_steps }).unwrap(),
        )
    }

    fn req(id: &str, max: u32) -> EngineCoreRequest {
        EngineCoreRequest::new(id, vec![1, 2, 3], SamplingParams::greedy(max), None)
    }

    #[test]
    fn dead_engine_fails_live_and_new_requests_naming_the_rank() {
        let client = engine(3);
        let mut s = client.add_request(req("a", 100)).unwrap();
        let mut last = None;
        while let Some(item) = s.blocking_next() {
            last = Some(item);
        }
        let err = last.unwrap().unwrap_err();
        assert!(err.to_string().contains("worker 1"), "{err}");
        assert!(client.health().is_err());
        let err = client.add_request(req("b", 1)).unwrap_err();
        assert!(matches!(
            err,
            RequestError::Engine(EngineDeadError::Worker { rank: 1, .. })
        ));
    }

    #[test]
    fn abort_ends_the_stream_with_abort_reason() {
        let client = engine(usize::MAX);
        let mut s = client.add_request(req("a", 100_000)).unwrap();
        assert!(s.blocking_next().unwrap().is_ok());
        client.abort(vec!["a".into()]);
        let mut last = None;
        while let Some(item) = s.blocking_next() {
            last = Some(item.unwrap());
        }
        assert_eq!(last.unwrap().finish_reason, Some(FinishReason::Abort));
        // The stream was finished, nothing left in the scheduler.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(client.stats().num_running_reqs, 0);
        client.shutdown();
    }

    #[test]
    fn invalid_request_is_rejected_on_its_stream() {
        let client = engine(usize::MAX);
        let mut s = client
            .add_request(EngineCoreRequest::new(
                "e",
                vec![],
                SamplingParams::greedy(1),
                None,
            ))
            .unwrap();
        assert!(matches!(
            s.blocking_next(),
            Some(Err(RequestError::Rejected(AddRequestError::EmptyPrompt(_))))
        ));
        assert!(s.blocking_next().is_none());
    }

    #[test]
    fn dropping_a_stream_aborts_its_request() {
        let client = engine(usize::MAX);
        let mut s = client.add_request(req("a", 100_000)).unwrap();
        assert!(s.blocking_next().unwrap().is_ok());
        drop(s);
        for _ in 0..100 {
            if client.stats().num_running_reqs == 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("request still running after its stream was dropped");
    }

    #[test]
    fn shutdown_ends_live_streams_and_refuses_new_requests() {
        let client = engine(usize::MAX);
        let mut s = client.add_request(req("a", 100_000)).unwrap();
        assert!(s.blocking_next().unwrap().is_ok());
        client.shutdown();
        let mut last = None;
        while let Some(item) = s.blocking_next() {
            last = Some(item);
        }
        assert_eq!(last, Some(Err(RequestError::Shutdown)));
        assert_eq!(
            client.add_request(req("b", 1)).unwrap_err(),
            RequestError::Shutdown
        );
    }
}
