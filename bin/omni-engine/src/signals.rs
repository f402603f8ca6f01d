//! `generate` and `bench`: SIGTERM or SIGINT removes the shared-memory segments of the engine
//! this process launched, then exits with status 128 + the signal (what a shell reports for a
//! process the signal killed). Without it the default action killed the process at once and
//! its segments stayed in /dev/shm until the next start-up's sweep. (`serve` and `serve
//! --headless` stop gracefully through their own handlers; the worker and engine-core
//! processes die with their parent.)
//!
//! The handler only writes the signal's number into a pipe (async-signal-safe); a thread reads
//! it, removes `/dev/shm/omni.<pid>x*` (every segment of an engine instance this process
//! started, its workers' included: `omni_ipc::shm::remove_segments_of`) and exits. Workers
//! still mapping a segment keep their mapping; they die with this process (`PR_SET_PDEATHSIG`).

use std::io::Read;
use std::os::fd::IntoRawFd;
use std::sync::atomic::{AtomicI32, Ordering};

use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

/// The pipe's write end (-1 until installed).
static PIPE_W: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(sig: nix::libc::c_int) {
    // Relaxed: the descriptor was stored before the handler was installed (sigaction orders it).
    let fd = PIPE_W.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = sig as u8;
        // SAFETY: write(2) is async-signal-safe; one byte from a live stack location into a
        // descriptor this process keeps open for its lifetime. A failed write changes nothing.
        unsafe { nix::libc::write(fd, (&raw const b).cast(), 1) };
    }
}

/// Installs the SIGTERM / SIGINT handling described in the module docs.
pub fn remove_segments_on_signals() -> anyhow::Result<()> {
    let (read, write) = nix::unistd::pipe()?;
    // The write end lives as long as the process (the handler may run at any time).
    PIPE_W.store(write.into_raw_fd(), Ordering::Relaxed);
    std::thread::Builder::new()
        .name("omni-signals".into())
        .spawn(move || {
            let mut b = [0u8; 1];
            if std::fs::File::from(read).read_exact(&mut b).is_ok() {
                let removed = omni_ipc::shm::remove_segments_of(std::process::id());
                tracing::warn!(
                    signal = b[0],
                    segments = removed.len(),
                    "stopped by a signal: removed this engine's shared memory"
                );
                std::process::exit(128 + i32::from(b[0]));
            }
        })?;
    // SAFETY: the handler only loads an atomic and calls write(2), both async-signal-safe; no
    // other code of these commands installs a handler for these signals.
    unsafe { on_stop_signals(on_signal) }
}

/// Installs `handler` for SIGTERM and SIGINT (with `SA_RESTART`).
///
/// # Safety
/// `handler` does only what is async-signal-safe, and no other code of the process installs a
/// handler for these signals.
pub unsafe fn on_stop_signals(handler: extern "C" fn(nix::libc::c_int)) -> anyhow::Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(handler),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [Signal::SIGTERM, Signal::SIGINT] {
        // SAFETY: the caller's handler is async-signal-safe and the only one these signals get
        // (this function's contract).
        unsafe { sigaction(sig, &action) }?;
    }
    Ok(())
}
