//! `omni-engine engine-core`: the engine core in a process of its own (`omni-engine-core`,
//! vLLM's `EngineCoreProc`). Started by an API process run with `--enable-multiprocessing`,
//! never by hand: it reads its whole configuration from ONE JSON line on stdin (the resolved
//! `EngineConfig`), spawns its own workers, answers ONE JSON line on stdout, then serves the
//! two queues that line names until it is told to stop; logs go to stderr. It dies with its
//! parent (`PR_SET_PDEATHSIG`, and EOF on stdin).

/// `omni-engine engine-core` takes no flags: the resolved config comes in the handshake.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Args {}

/// Runs the engine core until its client shuts it down (or dies).
pub fn run(_args: Args) -> anyhow::Result<()> {
    // stdout carries the handshake answer: logs go to stderr (main's subscriber).
    match omni_launch::run_engine_core_process(&crate::current_exe()?)? {
        omni_launch::EngineCoreExit::Served => Ok(()),
        // The client prints the start-up error; the status says it failed.
        omni_launch::EngineCoreExit::StartupFailed => std::process::exit(1),
    }
}
