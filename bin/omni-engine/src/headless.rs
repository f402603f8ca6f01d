//! `serve --headless --node-rank N`: a follower node of a multi-node group. It runs only this
//! node's workers, joined to the leader (`--master-addr`, `--master-port`), and exits when the
//! leader shuts the group down (0), on SIGTERM / SIGINT (0, after telling the leader, stopping
//! its workers and removing its segments) or when the group breaks (non-zero).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use omni_config::EngineConfig;
use omni_core::{HeadlessConfig, NodeConfig};

/// Set by SIGTERM / SIGINT; the follower's loops poll it.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: nix::libc::c_int) {
    // Relaxed: a flag with no data behind it (see `omni_core`'s headless loop).
    STOP.store(true, Ordering::Relaxed);
}

/// Makes SIGTERM and SIGINT set [`STOP`] instead of killing the process.
fn catch_stop_signals() -> anyhow::Result<()> {
    // SAFETY: the handler only stores into a static atomic, which is async-signal-safe; no
    // other code of this process installs a handler for these signals.
    unsafe { crate::signals::on_stop_signals(on_stop_signal) }
}

/// Runs the follower until the group ends.
pub fn run(config: &EngineConfig) -> anyhow::Result<()> {
    catch_stop_signals()?;
    let p = &config.parallel;
    let cfg = HeadlessConfig {
        worker_exe: crate::current_exe()?,
        worker_args: vec!["worker".into()],
        node_rank: p.node_rank,
        tensor_parallel_size: p.tensor_parallel_size,
        pipeline_parallel_size: p.pipeline_parallel_size,
        nodes: NodeConfig {
            nnodes: p.nnodes,
            master_addr: p.master_addr.clone(),
            master_port: p.master_port,
            host_ip: p.host_ip,
            join_timeout: Duration::from_secs(p.distributed_timeout_seconds),
        },
        stop: Some(&STOP),
    };
    tracing::info!(
        node_rank = p.node_rank,
        nnodes = p.nnodes,
        leader = %format!("{}:{}", p.master_addr, p.master_port),
        "starting a headless node (workers only; the leader serves the API)"
    );
    match omni_core::run_headless(&cfg) {
        Ok(()) => tracing::info!("the leader shut the group down"),
        Err(e) if e.is_requested_stop() => tracing::info!("{e}: workers stopped, segments removed"),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}
