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
//! Set-up: sweep stale segments, create the all-reduce segment (world > 1) and the broadcast
//! queue, launch every rank, wait until all attached, read each hello and attach to its
//! response queue. Shutdown: `Shutdown` command, close stdin, wait, SIGTERM, wait, SIGKILL;
//! then every `/dev/shm/omni.<instance>.*` segment left behind by a killed worker is removed.

pub(crate) mod launch;
pub(crate) mod monitor;

use std::io::BufReader;
use std::process::{ChildStdin, ChildStdout};
use std::time::{Duration, Instant};

use omni_ipc::shm::ShmSegment;
use omni_ipc::{IpcError, MessageQueue, MessageQueueReader, QueueSpec, ReaderId};
use omni_protocol::{
    PROTOCOL_VERSION, WorkerCommand, WorkerCommandRef, WorkerHandshake, WorkerResponse,
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
    broadcast: Option<MessageQueue>,
    responses: Vec<MessageQueueReader>,
    processes: ChildProcesses,
    stdins: Vec<ChildStdin>,
    _stdouts: Vec<BufReader<ChildStdout>>,
    all_reduce: Option<ShmSegment>,
    shut_down: bool,
}

fn spawn_err(what: &str, e: &dyn std::fmt::Display) -> ExecutorStartError {
    ExecutorStartError::Spawn(format!("{what}: {e}"))
}

impl WorkerGroup {
    /// Launches `cfg.tensor_parallel_size` workers and connects their queues.
    pub(crate) fn start(cfg: &MultiprocConfig) -> Result<Self, ExecutorStartError> {
        let world = cfg.tensor_parallel_size.max(1) as usize;
        let swept = omni_ipc::shm::sweep_stale();
        if !swept.is_empty() {
            tracing::info!(?swept, "removed stale shared memory segments");
        }
        let instance = omni_ipc::shm::new_instance_id();
        let all_reduce = if world > 1 {
            let name = omni_ipc::shm::segment_name(&instance, "allreduce");
            Some(
                ShmSegment::create(&name, cfg.all_reduce_segment_bytes)
                    .map_err(|e| spawn_err("creating the all-reduce segment", &e))?,
            )
        } else {
            None
        };
        let broadcast =
            MessageQueue::create(QueueSpec::local(&instance, "bcast", world, cfg.ipc.clone()))
                .map_err(|e| spawn_err("creating the broadcast queue", &e))?;
        let handle = broadcast.handle();
        let mut group = Self {
            instance,
            world,
            broadcast: Some(broadcast),
            responses: Vec::new(),
            processes: ChildProcesses::new(ChildRole::Worker),
            stdins: Vec::new(),
            _stdouts: Vec::new(),
            all_reduce,
            shut_down: false,
        };
        // From here on, an early return drops `group`, which stops the workers and cleans up.
        let mut stdouts = Vec::with_capacity(world);
        for rank in 0..world {
            let mut w = launch::spawn(&cfg.worker_exe, &cfg.worker_args)?;
            group.processes.push(w.child);
            let hs = WorkerHandshake {
                protocol_version: PROTOCOL_VERSION,
                instance: group.instance.clone(),
                rank: rank as u32,
                world_size: world as u32,
                parent_pid: std::process::id(),
                broadcast: handle.clone(),
                response_queue: cfg.response.clone(),
                all_reduce_segment: group.all_reduce.as_ref().map(|s| s.name().to_string()),
                ready_timeout: cfg.startup_timeout,
            };
            launch::send_handshake(&mut w.stdin, &hs)?;
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
        for (rank, out) in stdouts.iter_mut().enumerate() {
            let Some(hello) = launch::read_hello(out, rank)? else {
                let e = group
                    .processes
                    .wait_for_cause(rank, "worker closed stdout before its hello");
                return Err(e.into());
            };
            let reader = MessageQueueReader::attach(&hello.response, ReaderId::Local(0))
                .map_err(|e| spawn_err(&format!("attaching to rank {rank}'s responses"), &e))?;
            group.responses.push(reader);
        }
        group._stdouts = stdouts;
        for rank in 0..world {
            group.until_ready(deadline, &format!("rank {rank}'s response queue"), |g| {
                g.responses[rank].wait_until_ready(READY_SLICE)
            })?;
        }
        Ok(group)
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
                IpcError::ReaderDead {
                    reader: ReaderId::Local(r),
                    ..
                } => self.processes.wait_for_cause(r, "worker process died"),
                IpcError::EnqueueTimeout { lagging, .. } => {
                    let r = match lagging.first() {
                        Some(ReaderId::Local(r)) => *r,
                        _ => 0,
                    };
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
        self.processes.stop();
        self.responses.clear();
        self.broadcast = None;
        self.all_reduce = None;
        // Segments whose creator (a killed worker) could not unlink them.
        self.remove_instance_segments();
    }

    fn remove_instance_segments(&self) {
        let prefix = omni_ipc::shm::segment_name(&self.instance, "");
        let Ok(dir) = std::fs::read_dir(omni_ipc::shm::SHM_DIR) else {
            return;
        };
        for entry in dir.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

impl Drop for WorkerGroup {
    fn drop(&mut self) {
        self.shutdown();
    }
}
