//! [`EngineCoreProc`]: the engine core in a process of its own (`omni-engine-core`, vLLM's
//! `EngineCoreProc`), the other end of [`crate::MpClient`].
//!
//! 1. Read ONE JSON line from stdin: [`EngineCoreHandshake`] (the resolved engine config, the
//!    client's input queue, the output queue's config).
//! 2. `PR_SET_PDEATHSIG(SIGKILL)`, then check the parent is still the one that wrote the
//!    handshake; name the process `omni-engine-core` (`PR_SET_NAME` keeps 15 bytes:
//!    `omni-engine-cor`); ignore SIGINT (the client stops us in order on CTRL+C).
//! 3. A thread keeps reading stdin: EOF means the parent is gone: remove this process's
//!    segments (`omni.<pid>x*`: the output queue, the workers' queues) and exit at once.
//! 4. Attach to the input queue as local reader 0.
//! 5. The caller builds the engine core from the config (workers, model load, KV cache), then
//!    [`EngineCoreProc::run`]: create the output queue, answer ONE JSON line on stdout
//!    ([`EngineCoreStartup::Ready`] with its handle), and run the busy loop (the one
//!    [`crate::InprocClient`] runs on a thread) over the two queues until `Shutdown`. A failed
//!    start-up answers [`EngineCoreStartup::Failed`] instead ([`EngineCoreProc::fail`]).

use std::io::{Read, Write};
use std::time::Duration;

use omni_ipc::{
    IpcError, MessageQueue, MessageQueueConfig, MessageQueueReader, QueueSpec, ReaderId,
};
use omni_protocol::{
    Device, EngineCoreHandshake, EngineCoreInput, EngineCoreOutputs, EngineCoreReady,
    EngineCoreStartup, PROTOCOL_VERSION, TensorBuffers,
};

use crate::engine_core::EngineCore;
use crate::engine_loop::{CoreLoop, InputSource, OutputSink, Received};
use crate::executor::Executor;

/// The name the engine-core process gives itself (`comm` keeps its first 15 bytes).
pub const ENGINE_CORE_PROCESS_NAME: &str = "omni-engine-core";

/// Why an engine-core process stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum EngineCoreProcError {
    /// Reading the handshake or writing the answer failed.
    #[error("engine-core handshake: {0}")]
    Handshake(String),
    /// The parent died before the death signal was armed.
    #[error("parent process {0} is gone")]
    ParentGone(u32),
    /// A queue operation failed.
    #[error(transparent)]
    Ipc(#[from] IpcError),
}

fn handshake_err(e: impl std::fmt::Display) -> EngineCoreProcError {
    EngineCoreProcError::Handshake(e.to_string())
}

/// `PR_SET_PDEATHSIG(SIGKILL)`, the process name, and SIGINT ignored: a terminal's CTRL+C
/// reaches the whole process group, and the client, which gets it too, stops this process in
/// order (its workers inherit the disposition and are stopped by it in turn).
fn arm_process(process_name: &str) {
    use nix::sys::signal::{SigHandler, Signal};
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        tracing::warn!("PR_SET_PDEATHSIG failed: {e}");
    }
    // SAFETY: SIG_IGN installs no handler code, so nothing can run in signal context; no
    // other handler for SIGINT exists in this process to be replaced.
    if let Err(e) = unsafe { nix::sys::signal::signal(Signal::SIGINT, SigHandler::SigIgn) } {
        tracing::warn!("ignoring SIGINT failed: {e}");
    }
    let bytes = process_name.as_bytes();
    let mut name = bytes[..bytes.len().min(15)].to_vec();
    name.push(0);
    if let Ok(name) = std::ffi::CStr::from_bytes_with_nul(&name)
        && let Err(e) = nix::sys::prctl::set_name(name)
    {
        tracing::warn!("PR_SET_NAME failed: {e}");
    }
}

/// The engine-core side of the two queues; see the module docs.
#[derive(Debug)]
pub struct EngineCoreProc {
    inputs: MessageQueueReader,
    output_queue: MessageQueueConfig,
    ready_timeout: Duration,
}

impl EngineCoreProc {
    /// Steps 1-4 of the module docs, on this process's stdin; returns the config the client
    /// sent (`C` is the engine config type).
    pub fn accept<C: serde::de::DeserializeOwned>() -> Result<(Self, C), EngineCoreProcError> {
        Self::accept_named(|_: &C| ENGINE_CORE_PROCESS_NAME.to_string())
    }

    /// [`EngineCoreProc::accept`] for a process whose name depends on its config (an omni
    /// stage: `omni-stage-<id>`; at most 15 bytes are kept).
    pub fn accept_named<C: serde::de::DeserializeOwned>(
        name: impl FnOnce(&C) -> String,
    ) -> Result<(Self, C), EngineCoreProcError> {
        let hs: EngineCoreHandshake<C> =
            omni_protocol::handshake::read_stdin_json("the handshake").map_err(handshake_err)?;
        omni_protocol::check_protocol_version(hs.protocol_version).map_err(handshake_err)?;
        arm_process(&name(&hs.config));
        if std::os::unix::process::parent_id() != hs.parent_pid {
            return Err(EngineCoreProcError::ParentGone(hs.parent_pid));
        }
        let watcher = std::thread::Builder::new()
            .name("stdin-watch".into())
            .spawn(|| {
                let mut sink = [0u8; 256];
                let mut input = std::io::stdin().lock();
                while matches!(input.read(&mut sink), Ok(n) if n > 0) {}
                // Our destructors will not run, nor will our workers' (they get SIGKILL).
                omni_ipc::shm::remove_segments_of(std::process::id());
                std::process::exit(0);
            });
        if let Err(e) = watcher {
            tracing::warn!("no stdin watcher thread: {e}");
        }
        let mut inputs = MessageQueueReader::attach(&hs.input, ReaderId::Local(0))?;
        inputs.wait_until_ready(hs.ready_timeout)?;
        Ok((
            Self {
                inputs,
                output_queue: hs.output_queue,
                ready_timeout: hs.ready_timeout,
            },
            hs.config,
        ))
    }

    /// Reports a failed start-up to the client (which then fails its own start-up with
    /// `message`).
    pub fn fail(self, message: &str) -> Result<(), EngineCoreProcError> {
        answer(&EngineCoreStartup::Failed {
            message: message.to_string(),
        })
    }

    /// Step 5: serves `core` until the client says `Shutdown` (or goes away), then shuts the
    /// executor down. `model` and `device` are reported to the client with the KV cache size.
    pub fn run<E: Executor>(
        self,
        core: EngineCore<E>,
        model: &str,
        device: Device,
    ) -> Result<(), EngineCoreProcError> {
        let blocks = u32::try_from(core.scheduler().config().num_blocks).unwrap_or(u32::MAX);
        let (inputs, outputs) = self.open_queues(blocks, model, device)?;
        let mut core_loop = CoreLoop::new(core);
        core_loop.run(&mut QueueInputs(inputs), &mut QueueOutputs(outputs));
        core_loop.finish();
        Ok(())
    }

    /// For a process with a loop of its own (an omni stage): creates the output queue, answers
    /// [`EngineCoreStartup::Ready`] and waits for the client to attach; returns the input
    /// reader and the output queue.
    pub fn open_queues(
        self,
        num_gpu_blocks: u32,
        model: &str,
        device: Device,
    ) -> Result<(MessageQueueReader, MessageQueue), EngineCoreProcError> {
        let instance = omni_ipc::shm::new_instance_id();
        let mut outputs =
            MessageQueue::create(QueueSpec::local(&instance, "output", 1, self.output_queue))?;
        answer(&EngineCoreStartup::Ready(EngineCoreReady {
            protocol_version: PROTOCOL_VERSION,
            pid: std::process::id(),
            output: outputs.handle(),
            num_gpu_blocks,
            model: model.to_string(),
            device,
        }))?;
        outputs.wait_until_ready(self.ready_timeout)?;
        Ok((self.inputs, outputs))
    }
}

fn answer(startup: &EngineCoreStartup) -> Result<(), EngineCoreProcError> {
    let text = serde_json::to_string(startup).map_err(handshake_err)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(handshake_err)
}

/// The client's input queue as the loop's source.
struct QueueInputs(MessageQueueReader);

impl QueueInputs {
    fn recv(&mut self, timeout: Duration) -> Received {
        match self.0.dequeue(Some(timeout)) {
            Ok(msg) => match msg.header::<EngineCoreInput>() {
                Ok(EngineCoreInput::Add(mut req)) => {
                    // The tensors of its items: the message's out-of-band buffers.
                    req.mm_buffers = TensorBuffers::from(msg.into_buffers());
                    Received::Input(EngineCoreInput::Add(req))
                }
                Ok(input) => Received::Input(input),
                Err(e) => {
                    tracing::error!("undecodable input from the client: {e}");
                    Received::Closed
                }
            },
            Err(IpcError::Timeout(_)) => Received::Empty,
            Err(IpcError::Closed | IpcError::Cancelled) => Received::Closed,
            Err(e) => {
                tracing::error!("input queue: {e}");
                Received::Closed
            }
        }
    }
}

impl InputSource for QueueInputs {
    fn recv_timeout(&mut self, timeout: Duration) -> Received {
        self.recv(timeout)
    }

    fn try_recv(&mut self) -> Received {
        self.recv(Duration::ZERO)
    }
}

/// The output queue as the loop's sink.
struct QueueOutputs(MessageQueue);

impl OutputSink for QueueOutputs {
    fn send(&mut self, outputs: EngineCoreOutputs) -> Result<(), ()> {
        self.0.enqueue(&outputs, &[]).map_err(|e| {
            tracing::error!("output queue: {e}");
        })
    }
}
