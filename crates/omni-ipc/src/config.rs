//! Queue configuration. The binary fills it from `EngineConfig` (where
//! `VLLM_MQ_MAX_CHUNK_BYTES_MB` is read once, through envy); this crate reads no environment.

use std::time::Duration;

/// Slot size of a queue that carries small answers (a worker's responses, the engine core's
/// inputs and outputs): a few KB per message, a larger one takes the overflow path.
pub const SMALL_QUEUE_CHUNK_BYTES: usize = 2 << 20;
/// Slots of such a queue: one is in use at a time; the rest leave room for pipelined batches.
pub const SMALL_QUEUE_CHUNKS: usize = 4;

/// Sizes and timings of one broadcast queue.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MessageQueueConfig {
    /// Bytes of one ring slot. A message whose encoding is larger goes over ZeroMQ.
    /// Default 16 MiB (vLLM's `VLLM_MQ_MAX_CHUNK_BYTES_MB`).
    pub max_chunk_bytes: usize,
    /// Number of ring slots: how far the writer may run ahead of the slowest reader.
    pub max_chunks: usize,
    /// How long a waiting reader or writer busy-spins before it parks on a futex.
    pub spin: Duration,
    /// While blocked, log a warning this often.
    pub warn_interval: Duration,
    /// Give up an enqueue after this long (`None`: wait for ever, still warning and still
    /// failing at once when a lagging reader's process is dead).
    pub enqueue_timeout: Option<Duration>,
    /// Largest message accepted from the network (remote readers / overflow frames).
    pub max_message_bytes: usize,
    /// How often a blocked call (parked on the ring or stalled in a socket transfer)
    /// re-checks its deadline and its peer's liveness: a dead peer is noticed within this.
    /// Cancellation, shutdown and new messages wake a parked call at once, not at this pace.
    pub liveness_interval: Duration,
}

impl Default for MessageQueueConfig {
    fn default() -> Self {
        Self {
            max_chunk_bytes: 16 << 20,
            max_chunks: 10,
            spin: Duration::from_micros(200),
            warn_interval: Duration::from_secs(60),
            enqueue_timeout: None,
            max_message_bytes: 8 << 30,
            liveness_interval: Duration::from_millis(50),
        }
    }
}

impl MessageQueueConfig {
    /// A queue of small answers: [`SMALL_QUEUE_CHUNKS`] slots of [`SMALL_QUEUE_CHUNK_BYTES`],
    /// the default timings.
    pub fn small() -> Self {
        Self {
            max_chunk_bytes: SMALL_QUEUE_CHUNK_BYTES,
            max_chunks: SMALL_QUEUE_CHUNKS,
            ..Self::default()
        }
    }

    /// Checks the values; every problem is reported, not just the first.
    pub fn validate(&self) -> Result<(), crate::IpcError> {
        let mut problems = Vec::new();
        if self.max_chunk_bytes < 4096 {
            problems.push(format!(
                "max_chunk_bytes must be at least 4096, got {}",
                self.max_chunk_bytes
            ));
        }
        if self.max_chunks == 0 {
            problems.push("max_chunks must be at least 1".to_string());
        }
        if self.max_message_bytes < self.max_chunk_bytes {
            problems.push("max_message_bytes must be at least max_chunk_bytes".to_string());
        }
        if self.liveness_interval.is_zero() {
            problems.push("liveness_interval must be positive".to_string());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(crate::IpcError::Config(problems.join("; ")))
        }
    }
}
