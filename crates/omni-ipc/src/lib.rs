//! The IPC core of omni-engine: a 1 -> N broadcast [`MessageQueue`] over a shared-memory
//! ring ([`ShmRingBuffer`]), with ZeroMQ (ZMTP/3.0) for messages larger than a slot and for
//! readers on other hosts.
//!
//! Layer L0: depends on nothing else in the workspace. The scheduler broadcasts each step's
//! batched input (a typed header plus tensor buffers) to every tensor-parallel worker through
//! it; each worker answers on a queue of its own.
//!
//! ```no_run
//! use omni_ipc::{MessageQueue, MessageQueueConfig, MessageQueueReader, QueueSpec, ReaderId};
//! # fn main() -> Result<(), omni_ipc::IpcError> {
//! let spec = QueueSpec::local(&omni_ipc::shm::new_instance_id(), "bcast", 1, MessageQueueConfig::default());
//! let mut writer = MessageQueue::create(spec)?;
//! let handle = writer.handle(); // serialize and send to the reader process
//! // ... in the reader process:
//! let mut reader = MessageQueueReader::attach(&handle, ReaderId::Local(0))?;
//! # std::thread::spawn(move || { writer.wait_until_ready(std::time::Duration::from_secs(5)).ok();
//! #   writer.enqueue(&("step", 7u32), &[&[0u8; 1024][..]]).ok(); });
//! reader.wait_until_ready(std::time::Duration::from_secs(5))?;
//! let msg = reader.dequeue_borrowed(None)?; // zero-copy view of the slot
//! let (name, step): (String, u32) = msg.header()?;
//! assert_eq!(msg.buffer(0).len(), 1024);
//! # Ok(()) }
//! ```

pub mod codec;
pub mod config;
pub mod error;
pub mod futex;
pub mod queue;
pub mod ring;
pub mod shm;
mod sync;
pub mod zmtp;

pub use config::MessageQueueConfig;
pub use error::{IpcError, ReaderId};
pub use queue::{
    Canceller, Handle, Message, MessageQueue, MessageQueueReader, MessageQueueStats, QueueSpec,
    ReadGuard,
};
pub use ring::ShmRingBuffer;
