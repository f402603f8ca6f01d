//! The start-up handshake between an executor and a worker process it spawned: one JSON line on
//! the worker's stdin ([`WorkerHandshake`]), one JSON line back on its stdout ([`WorkerHello`]).
//! After that, every message goes over the `omni-ipc` queues the two lines name.
//!
//! ```text
//! executor ──stdin:  WorkerHandshake {instance, rank, broadcast handle, response config, ..}──▶ worker
//! executor ◀─stdout: WorkerHello {rank, pid, response handle}─────────────────────────────── worker
//! ```
//!
//! Both carry [`crate::PROTOCOL_VERSION`]; each side refuses a peer of another version.

use std::time::Duration;

use omni_ipc::{Handle, MessageQueueConfig};
use serde::{Deserialize, Serialize};

/// The one JSON line a worker reads from its stdin at start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerHandshake {
    /// The parent's [`crate::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Engine instance id (names every shared-memory segment: `omni.<instance>.<channel>`).
    pub instance: String,
    /// This worker's rank.
    pub rank: u32,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// The parent's pid (the worker exits if its parent already changed).
    pub parent_pid: u32,
    /// Where to read commands from (as local reader `rank`).
    pub broadcast: Handle,
    /// Config of the response queue the worker creates (small: answers are a few KB; it does
    /// not follow the broadcast queue's `VLLM_MQ_MAX_CHUNK_BYTES_MB`).
    pub response_queue: MessageQueueConfig,
    /// The all-reduce segment (created by the executor), when `world_size > 1`.
    pub all_reduce_segment: Option<String>,
    /// How long to wait for the queues' peers at start.
    pub ready_timeout: Duration,
}

/// The one JSON line a worker answers on its stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerHello {
    /// The worker's [`crate::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Its rank.
    pub rank: u32,
    /// Its pid.
    pub pid: u32,
    /// Its response queue (the executor attaches as local reader 0).
    pub response: Handle,
}
