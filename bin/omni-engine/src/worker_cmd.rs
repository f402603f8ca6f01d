//! `omni-engine worker`: one tensor-parallel worker process. Started by the engine core's
//! `MultiprocExecutor`, never by hand: it reads its whole configuration from ONE JSON line on
//! stdin and answers ONE JSON line on stdout; logs go to stderr.

/// `omni-engine worker` takes no flags: the resolved config comes in the handshake.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Args {}

/// Runs the worker until the engine shuts it down (or dies).
pub fn run(_args: Args) -> anyhow::Result<()> {
    // stdout carries the handshake answer: logs must go to stderr.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // Warnings, plus rank 0's weight-loading progress lines (shown when stderr is
                // not a terminal; a terminal gets a progress bar instead).
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("warn,omni_worker::load_progress=info")
                }),
        )
        .try_init();
    omni_worker::run_worker_process()?;
    Ok(())
}
