//! The worker processes and their death monitor.
//!
//! A monitor thread `try_wait()`s every child each 50 ms. A child that exits while the group is
//! not stopping is recorded as `EngineDead { rank, cause }` (the first death wins); every pending
//! and later call of the group sees it within ~100 ms. Stopping: SIGTERM, then SIGKILL, for
//! children that do not exit on their own.

use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::executor::EngineError;

/// How often the monitor polls the children.
const POLL: Duration = Duration::from_millis(50);

/// The error of a rank.
pub(crate) fn dead_rank(rank: usize, cause: impl Into<String>) -> EngineError {
    EngineError::EngineDead {
        rank: rank as u32,
        cause: cause.into(),
    }
}

/// Why a worker process ended, in words.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (_, Some(sig)) => format!("worker process killed by signal {sig}"),
        (Some(code), _) => format!("worker process exited with status {code}"),
        _ => format!("worker process ended: {status}"),
    }
}

/// The first fatal error of a group, shared with the monitor thread.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeathNotice(Arc<Mutex<Option<EngineError>>>);

impl DeathNotice {
    /// The recorded error, if any.
    pub(crate) fn get(&self) -> Option<EngineError> {
        self.0
            .lock()
            .map(|d| d.clone())
            .unwrap_or_else(|p| p.into_inner().clone())
    }

    /// Records `e` unless an error is already recorded (the first cause is the one reported).
    pub(crate) fn set(&self, e: EngineError) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            tracing::error!("{e}");
            *g = Some(e);
        }
    }
}

/// The children by rank (`None` once reaped), the monitor thread, and the death notice.
#[derive(Debug, Default)]
pub(crate) struct WorkerProcesses {
    children: Arc<Mutex<Vec<Option<Child>>>>,
    dead: DeathNotice,
    stopping: Arc<AtomicBool>,
    monitor: Option<JoinHandle<()>>,
}

impl WorkerProcesses {
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
        let spawned = std::thread::Builder::new()
            .name("omni-worker-monitor".into())
            .spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    {
                        let mut guard = children.lock().unwrap_or_else(|p| p.into_inner());
                        for (rank, slot) in guard.iter_mut().enumerate() {
                            let Some(child) = slot else { continue };
                            if let Ok(Some(status)) = child.try_wait() {
                                if !stopping.load(Ordering::Acquire) {
                                    dead.set(dead_rank(rank, describe(status)));
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
                .set(dead_rank(0, format!("no monitor thread: {e}"))),
        }
    }

    /// The monitor's cause of death, if it comes within 200 ms; else `rank` with `fallback`.
    pub(crate) fn wait_for_cause(&self, rank: usize, fallback: &str) -> EngineError {
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until {
            if let Some(e) = self.dead.get() {
                return e;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        dead_rank(rank, fallback)
    }

    /// From now on an exit is expected: the monitor records no more deaths.
    pub(crate) fn begin_stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Waits up to 2 s for every child to exit, then SIGTERM, 2 s, SIGKILL; joins the monitor.
    pub(crate) fn stop(&mut self) {
        self.begin_stop();
        for sig in [None, Some(Signal::SIGTERM), Some(Signal::SIGKILL)] {
            if let Some(sig) = sig {
                self.signal_all(sig);
            }
            if self.wait_all(Duration::from_secs(2)) {
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
