//! [`EngineCoreClient`]: how servers and offline inference talk to an engine core, wherever it
//! runs (vLLM's `EngineCoreClient`). Two implementations:
//!
//! - [`crate::InprocClient`]: the engine core's busy loop on a thread of this process (vLLM's
//!   `InprocClient`, which vLLM runs without a thread; ours keeps the thread so `add_request`
//!   never waits for a step).
//! - [`crate::MpClient`]: the engine core in a process of its own (`omni-engine-core`, vLLM's
//!   `EngineCoreProc`), over a pair of `MessageQueue`s (vLLM's `MPClient`).
//!
//! Both send [`EngineCoreInput`]s and receive [`EngineCoreOutputs`]; the [`Frontend`] they
//! share turns those into one [`RequestStream`] per request: it keeps each live request's
//! channel, routes every output to its request, keeps the latest [`SchedulerStats`], and fails
//! every live stream at once when the engine dies or shuts down. Routing is by request id, so
//! ids must be unique among live requests (a duplicate is refused, as the scheduler would).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use omni_protocol::{
    AddRequestError, EngineCoreInput, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
    EngineDeadError, RequestId, SchedulerStats,
};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// Why a request got no (more) outputs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// Refused at admission (HTTP 400).
    #[error(transparent)]
    Rejected(#[from] AddRequestError),
    /// The engine died (HTTP 503); the message names the failed worker or the engine core.
    #[error(transparent)]
    Engine(#[from] EngineDeadError),
    /// The engine was shut down while the request was live.
    #[error("the engine is shutting down")]
    Shutdown,
}

/// One item of a request's stream: its next output, or why it ended abnormally.
pub type RequestOutput = Result<EngineCoreOutput, RequestError>;

/// A running engine core, seen from its client: in this process ([`crate::InprocClient`]) or in
/// its own ([`crate::MpClient`]). Share it as `Arc<dyn EngineCoreClient>`.
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
/// let client: std::sync::Arc<dyn EngineCoreClient> = std::sync::Arc::new(
///     InprocClient::spawn(EngineCore::new(SchedulerConfig::default(), Sevens).unwrap()),
/// );
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
pub trait EngineCoreClient: Send + Sync + std::fmt::Debug {
    /// Queues a request; its outputs arrive on the returned stream, which ends after the output
    /// with a `finish_reason` (or after one error: a refusal comes as the stream's only item).
    /// Dropping the stream early aborts the request.
    fn add_request(&self, req: EngineCoreRequest) -> Result<RequestStream, RequestError>;

    /// Aborts requests (their streams end with a [`omni_protocol::FinishReason::Abort`] output).
    fn abort(&self, request_ids: Vec<RequestId>);

    /// Scheduler state after the latest step.
    fn stats(&self) -> SchedulerStats;

    /// `Err` once the engine is dead (naming the failed worker or the engine core).
    fn health(&self) -> Result<(), EngineDeadError>;

    /// An omni pipeline's per-stage state and connector bytes (`None`: one engine).
    fn pipeline_stats(&self) -> Option<omni_protocol::PipelineStats> {
        None
    }

    /// Stops the engine core: live requests end at once with [`RequestError::Shutdown`], new
    /// ones are refused, then this waits until the engine core and its workers are gone.
    /// Idempotent; a second caller waits for the first.
    fn shutdown(&self);
}

/// A shared client is a client (so `&Arc<dyn EngineCoreClient>` passes as `&dyn ..`).
impl<T: EngineCoreClient + ?Sized> EngineCoreClient for Arc<T> {
    fn add_request(&self, req: EngineCoreRequest) -> Result<RequestStream, RequestError> {
        (**self).add_request(req)
    }

    fn abort(&self, request_ids: Vec<RequestId>) {
        (**self).abort(request_ids)
    }

    fn stats(&self) -> SchedulerStats {
        (**self).stats()
    }

    fn health(&self) -> Result<(), EngineDeadError> {
        (**self).health()
    }

    fn pipeline_stats(&self) -> Option<omni_protocol::PipelineStats> {
        (**self).pipeline_stats()
    }

    fn shutdown(&self) {
        (**self).shutdown()
    }
}

#[derive(Debug, Default)]
struct Routes {
    streams: HashMap<RequestId, UnboundedSender<RequestOutput>>,
    dead: Option<EngineDeadError>,
}

/// The client half both implementations share: the input channel towards the engine core and
/// the per-request output channels; see the module docs.
#[derive(Debug)]
pub(crate) struct Frontend {
    inputs: mpsc::Sender<EngineCoreInput>,
    routes: Mutex<Routes>,
    stats: Mutex<SchedulerStats>,
    stopped: AtomicBool,
}

impl Frontend {
    /// A frontend whose inputs go to `inputs`.
    pub(crate) fn new(inputs: mpsc::Sender<EngineCoreInput>) -> Self {
        Self {
            inputs,
            routes: Mutex::default(),
            stats: Mutex::default(),
            stopped: AtomicBool::new(false),
        }
    }

    fn routes(&self) -> MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`EngineCoreClient::add_request`].
    pub(crate) fn add_request(
        self: &Arc<Self>,
        req: EngineCoreRequest,
    ) -> Result<RequestStream, RequestError> {
        let (tx, rx) = unbounded_channel();
        let request_id = req.request_id.clone();
        let mut stream = RequestStream {
            request_id: request_id.clone(),
            rx,
            done: false,
            frontend: self.clone(),
        };
        {
            let mut routes = self.routes();
            // Under the lock that `die` and `close` take: a request is either failed by the
            // death (or the shutdown) or refused here, never missed.
            if let Some(e) = &routes.dead {
                stream.done = true;
                return Err(RequestError::Engine(e.clone()));
            }
            if self.is_stopped() {
                stream.done = true;
                return Err(RequestError::Shutdown);
            }
            if routes.streams.contains_key(&request_id) {
                // Refused on its own stream, which must not abort the live request of that id.
                stream.done = true;
                let e = AddRequestError::DuplicateRequestId(request_id);
                let _ = tx.send(Err(RequestError::Rejected(e)));
                return Ok(stream);
            }
            routes.streams.insert(request_id.clone(), tx);
        }
        if self
            .inputs
            .send(EngineCoreInput::Add(Box::new(req)))
            .is_err()
        {
            self.routes().streams.remove(&request_id);
            stream.done = true;
            return Err(RequestError::Shutdown);
        }
        Ok(stream)
    }

    /// [`EngineCoreClient::abort`].
    pub(crate) fn abort(&self, request_ids: Vec<RequestId>) {
        let _ = self.inputs.send(EngineCoreInput::Abort(request_ids));
    }

    /// [`EngineCoreClient::stats`].
    pub(crate) fn stats(&self) -> SchedulerStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    /// [`EngineCoreClient::health`].
    pub(crate) fn health(&self) -> Result<(), EngineDeadError> {
        match &self.routes().dead {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Whether a shutdown was asked for.
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// The first half of [`EngineCoreClient::shutdown`]: refuse new requests, end the live
    /// ones with [`RequestError::Shutdown`], tell the engine core to stop.
    pub(crate) fn begin_shutdown(&self) {
        self.stopped.store(true, Ordering::Release);
        self.close();
        let _ = self.inputs.send(EngineCoreInput::Shutdown);
    }

    /// Sends an input to the engine core (ignored once it is gone).
    pub(crate) fn send(&self, input: EngineCoreInput) {
        let _ = self.inputs.send(input);
    }

    /// Routes one message of the engine core to the requests it concerns.
    pub(crate) fn dispatch(&self, outputs: EngineCoreOutputs) {
        if let Some(s) = outputs.scheduler_stats
            && let Ok(mut g) = self.stats.lock()
        {
            *g = s;
        }
        let mut routes = self.routes();
        for (id, e) in outputs.rejected {
            if let Some(tx) = routes.streams.remove(&id) {
                let _ = tx.send(Err(RequestError::Rejected(e)));
            }
        }
        for out in outputs.outputs {
            let finished = out.finished();
            let Some(tx) = routes.streams.get(&out.request_id) else {
                continue;
            };
            let id = out.request_id.clone();
            // A failed send: the stream was dropped, which aborts the request itself.
            if tx.send(Ok(out)).is_err() || finished {
                routes.streams.remove(&id);
            }
        }
        if let Some(e) = outputs.engine_dead {
            Self::fail_all(&mut routes, e);
        }
    }

    /// The engine is dead: every live stream (and every later request) fails with `e`, or with
    /// the first death already recorded.
    /// Ends one request's stream with `e` (a pipeline stage it was bound to failed).
    pub(crate) fn fail_request(&self, request_id: &str, e: EngineDeadError) {
        if let Some(tx) = self.routes().streams.remove(request_id) {
            let _ = tx.send(Err(RequestError::Engine(e)));
        }
    }

    pub(crate) fn die(&self, e: EngineDeadError) {
        let mut routes = self.routes();
        if routes.dead.is_none() {
            tracing::error!("{e}; failing {} live requests", routes.streams.len());
        }
        Self::fail_all(&mut routes, e);
    }

    /// `die` without the log line (the engine core logged it already).
    fn fail_all(routes: &mut Routes, e: EngineDeadError) {
        let e = routes.dead.get_or_insert(e).clone();
        for (_, tx) in routes.streams.drain() {
            let _ = tx.send(Err(RequestError::Engine(e.clone())));
        }
    }

    /// The engine core is gone after a shutdown: every live stream ends with
    /// [`RequestError::Shutdown`].
    pub(crate) fn close(&self) {
        let mut routes = self.routes();
        self.stopped.store(true, Ordering::Release);
        for (_, tx) in routes.streams.drain() {
            let _ = tx.send(Err(RequestError::Shutdown));
        }
    }

    /// A dropped, unfinished stream: forget its channel and abort it in the engine core.
    fn drop_stream(&self, request_id: &str) {
        self.routes().streams.remove(request_id);
        self.abort(vec![request_id.to_string()]);
    }
}

/// The outputs of one request.
#[derive(Debug)]
pub struct RequestStream {
    request_id: RequestId,
    rx: UnboundedReceiver<RequestOutput>,
    done: bool,
    frontend: Arc<Frontend>,
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
            self.frontend.drop_stream(&self.request_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use omni_protocol::FinishReason;

    use super::*;

    fn output(id: &str, finish: Option<FinishReason>) -> EngineCoreOutput {
        EngineCoreOutput {
            request_id: id.into(),
            new_token_ids: vec![5],
            new_logprobs: Vec::new(),
            finish_reason: finish,
            stop_reason: None,
            num_cached_tokens: 0,
            queue_time: None,
            text_finish_reason: None,
            audio: None,
        }
    }

    fn req(id: &str) -> EngineCoreRequest {
        EngineCoreRequest::new(id, vec![1], omni_protocol::SamplingParams::greedy(4), None)
    }

    #[test]
    fn outputs_reach_their_own_request_and_a_finished_one_is_forgotten() {
        let (tx, rx) = mpsc::channel();
        let f = Arc::new(Frontend::new(tx));
        let mut a = f.add_request(req("a")).unwrap();
        let mut b = f.add_request(req("b")).unwrap();
        assert_eq!(rx.try_iter().count(), 2);
        f.dispatch(EngineCoreOutputs {
            outputs: vec![output("b", None), output("a", Some(FinishReason::Length))],
            ..Default::default()
        });
        assert_eq!(a.blocking_next().unwrap().unwrap().request_id, "a");
        assert!(a.blocking_next().is_none());
        assert_eq!(b.blocking_next().unwrap().unwrap().request_id, "b");
        assert!(matches!(b.try_next(), std::task::Poll::Pending));
        drop(b); // unfinished: aborted
        assert!(matches!(
            rx.try_recv(),
            Ok(EngineCoreInput::Abort(ids)) if ids == ["b"]
        ));
    }

    #[test]
    fn a_duplicate_live_id_is_refused_on_its_own_stream() {
        let (tx, _rx) = mpsc::channel();
        let f = Arc::new(Frontend::new(tx));
        let _a = f.add_request(req("a")).unwrap();
        let mut dup = f.add_request(req("a")).unwrap();
        assert!(matches!(
            dup.blocking_next(),
            Some(Err(RequestError::Rejected(
                AddRequestError::DuplicateRequestId(_)
            )))
        ));
    }

    #[test]
    fn death_fails_live_and_later_requests_with_the_first_cause() {
        let (tx, _rx) = mpsc::channel();
        let f = Arc::new(Frontend::new(tx));
        let mut a = f.add_request(req("a")).unwrap();
        let first = EngineDeadError::EngineCore {
            cause: "engine-core process 7 (omni-engine-core) killed by signal 9".into(),
        };
        f.die(first.clone());
        f.die(EngineDeadError::Worker {
            rank: 0,
            cause: "later".into(),
        });
        assert_eq!(
            a.blocking_next(),
            Some(Err(RequestError::Engine(first.clone())))
        );
        assert_eq!(f.health(), Err(first.clone()));
        assert_eq!(
            f.add_request(req("b")).unwrap_err(),
            RequestError::Engine(first)
        );
    }
}
