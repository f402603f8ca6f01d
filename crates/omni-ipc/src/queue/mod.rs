//! `MessageQueue`: a 1 -> N broadcast of typed messages. Local readers read from the
//! [`ShmRingBuffer`]; a message too large for a slot goes over ZeroMQ and its slot is marked, so
//! order holds across both paths. Remote readers receive every message over ZeroMQ TCP, with
//! credit-based flow control (an ack per message), so the writer never runs more than
//! `max_chunks` messages ahead of any reader, local or remote.
//!
//! # Waiting rules (both sides, both paths)
//! Every blocking call, whether it waits on the ring (credit, a new message) or in the middle of
//! an overflow transfer on a socket, obeys the same rules:
//! * its deadline (`enqueue_timeout`, the `dequeue` timeout), also during the spin phase;
//! * the reader's [`Canceller`] and the writer's [`MessageQueue::shutdown`], which wake a parked
//!   reader at once: they are part of the condition it sleeps on (`wait.rs`);
//! * the peer's liveness, re-checked every `liveness_interval`; a writer blocked by a reader
//!   that is alive but not reading logs vLLM's "No available shared memory broadcast block"
//!   warning every `warn_interval`, naming the reader;
//! * a transfer cut off mid-message leaves that connection (and so the queue) unusable, with
//!   [`crate::IpcError::Unusable`] on every later call: never a hang, never a torn message.
//!
//! [`ShmRingBuffer`]: crate::ShmRingBuffer

mod reader;
mod wait;
mod writer;

use serde::{Deserialize, Serialize};

use crate::codec::{Meta, MetaKind};
use crate::{MessageQueueConfig, ReaderId};

pub use reader::{Canceller, Message, MessageQueueReader, ReadGuard};
pub use writer::MessageQueue;

/// What a [`MessageQueue`] has sent so far (cumulative, per queue; [`MessageQueue::stats`]).
///
/// Bytes are a message's payload, its encoded header plus its out-of-band buffers, counted once
/// per message however many readers receive it; framing and alignment padding are left out.
/// A message larger than a ring slot (`max_chunk_bytes`) is an overflow message: its slot
/// holds a marker and the payload goes over the ZeroMQ sockets. Messages to remote readers
/// only (a queue with no ring) count in `messages` and in neither byte total.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageQueueStats {
    /// Messages enqueued.
    pub messages: u64,
    /// Of those, messages that went over the overflow sockets.
    pub overflow_messages: u64,
    /// Payload bytes written into ring slots.
    pub ring_bytes: u64,
    /// Payload bytes sent over the overflow sockets.
    pub overflow_bytes: u64,
}

/// Version of the handle and wire format; checked when a reader attaches.
pub const WIRE_VERSION: u32 = 1;

/// What to create.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueueSpec {
    /// Engine instance id (see [`crate::shm::new_instance_id`]); names the segment.
    pub instance: String,
    /// Channel name within the instance (`"bcast"`, `"resp0"`, ...).
    pub channel: String,
    /// Readers on this host (shared memory).
    pub n_local_readers: usize,
    /// Readers on other hosts (ZeroMQ TCP).
    pub n_remote_readers: usize,
    /// The address of this host to bind for remote readers (required when there are any).
    pub remote_addr: Option<std::net::IpAddr>,
    /// TCP port for remote readers (0: any free port).
    pub remote_port: u16,
    /// Sizes and timings.
    pub config: MessageQueueConfig,
}

impl QueueSpec {
    /// A spec for `n` local readers with the given config.
    pub fn local(instance: &str, channel: &str, n: usize, config: MessageQueueConfig) -> Self {
        Self {
            instance: instance.to_string(),
            channel: channel.to_string(),
            n_local_readers: n,
            n_remote_readers: 0,
            remote_addr: None,
            remote_port: 0,
            config,
        }
    }
}

/// Everything a reader process needs to attach. Serialize it (JSON, bincode) and send it over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Handle {
    /// [`WIRE_VERSION`] of the writer.
    pub version: u32,
    /// Ring segment name (when there are local readers).
    pub ring: Option<String>,
    /// Local readers.
    pub n_local_readers: usize,
    /// Remote readers.
    pub n_remote_readers: usize,
    /// `ipc://@...` endpoint for local overflow traffic.
    pub local_endpoint: Option<String>,
    /// `tcp://ip:port` endpoint for remote readers.
    pub remote_endpoint: Option<String>,
    /// Writer's pid.
    pub writer_pid: u32,
    /// The writer's config (readers use its bounds and timings).
    pub config: MessageQueueConfig,
}

fn meta_frame(kind: MetaKind, seq: u64) -> [u8; 16] {
    Meta { kind, seq }.encode()
}

fn identity(id: ReaderId) -> Vec<u8> {
    match id {
        ReaderId::Local(i) => format!("L{i}").into_bytes(),
        ReaderId::Remote(i) => format!("R{i}").into_bytes(),
    }
}

fn parse_identity(b: &[u8]) -> Option<ReaderId> {
    let s = std::str::from_utf8(b).ok()?;
    let n: usize = s.get(1..)?.parse().ok()?;
    match s.as_bytes().first()? {
        b'L' => Some(ReaderId::Local(n)),
        b'R' => Some(ReaderId::Remote(n)),
        _ => None,
    }
}
