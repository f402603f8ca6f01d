//! The start-up handshakes of the child processes, one JSON line each way over the child's
//! stdin and stdout. After that, every message goes over the `omni-ipc` queues the lines name.
//!
//! A worker, spawned by an executor:
//!
//! ```text
//! executor ──stdin:  WorkerHandshake {instance, rank, layout, broadcast handle, ..}──────────▶ worker
//! executor ◀─stdout: WorkerHello {rank, pid, response handle, peer queues}──────────────────── worker
//! executor ──stdin:  WorkerPeers {every rank's peer queues} (once every rank said hello)──▶ worker
//! ```
//!
//! A worker on another node gets the same lines from that node's launcher (`serve --headless`),
//! which relays them to and from the leader over the master rendezvous connection.
//!
//! An engine-core process (`omni-engine-core`), spawned by its client in the API process:
//!
//! ```text
//! client ──stdin:  EngineCoreHandshake {input queue handle, output config, resolved config}──▶ core
//! client ◀─stdout: EngineCoreStartup::Ready {pid, output queue handle, KV blocks, device}──── core
//!                  (or ::Failed {message}: its start-up error, said once, before it exits)
//! ```
//!
//! All carry [`crate::PROTOCOL_VERSION`]; each side refuses a peer of another version.

use std::net::IpAddr;
use std::time::Duration;

use omni_ipc::{Handle, MessageQueueConfig, ReaderId};

use crate::{Device, ParallelLayout, PeerQueues};
use serde::{Deserialize, Serialize};

/// The one JSON line a worker reads from its stdin at start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerHandshake {
    /// The parent's [`crate::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Engine instance id (names every shared-memory segment: `omni.<instance>.<channel>`).
    pub instance: String,
    /// This worker's rank (`pp_rank * tp_size + tp_rank`).
    pub rank: u32,
    /// Every rank's place: tensor- and pipeline-parallel sizes, nodes.
    pub layout: ParallelLayout,
    /// The address of this worker's node that its queues bind for readers on other nodes
    /// (`None`: every peer is on this node).
    pub host_ip: Option<IpAddr>,
    /// The parent's pid (the worker exits if its parent already changed).
    pub parent_pid: u32,
    /// Where to read commands from.
    pub broadcast: Handle,
    /// This worker's reader id on `broadcast` (local on the engine core's node, remote on others).
    pub broadcast_reader: ReaderId,
    /// Config of the response queue the worker creates (small: answers are a few KB; it does
    /// not follow the broadcast queue's `VLLM_MQ_MAX_CHUNK_BYTES_MB`).
    pub response_queue: MessageQueueConfig,
    /// The all-reduce segment of this rank's tensor-parallel group (created on its node by the
    /// executor or the node's launcher), when the group has several ranks on one node.
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
    /// Its response queue (the executor attaches as its one reader: local on the engine core's
    /// node, remote elsewhere).
    pub response: Handle,
    /// The queues it writes to its peers (pipeline stage, tensor-parallel group across nodes).
    pub peers: PeerQueues,
}

/// Reads one JSON line of this process's stdin (a child's handshake lines); `what` names the
/// line in errors.
pub fn read_stdin_json<T: serde::de::DeserializeOwned>(what: &str) -> Result<T, String> {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| format!("reading {what}: {e}"))?;
    if line.is_empty() {
        return Err(format!("stdin closed before {what}"));
    }
    serde_json::from_str(&line).map_err(|e| format!("{what}: {e}"))
}

impl WorkerHandshake {
    /// Ranks of the engine.
    pub fn world_size(&self) -> usize {
        self.layout.world()
    }
}

/// The one JSON line an engine-core process reads from its stdin at start. `C` is the resolved
/// engine config (omni-config's `EngineConfig`; generic here because configuration sits above
/// this crate): the process never re-reads the environment or its argv.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreHandshake<C> {
    /// The client's [`crate::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The client's pid (the engine core exits if its parent already changed).
    pub parent_pid: u32,
    /// Where to read [`crate::EngineCoreInput`]s from (as local reader 0).
    pub input: Handle,
    /// Config of the queue the engine core creates for its [`crate::EngineCoreOutputs`].
    pub output_queue: MessageQueueConfig,
    /// How long to wait for the queues' peers at start.
    pub ready_timeout: Duration,
    /// The resolved engine config.
    pub config: C,
}

/// What a started engine core reports to its client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreReady {
    /// The engine core's [`crate::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Its pid (its segments are `omni.<pid>x*`).
    pub pid: u32,
    /// Its output queue (the client attaches as local reader 0).
    pub output: Handle,
    /// KV blocks allocated on every rank.
    pub num_gpu_blocks: u32,
    /// The model path that was loaded.
    pub model: String,
    /// The device the model runs on (`--device auto` resolved).
    pub device: Device,
}

/// The one JSON line an engine-core process answers on its stdout, once its workers are up and
/// the model is loaded (or start-up failed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineCoreStartup {
    /// Serving: attach to the output queue.
    Ready(EngineCoreReady),
    /// Start-up failed; the process exits after this line.
    Failed {
        /// The start-up error, in words.
        message: String,
    },
}
