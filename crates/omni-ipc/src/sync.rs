//! Atomics shim: std atomics normally, loom's under `cfg(loom)` so the ring's flag protocol
//! can be model-checked (`RUSTFLAGS="--cfg loom" cargo test -p omni-ipc --release --lib loom`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU8, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU8, Ordering};

/// Spin hint in the model-checked wait loops: a real yield, so loom can progress.
#[cfg(loom)]
pub(crate) fn spin_hint() {
    loom::thread::yield_now();
}
