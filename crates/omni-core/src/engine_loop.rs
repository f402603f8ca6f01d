//! The engine-core busy loop on its own thread ([`EngineLoop`]) and the cloneable handle that
//! feeds it ([`EngineClient`]).
//!
//! The loop owns the [`EngineCore`]. It takes inputs (add, abort, shutdown) from a channel,
//! steps while any request is live, and blocks on the channel when idle (waking every
//! [`HEALTH_CHECK_INTERVAL`] to ask the executor whether its workers are alive). Each request's
//! outputs go to that request's own tokio channel, so an async server awaits them
//! ([`RequestStream::next`]) and offline code blocks on them ([`RequestStream::blocking_next`]).
//!
//! When the executor reports [`EngineError::EngineDead`], the loop fails every in-flight request
//! with that error (it names the rank), shuts the executor down, and from then on answers every
//! new request with the same error; [`EngineClient::health`] reports it too.
//!
//! ```
//! use omni_core::{EngineCore, EngineError, EngineLoop, Executor, SchedulerConfig};
//! use omni_protocol::{EngineCoreRequest, ModelRunnerOutput, SamplingParams, SchedulerOutput};
//!
//! struct Sevens;
//! impl Executor for Sevens {
//!     fn execute_model(
//!         &mut self,
//!         so: &SchedulerOutput,
//!         _buffers: &[&[u8]],
//!     ) -> Result<ModelRunnerOutput, EngineError> {
//!         let req_ids: Vec<String> = so.num_scheduled_tokens.keys().cloned().collect();
//!         let sampled_token_ids = vec![vec![7]; req_ids.len()];
//!         Ok(ModelRunnerOutput { req_ids, sampled_token_ids, ..Default::default() })
//!     }
//! }
//!
//! let engine = EngineLoop::spawn(EngineCore::new(SchedulerConfig::default(), Sevens).unwrap());
//! let client = engine.client();
//! let mut stream = client
//!     .add_request(EngineCoreRequest::new("r0", vec![1, 2], SamplingParams::greedy(2), None))
//!     .unwrap();
//! let mut tokens = Vec::new();
//! while let Some(out) = stream.blocking_next() {
//!     tokens.extend(out.unwrap().new_token_ids);
//! }
//! assert_eq!(tokens, vec![7, 7]);
//! engine.shutdown();
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use omni_protocol::{EngineCoreOutput, EngineCoreRequest, FinishReason, RequestId, SchedulerStats};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::engine_core::EngineCore;
use crate::executor::{EngineError, Executor};
use crate::scheduler::AddRequestError;

/// How often an idle loop asks the executor whether its workers are alive.
pub const HEALTH_CHECK_INTERVAL: Duration = Duration::from_millis(200);

/// Why a request got no (more) outputs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// Refused at admission (HTTP 400).
    #[error(transparent)]
    Rejected(#[from] AddRequestError),
    /// The engine died (HTTP 503); the message names the failed rank.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The engine was shut down while the request was live.
    #[error("the engine is shutting down")]
    Shutdown,
}

/// One item of a request's stream: its next output, or why it ended abnormally.
pub type RequestOutput = Result<EngineCoreOutput, RequestError>;

enum LoopInput {
    Add(Box<EngineCoreRequest>, UnboundedSender<RequestOutput>),
    Abort(Vec<RequestId>),
    Shutdown,
}

#[derive(Debug, Default)]
struct Shared {
    stats: Mutex<SchedulerStats>,
    dead: Mutex<Option<EngineError>>,
    stopped: AtomicBool,
}

impl Shared {
    fn dead(&self) -> Option<EngineError> {
        self.dead
            .lock()
            .map(|d| d.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    fn set_dead(&self, e: EngineError) {
        match self.dead.lock() {
            Ok(mut d) => *d = Some(e),
            Err(p) => *p.into_inner() = Some(e),
        }
    }

    fn set_stats(&self, s: SchedulerStats) {
        if let Ok(mut g) = self.stats.lock() {
            *g = s;
        }
    }
}

/// A cloneable, thread-safe handle on a running [`EngineLoop`].
#[derive(Debug, Clone)]
pub struct EngineClient {
    tx: mpsc::Sender<LoopInput>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LoopInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoopInput::Add(r, _) => write!(f, "Add({})", r.request_id),
            LoopInput::Abort(ids) => write!(f, "Abort({ids:?})"),
            LoopInput::Shutdown => f.write_str("Shutdown"),
        }
    }
}

impl EngineClient {
    /// Queues a request; its outputs arrive on the returned stream, which ends after the output
    /// with a `finish_reason` (or after one error). Dropping the stream early aborts the request.
    pub fn add_request(&self, req: EngineCoreRequest) -> Result<RequestStream, RequestError> {
        self.health()?;
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(RequestError::Shutdown);
        }
        let (tx, rx) = unbounded_channel();
        let request_id = req.request_id.clone();
        self.tx
            .send(LoopInput::Add(Box::new(req), tx))
            .map_err(|_| RequestError::Shutdown)?;
        Ok(RequestStream {
            request_id,
            rx,
            done: false,
            client: self.clone(),
        })
    }

    /// Aborts requests (their streams end with a [`FinishReason::Abort`] output).
    pub fn abort(&self, request_ids: Vec<RequestId>) {
        let _ = self.tx.send(LoopInput::Abort(request_ids));
    }

    /// Scheduler state after the latest step.
    pub fn stats(&self) -> SchedulerStats {
        self.shared.stats.lock().map(|s| *s).unwrap_or_default()
    }

    /// `Err` once the engine is dead (with the failed rank and cause).
    pub fn health(&self) -> Result<(), EngineError> {
        match self.shared.dead() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Asks the loop to stop: live requests end with [`RequestError::Shutdown`], the executor
    /// shuts its workers down.
    pub fn shutdown(&self) {
        self.shared.stopped.store(true, Ordering::Release);
        let _ = self.tx.send(LoopInput::Shutdown);
    }
}

/// The outputs of one request.
#[derive(Debug)]
pub struct RequestStream {
    request_id: RequestId,
    rx: UnboundedReceiver<RequestOutput>,
    done: bool,
    client: EngineClient,
}

impl RequestStream {
    /// The request's id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The next output; `None` after the last one.
    pub async fn next(&mut self) -> Option<RequestOutput> {
        let item = self.rx.recv().await;
        self.note(&item);
        item
    }

    /// The next output, blocking the thread (not for use inside an async runtime).
    pub fn blocking_next(&mut self) -> Option<RequestOutput> {
        let item = self.rx.blocking_recv();
        self.note(&item);
        item
    }

    /// The next output if one is ready: `Pending` when none is yet, `Ready(None)` after the last.
    pub fn try_next(&mut self) -> std::task::Poll<Option<RequestOutput>> {
        use tokio::sync::mpsc::error::TryRecvError;
        let item = match self.rx.try_recv() {
            Ok(item) => Some(item),
            Err(TryRecvError::Empty) => return std::task::Poll::Pending,
            Err(TryRecvError::Disconnected) => None,
        };
        self.note(&item);
        std::task::Poll::Ready(item)
    }

    fn note(&mut self, item: &Option<RequestOutput>) {
        match item {
            Some(Ok(o)) if !o.finished() => {}
            _ => self.done = true,
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            self.client.abort(vec![self.request_id.clone()]);
        }
    }
}

/// The thread that owns the [`EngineCore`]. Dropping it (or [`EngineLoop::shutdown`]) stops the
/// loop and joins the thread.
#[derive(Debug)]
pub struct EngineLoop {
    client: EngineClient,
    thread: Option<JoinHandle<()>>,
}

impl EngineLoop {
    /// Starts the loop on a thread named `omni-engine-core`.
    pub fn spawn<E: Executor + Send + 'static>(core: EngineCore<E>) -> Self {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        shared.set_stats(core.stats());
        let state = LoopState {
            core,
            rx,
            shared: shared.clone(),
            streams: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name("omni-engine-core".into())
            .spawn(move || state.run());
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                shared.set_dead(EngineError::EngineDead {
                    rank: 0,
                    cause: format!("could not start the engine-core thread: {e}"),
                });
                None
            }
        };
        Self {
            client: EngineClient { tx, shared },
            thread,
        }
    }

    /// A handle for submitting requests.
    pub fn client(&self) -> EngineClient {
        self.client.clone()
    }

    /// Stops the loop and waits for it (and the executor's shutdown).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.client.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EngineLoop {
    fn drop(&mut self) {
        self.stop();
    }
}

struct LoopState<E: Executor> {
    core: EngineCore<E>,
    rx: mpsc::Receiver<LoopInput>,
    shared: Arc<Shared>,
    streams: HashMap<RequestId, UnboundedSender<RequestOutput>>,
}

impl<E: Executor> LoopState<E> {
    fn run(mut self) {
        let mut executor_up = true;
        loop {
            let busy = executor_up && self.core.has_unfinished_requests();
            if !busy {
                match self.rx.recv_timeout(HEALTH_CHECK_INTERVAL) {
                    Ok(input) => {
                        if !self.handle(input) {
                            break;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                if executor_up && let Err(e) = self.core.executor_mut().check_health() {
                    self.die(e);
                    executor_up = false;
                }
            }
            let mut stop = false;
            while let Ok(input) = self.rx.try_recv() {
                if !self.handle(input) {
                    stop = true;
                    break;
                }
            }
            if stop {
                break;
            }
            if executor_up && self.shared.dead().is_some() {
                executor_up = false;
            }
            if executor_up && self.core.has_unfinished_requests() {
                match self.core.step() {
                    Ok(outputs) => self.deliver(outputs),
                    Err(e) => {
                        self.die(e);
                        executor_up = false;
                    }
                }
                self.shared.set_stats(self.core.stats());
            }
        }
        for (_, tx) in self.streams.drain() {
            let _ = tx.send(Err(RequestError::Shutdown));
        }
        self.shared.stopped.store(true, Ordering::Release);
        if executor_up {
            self.core.shutdown();
        }
    }

    /// Applies one input; `false` means stop.
    fn handle(&mut self, input: LoopInput) -> bool {
        match input {
            LoopInput::Add(req, tx) => {
                if let Some(e) = self.shared.dead() {
                    let _ = tx.send(Err(RequestError::Engine(e)));
                    return true;
                }
                let id = req.request_id.clone();
                match self.core.add_request(*req) {
                    Ok(()) => {
                        self.streams.insert(id, tx);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(RequestError::Rejected(e)));
                    }
                }
            }
            LoopInput::Abort(ids) => self.abort(&ids),
            LoopInput::Shutdown => return false,
        }
        self.shared.set_stats(self.core.stats());
        true
    }

    fn abort(&mut self, ids: &[RequestId]) {
        for id in self.core.abort(ids) {
            if let Some(tx) = self.streams.remove(&id) {
                let _ = tx.send(Ok(EngineCoreOutput {
                    request_id: id,
                    new_token_ids: Vec::new(),
                    new_logprobs: Vec::new(),
                    finish_reason: Some(FinishReason::Abort),
                    stop_reason: None,
                    num_cached_tokens: 0,
                    queue_time: None,
                }));
            }
        }
    }

    fn deliver(&mut self, outputs: Vec<EngineCoreOutput>) {
        let mut gone = Vec::new();
        for out in outputs {
            let id = out.request_id.clone();
            let finished = out.finished();
            let sent = match self.streams.get(&id) {
                Some(tx) => tx.send(Ok(out)).is_ok(),
                None => continue,
            };
            if finished {
                self.streams.remove(&id);
            } else if !sent {
                gone.push(id); // the client dropped its stream
            }
        }
        if !gone.is_empty() {
            for id in &gone {
                self.streams.remove(id);
            }
            self.core.abort(&gone);
        }
    }

    fn die(&mut self, e: EngineError) {
        tracing::error!("{e}; failing {} live requests", self.streams.len());
        self.shared.set_dead(e.clone());
        for (_, tx) in self.streams.drain() {
            let _ = tx.send(Err(RequestError::Engine(e.clone())));
        }
        self.core.fail_all();
        self.core.shutdown();
        self.shared.set_stats(self.core.stats());
    }
}

#[cfg(test)]
mod tests {
    use omni_protocol::{ModelRunnerOutput, SamplingParams, SchedulerOutput};

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
        ) -> Result<omni_protocol::ModelRunnerOutput, EngineError> {
            if self.ok_steps == 0 {
                return Err(EngineError::EngineDead {
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

    fn engine(ok_steps: usize) -> EngineLoop {
        EngineLoop::spawn(
            EngineCore::new(SchedulerConfig::default(), DiesAfter { ok_steps }).unwrap(),
        )
    }

    fn req(id: &str, max: u32) -> EngineCoreRequest {
        EngineCoreRequest::new(id, vec![1, 2, 3], SamplingParams::greedy(max), None)
    }

    #[test]
    fn dead_engine_fails_live_and_new_requests_naming_the_rank() {
        let engine = engine(3);
        let client = engine.client();
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
            RequestError::Engine(EngineError::EngineDead { rank: 1, .. })
        ));
    }

    #[test]
    fn abort_ends_the_stream_with_abort_reason() {
        let engine = engine(usize::MAX);
        let client = engine.client();
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
        engine.shutdown();
    }

    #[test]
    fn invalid_request_is_rejected_on_its_stream() {
        let engine = engine(usize::MAX);
        let client = engine.client();
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
        let engine = engine(usize::MAX);
        let client = engine.client();
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
}
