//! Cross-process futex wait/wake on a 32-bit word in shared memory.
//!
//! The words live in a `MAP_SHARED` mapping, so the *shared* (non-`PRIVATE`) futex operations
//! are used: the kernel keys the wait queue on the physical page, so a waiter in one process is
//! woken by a waker in another.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `*word == expected`, at most `timeout`. Returns early on a wake, on a
/// mismatch (the value changed before the kernel queued us), on a signal, or on timeout;
/// callers always re-check their condition.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit atomic for the duration of the call (it is
    // borrowed); FUTEX_WAIT only reads it and compares atomically with `expected`; `ts` is a
    // valid relative timeout. Errors (EAGAIN, EINTR, ETIMEDOUT) all mean "re-check".
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every waiter parked on `word`, in any process.
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid aligned 32-bit word; FUTEX_WAKE does not access memory
    // beyond using its address as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}
