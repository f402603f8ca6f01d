//! A fork-join pool for the short parallel loops of CPU decode: the caller and `threads - 1`
//! helpers claim task indices of one job; helpers spin for a while after a job before they
//! sleep, so the next product of the same step (tens of µs later) finds them awake. rayon's
//! pool puts its threads to sleep at once and wakes them through the kernel: 12-40 µs per
//! product on the 2-vCPU CI machine, ~120 products per decode step of the built-in model.
//!
//! # Protocol
//!
//! One `AtomicU64` word holds the job: `epoch` (high 24 bits), `tasks` (20 bits) and the next
//! unclaimed index (low 20 bits). [`SpinPool::run`] writes the job's function into `job`,
//! resets `done`, then stores the word `(epoch + 1, tasks, 0)` with `SeqCst` (a release: the
//! job and `done` writes happen-before any thread that reads this store or a later value of
//! its release sequence). Every claim is a `compare_exchange` (an RMW, `AcqRel`) from `(e, n,
//! i)` to `(e, n, i + 1)`: RMWs continue the release sequence, so a successful claim acquires
//! the job of epoch `e`, and it succeeds only while the word still says `e`. A claim with `i <
//! n` owns task `i`; the claimant reads `job`, runs the task and then adds 1 to `done`
//! (`Release`). `run` claims tasks too, then waits until `done == n` (`Acquire`): every task's
//! writes, and every read of `job` (each before its claimant's `done` increment), happen-before
//! `run` returns. The next `run` overwrites `job` only after that, so no thread reads a job
//! that is being replaced, and a helper that wakes late fails its claim (a new epoch or `i >=
//! n`) without touching `job`.
//!
//! Sleep: a helper that has spun [`SPIN`] without a new epoch increments `sleeping` (`SeqCst`)
//! and re-reads the word under the mutex before it waits; `run` reads `sleeping` (`SeqCst`)
//! after its `SeqCst` store of the word and notifies under the mutex when it is non-zero. Of
//! the two `SeqCst` pairs one thread sees the other's write (there is a single total order),
//! so either the helper sees the new epoch or `run` sees the sleeper and wakes it: no lost
//! wake-up. `run` never waits for helpers to wake: with none awake it runs every task itself.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle helper spins before it sleeps.
const SPIN: Duration = Duration::from_micros(300);
/// Largest task count of one job (the word's 20-bit fields).
pub const MAX_TASKS: usize = (1 << 20) - 1;

const IDX_BITS: u32 = 20;
const IDX_MASK: u64 = (1 << IDX_BITS) - 1;

fn pack(epoch: u64, tasks: usize, next: usize) -> u64 {
    ((epoch & 0xff_ffff) << (2 * IDX_BITS)) | ((tasks as u64) << IDX_BITS) | next as u64
}

fn unpack(w: u64) -> (u64, usize, usize) {
    (
        w >> (2 * IDX_BITS),
        ((w >> IDX_BITS) & IDX_MASK) as usize,
        (w & IDX_MASK) as usize,
    )
}

/// The job's function with its lifetime erased (`run` keeps it alive while any task runs).
type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    word: AtomicU64,
    done: AtomicUsize,
    job: std::cell::UnsafeCell<Option<Job>>,
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by `run` while no task of the previous job can read it, and
// read only by a thread holding a successful claim of the current one (the module's protocol);
// the function it points at is `Sync`. Every other field is a synchronization primitive.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under the protocol.
unsafe impl Send for Shared {}

impl Shared {
    /// Claims and runs tasks of epoch `epoch` until none is left (or the epoch changed).
    /// Returns how many it ran.
    fn work(&self, epoch: u64) -> usize {
        let mut ran = 0;
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let (e, n, i) = unpack(w);
            if e != epoch || i >= n {
                return ran;
            }
            match self.word.compare_exchange_weak(
                w,
                pack(e, n, i + 1),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // SAFETY: the successful claim of task i < n of epoch e acquired `run`'s
                    // write of this epoch's job, and `run` does not return (nor rewrite `job`)
                    // before this task's `done` increment below.
                    if let Some(job) = unsafe { *self.job.get() } {
                        // SAFETY: the function outlives the job (`run` borrows it until `done
                        // == n`), so the pointer is valid here.
                        unsafe { (*job)(i) };
                    }
                    self.done.fetch_add(1, Ordering::Release);
                    ran += 1;
                    w = self.word.load(Ordering::Acquire);
                }
                Err(now) => w = now,
            }
        }
    }
}

/// The pool: `threads - 1` helper threads and the caller of [`SpinPool::run`].
pub struct SpinPool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// One job at a time (jobs from several threads take turns).
    serial: Mutex<()>,
}

impl std::fmt::Debug for SpinPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinPool")
            .field("threads", &(self.helpers.len() + 1))
            .finish()
    }
}

impl SpinPool {
    /// A pool of `threads` (the caller counts: `threads - 1` helpers; at least 1).
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            word: AtomicU64::new(pack(0, 0, 0)),
            done: AtomicUsize::new(0),
            job: std::cell::UnsafeCell::new(None),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let helpers = (1..threads.max(1))
            .filter_map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("omni-spin-{i}"))
                    .spawn(move || helper(&s))
                    .ok()
            })
            .collect();
        Self {
            shared,
            helpers,
            serial: Mutex::new(()),
        }
    }

    /// The process's pool, as many threads as rayon's global pool.
    pub fn global() -> &'static SpinPool {
        static POOL: OnceLock<SpinPool> = OnceLock::new();
        POOL.get_or_init(|| SpinPool::new(rayon::current_num_threads()))
    }

    /// Threads that run tasks (the caller and the helpers).
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Runs `f(0) .. f(tasks - 1)` over the pool (each index once, in any order and thread)
    /// and returns when all have run. More than [`MAX_TASKS`] tasks run in rounds.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if self.helpers.is_empty() || tasks == 1 {
            (0..tasks).for_each(f);
            return;
        }
        let _turn = self.serial.lock().unwrap_or_else(|p| p.into_inner());
        let mut base = 0;
        while base < tasks {
            let n = (tasks - base).min(MAX_TASKS);
            let off = base;
            let g = move |i: usize| f(off + i);
            self.run_round(n, &g);
            base += n;
        }
    }

    fn run_round(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        let (epoch, _, _) = unpack(s.word.load(Ordering::Relaxed));
        let next = (epoch + 1) & 0xff_ffff;
        // SAFETY: the previous job's `run` returned only after all its claimed tasks finished
        // (`done == n`), and no later claim of it can succeed (it has none left), so nothing
        // reads `job` now; `serial` keeps other callers out. The erased lifetime: this function
        // does not return before every task that reads the pointer has finished.
        unsafe {
            let erased: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f);
            *s.job.get() = Some(erased);
        }
        s.done.store(0, Ordering::Relaxed);
        s.word.store(pack(next, n, 0), Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        s.work(next);
        while s.done.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

/// A helper's loop: run each new epoch's tasks, spin [`SPIN`] for the next, then sleep.
fn helper(s: &Shared) {
    let mut seen = unpack(s.word.load(Ordering::Acquire)).0;
    loop {
        let t0 = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = unpack(s.word.load(Ordering::Acquire)).0;
            if e != seen {
                break Some(e);
            }
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && t0.elapsed() > SPIN {
                break None;
            }
            std::hint::spin_loop();
        };
        let epoch = match epoch {
            Some(e) => e,
            None => {
                let mut g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
                s.sleeping.fetch_add(1, Ordering::SeqCst);
                let e = loop {
                    let e = unpack(s.word.load(Ordering::SeqCst)).0;
                    if e != seen || s.shutdown.load(Ordering::SeqCst) {
                        break e;
                    }
                    g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
                };
                s.sleeping.fetch_sub(1, Ordering::SeqCst);
                drop(g);
                if s.shutdown.load(Ordering::SeqCst) {
                    return;
                }
                e
            }
        };
        s.work(epoch);
        seen = epoch;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_jobs_sizes_and_sleeps() {
        let pool = SpinPool::new(3);
        for round in 0..200usize {
            let n = [1usize, 2, 3, 7, 64, 1000][round % 6];
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
            if round % 50 == 49 {
                // Let the helpers fall asleep: the next job must still complete.
                std::thread::sleep(SPIN * 3);
            }
        }
    }

    #[test]
    fn tasks_write_disjoint_parts_visible_to_the_caller() {
        let pool = SpinPool::new(2);
        let mut out = vec![0u64; 4096];
        for rep in 0..50u64 {
            let ptr = out.as_mut_ptr() as usize;
            pool.run(64, &|t| {
                // SAFETY: task t writes only elements t * 64 .. (t + 1) * 64 of `out`, which
                // outlives the job; tasks are disjoint.
                let part =
                    unsafe { std::slice::from_raw_parts_mut((ptr as *mut u64).add(t * 64), 64) };
                part.iter_mut()
                    .enumerate()
                    .for_each(|(j, v)| *v = rep + (t * 64 + j) as u64);
            });
            assert!(
                out.iter().enumerate().all(|(j, &v)| v == rep + j as u64),
                "rep {rep}"
            );
        }
    }

    #[test]
    fn a_pool_of_one_runs_inline_and_drop_joins_the_helpers() {
        let one = SpinPool::new(1);
        let sum = AtomicUsize::new(0);
        one.run(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
        let many = SpinPool::new(4);
        assert_eq!(many.threads(), 4);
        drop(many);
    }
}
