//! Child processes and their death monitor: the workers of a group, or an engine-core process.
//!
//! A monitor thread `try_wait()`s every child each 50 ms. A child that exits while the owner is
//! not stopping is recorded as an [`EngineDeadError`] naming it (`Worker { rank, cause }` or
//! `EngineCore { cause }`; the first death wins); every pending and later call of the owner sees
//! it within ~100 ms. Stopping: SIGTERM, then SIGKILL, for children that do not exit on their
//! own.

use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::executor::EngineDeadError;

/// How often the monitor polls the children.
const POLL: Duration = Duration::from_millis(50);

/// The error of a rank.
pub(crate) fn dead_rank(rank: usize, cause: impl Into<String>) -> EngineDeadError {
    EngineDeadError::Worker {
        rank: rank as u32,
        cause: cause.into(),
    }
}

/// What the children are, which decides how their deaths are named.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum ChildRole {
    /// Tensor-parallel workers, one per rank (the index is the rank).
    #[default]
    Worker,
    /// One engine-core process.
    EngineCore,
    /// A replica of an omni pipeline's stage.
    Stage {
        stage_id: u32,
        replica: u32,
        kind: omni_protocol::StageKind,
    },
}

impl ChildRole {
    /// The error for child `index` with `cause`.
    pub(crate) fn dead(self, index: usize, cause: impl Into<String>) -> EngineDeadError {
        match self {
            ChildRole::Worker => dead_rank(index, cause),
            ChildRole::EngineCore => EngineDeadError::EngineCore {
                cause: cause.into(),
            },
            ChildRole::Stage {
                stage_id,
                replica,
                kind,
            } => EngineDeadError::Stage {
                stage_id,
                kind: kind.as_str().to_string(),
                replica,
                cause: cause.into(),
            },
        }
    }

    /// Why a child process ended, in words.
    fn describe(self, pid: u32, status: ExitStatus) -> String {
        use std::os::unix::process::ExitStatusExt;
        let what = match self {
            ChildRole::Worker => "worker process".to_string(),
            ChildRole::EngineCore => format!("engine-core process {pid} (omni-engine-core)"),
            ChildRole::Stage {
                stage_id, replica, ..
            } => {
                let name = if replica == 0 {
                    format!("omni-stage-{stage_id}")
                } else {
                    format!("omni-stage-{stage_id}-{replica}")
                };
                format!("stage process {pid} ({name})")
            }
        };
        match (status.code(), status.signal()) {
            (_, Some(sig)) => format!("{what} killed by signal {sig}"),
            (Some(code), _) => format!("{what} exited with status {code}"),
            _ => format!("{what} ended: {status}"),
        }
    }

    fn monitor_thread_name(self) -> &'static str {
        match self {
            ChildRole::Worker => "omni-worker-monitor",
            ChildRole::EngineCore => "omni-core-monitor",
            ChildRole::Stage { .. } => "omni-stage-monitor",
        }
    }
}

/// The first fatal error of a group, shared with the monitor thread.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeathNotice(Arc<Mutex<Option<EngineDeadError>>>);

impl DeathNotice {
    /// The recorded error, if any.
    pub(crate) fn get(&self) -> Option<EngineDeadError> {
        self.0
            .lock()
            .map(|d| d.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Records `e` unless an error is already recorded (the first cause is the one reported).
    pub(crate) fn set(&self, e: EngineDeadError) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            tracing::error!("{e}");
            *g = Some(e);
        }
    }
}

/// The children by rank (`None` once reaped), the monitor thread, and the death notice.
#[derive(Debug, Default)]
pub(crate) struct ChildProcesses {
    role: ChildRole,
    children: Arc<Mutex<Vec<Option<Child>>>>,
    dead: DeathNotice,
    stopping: Arc<AtomicBool>,
    monitor: Option<JoinHandle<()>>,
}

impl ChildProcesses {
    /// No children yet; their deaths will be named as `role`'s.
    pub(crate) fn new(role: ChildRole) -> Self {
        Self {
            role,
            ..Self::default()
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Option<Child>>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds the next rank's process.
    pub(crate) fn push(&self, child: Child) {
        self.lock().push(Some(child));
    }

    /// The death notice (shared with the monitor).
    pub(crate) fn dead(&self) -> &DeathNotice {
        &self.dead
    }

    /// Starts the monitor thread; without one, the group is dead at once.
    pub(crate) fn start_monitor(&mut self) {
        let children = self.children.clone();
        let dead = self.dead.clone();
        let stopping = self.stopping.clone();
        let role = self.role;
        let spawned = std::thread::Builder::new()
            .name(role.monitor_thread_name().into())
            .spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    {
                        let mut guard = children.lock().unwrap_or_else(|p| p.into_inner());
                        for (rank, slot) in guard.iter_mut().enumerate() {
                            let Some(child) = slot else { continue };
                            if let Ok(Some(status)) = child.try_wait() {
                                if !stopping.load(Ordering::Acquire) {
                                    let cause = role.describe(child.id(), status);
                                    dead.set(role.dead(rank, cause));
                                }
                                *slot = None;
                            }
                        }
                    }
                    std::thread::sleep(POLL);
                }
            });
        match spawned {
            Ok(t) => self.monitor = Some(t),
            Err(e) => self
                .dead
                .set(self.role.dead(0, format!("no monitor thread: {e}"))),
        }
    }

    /// The monitor's cause of death, if it comes within 200 ms; else `rank` with `fallback`.
    pub(crate) fn wait_for_cause(&self, rank: usize, fallback: &str) -> EngineDeadError {
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until {
            if let Some(e) = self.dead.get() {
                return e;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.role.dead(rank, fallback)
    }

    /// From now on an exit is expected: the monitor records no more deaths.
    pub(crate) fn begin_stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Waits up to 2 s for every child to exit, then SIGTERM, 2 s, SIGKILL; joins the monitor.
    pub(crate) fn stop(&mut self) {
        self.stop_within(Duration::from_secs(2));
    }

    /// [`Self::stop`] with `grace` for the children to exit on their own before SIGTERM.
    pub(crate) fn stop_within(&mut self, grace: Duration) {
        self.begin_stop();
        for (sig, wait) in [
            (None, grace),
            (Some(Signal::SIGTERM), Duration::from_secs(2)),
            (Some(Signal::SIGKILL), Duration::from_secs(2)),
        ] {
            if let Some(sig) = sig {
                self.signal_all(sig);
            }
            if self.wait_all(wait) {
                break;
            }
        }
        if let Some(t) = self.monitor.take() {
            let _ = t.join();
        }
    }

    /// Reaps exited children; whether all are gone, within `timeout`.
    fn wait_all(&self, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        loop {
            let all_gone = {
                let mut guard = self.lock();
                for slot in guard.iter_mut() {
                    if let Some(c) = slot
                        && let Ok(Some(_)) = c.try_wait()
                    {
                        *slot = None;
                    }
                }
                guard.iter().all(Option::is_none)
            };
            if all_gone || Instant::now() >= until {
                return all_gone;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal_all(&self, sig: Signal) {
        for c in self.lock().iter().flatten() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), sig);
        }
    }
}
