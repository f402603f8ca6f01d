//! [`MultiprocExecutor`]: one worker process per tensor-parallel rank (vLLM's
//! `MultiprocExecutor`).
//!
//! ```text
//!            broadcast MessageQueue "bcast" (1 -> world)             response queues "resp<r>"
//! executor ───WorkerCommand──▶ omni-worker-0 ... omni-worker-<w-1> ───WorkerResponse──▶ executor
//!    │  stdin: 1 JSON line (WorkerHandshake), then held open: EOF = "parent died"
//!    │  stdout: 1 JSON line (WorkerHello: the response queue's handle)
//!    └─ monitor thread: try_wait()s every child each 50 ms; a death is recorded as
//!       EngineDead { rank, cause } and seen by pending and new calls within ~100 ms
//! ```
//!
//! Start-up: spawn `<exe> <worker_args...>` per rank, handshake (the resolved config travels in
//! the handshake, never in argv or env), `LoadModel` on every rank (each reports KV bytes per
//! block), [`plan_num_blocks`], `InitCache`. Each step broadcasts `ExecuteModel` and reads every
//! rank's answer: rank 0's [`ModelRunnerOutput`], the others' small acknowledgements (so a
//! failing rank is seen at once and no response queue fills up). Shutdown: `Shutdown` command,
//! close stdin, wait, SIGTERM, wait, SIGKILL; then every `/dev/shm/omni.<instance>.*` segment
//! left behind by a killed worker is removed.
//!
//! A worker gets `PR_SET_PDEATHSIG`: it is killed when the *thread* that spawned it exits, so
//! start the executor on a thread that lives as long as the engine (the main thread).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use omni_ipc::shm::ShmSegment;
use omni_ipc::{
    Handle, IpcError, MessageQueue, MessageQueueConfig, MessageQueueReader, QueueSpec, ReaderId,
};
use omni_protocol::{
    ModelRunnerOutput, PROTOCOL_VERSION, SchedulerOutput, WorkerCommand, WorkerResponse,
};
use serde::{Deserialize, Serialize};

use super::{EngineError, ExecutorStartError, StartupSpec, kv_budget_bytes, plan_num_blocks};
use crate::Executor;

/// The one JSON line a worker reads from its stdin at start.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerHandshake {
    /// The parent's [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Engine instance id (names every shared-memory segment: `omni.<instance>.<channel>`).
    pub instance: String,
    /// This worker's rank.
    pub rank: u32,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// The parent's pid (the worker exits if its parent already changed).
    pub parent_pid: u32,
    /// Where to read commands from (as local reader `rank`).
    pub broadcast: Handle,
    /// Config of the response queue the worker creates.
    pub response_queue: MessageQueueConfig,
    /// The all-reduce segment (created by the executor), when `world_size > 1`.
    pub all_reduce_segment: Option<String>,
    /// How long to wait for the queues' peers at start.
    pub ready_timeout: Duration,
}

/// The one JSON line a worker answers on its stdout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerHello {
    /// The worker's [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Its rank.
    pub rank: u32,
    /// Its pid.
    pub pid: u32,
    /// Its response queue (the executor attaches as local reader 0).
    pub response: Handle,
}

/// How to start the workers.
#[derive(Debug, Clone)]
pub struct MultiprocConfig {
    /// The binary to run (usually `std::env::current_exe()`).
    pub worker_exe: PathBuf,
    /// Its arguments (e.g. `["worker"]`); nothing else goes on the command line.
    pub worker_args: Vec<String>,
    /// Ranks (processes).
    pub tensor_parallel_size: u32,
    /// Sizes and timings of the broadcast queue (`VLLM_MQ_MAX_CHUNK_BYTES_MB` sets its slot size).
    pub ipc: MessageQueueConfig,
    /// Sizes and timings of each worker's response queue, sent to the workers in the handshake
    /// (default [`MultiprocConfig::default_response_queue`]). Independent of [`Self::ipc`], as
    /// vLLM's `worker_response_mq` ignores the chunk-size variable.
    pub response: MessageQueueConfig,
    /// Model and KV cache sizing.
    pub startup: StartupSpec,
    /// Longest wait for any start-up step (handshake, model load).
    pub startup_timeout: Duration,
    /// Longest wait for one step's answer (vLLM: 300 s).
    pub execute_timeout: Duration,
    /// Bytes of the all-reduce segment (only for `tensor_parallel_size > 1`).
    pub all_reduce_segment_bytes: usize,
}

impl MultiprocConfig {
    /// Defaults for everything but the binary, the world size and the model.
    pub fn new(worker_exe: PathBuf, tensor_parallel_size: u32, startup: StartupSpec) -> Self {
        Self {
            worker_exe,
            worker_args: vec!["worker".into()],
            tensor_parallel_size,
            ipc: MessageQueueConfig::default(),
            response: Self::default_response_queue(),
            startup,
            startup_timeout: Duration::from_secs(300),
            execute_timeout: Duration::from_secs(300),
            all_reduce_segment_bytes: (4 << 20) * tensor_parallel_size.max(1) as usize + 65536,
        }
    }

    /// The response queue's defaults: 4 slots of 2 MiB (8 MiB of `/dev/shm` per worker).
    ///
    /// The executor reads every rank's answer before it broadcasts the next command, so one
    /// slot is in use at a time; 4 leave room for pipelined batches. A step's
    /// `ModelRunnerOutput` is a few KB (about 45 KB for 256 requests with 20 top logprobs each);
    /// a larger answer (hidden states) takes the overflow path.
    pub fn default_response_queue() -> MessageQueueConfig {
        MessageQueueConfig {
            max_chunk_bytes: 2 << 20,
            max_chunks: 4,
            ..MessageQueueConfig::default()
        }
    }
}

type Dead = Arc<Mutex<Option<EngineError>>>;

/// One slice of a start-up wait, between checks for dead workers.
const READY_SLICE: Duration = Duration::from_millis(200);

fn read_dead(dead: &Dead) -> Option<EngineError> {
    dead.lock()
        .map(|d| d.clone())
        .unwrap_or_else(|p| p.into_inner().clone())
}

fn set_dead(dead: &Dead, e: EngineError) {
    let mut g = dead.lock().unwrap_or_else(|p| p.into_inner());
    if g.is_none() {
        tracing::error!("{e}");
        *g = Some(e);
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (_, Some(sig)) => format!("worker process killed by signal {sig}"),
        (Some(code), _) => format!("worker process exited with status {code}"),
        _ => format!("worker process ended: {status}"),
    }
}

fn dead_rank(rank: usize, cause: impl Into<String>) -> EngineError {
    EngineError::EngineDead {
        rank: rank as u32,
        cause: cause.into(),
    }
}

/// Worker processes behind a broadcast queue; see the module docs.
#[derive(Debug)]
pub struct MultiprocExecutor {
    instance: String,
    world: usize,
    broadcast: Option<MessageQueue>,
    responses: Vec<MessageQueueReader>,
    children: Arc<Mutex<Vec<Option<Child>>>>,
    stdins: Vec<ChildStdin>,
    _stdouts: Vec<BufReader<ChildStdout>>,
    dead: Dead,
    stopping: Arc<AtomicBool>,
    monitor: Option<JoinHandle<()>>,
    all_reduce: Option<ShmSegment>,
    num_blocks: u32,
    execute_timeout: Duration,
    shut_down: bool,
}

impl MultiprocExecutor {
    /// Spawns and connects the workers, loads the model and allocates the KV cache.
    pub fn start(cfg: MultiprocConfig) -> Result<Self, ExecutorStartError> {
        let spawn_err = |what: &str, e: &dyn std::fmt::Display| {
            ExecutorStartError::Spawn(format!("{what}: {e}"))
        };
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
        let mut ex = Self {
            instance: instance.clone(),
            world,
            broadcast: Some(broadcast),
            responses: Vec::new(),
            children: Arc::new(Mutex::new(Vec::new())),
            stdins: Vec::new(),
            _stdouts: Vec::new(),
            dead: Arc::new(Mutex::new(None)),
            stopping: Arc::new(AtomicBool::new(false)),
            monitor: None,
            all_reduce,
            num_blocks: 0,
            execute_timeout: cfg.execute_timeout,
            shut_down: false,
        };
        // From here on, an early return drops `ex`, which kills the workers and cleans up.
        let handle = ex.broadcast_queue()?.handle();
        let mut stdouts = Vec::new();
        for rank in 0..world {
            let child = Command::new(&cfg.worker_exe)
                .args(&cfg.worker_args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| spawn_err(&format!("spawning {}", cfg.worker_exe.display()), &e))?;
            let mut child = child;
            let stdin = child.stdin.take();
            let stdout = child.stdout.take();
            ex.lock_children().push(Some(child));
            let (Some(mut stdin), Some(stdout)) = (stdin, stdout) else {
                return Err(ExecutorStartError::Spawn("worker pipes missing".into()));
            };
            let hs = WorkerHandshake {
                protocol_version: PROTOCOL_VERSION,
                instance: instance.clone(),
                rank: rank as u32,
                world_size: world as u32,
                parent_pid: std::process::id(),
                broadcast: handle.clone(),
                response_queue: cfg.response.clone(),
                all_reduce_segment: ex.all_reduce.as_ref().map(|s| s.name().to_string()),
                ready_timeout: cfg.startup_timeout,
            };
            let line = serde_json::to_string(&hs).map_err(|e| spawn_err("handshake", &e))?;
            writeln!(stdin, "{line}")
                .and_then(|()| stdin.flush())
                .map_err(|e| spawn_err(&format!("writing the handshake to rank {rank}"), &e))?;
            ex.stdins.push(stdin);
            stdouts.push(BufReader::new(stdout));
        }
        ex.start_monitor();
        // Workers attach to the broadcast queue as soon as they have read the handshake; the
        // writer must be accepting them meanwhile.
        let deadline = Instant::now() + cfg.startup_timeout;
        ex.until_ready(deadline, "the workers to attach", |ex| {
            ex.broadcast_queue()
                .map_err(|e| IpcError::Config(e.to_string()))?
                .wait_until_ready(READY_SLICE)
        })?;
        let mut hellos = Vec::new();
        for (rank, out) in stdouts.iter_mut().enumerate() {
            let mut line = String::new();
            let n = out
                .read_line(&mut line)
                .map_err(|e| spawn_err(&format!("reading rank {rank}'s hello"), &e))?;
            if n == 0 {
                return Err(ex
                    .wait_for_cause(rank, "worker closed stdout before its hello")
                    .into());
            }
            let hello: WorkerHello = serde_json::from_str(&line)
                .map_err(|e| spawn_err(&format!("rank {rank}'s hello {line:?}"), &e))?;
            omni_protocol::check_protocol_version(hello.protocol_version)
                .map_err(|e| spawn_err(&format!("rank {rank}"), &e))?;
            hellos.push(hello);
        }
        ex._stdouts = stdouts;
        for (rank, hello) in hellos.iter().enumerate() {
            let reader = MessageQueueReader::attach(&hello.response, ReaderId::Local(0))
                .map_err(|e| spawn_err(&format!("attaching to rank {rank}'s responses"), &e))?;
            ex.responses.push(reader);
        }
        for rank in 0..world {
            ex.until_ready(deadline, &format!("rank {rank}'s response queue"), |ex| {
                ex.responses[rank].wait_until_ready(READY_SLICE)
            })?;
        }

        // LoadModel -> KV bytes per block -> num_blocks -> InitCache.
        ex.broadcast_cmd(&WorkerCommand::LoadModel(cfg.startup.load.clone()))?;
        let mut kv_bytes_per_block = 0u64;
        let mut available = Vec::with_capacity(world);
        for rank in 0..world {
            match ex.recv(rank, cfg.startup_timeout)? {
                WorkerResponse::ModelLoaded {
                    kv_bytes_per_block: b,
                    available_memory_bytes,
                } => {
                    kv_bytes_per_block = kv_bytes_per_block.max(b);
                    available.push(available_memory_bytes);
                }
                other => return Err(ex.unexpected(rank, "LoadModel", other).into()),
            }
        }
        let num_blocks = plan_num_blocks(
            kv_bytes_per_block,
            kv_budget_bytes(&cfg.startup, &available),
            cfg.startup.num_blocks_override,
        )?;
        ex.broadcast_cmd(&WorkerCommand::InitCache {
            num_blocks,
            block_size: cfg.startup.load.block_size,
        })?;
        for rank in 0..world {
            match ex.recv(rank, cfg.startup_timeout)? {
                WorkerResponse::Ready { .. } => {}
                other => return Err(ex.unexpected(rank, "InitCache", other).into()),
            }
        }
        ex.num_blocks = num_blocks;
        tracing::info!(
            instance = %ex.instance,
            world,
            num_blocks,
            kv_bytes_per_block,
            "workers ready"
        );
        Ok(ex)
    }

    /// KV blocks allocated on every rank.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The engine instance id (prefix of every shared-memory segment it uses).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The workers' process ids, by rank (0 once reaped).
    pub fn worker_pids(&self) -> Vec<u32> {
        self.lock_children()
            .iter()
            .map(|c| c.as_ref().map_or(0, Child::id))
            .collect()
    }

    fn lock_children(&self) -> std::sync::MutexGuard<'_, Vec<Option<Child>>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn broadcast_queue(&mut self) -> Result<&mut MessageQueue, EngineError> {
        self.broadcast
            .as_mut()
            .ok_or_else(|| dead_rank(0, "executor is shut down"))
    }

    fn start_monitor(&mut self) {
        let children = self.children.clone();
        let dead = self.dead.clone();
        let stopping = self.stopping.clone();
        let spawned = std::thread::Builder::new()
            .name("omni-worker-monitor".into())
            .spawn(move || {
                while !stopping.load(Ordering::Acquire) {
                    {
                        let mut guard = children.lock().unwrap_or_else(|p| p.into_inner());
                        for (rank, slot) in guard.iter_mut().enumerate() {
                            let Some(child) = slot else { continue };
                            if let Ok(Some(status)) = child.try_wait() {
                                if !stopping.load(Ordering::Acquire) {
                                    set_dead(&dead, dead_rank(rank, describe(status)));
                                }
                                *slot = None;
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
        match spawned {
            Ok(t) => self.monitor = Some(t),
            Err(e) => set_dead(&self.dead, dead_rank(0, format!("no monitor thread: {e}"))),
        }
    }

    /// Repeats a short `wait_until_ready` until it succeeds, a worker dies, or `deadline`.
    fn until_ready(
        &mut self,
        deadline: Instant,
        what: &str,
        mut wait: impl FnMut(&mut Self) -> Result<(), IpcError>,
    ) -> Result<(), ExecutorStartError> {
        loop {
            if let Some(e) = read_dead(&self.dead) {
                return Err(e.into());
            }
            match wait(self) {
                Ok(()) => return Ok(()),
                Err(IpcError::Timeout(_) | IpcError::ReadyTimeout { .. })
                    if Instant::now() < deadline => {}
                Err(e) => {
                    return Err(ExecutorStartError::Spawn(format!(
                        "waiting for {what}: {e}"
                    )));
                }
            }
        }
    }

    fn unexpected(&self, rank: usize, what: &str, resp: WorkerResponse) -> EngineError {
        let e = match resp {
            WorkerResponse::Error { rank, message } => dead_rank(rank as usize, message),
            other => dead_rank(rank, format!("unexpected answer to {what}: {other:?}")),
        };
        set_dead(&self.dead, e.clone());
        e
    }

    fn broadcast_cmd(&mut self, cmd: &WorkerCommand) -> Result<(), EngineError> {
        if let Some(e) = read_dead(&self.dead) {
            return Err(e);
        }
        let result = self.broadcast_queue()?.enqueue(cmd, &[]);
        result.map_err(|e| {
            let err = match e {
                IpcError::ReaderDead {
                    reader: ReaderId::Local(r),
                    ..
                } => self.wait_for_cause(r, "worker process died"),
                IpcError::EnqueueTimeout { lagging, .. } => {
                    let r = match lagging.first() {
                        Some(ReaderId::Local(r)) => *r,
                        _ => 0,
                    };
                    dead_rank(r, "stopped reading commands")
                }
                other => dead_rank(0, format!("broadcast failed: {other}")),
            };
            set_dead(&self.dead, err.clone());
            err
        })
    }

    /// The monitor's cause of death, if it comes within 200 ms; else a generic one.
    fn wait_for_cause(&self, rank: usize, fallback: &str) -> EngineError {
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until {
            if let Some(e) = read_dead(&self.dead) {
                return e;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        dead_rank(rank, fallback)
    }

    /// Rank `rank`'s next answer, failing fast when any worker dies.
    fn recv(&mut self, rank: usize, timeout: Duration) -> Result<WorkerResponse, EngineError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = read_dead(&self.dead) {
                return Err(e);
            }
            let Some(reader) = self.responses.get_mut(rank) else {
                return Err(dead_rank(rank, "no response queue"));
            };
            match reader.dequeue(Some(Duration::from_millis(100))) {
                Ok(msg) => {
                    return msg.header::<WorkerResponse>().map_err(|e| {
                        let e = dead_rank(rank, format!("undecodable answer: {e}"));
                        set_dead(&self.dead, e.clone());
                        e
                    });
                }
                Err(IpcError::Timeout(_) | IpcError::ReadyTimeout { .. })
                    if Instant::now() < deadline => {}
                Err(IpcError::Timeout(_)) => {
                    let e = dead_rank(rank, format!("no answer within {timeout:?}"));
                    set_dead(&self.dead, e.clone());
                    return Err(e);
                }
                Err(other) => {
                    let e = self.wait_for_cause(rank, &format!("response queue: {other}"));
                    set_dead(&self.dead, e.clone());
                    return Err(e);
                }
            }
        }
    }

    fn wait_children(&self, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        loop {
            let all_gone = {
                let mut guard = self.lock_children();
                for slot in guard.iter_mut() {
                    if let Some(c) = slot
                        && let Ok(Some(_)) = c.try_wait()
                    {
                        *slot = None;
                    }
                }
                guard.iter().all(Option::is_none)
            };
            if all_gone || Instant::now() >= until {
                return all_gone;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal_children(&self, sig: nix::sys::signal::Signal) {
        for c in self.lock_children().iter().flatten() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), sig);
        }
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

impl Executor for MultiprocExecutor {
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
    ) -> Result<ModelRunnerOutput, EngineError> {
        self.broadcast_cmd(&WorkerCommand::ExecuteModel(scheduler_output.clone()))?;
        let mut output = None;
        for rank in 0..self.world {
            match self.recv(rank, self.execute_timeout)? {
                WorkerResponse::ModelRunnerOutput(out) if rank == 0 => output = Some(out),
                WorkerResponse::Ready { .. } if rank != 0 => {}
                other => return Err(self.unexpected(rank, "ExecuteModel", other)),
            }
        }
        output.ok_or_else(|| dead_rank(0, "no output from rank 0"))
    }

    fn check_health(&mut self) -> Result<(), EngineError> {
        match read_dead(&self.dead) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn shutdown(&mut self) {
        if self.shut_down {
            return;
        }
        self.shut_down = true;
        self.stopping.store(true, Ordering::Release);
        if read_dead(&self.dead).is_none()
            && let Some(b) = self.broadcast.as_mut()
        {
            let _ = b.enqueue(&WorkerCommand::Shutdown, &[]);
        }
        if let Some(b) = &self.broadcast {
            b.shutdown();
        }
        self.stdins.clear(); // EOF on every worker's stdin
        if !self.wait_children(Duration::from_secs(2)) {
            self.signal_children(nix::sys::signal::Signal::SIGTERM);
            if !self.wait_children(Duration::from_secs(2)) {
                self.signal_children(nix::sys::signal::Signal::SIGKILL);
                self.wait_children(Duration::from_secs(2));
            }
        }
        if let Some(t) = self.monitor.take() {
            let _ = t.join();
        }
        self.responses.clear();
        self.broadcast = None;
        self.all_reduce = None;
        // Segments whose creator (a killed worker) could not unlink them.
        self.remove_instance_segments();
    }
}

impl Drop for MultiprocExecutor {
    fn drop(&mut self) {
        self.shutdown();
    }
}
