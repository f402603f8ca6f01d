//! A follower node (`serve --headless --node-rank N`, vLLM's headless multiproc executor):
//! no API server and no engine core, only this node's workers, joined to the leader's
//! rendezvous (see `nodes.rs` for the lines both sides exchange).
//!
//! 1. Connect to `--master-addr:--master-port`, retrying (the name resolved again each time)
//!    until `join_timeout`: under a LeaderWorkerSet the workers may start before the leader.
//! 2. Join; get this node's handshakes; create the node's all-reduce segments.
//! 3. Start the workers (this launcher is their parent), relay their hellos to the leader and
//!    the leader's peer queues to them.
//! 4. Watch: a worker that dies is reported to the leader (`NodeEvent::WorkerDied`) and the
//!    others are stopped; a lost leader stops every worker. Either way this returns an error
//!    (the process exits non-zero and LeaderWorkerSet recreates the group); the leader's
//!    `Shutdown` returns `Ok`; a requested stop ([`HeadlessConfig::stop`], SIGTERM) tells the
//!    leader (`NodeEvent::Failed`) and returns [`HeadlessError::Stopped`]. Every segment of the
//!    instance on this node is removed.

use std::io::BufReader;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use omni_ipc::shm::ShmSegment;
use omni_protocol::{
    LeaderMessage, NodeAssignment, NodeEvent, NodeHellos, NodeJoin, PROTOCOL_VERSION,
};

use super::launch;
use super::monitor::{ChildProcesses, ChildRole};
use super::nodes::{NodeConfig, read_json, write_json};

/// What a follower node runs.
#[derive(Debug, Clone)]
pub struct HeadlessConfig {
    /// The binary to run the workers with, and its arguments (`["worker"]`).
    pub worker_exe: PathBuf,
    /// Its arguments.
    pub worker_args: Vec<String>,
    /// This node's rank (1..nnodes).
    pub node_rank: u32,
    /// Ranks per pipeline stage.
    pub tensor_parallel_size: u32,
    /// Pipeline stages.
    pub pipeline_parallel_size: u32,
    /// Where the leader is, and how long to wait for it.
    pub nodes: NodeConfig,
    /// Set (by a SIGTERM / SIGINT handler) to stop the node: it tells the leader, stops its
    /// workers, removes its segments and returns [`HeadlessError::Stopped`].
    pub stop: Option<&'static AtomicBool>,
}

/// Why a follower node stopped.
#[derive(Debug, thiserror::Error)]
pub enum HeadlessError {
    /// The leader could not be reached, refused the join or broke the start-up.
    #[error("node {node}: {message}")]
    Join {
        /// This node.
        node: u32,
        /// What happened.
        message: String,
    },
    /// A worker of this node died (the leader was told).
    #[error("node {node}: {cause}")]
    WorkerDied {
        /// This node.
        node: u32,
        /// Which worker and how.
        cause: String,
    },
    /// The leader's connection closed without a shutdown.
    #[error("node {node}: the leader is gone ({message})")]
    LeaderLost {
        /// This node.
        node: u32,
        /// What the connection said.
        message: String,
    },
    /// A stop was requested ([`HeadlessConfig::stop`]; the leader was told).
    #[error("node {node}: stopped by a signal")]
    Stopped {
        /// This node.
        node: u32,
    },
}

impl HeadlessError {
    /// Whether the node stopped because it was asked to (not a failure of the group).
    pub fn is_requested_stop(&self) -> bool {
        matches!(self, Self::Stopped { .. })
    }
}

/// Whether `stop` is set. Relaxed is enough: the flag carries no data, and the loops that read
/// it only decide to end; everything they do afterwards is ordered by their own thread.
fn stop_requested(stop: Option<&AtomicBool>) -> bool {
    stop.is_some_and(|s| s.load(Ordering::Relaxed))
}

/// Runs the follower node until the leader shuts it down (`Ok`) or the group fails (`Err`).
pub fn run_headless(cfg: &HeadlessConfig) -> Result<(), HeadlessError> {
    let node = cfg.node_rank;
    let join_err = |m: String| HeadlessError::Join { node, message: m };
    let deadline = Instant::now() + cfg.nodes.join_timeout;
    let mut stream = connect(&cfg.nodes, deadline, cfg.stop).map_err(|e| match e {
        None => HeadlessError::Stopped { node },
        Some(m) => join_err(m),
    })?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| join_err(e.to_string()))?);
    let host_ip = match cfg.nodes.host_ip {
        Some(ip) => ip,
        None => stream
            .local_addr()
            .map_err(|e| join_err(e.to_string()))?
            .ip(),
    };
    write_json(
        &mut stream,
        &NodeJoin {
            protocol_version: PROTOCOL_VERSION,
            node_rank: node,
            nnodes: cfg.nodes.nnodes,
            tensor_parallel_size: cfg.tensor_parallel_size,
            pipeline_parallel_size: cfg.pipeline_parallel_size,
            pid: std::process::id(),
        },
    )
    .map_err(|e| join_err(format!("joining: {e}")))?;
    // The leader answers once every node joined: wait as long as the join may take.
    let (instance, handshakes, seg_bytes) =
        match read_json::<NodeAssignment>(&mut reader, Some(deadline)) {
            Ok(NodeAssignment::Workers {
                instance,
                handshakes,
                all_reduce_segment_bytes,
            }) => (instance, handshakes, all_reduce_segment_bytes),
            Ok(NodeAssignment::Refused { message }) => {
                return Err(join_err(format!("the leader refused: {message}")));
            }
            Err(e) => return Err(join_err(format!("waiting for the assignment: {e}"))),
        };
    let ranks: Vec<u32> = handshakes.iter().map(|h| h.rank).collect();
    tracing::info!(node, ?ranks, %host_ip, "joined the leader; starting the workers");
    let mut node_run = NodeRun {
        instance,
        processes: ChildProcesses::new(ChildRole::Worker),
        stdins: Vec::new(),
        _segments: Vec::new(),
    };
    let result = node_run.start_and_watch(cfg, handshakes, seg_bytes, &mut stream, &mut reader);
    node_run.stop();
    result
}

/// The node's workers and segments; [`NodeRun::stop`] removes what is left.
struct NodeRun {
    instance: String,
    processes: ChildProcesses,
    stdins: Vec<std::process::ChildStdin>,
    _segments: Vec<ShmSegment>,
}

impl NodeRun {
    fn start_and_watch(
        &mut self,
        cfg: &HeadlessConfig,
        handshakes: Vec<omni_protocol::WorkerHandshake>,
        seg_bytes: usize,
        stream: &mut TcpStream,
        reader: &mut BufReader<TcpStream>,
    ) -> Result<(), HeadlessError> {
        let node = cfg.node_rank;
        let join_err = |m: String| HeadlessError::Join { node, message: m };
        let mut names: Vec<String> = handshakes
            .iter()
            .filter_map(|h| h.all_reduce_segment.clone())
            .collect();
        names.dedup();
        for name in names {
            self._segments
                .push(ShmSegment::create(&name, seg_bytes).map_err(|e| join_err(e.to_string()))?);
        }
        let ranks: Vec<usize> = handshakes.iter().map(|h| h.rank as usize).collect();
        let mut stdouts = Vec::new();
        for mut hs in handshakes {
            let mut w = launch::spawn(&cfg.worker_exe, &cfg.worker_args)
                .map_err(|e| join_err(e.to_string()))?;
            self.processes.push(w.child);
            hs.parent_pid = std::process::id();
            launch::send_handshake(&mut w.stdin, &hs).map_err(|e| join_err(e.to_string()))?;
            self.stdins.push(w.stdin);
            stdouts.push(w.stdout);
        }
        self.processes.start_monitor();
        let mut hellos = Vec::new();
        for (&rank, out) in ranks.iter().zip(stdouts.iter_mut()) {
            match launch::read_hello(out, rank).map_err(|e| join_err(e.to_string()))? {
                Some(h) => hellos.push(h),
                None => {
                    let i = ranks.iter().position(|&r| r == rank).unwrap_or(0);
                    let cause = self
                        .processes
                        .wait_for_cause(i, "closed stdout before its hello");
                    return Err(self.report(stream, rank, cause.to_string(), node));
                }
            }
        }
        write_json(stream, &NodeHellos { hellos }).map_err(|e| join_err(e.to_string()))?;
        match read_json::<LeaderMessage>(reader, Some(Instant::now() + cfg.nodes.join_timeout)) {
            Ok(LeaderMessage::Peers(peers)) => {
                for (&rank, stdin) in ranks.iter().zip(self.stdins.iter_mut()) {
                    launch::send_line(stdin, &peers, &format!("rank {rank}"))
                        .map_err(|e| join_err(e.to_string()))?;
                }
            }
            Ok(LeaderMessage::Shutdown) => return Ok(()),
            Err(e) => {
                return Err(HeadlessError::LeaderLost {
                    node,
                    message: e.to_string(),
                });
            }
        }
        tracing::info!(node, "workers connected; serving");
        self.watch(stream, reader, &ranks, node, cfg.stop)
    }

    /// Until a worker dies, the leader says shut down, or its connection ends.
    fn watch(
        &mut self,
        stream: &mut TcpStream,
        reader: &mut BufReader<TcpStream>,
        ranks: &[usize],
        node: u32,
        stop: Option<&AtomicBool>,
    ) -> Result<(), HeadlessError> {
        loop {
            if stop_requested(stop) {
                tracing::info!(
                    node,
                    "stop requested: telling the leader, stopping the workers"
                );
                let _ = write_json(
                    stream,
                    &NodeEvent::Failed {
                        message: "stopped by a signal (SIGTERM or SIGINT)".into(),
                    },
                );
                return Err(HeadlessError::Stopped { node });
            }
            if let Some(e) = self.processes.dead().get() {
                // The monitor names the rank by its index on this node.
                let (index, cause) = match &e {
                    omni_protocol::EngineDeadError::Worker { rank, cause } => {
                        (*rank as usize, cause.clone())
                    }
                    other => (0, other.to_string()),
                };
                let rank = ranks.get(index).copied().unwrap_or(0);
                return Err(self.report(stream, rank, cause, node));
            }
            match read_json::<LeaderMessage>(reader, Some(Instant::now() + POLL)) {
                Ok(LeaderMessage::Shutdown) => return Ok(()),
                Ok(LeaderMessage::Peers(_)) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => {
                    return Err(HeadlessError::LeaderLost {
                        node,
                        message: e.to_string(),
                    });
                }
            }
        }
    }

    /// Tells the leader that `rank` died, and returns the error this node exits with.
    fn report(
        &self,
        stream: &mut TcpStream,
        rank: usize,
        cause: String,
        node: u32,
    ) -> HeadlessError {
        let cause = format!("rank {rank}: {cause}");
        let _ = write_json(
            stream,
            &NodeEvent::WorkerDied {
                rank: rank as u32,
                cause: cause.clone(),
            },
        );
        HeadlessError::WorkerDied { node, cause }
    }

    /// Stops the workers (EOF on their stdin, then signals) and removes the instance's
    /// segments on this node.
    fn stop(&mut self) {
        self.processes.begin_stop();
        self.stdins.clear();
        self.processes.stop();
        omni_ipc::shm::remove_segments_with_prefix(&omni_ipc::shm::segment_name(
            &self.instance,
            "",
        ));
        self._segments.clear();
    }
}

/// How often the follower checks its workers while it waits for the leader.
const POLL: Duration = Duration::from_millis(50);

/// Connects to the leader, retrying every 500 ms until `deadline` (`Err(None)`: `stop` was
/// set meanwhile).
fn connect(
    cfg: &NodeConfig,
    deadline: Instant,
    stop: Option<&AtomicBool>,
) -> Result<TcpStream, Option<String>> {
    let mut last = String::new();
    let mut logged = false;
    loop {
        let addrs: Vec<_> = match (cfg.master_addr.as_str(), cfg.master_port).to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                last = format!("resolving {}: {e}", cfg.master_addr);
                Vec::new()
            }
        };
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        if stop_requested(stop) {
            return Err(None);
        }
        if Instant::now() >= deadline {
            return Err(Some(format!(
                "the leader at {}:{} did not answer within {:?} ({last})",
                cfg.master_addr, cfg.master_port, cfg.join_timeout
            )));
        }
        if !logged {
            tracing::info!(leader = %format!("{}:{}", cfg.master_addr, cfg.master_port), "waiting for the leader ({last})");
            logged = true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}
