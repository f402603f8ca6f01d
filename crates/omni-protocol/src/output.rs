//! What the engine core sends back to the API process.

use serde::{Deserialize, Serialize};

use crate::{
    AddRequestError, AudioOutput, EngineDeadError, RequestId, TensorRef, TokenId, TokenLogprobs,
};

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FinishReason {
    /// EOS, a stop token, or a stop string.
    Stop,
    /// `max_tokens` or `max_model_len` reached.
    Length,
    /// Aborted by the client or the server.
    Abort,
    /// The engine failed while the request was live.
    Error,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string (and vLLM's metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What matched when a request stopped with [`FinishReason::Stop`] (vLLM's `stop_reason`; `None`
/// there means EOS).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// A token of `stop_token_ids`.
    TokenId(TokenId),
    /// A string of `stop`.
    String(String),
}

/// New tokens of one request since the previous output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreOutput {
    /// Request id.
    pub request_id: RequestId,
    /// Tokens appended this step (usually one).
    pub new_token_ids: Vec<TokenId>,
    /// Log-probabilities of `new_token_ids`, when requested.
    pub new_logprobs: Vec<TokenLogprobs>,
    /// Set on the request's last output.
    pub finish_reason: Option<FinishReason>,
    /// What matched, for [`FinishReason::Stop`] other than EOS.
    pub stop_reason: Option<StopReason>,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: u32,
    /// Seconds the request waited before the scheduler first put it in a batch (its first
    /// scheduling minus its `arrival_time`; vLLM's queued -> scheduled interval, exported as
    /// `vllm:request_queue_time_seconds`). Set on the request's first output once it has been
    /// scheduled, `None` on every other output and for a request never scheduled.
    #[serde(default)]
    pub queue_time: Option<f64>,
    /// Omni requests that also want audio: the Thinker's finish reason, on its last text
    /// output (whose `finish_reason` stays `None`: the request ends with its last audio).
    #[serde(default)]
    pub text_finish_reason: Option<FinishReason>,
    /// Omni requests: audio decoded since the previous output.
    #[serde(default)]
    pub audio: Option<AudioOutput>,
}

impl EngineCoreOutput {
    /// An output with no tokens: a request's end (`finish_reason`) or a speech stage's audio.
    pub fn bare(
        request_id: impl Into<RequestId>,
        finish_reason: Option<FinishReason>,
        audio: Option<AudioOutput>,
    ) -> Self {
        Self {
            request_id: request_id.into(),
            new_token_ids: Vec::new(),
            new_logprobs: Vec::new(),
            finish_reason,
            stop_reason: None,
            num_cached_tokens: 0,
            queue_time: None,
            text_finish_reason: None,
            audio,
        }
    }

    /// Whether this is the request's last output.
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}

/// Scheduler state for metrics (vLLM's `SchedulerStats`); counters are cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SchedulerStats {
    /// Requests in the running set (`vllm:num_requests_running`).
    pub num_running_reqs: u32,
    /// Requests waiting, preempted ones included (`vllm:num_requests_waiting`).
    pub num_waiting_reqs: u32,
    /// Fraction of KV blocks in use, 0..=1 (`vllm:kv_cache_usage_perc`).
    pub kv_cache_usage: f32,
    /// Preemptions so far (`vllm:num_preemptions`).
    pub num_preemptions: u64,
    /// Prompt tokens looked up in the prefix cache so far (`vllm:prefix_cache_queries`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found (`vllm:prefix_cache_hits`).
    pub prefix_cache_hits: u64,
    /// Batches the engine core ran on its executor so far (`omni:engine_steps_total`; vLLM has
    /// no such metric).
    pub engine_steps: u64,
    /// Messages the executor's broadcast queue sent so far, to the workers
    /// (`omni:mq_broadcast_messages_total`; zero for an in-process executor).
    pub mq_broadcast_messages: u64,
    /// Of those, messages larger than a ring chunk (`VLLM_MQ_MAX_CHUNK_BYTES_MB`), sent over the
    /// ZeroMQ overflow socket (`omni:mq_overflow_messages_total`).
    pub mq_overflow_messages: u64,
    /// Payload bytes (header plus out-of-band buffers, once per message) through the ring
    /// (`omni:mq_ring_bytes_total`).
    pub mq_ring_bytes: u64,
    /// Payload bytes through the overflow socket (`omni:mq_overflow_bytes_total`).
    pub mq_overflow_bytes: u64,
}

/// One message from the engine core to its client: what one turn of the busy loop produced
/// (a step's outputs, the outputs of aborts, refusals, the engine's death, new stats).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreOutputs {
    /// Per-request outputs.
    pub outputs: Vec<EngineCoreOutput>,
    /// Scheduler state after the step.
    pub scheduler_stats: Option<SchedulerStats>,
    /// When the step finished, seconds since the Unix epoch.
    pub timestamp: f64,
    /// Per-request tensors (e.g. Thinker hidden states for the next stage), out-of-band.
    pub tensors: Vec<TensorRef>,
    /// Requests refused at admission, with why (each ends its stream).
    pub rejected: Vec<(RequestId, AddRequestError)>,
    /// Set when the engine is dead: every live request fails with it. Sent again in answer to a
    /// request that arrives later, so a client that added one in the meantime fails it too.
    pub engine_dead: Option<EngineDeadError>,
}

impl EngineCoreOutputs {
    /// Whether the message says nothing but (possibly) stats.
    pub fn is_empty(&self) -> bool {
        self.outputs.is_empty()
            && self.rejected.is_empty()
            && self.engine_dead.is_none()
            && self.tensors.is_empty()
    }
}
