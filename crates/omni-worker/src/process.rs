//! The worker process's main: handshake on stdin/stdout, then serve commands from the broadcast
//! queue until `Shutdown`, a cancelled queue, or the parent's death.
//!
//! 1. Read ONE JSON line from stdin: [`WorkerHandshake`] (the resolved config, the broadcast
//!    queue's handle, this worker's rank).
//! 2. `PR_SET_PDEATHSIG(SIGKILL)`, then check the parent is still the one that wrote the
//!    handshake; name the process `omni-worker-<rank>` (`PR_SET_NAME`).
//! 3. Attach to the broadcast queue as the reader the handshake names; create the response
//!    queue (`omni.<instance>.resp<rank>`, one reader: the executor, local on the engine
//!    core's node, remote elsewhere) and the queues to this rank's peers ([`PeerWriters`]).
//! 4. Answer ONE JSON line on stdout: [`WorkerHello`] with those queues' handles; once the
//!    broadcast and response queues are ready, read ONE more line, [`WorkerPeers`] (every
//!    rank's peer queues), and connect to the peers.
//! 5. A thread keeps reading stdin: EOF means the parent is gone (or shutting down): remove our
//!    own segments and exit at once.
//! 6. Serve: dequeue a [`WorkerCommand`] (borrowed from the ring slot, so a step's tensor
//!    buffers are read in place), let the worker answer, enqueue the answer with its buffers.
//!
//! [`serve`] runs this loop around any [`WorkerBase`]; [`run_worker_process`] around the model
//! [`Worker`].

use std::io::{Read, Write};
use std::time::Duration;

use omni_ipc::{IpcError, MessageQueue, MessageQueueReader, QueueSpec};
use omni_protocol::{
    PROTOCOL_VERSION, WorkerBase, WorkerCommand, WorkerHandshake, WorkerHello, WorkerPeers,
    WorkerResponse,
};

use crate::peers::{PeerLinkError, PeerLinks, PeerWriters, peer_channels};
use crate::{ShmAllReduceError, Worker};

/// Why a worker process stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum WorkerProcessError {
    /// Reading the handshake or writing the hello failed.
    #[error("handshake: {0}")]
    Handshake(String),
    /// The parent died before we could arm the death signal.
    #[error("parent process {0} is gone")]
    ParentGone(u32),
    /// A queue operation failed.
    #[error(transparent)]
    Ipc(#[from] IpcError),
    /// The all-reduce segment could not be opened.
    #[error(transparent)]
    AllReduce(#[from] ShmAllReduceError),
    /// The links to the peer ranks could not be set up.
    #[error(transparent)]
    Peers(#[from] PeerLinkError),
}

fn handshake_err(e: impl std::fmt::Display) -> WorkerProcessError {
    WorkerProcessError::Handshake(e.to_string())
}

/// Sets `PR_SET_PDEATHSIG(SIGKILL)` and the process name (`comm`, at most 15 bytes).
fn arm_process(name: &str) {
    // SAFETY: prctl(PR_SET_PDEATHSIG, sig) takes an integer signal number and no pointers.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        tracing::warn!(
            "PR_SET_PDEATHSIG failed: {}",
            std::io::Error::last_os_error()
        );
    }
    let mut buf = [0u8; 16];
    let n = name.len().min(15);
    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes from the pointer;
    // `buf` is 16 bytes, zero-filled after the name, and outlives the call.
    let rc = unsafe { libc::prctl(libc::PR_SET_NAME, buf.as_ptr() as libc::c_ulong, 0, 0, 0) };
    if rc != 0 {
        tracing::warn!("PR_SET_NAME failed: {}", std::io::Error::last_os_error());
    }
}

/// One JSON line of stdin (`what` names it in errors).
fn read_line_json<T: serde::de::DeserializeOwned>(what: &str) -> Result<T, WorkerProcessError> {
    omni_protocol::handshake::read_stdin_json(what).map_err(handshake_err)
}

/// Runs the worker process on this process's stdin and stdout with the model [`Worker`].
/// Returns when told to shut down; exits the process directly when the parent goes away.
pub fn run_worker_process() -> Result<(), WorkerProcessError> {
    serve(Worker::in_worker_process)
}

/// The worker process loop around any [`WorkerBase`]: the handshake (steps 1-5 of the module
/// docs), then every command from the broadcast queue goes to the worker `make` builds from
/// the handshake and the connected peer links. An `ExecuteModel`'s buffers are borrowed from the ring slot (zero-copy) for
/// the length of the step; the answer goes out with its [`ModelRunnerOutput::buffers`].
///
/// [`ModelRunnerOutput::buffers`]: omni_protocol::ModelRunnerOutput::buffers
pub fn serve<W: WorkerBase>(
    make: impl FnOnce(&WorkerHandshake, PeerLinks) -> W,
) -> Result<(), WorkerProcessError> {
    let hs: WorkerHandshake = read_line_json("the handshake")?;
    omni_protocol::check_protocol_version(hs.protocol_version).map_err(handshake_err)?;
    let rank = hs.rank as usize;
    arm_process(&format!("omni-worker-{rank}"));
    if std::os::unix::process::parent_id() != hs.parent_pid {
        return Err(WorkerProcessError::ParentGone(hs.parent_pid));
    }

    let mut commands = MessageQueueReader::attach(&hs.broadcast, hs.broadcast_reader)?;
    let channel = format!("resp{rank}");
    // The executor reads the answers: through shared memory on the engine core's node, over
    // TCP from any other.
    let remote_executor = hs.layout.node(rank) != 0;
    let mut response_spec = QueueSpec::local(&hs.instance, &channel, 1, hs.response_queue.clone());
    if remote_executor {
        response_spec.n_local_readers = 0;
        response_spec.n_remote_readers = 1;
        response_spec.remote_addr = hs.host_ip;
    }
    let mut responses = MessageQueue::create(response_spec)?;
    let writers = PeerWriters::create(&hs)?;
    let hello = WorkerHello {
        protocol_version: PROTOCOL_VERSION,
        rank: hs.rank,
        pid: std::process::id(),
        response: responses.handle(),
        peers: writers.handles(),
    };
    let mut out = std::io::stdout().lock();
    let text = serde_json::to_string(&hello).map_err(handshake_err)?;
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(handshake_err)?;
    drop(out);
    commands.wait_until_ready(hs.ready_timeout)?;
    responses.wait_until_ready(hs.ready_timeout)?;
    let peers: WorkerPeers = read_line_json("the peer queues")?;

    // EOF on stdin: the parent died or is shutting us down. Remove our segments (our
    // destructors will not run) and exit at once.
    let own_segments: Vec<String> = std::iter::once(channel)
        .chain(peer_channels(rank))
        .map(|c| omni_ipc::shm::segment_name(&hs.instance, &c))
        .collect();
    let watcher = std::thread::Builder::new()
        .name("stdin-watch".into())
        .spawn(move || {
            let mut sink = [0u8; 256];
            let mut input = std::io::stdin().lock();
            while matches!(input.read(&mut sink), Ok(n) if n > 0) {}
            for seg in &own_segments {
                let _ = std::fs::remove_file(format!("{}/{seg}", omni_ipc::shm::SHM_DIR));
            }
            std::process::exit(0);
        });
    if let Err(e) = watcher {
        tracing::warn!("no stdin watcher thread: {e}");
    }

    let links = writers.connect(&hs, &peers)?;

    let mut worker = make(&hs, links);
    tracing::debug!(rank, world = hs.world_size(), "worker ready");
    loop {
        let msg = match commands.dequeue_borrowed(Some(Duration::from_secs(1))) {
            Ok(m) => m,
            Err(IpcError::Timeout(_)) => continue,
            Err(IpcError::Cancelled | IpcError::Closed) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let cmd: WorkerCommand = msg.header()?;
        let answer = match &cmd {
            WorkerCommand::ExecuteModel(so) => {
                let buffers: Vec<&[u8]> = (0..msg.num_buffers()).map(|i| msg.buffer(i)).collect();
                Some(worker.execute_model(so, &buffers))
            }
            other => worker.handle(other),
        };
        drop(msg); // releases the slot: the step is done with its buffers
        let Some(answer) = answer else {
            return Ok(());
        };
        let buffers: Vec<&[u8]> = match &answer {
            WorkerResponse::ModelRunnerOutput(out) => {
                out.buffers.iter().map(Vec::as_slice).collect()
            }
            _ => Vec::new(),
        };
        responses.enqueue(&answer, &buffers)?;
    }
}
