//! The engine as the server sees it: [`EngineClient`], a small trait the real engine-core client
//! (omni-core, another process behind omni-ipc) and test fakes implement.

use omni_protocol::{EngineCoreOutput, EngineCoreRequest, RequestId, SchedulerStats};
use tokio::sync::mpsc;

/// Outputs of one engine request, in order; the last `Ok` has `finish_reason` set. An `Err` ends
/// the stream (the engine failed while the request was live).
///
/// Unbounded on purpose: the engine's output loop must never block on one slow HTTP client; the
/// volume per request is bounded by `max_tokens`.
pub type OutputReceiver = mpsc::UnboundedReceiver<Result<EngineCoreOutput, EngineError>>;

/// Why the engine refused or failed a request; the server maps each variant to one HTTP status
/// (see [`crate::ApiError`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The engine core (or a worker) is gone: 503.
    #[error("engine is dead: {cause}")]
    Dead {
        /// What killed it.
        cause: String,
    },
    /// Too many requests in flight: 429.
    #[error("engine overloaded: {reason}")]
    Overloaded {
        /// Which limit was hit.
        reason: String,
    },
    /// The engine rejected the request itself (a check the server could not do): 400.
    #[error("invalid request: {reason}")]
    InvalidRequest {
        /// Why.
        reason: String,
    },
    /// Any other failure: 500.
    #[error("engine error: {reason}")]
    Internal {
        /// Why.
        reason: String,
    },
}

/// KV cache geometry, for `vllm:cache_config_info`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheInfo {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks on the GPU (or CPU).
    pub num_gpu_blocks: u32,
}

/// The API server's handle on the engine (vLLM's `EngineClient` / `AsyncLLM`, reduced to what the
/// HTTP layer needs). Every method is cheap and non-blocking.
///
/// Contract:
/// - [`add_request`](Self::add_request) admits a tokenized request (unique `request_id`) and
///   returns the receiver of its outputs. The engine sends every [`EngineCoreOutput`] of that
///   request to it, the last one with `finish_reason` set, then drops the sender.
/// - [`abort`](Self::abort) stops requests and frees their KV cache; the server calls it when a
///   client disconnects or a stop string matches. Unknown or finished ids are ignored. After an
///   abort the engine may send a last output with `FinishReason::Abort` or just drop the sender.
/// - [`stats`](Self::stats) is the latest [`SchedulerStats`] (scraped by `/metrics`).
/// - [`is_healthy`](Self::is_healthy) is `Err(cause)` once the engine is dead (`/health` -> 503).
pub trait EngineClient: Send + Sync + 'static {
    /// Admits a request; its outputs arrive on the returned receiver.
    fn add_request(&self, request: EngineCoreRequest) -> Result<OutputReceiver, EngineError>;
    /// Stops these requests (idempotent).
    fn abort(&self, request_ids: &[RequestId]);
    /// Latest scheduler statistics (gauges and cumulative counters).
    fn stats(&self) -> SchedulerStats;
    /// `Ok` while the engine is alive, else why it is not.
    fn is_healthy(&self) -> Result<(), String>;
    /// The KV cache geometry.
    fn cache_info(&self) -> CacheInfo;
    /// An omni pipeline's per-stage scheduler state and connector bytes (`None`: one engine).
    fn pipeline_stats(&self) -> Option<omni_protocol::PipelineStats> {
        None
    }
}
