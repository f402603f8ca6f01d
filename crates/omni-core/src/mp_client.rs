//! [`MpClient`]: the engine core in a process of its own (vLLM's `MPClient`), behind
//! [`EngineCoreClient`].
//!
//! ```text
//!          input MessageQueue "input" (1 reader)                 output MessageQueue "output"
//! client ───EngineCoreInput───▶ omni-engine-core ───EngineCoreOutputs───▶ client
//!    │     (writer thread)        │ its own workers (its executor)       (reader thread → Frontend)
//!    │  stdin / stdout: the handshake, then stdin held open: EOF = "parent died"
//!    └─ monitor thread: its death is EngineDeadError::EngineCore { cause }
//! ```
//!
//! Start-up: create the input queue, spawn `<exe> engine-core`, write the
//! [`EngineCoreHandshake`] (the resolved config inside) to its stdin, wait until it attached,
//! then read its [`EngineCoreStartup`] line (after its workers are up and the model is loaded)
//! and attach to its output queue. A writer thread moves inputs from the frontend's channel
//! into the input queue (so `add_request` never blocks on IPC); a reader thread routes every
//! [`omni_protocol::EngineCoreOutputs`] through the frontend.
//!
//! Death (like a worker's): when the process exits unasked, every live request fails at once
//! with [`EngineDeadError::EngineCore`] naming it (its pid and exit status), as does every new
//! one and [`EngineCoreClient::health`]; its workers die with it (`PR_SET_PDEATHSIG`), and every
//! segment it or they left (`/dev/shm/omni.<pid>x*`) is removed, as is this side's input queue.
//!
//! Shutdown: the `Shutdown` input, then up to [`MpClientConfig::shutdown_grace`] for the
//! process to stop its workers and exit, then SIGTERM, SIGKILL.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{ChildStdin, ChildStdout};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use omni_ipc::{
    IpcError, MessageQueue, MessageQueueConfig, MessageQueueReader, QueueSpec, ReaderId,
};
use omni_protocol::{
    EngineCoreHandshake, EngineCoreInput, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest,
    EngineCoreStartup, EngineDeadError, PROTOCOL_VERSION, RequestId, SchedulerStats,
};

use crate::engine_core_client::{EngineCoreClient, Frontend, RequestError, RequestStream};
use crate::executor::MultiprocConfig;
use crate::executor::workers::launch;
use crate::executor::workers::monitor::{ChildProcesses, ChildRole, DeathNotice};
use omni_ipc::shm::remove_segments_of;

/// One slice of a start-up wait, between checks for a dead engine core.
pub(crate) const READY_SLICE: Duration = Duration::from_millis(200);
/// How long the reader waits for a message before it looks at the death notice again.
const POLL: Duration = Duration::from_millis(50);

/// How to start the engine-core process.
#[derive(Debug, Clone)]
pub struct MpClientConfig {
    /// The binary to run (usually `std::env::current_exe()`).
    pub exe: PathBuf,
    /// Its arguments (e.g. `["engine-core"]`); nothing else goes on the command line.
    pub args: Vec<String>,
    /// Sizes and timings of the input queue (this side creates it).
    pub input_queue: MessageQueueConfig,
    /// Sizes and timings of the output queue (sent to the engine core, which creates it).
    pub output_queue: MessageQueueConfig,
    /// Longest wait for a queue's peer to attach.
    pub ready_timeout: Duration,
    /// How long a shutdown waits for the process to stop its workers and exit before SIGTERM.
    pub shutdown_grace: Duration,
}

impl MpClientConfig {
    /// Defaults for everything but the binary: both queues small (4 slots of 2 MiB, as the
    /// workers' response queues: a message is one step's outputs or one request).
    pub fn new(exe: PathBuf) -> Self {
        Self {
            exe,
            args: vec!["engine-core".into()],
            input_queue: MultiprocConfig::default_response_queue(),
            output_queue: MultiprocConfig::default_response_queue(),
            ready_timeout: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// Why the engine-core process did not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineCoreStartError {
    /// Spawning it, its queues or its handshake failed.
    #[error("starting the engine-core process: {0}")]
    Spawn(String),
    /// It reported a start-up error of its own (its workers, the model, the KV cache).
    #[error("{0}")]
    Failed(String),
    /// It died during start-up.
    #[error(transparent)]
    Died(EngineDeadError),
}

pub(crate) fn spawn_err(what: &str, e: &dyn std::fmt::Display) -> EngineCoreStartError {
    EngineCoreStartError::Spawn(format!("{what}: {e}"))
}

/// The monitor's cause of death, if it comes within 200 ms; else `fallback`.
pub(crate) fn wait_for_cause(dead: &DeathNotice, fallback: String) -> EngineDeadError {
    wait_for_cause_or(dead, || EngineDeadError::EngineCore { cause: fallback })
}

/// The monitor's cause of death, if it comes within 200 ms; else `fallback()`.
pub(crate) fn wait_for_cause_or(
    dead: &DeathNotice,
    fallback: impl FnOnce() -> EngineDeadError,
) -> EngineDeadError {
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        if let Some(e) = dead.get() {
            return e;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    fallback()
}

#[derive(Debug)]
struct MpState {
    processes: ChildProcesses,
    stdin: Option<ChildStdin>,
    _stdout: Option<BufReader<ChildStdout>>,
    threads: Vec<JoinHandle<()>>,
    shut_down: bool,
}

#[derive(Debug)]
struct MpInner {
    frontend: Arc<Frontend>,
    pid: u32,
    shutdown_grace: Duration,
    state: Mutex<MpState>,
}

impl MpInner {
    fn shutdown(&self) {
        // Held throughout, so a second caller waits for the first.
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.shut_down {
            return;
        }
        st.shut_down = true;
        // Exiting is expected from now on: the monitor records no death.
        st.processes.begin_stop();
        self.frontend.begin_shutdown();
        st.processes.stop_within(self.shutdown_grace);
        st.stdin = None;
        for t in st.threads.drain(..) {
            let _ = t.join();
        }
        let left = remove_segments_of(self.pid);
        if !left.is_empty() {
            tracing::info!(?left, "removed the engine core's shared memory segments");
        }
    }
}

impl Drop for MpInner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The engine core in a process of its own; see the module docs. Cheap to clone; when the last
/// clone is dropped (or on [`EngineCoreClient::shutdown`]) the process is stopped.
///
/// Start it on a thread that lives as long as the engine (the main thread): the process gets
/// `PR_SET_PDEATHSIG` and dies with the thread that spawned it.
#[derive(Debug, Clone)]
pub struct MpClient {
    inner: Arc<MpInner>,
}

impl MpClient {
    /// Spawns the engine-core process with `engine_config` in its handshake and waits until it
    /// is serving (workers up, model loaded, KV cache allocated); returns what it reported.
    pub fn start<C: serde::Serialize>(
        cfg: &MpClientConfig,
        engine_config: &C,
    ) -> Result<(Self, EngineCoreReady), EngineCoreStartError> {
        let Connection {
            processes,
            pid,
            stdin,
            stdout,
            ready,
            input,
            output,
        } = spawn_and_connect(cfg, ChildRole::EngineCore, engine_config)?;
        let (tx, rx) = mpsc::channel();
        let frontend = Arc::new(Frontend::new(tx));
        let threads = start_threads(&frontend, input, rx, output, &processes, pid);
        let client = Self {
            inner: Arc::new(MpInner {
                frontend,
                pid,
                shutdown_grace: cfg.shutdown_grace,
                state: Mutex::new(MpState {
                    processes,
                    stdin: Some(stdin),
                    _stdout: Some(stdout),
                    threads: Vec::new(),
                    shut_down: false,
                }),
            }),
        };
        match threads {
            Ok(t) => {
                if let Ok(mut st) = client.inner.state.lock() {
                    st.threads = t;
                }
                tracing::info!(pid, "engine core ready in its own process");
                Ok((client, ready))
            }
            Err(e) => Err(e), // dropping `client` stops the process
        }
    }

    /// The engine-core process's pid.
    pub fn pid(&self) -> u32 {
        self.inner.pid
    }
}

pub(crate) type Connected = (EngineCoreReady, MessageQueue, MessageQueueReader);

/// A started child (an engine core or an omni stage) that answered `Ready`: its process under
/// a death monitor, its pipes, its report and both queues.
#[derive(Debug)]
pub(crate) struct Connection {
    pub(crate) processes: ChildProcesses,
    pub(crate) pid: u32,
    pub(crate) stdin: ChildStdin,
    pub(crate) stdout: BufReader<ChildStdout>,
    pub(crate) ready: EngineCoreReady,
    pub(crate) input: MessageQueue,
    pub(crate) output: MessageQueueReader,
}

/// Creates the input queue, spawns `cfg.exe cfg.args` watched as `role`, and runs the
/// handshake with `config`; on failure the process is stopped and its segments removed.
pub(crate) fn spawn_and_connect<C: serde::Serialize>(
    cfg: &MpClientConfig,
    role: ChildRole,
    config: &C,
) -> Result<Connection, EngineCoreStartError> {
    let instance = omni_ipc::shm::new_instance_id();
    let input = MessageQueue::create(QueueSpec::local(
        &instance,
        "input",
        1,
        cfg.input_queue.clone(),
    ))
    .map_err(|e| spawn_err("creating the input queue", &e))?;
    let spawned = launch::spawn(&cfg.exe, &cfg.args)
        .map_err(|e| spawn_err(&format!("spawning {}", cfg.exe.display()), &e))?;
    let pid = spawned.child.id();
    let mut processes = ChildProcesses::new(role);
    processes.push(spawned.child);
    processes.start_monitor();
    let mut stdin = spawned.stdin;
    let mut stdout = spawned.stdout;
    match connect(cfg, config, input, &processes, &mut stdin, &mut stdout) {
        Ok((ready, input, output)) => Ok(Connection {
            processes,
            pid,
            stdin,
            stdout,
            ready,
            input,
            output,
        }),
        Err(e) => {
            processes.stop();
            drop(stdin);
            remove_segments_of(pid);
            Err(e)
        }
    }
}

/// The handshake, the attach waits and the start-up line; see the module docs.
pub(crate) fn connect<C: serde::Serialize>(
    cfg: &MpClientConfig,
    engine_config: &C,
    mut input: MessageQueue,
    processes: &ChildProcesses,
    stdin: &mut ChildStdin,
    stdout: &mut BufReader<ChildStdout>,
) -> Result<Connected, EngineCoreStartError> {
    let hs = EngineCoreHandshake {
        protocol_version: PROTOCOL_VERSION,
        parent_pid: std::process::id(),
        input: input.handle(),
        output_queue: cfg.output_queue.clone(),
        ready_timeout: cfg.ready_timeout,
        config: engine_config,
    };
    launch::send_line(stdin, &hs, "the engine core").map_err(|e| spawn_err("handshake", &e))?;
    let deadline = Instant::now() + cfg.ready_timeout;
    until_ready(processes, deadline, "the engine core to attach", || {
        input.wait_until_ready(READY_SLICE)
    })?;
    let mut line = String::new();
    let n = stdout
        .read_line(&mut line)
        .map_err(|e| spawn_err("reading the engine core's start-up line", &e))?;
    if n == 0 {
        let e = wait_for_cause(
            processes.dead(),
            "the engine-core process closed its stdout during start-up".into(),
        );
        return Err(EngineCoreStartError::Died(e));
    }
    let ready = match serde_json::from_str::<EngineCoreStartup>(&line)
        .map_err(|e| spawn_err(&format!("the engine core's start-up line {line:?}"), &e))?
    {
        EngineCoreStartup::Ready(r) => r,
        EngineCoreStartup::Failed { message } => return Err(EngineCoreStartError::Failed(message)),
    };
    omni_protocol::check_protocol_version(ready.protocol_version)
        .map_err(|e| spawn_err("the engine core", &e))?;
    let mut output = MessageQueueReader::attach(&ready.output, ReaderId::Local(0))
        .map_err(|e| spawn_err("attaching to the engine core's output queue", &e))?;
    let deadline = Instant::now() + cfg.ready_timeout;
    until_ready(
        processes,
        deadline,
        "the engine core's output queue",
        || output.wait_until_ready(READY_SLICE),
    )?;
    Ok((ready, input, output))
}

/// Repeats a short `wait_until_ready` until it succeeds, the process dies, or `deadline`.
fn until_ready(
    processes: &ChildProcesses,
    deadline: Instant,
    what: &str,
    mut wait: impl FnMut() -> Result<(), IpcError>,
) -> Result<(), EngineCoreStartError> {
    loop {
        if let Some(e) = processes.dead().get() {
            return Err(EngineCoreStartError::Died(e));
        }
        match wait() {
            Ok(()) => return Ok(()),
            Err(IpcError::Timeout(_) | IpcError::ReadyTimeout { .. })
                if Instant::now() < deadline => {}
            Err(e) => return Err(spawn_err(&format!("waiting for {what}"), &e)),
        }
    }
}

fn start_threads(
    frontend: &Arc<Frontend>,
    input: MessageQueue,
    rx: mpsc::Receiver<EngineCoreInput>,
    output: MessageQueueReader,
    processes: &ChildProcesses,
    pid: u32,
) -> Result<Vec<JoinHandle<()>>, EngineCoreStartError> {
    let f = frontend.clone();
    let writer = std::thread::Builder::new()
        .name("omni-core-input".into())
        .spawn(move || write_inputs(&f, input, &rx))
        .map_err(|e| spawn_err("starting the input thread", &e))?;
    let f = frontend.clone();
    let dead = processes.dead().clone();
    let reader = std::thread::Builder::new()
        .name("omni-core-output".into())
        .spawn(move || read_outputs(&f, output, &dead, pid))
        .map_err(|e| spawn_err("starting the output thread", &e))?;
    Ok(vec![writer, reader])
}

/// The writer thread: inputs from the frontend's channel into the queue, until `Shutdown`, a
/// failed enqueue, or the engine's death. Dropping the queue removes its segment.
fn write_inputs(
    frontend: &Frontend,
    mut input: MessageQueue,
    rx: &mpsc::Receiver<EngineCoreInput>,
) {
    while let Ok(msg) = rx.recv() {
        let last = matches!(msg, EngineCoreInput::Shutdown);
        // A dead reader fails the enqueue at once when the ring is full (else the message
        // lands in a ring nobody reads): never a hang on a dead engine core.
        // A request's multimodal tensors go as the message's out-of-band buffers, copied once
        // into the ring slot (or sent from these slices on the overflow path).
        let buffers = match &msg {
            EngineCoreInput::Add(req) => req.mm_buffers.as_slices(),
            _ => Vec::new(),
        };
        if let Err(e) = input.enqueue(&msg, &buffers) {
            if !last && frontend.health().is_ok() {
                tracing::warn!("engine core input queue: {e}");
            }
            break;
        }
        if last {
            break;
        }
    }
}

/// The reader thread: every message of the engine core through the frontend, until it is gone.
fn read_outputs(frontend: &Frontend, mut output: MessageQueueReader, dead: &DeathNotice, pid: u32) {
    let died = loop {
        if let Some(e) = dead.get() {
            break Some(e);
        }
        match output.dequeue(Some(POLL)) {
            Ok(msg) => match msg.header::<EngineCoreOutputs>() {
                Ok(outputs) => frontend.dispatch(outputs),
                Err(e) => {
                    break Some(EngineDeadError::EngineCore {
                        cause: format!("engine-core process {pid} sent an undecodable output: {e}"),
                    });
                }
            },
            Err(IpcError::Timeout(_)) => {}
            Err(_) if frontend.is_stopped() => break None,
            Err(e) => {
                let fallback = format!("engine-core process {pid}: output queue: {e}");
                break Some(wait_for_cause(dead, fallback));
            }
        }
    };
    match died {
        None => frontend.close(),
        Some(e) => {
            frontend.die(e);
            // Its workers die with it (PR_SET_PDEATHSIG); nobody else unlinks what they made.
            let removed = remove_segments_of(pid);
            if !removed.is_empty() {
                tracing::info!(
                    ?removed,
                    "removed the dead engine core's shared memory segments"
                );
            }
            frontend.send(EngineCoreInput::Shutdown); // lets the writer thread drop its queue
        }
    }
}

impl EngineCoreClient for MpClient {
    fn add_request(&self, req: EngineCoreRequest) -> Result<RequestStream, RequestError> {
        self.inner.frontend.add_request(req)
    }

    fn abort(&self, request_ids: Vec<RequestId>) {
        self.inner.frontend.abort(request_ids);
    }

    fn stats(&self) -> SchedulerStats {
        self.inner.frontend.stats()
    }

    fn health(&self) -> Result<(), EngineDeadError> {
        self.inner.frontend.health()
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}
