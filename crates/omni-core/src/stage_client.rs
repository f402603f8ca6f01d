//! [`StageClient`]: one replica of an omni pipeline's stage in a process of its own
//! (`omni-stage-<id>[-<replica>]`), started and watched like the engine-core process.
//!
//! ```text
//!  pipeline ──StageInput + buffers──▶ MessageQueue "input" (1 reader) ──▶ omni-stage-<id>
//!  pipeline ◀── reader thread ◀── MessageQueue "output" (1 reader) ◀──StageOutputs + buffers── ┘
//!     └─ monitor thread: its death is EngineDeadError::Stage { stage_id, kind, replica, cause }
//! ```
//!
//! Start-up is the engine-core process's: the handshake carries the [`StageSpec`] (nothing goes
//! on the command line), the process answers `Ready` with its output queue once its model is
//! loaded. Inputs are written under a mutex by whichever thread routes them (the API thread,
//! the readers of the upstream stages); a full ring makes that writer wait for the stage, which
//! is the back-pressure between stages. When the process exits unasked, the death handler runs
//! once with the error naming it, and its segments are removed.

use std::io::BufReader;
use std::process::{ChildStdin, ChildStdout};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use omni_ipc::{IpcError, MessageQueue, MessageQueueReader};
use omni_protocol::{EngineCoreReady, EngineDeadError, StageInput, StageOutputs, StageSpec};

use crate::executor::workers::monitor::{ChildProcesses, ChildRole, DeathNotice};
use crate::mp_client::{
    Connection, EngineCoreStartError, MpClientConfig, spawn_and_connect, spawn_err,
    wait_for_cause_or,
};
use omni_ipc::shm::remove_segments_of;

/// How long the reader waits for a message before it looks at the death notice again.
const POLL: Duration = Duration::from_millis(50);

/// What a stage's reader thread hands on: each message with its out-of-band buffers.
pub type StageOutputHandler = Box<dyn FnMut(StageOutputs, Vec<Vec<u8>>) + Send>;
/// Called once when the stage dies unasked.
pub type StageDeathHandler = Box<dyn FnOnce(EngineDeadError) + Send>;

#[derive(Debug)]
struct StageState {
    processes: ChildProcesses,
    stdin: Option<ChildStdin>,
    _stdout: Option<BufReader<ChildStdout>>,
    reader: Option<JoinHandle<()>>,
    shut_down: bool,
}

#[derive(Debug)]
struct StageInner {
    stage_id: u32,
    replica: u32,
    kind: omni_protocol::StageKind,
    pid: u32,
    input: Mutex<Option<MessageQueue>>,
    dead: DeathNotice,
    /// Set by [`StageInner::shutdown`] (Release) before it stops the process; the reader
    /// (Acquire) then treats the end of its queue as asked for, not as a death.
    stopping: AtomicBool,
    shutdown_grace: Duration,
    state: Mutex<StageState>,
}

/// One stage replica's process; see the module docs. Cheap to clone; the process stops on
/// [`StageClient::shutdown`] or when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct StageClient {
    inner: Arc<StageInner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl StageClient {
    /// Spawns `cfg.exe cfg.args` with `spec` in its handshake and waits until it serves.
    /// `on_output` runs on the reader thread for every message, `on_death` once if the process
    /// dies unasked (or sends garbage).
    pub fn start(
        cfg: &MpClientConfig,
        spec: &StageSpec,
        on_output: StageOutputHandler,
        on_death: StageDeathHandler,
    ) -> Result<(Self, EngineCoreReady), EngineCoreStartError> {
        let role = ChildRole::Stage {
            stage_id: spec.stage_id,
            replica: spec.replica,
            kind: spec.kind,
        };
        let Connection {
            processes,
            pid,
            stdin,
            stdout,
            ready,
            input,
            output,
        } = spawn_and_connect(cfg, role, spec)?;
        let dead = processes.dead().clone();
        let inner = Arc::new(StageInner {
            stage_id: spec.stage_id,
            replica: spec.replica,
            kind: spec.kind,
            pid,
            input: Mutex::new(Some(input)),
            dead: dead.clone(),
            stopping: AtomicBool::new(false),
            shutdown_grace: cfg.shutdown_grace,
            state: Mutex::new(StageState {
                processes,
                stdin: Some(stdin),
                _stdout: Some(stdout),
                reader: None,
                shut_down: false,
            }),
        });
        let weak = Arc::downgrade(&inner);
        let reader = std::thread::Builder::new()
            .name(format!("omni-stage-{}-out", spec.stage_id))
            .spawn(move || read_outputs(output, &dead, pid, on_output, on_death, weak))
            .map_err(|e| spawn_err("starting a stage's output thread", &e))?;
        lock(&inner.state).reader = Some(reader);
        tracing::info!(
            stage = spec.stage_id,
            replica = spec.replica,
            kind = spec.kind.as_str(),
            pid,
            "stage ready"
        );
        Ok((Self { inner }, ready))
    }

    /// The stage.
    pub fn stage_id(&self) -> u32 {
        self.inner.stage_id
    }

    /// The replica.
    pub fn replica(&self) -> u32 {
        self.inner.replica
    }

    /// The process's pid.
    pub fn pid(&self) -> u32 {
        self.inner.pid
    }

    fn dead_error(&self, cause: String) -> EngineDeadError {
        self.inner.dead_error(cause)
    }

    /// `Ok` while the process lives.
    pub fn health(&self) -> Result<(), EngineDeadError> {
        match self.inner.dead.get() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Sends one input with its buffers (waits while the stage's ring is full).
    pub fn send(&self, input: &StageInput, buffers: &[&[u8]]) -> Result<(), EngineDeadError> {
        self.health()?;
        let mut q = lock(&self.inner.input);
        let Some(q) = q.as_mut() else {
            return Err(self.dead_error("its input queue is closed".into()));
        };
        // A dead reader fails the enqueue at once when the ring is full: never a hang. The
        // failure is the stage's death from now on, also before its monitor sees the exit:
        // a request that fails here must not find the pipeline healthy.
        q.enqueue(input, buffers).map_err(|e| {
            let err = self.dead_error(format!("input queue: {e}"));
            self.inner.dead.set(err.clone());
            err
        })
    }

    /// Asks the process to exit, waits up to the grace period, then SIGTERM, SIGKILL; removes
    /// its segments. Idempotent.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

impl StageInner {
    fn dead_error(&self, cause: String) -> EngineDeadError {
        EngineDeadError::Stage {
            stage_id: self.stage_id,
            kind: self.kind.as_str().to_string(),
            replica: self.replica,
            cause,
        }
    }

    fn shutdown(&self) {
        let mut st = lock(&self.state);
        if st.shut_down {
            return;
        }
        st.shut_down = true;
        self.stopping.store(true, Ordering::Release);
        st.processes.begin_stop();
        if let Some(q) = lock(&self.input).as_mut() {
            let _ = q.enqueue(&StageInput::Shutdown, &[]);
        }
        st.processes.stop_within(self.shutdown_grace);
        st.stdin = None;
        *lock(&self.input) = None;
        if let Some(t) = st.reader.take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
        let left = remove_segments_of(self.pid);
        if !left.is_empty() {
            tracing::info!(?left, "removed a stage's shared memory segments");
        }
    }
}

impl Drop for StageInner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The reader thread: every message through `on_output` until the process is gone or asked to
/// stop; an unasked end runs `on_death`.
fn read_outputs(
    mut output: MessageQueueReader,
    dead: &DeathNotice,
    pid: u32,
    mut on_output: StageOutputHandler,
    on_death: StageDeathHandler,
    owner: std::sync::Weak<StageInner>,
) {
    let stopping = || {
        owner
            .upgrade()
            .is_none_or(|o| o.stopping.load(Ordering::Acquire))
    };
    let stage_error = |cause: String| {
        owner.upgrade().map_or(
            EngineDeadError::EngineCore {
                cause: cause.clone(),
            },
            |o| o.dead_error(cause),
        )
    };
    let died = loop {
        if let Some(e) = dead.get() {
            break Some(e);
        }
        match output.dequeue(Some(POLL)) {
            Ok(msg) => match msg.header::<StageOutputs>() {
                Ok(outputs) => {
                    let buffers = msg.buffers().iter().map(|b| b.to_vec()).collect();
                    on_output(outputs, buffers);
                }
                Err(e) => {
                    let cause = format!("stage process {pid} sent an undecodable output: {e}");
                    dead.set(stage_error(cause));
                    break dead.get();
                }
            },
            Err(IpcError::Timeout(_)) => {}
            Err(_) if stopping() => break None,
            Err(e) => {
                // The monitor names the exit status within ~100 ms; else say what broke.
                break Some(wait_for_cause_or(dead, || {
                    stage_error(format!("stage process {pid}: output queue: {e}"))
                }));
            }
        }
    };
    if let Some(e) = died
        && !stopping()
    {
        on_death(e);
        let removed = remove_segments_of(pid);
        if !removed.is_empty() {
            tracing::info!(?removed, "removed a dead stage's shared memory segments");
        }
    }
}
