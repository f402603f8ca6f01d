//! Waiting helpers shared by the writer and the reader: the bounded spin, the blocked-writer
//! warning, and deadline arithmetic.

use std::time::{Duration, Instant};

use crate::ReaderId;

/// Waits for `ready()` until `until` without sleeping: a few pure spins (about a microsecond:
/// the hot path, where the other side is already running on another core), then `sched_yield`
/// between checks so that, when there are more runnable processes than cores (or a VM's vCPUs
/// share a physical core), the process we wait for gets the CPU. Spinning longer before the
/// first yield was measured to hurt on this project's 2-vCPU VMs: 64 B latency went from
/// ~4.5 us to ~52 us whenever the host ran both vCPUs on one core.
///
/// Callers fold their interrupts (cancel, shutdown, closed) into `ready` and cap `until` at
/// their deadline, so the spin phase obeys both like the parked phase does.
pub(super) fn spin_wait(until: Instant, ready: impl Fn() -> bool) -> bool {
    for _ in 0..128 {
        if ready() {
            return true;
        }
        std::hint::spin_loop();
    }
    while Instant::now() < until {
        if ready() {
            return true;
        }
        std::thread::yield_now();
    }
    ready()
}

/// The end of the spin phase: `spin` from `start`, but never past `deadline`.
pub(super) fn spin_until(start: Instant, spin: Duration, deadline: Option<Instant>) -> Instant {
    let end = start + spin;
    deadline.map_or(end, |d| end.min(d))
}

/// vLLM's warning for a writer that cannot move on, naming the readers it waits for.
pub(super) fn warn_blocked(waited: Duration, lagging: &[ReaderId]) {
    tracing::warn!(
        lagging = %lagging.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "),
        "No available shared memory broadcast block found in {} seconds. This typically happens \
         when some processes are hanging or doing some time-consuming work (e.g. compilation).",
        waited.as_secs()
    );
}

/// The first multiple of `interval` after `waited` (when the next warning is due).
pub(super) fn next_multiple(waited: Duration, interval: Duration) -> Duration {
    let n = waited.as_nanos() / interval.as_nanos().max(1) + 1;
    interval.saturating_mul(u32::try_from(n).unwrap_or(u32::MAX))
}
