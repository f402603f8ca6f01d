//! The crate's error type.

use std::time::Duration;

/// Which reader of a queue: one attached through shared memory on this host, or one on
/// another host that receives every message over ZeroMQ TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReaderId {
    /// Reader `i` of the shared-memory ring (0-based).
    Local(usize),
    /// Remote reader `i` (0-based), reached over TCP.
    Remote(usize),
}

impl std::fmt::Display for ReaderId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReaderId::Local(i) => write!(f, "local reader {i}"),
            ReaderId::Remote(i) => write!(f, "remote reader {i}"),
        }
    }
}

/// Everything that can go wrong in `omni-ipc`.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    /// Creating or opening a shared-memory segment failed.
    #[error("shared memory segment {name}: {op} failed: {source}")]
    Shm {
        /// Segment name (without the leading `/`).
        name: String,
        /// The system call that failed.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// `/dev/shm` has too little free space for the segment. Creating it anyway would end
    /// in a SIGBUS on first touch of a page the tmpfs cannot back.
    #[error(
        "not enough free space in /dev/shm for segment {name}: need {needed} bytes, {available} available; \
         enlarge /dev/shm (docker: --shm-size; Kubernetes: a memory-backed emptyDir) or lower \
         VLLM_MQ_MAX_CHUNK_BYTES_MB / max_chunks"
    )]
    ShmTooSmall {
        /// Segment name.
        name: String,
        /// Bytes the segment needs.
        needed: u64,
        /// Bytes free in `/dev/shm`.
        available: u64,
    },
    /// The segment exists but is not one of ours, or was written by another version.
    #[error("shared memory segment {name} is not a valid omni-engine segment: {reason}")]
    BadSegment {
        /// Segment name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The configuration or handle is not usable.
    #[error("invalid queue configuration: {0}")]
    Config(String),
    /// A remote address to bind is not an address of this host.
    #[error(
        "cannot bind the remote-reader socket to {addr}: it is not an address of this host ({source}); \
         pass one of this machine's own IPs"
    )]
    NonLocalBind {
        /// The address asked for.
        addr: std::net::IpAddr,
        /// What bind(2) said.
        source: std::io::Error,
    },
    /// A ZeroMQ operation failed.
    #[error("zeromq {op}: {message}")]
    Zmq {
        /// What we were doing.
        op: &'static str,
        /// The transport's error.
        message: String,
    },
    /// A frame from the network was rejected (wrong shape, out of order, too large).
    #[error("malformed frame from the queue's writer: {0}")]
    MalformedFrame(String),
    /// Encoding or decoding the typed header failed.
    #[error("message header codec: {0}")]
    Codec(String),
    /// A blocking call waited its whole timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The writer waited `waited` for its readers to attach; these had not (the ones that had
    /// stay attached: calling `wait_until_ready` again goes on waiting for the rest).
    #[error("timed out after {waited:?} waiting for {}", missing.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "))]
    ReadyTimeout {
        /// How long this call waited.
        waited: Duration,
        /// The readers that have not attached yet.
        missing: Vec<ReaderId>,
    },
    /// The queue was shut down while a call waited.
    #[error("cancelled: the queue is shutting down")]
    Cancelled,
    /// The writer closed the queue and every message it sent has been read.
    #[error("the queue's writer closed it")]
    Closed,
    /// The writer process is gone.
    #[error("the queue's writer (pid {pid}) died")]
    WriterDead {
        /// Writer's process id.
        pid: u32,
    },
    /// A reader process is gone while the writer waits for it.
    #[error("{reader} (pid {pid}) died")]
    ReaderDead {
        /// The dead reader.
        reader: ReaderId,
        /// Its process id.
        pid: u32,
    },
    /// A transfer was cut off in the middle of a message (a deadline, a cancel, a dead or
    /// stalled peer), so the connection's framing is lost: every later call on it fails
    /// with this instead of reading garbage or waiting for bytes that never come.
    #[error("{what} is unusable: {reason}")]
    Unusable {
        /// The connection or queue (names the peer).
        what: String,
        /// What cut it off.
        reason: String,
    },
    /// The writer waited `waited` for a free slot; these readers are behind.
    #[error("no free slot after {waited:?}: waiting for {}", lagging.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "))]
    EnqueueTimeout {
        /// How long the writer waited.
        waited: Duration,
        /// The readers that had not released the slot.
        lagging: Vec<ReaderId>,
    },
}
