//! [`WorkerGroup`]: the worker processes of one engine instance behind their queues, with RPC
//! over them and a death monitor.
//!
//! ```text
//!            broadcast MessageQueue "bcast" (1 -> world)             response queues "resp<r>"
//! group ───WorkerCommand──▶ omni-worker-0 ... omni-worker-<w-1> ───WorkerResponse──▶ group
//!    │  stdin / stdout: the handshake (launch.rs), then stdin held open: EOF = "parent died"
//!    └─ monitor thread (monitor.rs): a death is recorded as
//!       EngineDeadError::Worker { rank, cause } and seen by pending and new calls within ~100 ms
//! ```
//!
//! Set-up: sweep stale segments, create one all-reduce segment per tensor-parallel group
//! (tp > 1) and the broadcast queue, launch every rank, wait until all attached, read each
//! hello and attach to its response queue, then send every rank all ranks' peer queues
//! (pipeline activations; see [`omni_protocol::ParallelLayout`]). Shutdown: `Shutdown` command, close stdin, wait, SIGTERM, wait, SIGKILL;
//! then every `/dev/shm/omni.<instance>.*` segment left behind by a killed worker is removed.

pub(crate) mod headless;
pub(crate) mod launch;
pub(crate) mod monitor;
pub(crate) mod nodes;

use std::io::BufReader;
use std::process::{ChildStdin, ChildStdout};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use omni_ipc::shm::ShmSegment;
use omni_ipc::{IpcError, MessageQueue, MessageQueueReader, QueueSpec, ReaderId};
use omni_protocol::{
    LeaderMessage, NodeAssignment, NodeHellos, PROTOCOL_VERSION, ParallelLayout, WorkerCommand,
    WorkerCommandRef, WorkerHandshake, WorkerHello, WorkerPeers, WorkerResponse,
};

use self::monitor::{ChildProcesses, ChildRole, dead_rank};
use super::multiproc::MultiprocConfig;
use super::{EngineDeadError, ExecutorStartError};

/// One slice of a start-up wait, between checks for dead workers.
const READY_SLICE: Duration = Duration::from_millis(200);

/// The workers of one engine instance; see the module docs. Dropping it shuts them down.
#[derive(Debug)]
pub(crate) struct WorkerGroup {
    instance: String,
    world: usize,
    layout: ParallelLayout,
    broadcast: Option<MessageQueue>,
    responses: Vec<MessageQueueReader>,
    processes: ChildProcesses,
    stdins: Vec<ChildStdin>,
    _stdouts: Vec<BufReader<ChildStdout>>,
    all_reduce: Vec<ShmSegment>,
    /// The follower nodes' control connections (multi-node).
    followers: Vec<nodes::Follower>,
    /// Set at shutdown: a follower's connection closing is then expected.
    stopping: Arc<AtomicBool>,
    shut_down: bool,
}

fn spawn_err(what: &str, e: &dyn std::fmt::Display) -> ExecutorStartError {
    ExecutorStartError::Spawn(format!("{what}: {e}"))
}

impl WorkerGroup {
    /// Launches `tensor_parallel_size x pipeline_parallel_size` workers (this node's; with
    /// `cfg.nodes`, after every follower node joined and was given its ranks) and connects
    /// their queues.
    pub(crate) fn start(cfg: &MultiprocConfig) -> Result<Self, ExecutorStartError> {
        let nnodes = cfg.nodes.as_ref().map_or(1, |n| n.nnodes.max(1));
        let layout = ParallelLayout::across_nodes(
            cfg.tensor_parallel_size,
            cfg.pipeline_parallel_size,
            nnodes,
        );
        let world = layout.world();
        let swept = omni_ipc::shm::sweep_stale();
        if !swept.is_empty() {
            tracing::info!(?swept, "removed stale shared memory segments");
        }
        let mut followers = match &cfg.nodes {
            Some(n) if n.nnodes > 1 => nodes::accept_followers(n, &layout)?,
            _ => Vec::new(),
        };
        let instance = omni_ipc::shm::new_instance_id();
        let all_reduce = create_all_reduce_segments(&instance, &layout, 0, cfg)?;
        let all: Vec<usize> = (0..world).collect();
        let (n_local, n_remote) = layout.reader_counts(0, &all);
        let leader_ip = cfg
            .nodes
            .as_ref()
            .and_then(|n| n.host_ip)
            .or(followers.first().map(|f| f.local_ip));
        let mut spec = QueueSpec::local(&instance, "bcast", n_local, cfg.ipc.clone());
        spec.n_remote_readers = n_remote;
        spec.remote_addr = leader_ip.filter(|_| n_remote > 0);
        let broadcast = MessageQueue::create(spec)
            .map_err(|e| spawn_err("creating the broadcast queue", &e))?;
        let handle = broadcast.handle();
        let stopping = Arc::new(AtomicBool::new(false));
        let mut group = Self {
            instance,
            world,
            layout: layout.clone(),
            broadcast: Some(broadcast),
            responses: Vec::new(),
            processes: ChildProcesses::new(ChildRole::Worker),
            stdins: Vec::new(),
            _stdouts: Vec::new(),
            all_reduce,
            followers: Vec::new(),
            stopping: stopping.clone(),
            shut_down: false,
        };
        let handshake = |rank: usize, host_ip| WorkerHandshake {
            protocol_version: PROTOCOL_VERSION,
            instance: group.instance.clone(),
            rank: rank as u32,
            layout: layout.clone(),
            host_ip,
            parent_pid: std::process::id(),
            broadcast: handle.clone(),
            broadcast_reader: layout
                .reader_id(0, &all, rank)
                .unwrap_or(ReaderId::Local(rank)),
            response_queue: cfg.response.clone(),
            all_reduce_segment: all_reduce_segment_name(&group.instance, &layout, rank),
            ready_timeout: cfg.startup_timeout,
        };
        let local_ranks = layout.ranks_on(0);
        let local: Vec<WorkerHandshake> = local_ranks
            .iter()
            .map(|&r| handshake(r, leader_ip))
            .collect();
        for f in followers.iter_mut() {
            let handshakes = layout
                .ranks_on(f.node)
                .into_iter()
                .map(|r| handshake(r, Some(f.ip)))
                .collect();
            f.send(&NodeAssignment::Workers {
                instance: group.instance.clone(),
                handshakes,
                all_reduce_segment_bytes: cfg.all_reduce_segment_bytes,
            })?;
        }
        group.followers = followers;
        // From here on, an early return drops `group`, which stops the workers and cleans up.
        let mut stdouts = Vec::with_capacity(local.len());
        for hs in &local {
            let mut w = launch::spawn(&cfg.worker_exe, &cfg.worker_args)?;
            group.processes.push(w.child);
            launch::send_handshake(&mut w.stdin, hs)?;
            group.stdins.push(w.stdin);
            stdouts.push(w.stdout);
        }
        group.processes.start_monitor();
        // Workers attach to the broadcast queue as soon as they have read the handshake; the
        // writer must be accepting them meanwhile.
        let deadline = Instant::now() + cfg.startup_timeout;
        group.until_ready(deadline, "the workers to attach", |g| {
            match g.broadcast.as_mut() {
                Some(b) => b.wait_until_ready(READY_SLICE),
                None => Err(IpcError::Closed),
            }
        })?;
        let mut hellos: Vec<Option<WorkerHello>> = vec![None; world];
        for (&rank, out) in local_ranks.iter().zip(stdouts.iter_mut()) {
            let Some(hello) = launch::read_hello(out, rank)? else {
                let e = group
                    .processes
                    .wait_for_cause(rank, "worker closed stdout before its hello");
                return Err(e.into());
            };
            hellos[rank] = Some(hello);
        }
        group._stdouts = stdouts;
        for f in group.followers.iter_mut() {
            let NodeHellos { hellos: theirs } = f.recv(deadline)?;
            for h in theirs {
                if let Some(slot) = hellos.get_mut(h.rank as usize) {
                    *slot = Some(h);
                }
            }
        }
        let mut peers = WorkerPeers::default();
        for (rank, hello) in hellos.into_iter().enumerate() {
            let hello = hello.ok_or_else(|| {
                ExecutorStartError::Spawn(format!(
                    "no hello from rank {rank} (node {})",
                    layout.node(rank)
                ))
            })?;
            let id = if layout.node(rank) == 0 {
                ReaderId::Local(0)
            } else {
                ReaderId::Remote(0)
            };
            let reader = MessageQueueReader::attach(&hello.response, id)
                .map_err(|e| spawn_err(&format!("attaching to rank {rank}'s responses"), &e))?;
            group.responses.push(reader);
            peers.peers.push(hello.peers);
        }
        for rank in 0..world {
            group.until_ready(deadline, &format!("rank {rank}'s response queue"), |g| {
                g.responses[rank].wait_until_ready(READY_SLICE)
            })?;
        }
        for (&rank, stdin) in local_ranks.iter().zip(group.stdins.iter_mut()) {
            launch::send_line(stdin, &peers, &format!("rank {rank}"))?;
        }
        let dead = group.processes.dead().clone();
        for f in group.followers.iter_mut() {
            f.send(&LeaderMessage::Peers(peers.clone()))?;
            f.watch(&layout, dead.clone(), stopping.clone());
        }
        Ok(group)
    }

    /// The rank of a reader of the broadcast queue.
    fn rank_of(&self, id: ReaderId) -> usize {
        let all: Vec<usize> = (0..self.world).collect();
        all.iter()
            .copied()
            .find(|&r| self.layout.reader_id(0, &all, r) == Some(id))
            .unwrap_or(0)
    }

    /// Where every rank runs.
    pub(crate) fn layout(&self) -> &ParallelLayout {
        &self.layout
    }

    /// The engine instance id (prefix of every shared-memory segment of the group).
    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }

    /// Ranks.
    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// The group's error, once a worker died or failed.
    pub(crate) fn check(&self) -> Result<(), EngineDeadError> {
        self.processes.dead().get().map_or(Ok(()), Err)
    }

    /// Records `e` as the group's error (unless one is recorded) and returns it.
    pub(crate) fn fail(&self, e: EngineDeadError) -> EngineDeadError {
        self.processes.dead().set(e.clone());
        e
    }

    /// Repeats a short `wait_until_ready` until it succeeds, a worker dies, or `deadline`.
    fn until_ready(
        &mut self,
        deadline: Instant,
        what: &str,
        mut wait: impl FnMut(&mut Self) -> Result<(), IpcError>,
    ) -> Result<(), ExecutorStartError> {
        loop {
            self.check()?;
            match wait(self) {
                Ok(()) => return Ok(()),
                Err(IpcError::Timeout(_) | IpcError::ReadyTimeout { .. })
                    if Instant::now() < deadline => {}
                Err(e) => return Err(spawn_err(&format!("waiting for {what}"), &e)),
            }
        }
    }

    /// What the broadcast queue has sent so far (`None` once it is shut down).
    pub(crate) fn broadcast_stats(&self) -> Option<omni_ipc::MessageQueueStats> {
        self.broadcast.as_ref().map(|q| q.stats())
    }

    /// Sends `cmd` with its out-of-band `buffers` to every rank.
    pub(crate) fn broadcast(
        &mut self,
        cmd: WorkerCommandRef<'_>,
        buffers: &[&[u8]],
    ) -> Result<(), EngineDeadError> {
        self.check()?;
        let Some(queue) = self.broadcast.as_mut() else {
            return Err(dead_rank(0, "executor is shut down"));
        };
        queue.enqueue(&cmd, buffers).map_err(|e| {
            let err = match e {
                IpcError::ReaderDead { reader, .. } => {
                    let r = self.rank_of(reader);
                    self.processes.wait_for_cause(r, "worker process died")
                }
                IpcError::EnqueueTimeout { lagging, .. } => {
                    let r = lagging.first().map_or(0, |&id| self.rank_of(id));
                    dead_rank(r, "stopped reading commands")
                }
                other => dead_rank(0, format!("broadcast failed: {other}")),
            };
            self.fail(err)
        })
    }

    /// Rank `rank`'s next answer, failing fast when any worker dies. A
    /// [`WorkerResponse::ModelRunnerOutput`] gets the message's buffers back in
    /// [`omni_protocol::ModelRunnerOutput::buffers`].
    pub(crate) fn recv(
        &mut self,
        rank: usize,
        timeout: Duration,
    ) -> Result<WorkerResponse, EngineDeadError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check()?;
            let Some(reader) = self.responses.get_mut(rank) else {
                return Err(dead_rank(rank, "no response queue"));
            };
            match reader.dequeue(Some(Duration::from_millis(100))) {
                Ok(msg) => {
                    let mut answer = msg.header::<WorkerResponse>().map_err(|e| {
                        self.fail(dead_rank(rank, format!("undecodable answer: {e}")))
                    })?;
                    if let WorkerResponse::ModelRunnerOutput(out) = &mut answer {
                        out.buffers = msg.into_buffers().into_iter().map(Vec::from).collect();
                    }
                    return Ok(answer);
                }
                Err(IpcError::Timeout(_) | IpcError::ReadyTimeout { .. })
                    if Instant::now() < deadline => {}
                Err(IpcError::Timeout(_)) => {
                    return Err(self.fail(dead_rank(rank, format!("no answer within {timeout:?}"))));
                }
                Err(other) => {
                    let e = self
                        .processes
                        .wait_for_cause(rank, &format!("response queue: {other}"));
                    return Err(self.fail(e));
                }
            }
        }
    }

    /// Sends `cmd` to every rank and returns every rank's answer, by rank (vLLM's
    /// `collective_rpc`); each answer must come within `timeout`.
    pub(crate) fn collective_rpc(
        &mut self,
        cmd: &WorkerCommand,
        timeout: Duration,
    ) -> Result<Vec<WorkerResponse>, EngineDeadError> {
        self.broadcast(cmd.as_ref(), &[])?;
        (0..self.world)
            .map(|rank| self.recv(rank, timeout))
            .collect()
    }

    /// Stops the workers and removes the instance's segments; idempotent.
    pub(crate) fn shutdown(&mut self) {
        if self.shut_down {
            return;
        }
        self.shut_down = true;
        self.stopping.store(true, Ordering::Release);
        self.processes.begin_stop();
        if self.check().is_ok()
            && let Some(b) = self.broadcast.as_mut()
        {
            let _ = b.enqueue(&WorkerCommand::Shutdown, &[]);
        }
        if let Some(b) = &self.broadcast {
            b.shutdown();
        }
        self.stdins.clear(); // EOF on every worker's stdin
        for f in self.followers.iter_mut() {
            f.shutdown();
        }
        self.processes.stop();
        self.responses.clear();
        self.broadcast = None;
        self.all_reduce.clear();
        // Segments whose creator (a killed worker) could not unlink them.
        self.remove_instance_segments();
    }

    fn remove_instance_segments(&self) {
        omni_ipc::shm::remove_segments_with_prefix(&omni_ipc::shm::segment_name(
            &self.instance,
            "",
        ));
    }
}

/// The all-reduce segment name of `rank`'s tensor-parallel group, when the group has several
/// ranks on one node (one segment per group: `allreduce<pp_rank>`).
pub(crate) fn all_reduce_segment_name(
    instance: &str,
    layout: &ParallelLayout,
    rank: usize,
) -> Option<String> {
    (layout.tp_group(rank).len() > 1 && layout.tp_group_on_one_node(rank)).then(|| {
        omni_ipc::shm::segment_name(instance, &format!("allreduce{}", layout.pp_rank(rank)))
    })
}

/// Creates the all-reduce segments of the tensor-parallel groups on `node` (zero-filled, mode
/// 0600; removed when dropped).
pub(crate) fn create_all_reduce_segments(
    instance: &str,
    layout: &ParallelLayout,
    node: u32,
    cfg: &MultiprocConfig,
) -> Result<Vec<ShmSegment>, ExecutorStartError> {
    let mut segments = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for rank in layout.ranks_on(node) {
        if let Some(name) = all_reduce_segment_name(instance, layout, rank)
            && seen.insert(name.clone())
        {
            segments.push(
                ShmSegment::create(&name, cfg.all_reduce_segment_bytes)
                    .map_err(|e| spawn_err("creating the all-reduce segment", &e))?,
            );
        }
    }
    Ok(segments)
}

impl Drop for WorkerGroup {
    fn drop(&mut self) {
        self.shutdown();
    }
}
