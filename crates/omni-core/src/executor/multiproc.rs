//! [`MultiprocExecutor`]: one worker process per tensor-parallel rank (vLLM's
//! `MultiprocExecutor`), over a [`WorkerGroup`] (the processes, their queues, RPC and the death
//! monitor; see `workers/`).
//!
//! Start-up: the group launches and connects the workers, then the shared start-up sequence
//! (`LoadModel` on every rank, [`super::plan_num_blocks`], `InitCache`) runs over its
//! `collective_rpc`. Each step broadcasts `ExecuteModel` with the batch's tensor buffers and
//! reads every rank's answer: rank 0's [`ModelRunnerOutput`] (with its own buffers), the
//! others' small acknowledgements (so a failing rank is seen at once and no response queue
//! fills up).
//!
//! A worker gets `PR_SET_PDEATHSIG`: it is killed when the *thread* that spawned it exits, so
//! start the executor on a thread that lives as long as the engine (the main thread).

use std::path::PathBuf;
use std::time::Duration;

use omni_ipc::MessageQueueConfig;
use omni_protocol::{ModelRunnerOutput, SchedulerOutput, WorkerCommandRef, WorkerResponse};

use super::startup::{load_model_and_init_cache, unexpected};
use super::workers::WorkerGroup;
use super::{EngineDeadError, ExecutorStartError, StartupSpec};
use crate::Executor;

/// How to start the workers.
#[derive(Debug, Clone)]
pub struct MultiprocConfig {
    /// The binary to run (usually `std::env::current_exe()`).
    pub worker_exe: PathBuf,
    /// Its arguments (e.g. `["worker"]`); nothing else goes on the command line.
    pub worker_args: Vec<String>,
    /// Ranks (processes) per pipeline stage.
    pub tensor_parallel_size: u32,
    /// Pipeline stages (`tensor_parallel_size` ranks each).
    pub pipeline_parallel_size: u32,
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
    /// The other nodes, when the ranks span several (this executor runs on the leader).
    pub nodes: Option<super::workers::nodes::NodeConfig>,
}

impl MultiprocConfig {
    /// Defaults for everything but the binary, the world size and the model.
    pub fn new(worker_exe: PathBuf, tensor_parallel_size: u32, startup: StartupSpec) -> Self {
        Self {
            worker_exe,
            worker_args: vec!["worker".into()],
            tensor_parallel_size,
            pipeline_parallel_size: 1,
            ipc: MessageQueueConfig::default(),
            response: Self::default_response_queue(),
            startup,
            startup_timeout: Duration::from_secs(300),
            execute_timeout: Duration::from_secs(300),
            all_reduce_segment_bytes: (4 << 20) * tensor_parallel_size.max(1) as usize + 65536,
            nodes: None,
        }
    }

    /// The response queue's defaults: 4 slots of 2 MiB (8 MiB of `/dev/shm` per worker).
    ///
    /// The executor reads every rank's answer before it broadcasts the next command, so one
    /// slot is in use at a time; 4 leave room for pipelined batches. A step's
    /// `ModelRunnerOutput` is a few KB (about 45 KB for 256 requests with 20 top logprobs each);
    /// a larger answer (hidden states) takes the overflow path.
    pub fn default_response_queue() -> MessageQueueConfig {
        MessageQueueConfig::small()
    }
}

/// Worker processes behind a broadcast queue; see the module docs.
#[derive(Debug)]
pub struct MultiprocExecutor {
    group: WorkerGroup,
    num_blocks: u32,
    execute_timeout: Duration,
}

impl MultiprocExecutor {
    /// Spawns and connects the workers, loads the model and allocates the KV cache.
    pub fn start(cfg: MultiprocConfig) -> Result<Self, ExecutorStartError> {
        let mut group = WorkerGroup::start(&cfg)?;
        // An early return drops `group`, which stops the workers and cleans up.
        let layout = load_model_and_init_cache(&cfg.startup, |cmd| {
            group.collective_rpc(cmd, cfg.startup_timeout)
        })?;
        tracing::info!(
            instance = %group.instance(),
            world = group.world(),
            num_blocks = layout.num_blocks,
            kv_bytes_per_block = layout.kv_bytes_per_block,
            "workers ready"
        );
        Ok(Self {
            group,
            num_blocks: layout.num_blocks,
            execute_timeout: cfg.execute_timeout,
        })
    }

    /// KV blocks allocated on every rank.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The engine instance id (prefix of every shared-memory segment it uses).
    pub fn instance(&self) -> &str {
        self.group.instance()
    }
}

impl Executor for MultiprocExecutor {
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> Result<ModelRunnerOutput, EngineDeadError> {
        self.submit(scheduler_output, buffers)?;
        self.collect()
    }

    fn max_concurrent_batches(&self) -> usize {
        self.group.layout().pipeline_parallel_size.max(1) as usize
    }

    /// Without pipeline stages: then every rank samples (the same tokens) and keeps them.
    fn supports_async_scheduling(&self) -> bool {
        self.group.layout().pipeline_parallel_size <= 1
    }

    fn submit(
        &mut self,
        scheduler_output: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> Result<(), EngineDeadError> {
        // By reference: the batch is encoded straight from the scheduler's output, not cloned.
        self.group
            .broadcast(WorkerCommandRef::ExecuteModel(scheduler_output), buffers)
    }

    fn collect(&mut self) -> Result<ModelRunnerOutput, EngineDeadError> {
        // Every rank answers every batch, in the order the batches were sent.
        let mut output = None;
        let output_rank = self.group.layout().output_rank();
        for rank in 0..self.group.world() {
            match self.group.recv(rank, self.execute_timeout)? {
                WorkerResponse::ModelRunnerOutput(out) if rank == output_rank => output = Some(out),
                WorkerResponse::Ready { .. } if rank != output_rank => {}
                other => {
                    return Err(self.group.fail(unexpected(rank, "ExecuteModel", other)));
                }
            }
        }
        output.ok_or_else(|| {
            self.group.fail(EngineDeadError::Worker {
                rank: output_rank as u32,
                cause: format!("no output from rank {output_rank}"),
            })
        })
    }

    fn check_health(&mut self) -> Result<(), EngineDeadError> {
        self.group.check()
    }

    fn shutdown(&mut self) {
        self.group.shutdown();
    }

    fn broadcast_stats(&self) -> Option<omni_ipc::MessageQueueStats> {
        self.group.broadcast_stats()
    }
}
