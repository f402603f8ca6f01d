//! `serve --headless --node-rank N`: a follower node of a multi-node group. It runs only this
//! node's workers, joined to the leader (`--master-addr`, `--master-port`), and exits when the
//! leader shuts the group down (0) or the group breaks (non-zero).

use std::time::Duration;

use omni_config::EngineConfig;
use omni_core::{HeadlessConfig, NodeConfig};

/// Runs the follower until the group ends.
pub fn run(config: &EngineConfig) -> anyhow::Result<()> {
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
    };
    tracing::info!(
        node_rank = p.node_rank,
        nnodes = p.nnodes,
        leader = %format!("{}:{}", p.master_addr, p.master_port),
        "starting a headless node (workers only; the leader serves the API)"
    );
    omni_core::run_headless(&cfg)?;
    tracing::info!("the leader shut the group down");
    Ok(())
}
