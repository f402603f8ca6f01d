//! Benchmarks for omni-engine: the IPC micro-benchmark (`omni-engine bench ipc`) and the
//! serving benchmark client (`omni-engine bench serve`). Both print a table last and write
//! JSON; the same command runs here and on the GPU machine.

pub mod ipc;
pub mod latency;
pub mod mem;
pub mod roofline;
pub mod serve;
