//! [`EngineConfig`]: every setting of one engine, in per-area parts. Each part is both a clap
//! argument group (its `///` docs are `--help`; its defaults are written once, in the clap
//! attributes) and a serde struct (what a child process receives and what start-up logs).
//!
//! Precedence is defaults < `--config FILE` < environment < command line, resolved by
//! [`crate::layered_argv`] before clap parses (vLLM's scheme: the file's keys are the long flag
//! names, and they are parsed as if typed before the command line).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, FromArgMatches, ValueEnum};
use omni_ipc::MessageQueueConfig;
use serde::{Deserialize, Serialize};

use crate::Error;

/// Where the weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadFormat {
    /// From the files found at `--model`.
    Auto,
    /// HF safetensors files.
    Safetensors,
    /// A GGUF file.
    Gguf,
    /// Random weights of the model's shapes (`config.json` still required).
    Dummy,
}

/// Compute dtype of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dtype {
    /// The checkpoint's own dtype.
    Auto,
    /// 32-bit float.
    #[value(alias = "float")]
    Float32,
    /// 16-bit float.
    #[value(alias = "half")]
    Float16,
    /// bfloat16.
    Bfloat16,
}

/// Which executor runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExecutorKind {
    /// One worker process per rank (`MultiprocExecutor`).
    Mp,
    /// The model in the engine's own process (`UniprocExecutor`, tensor-parallel size 1).
    Uni,
}

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceKind {
    /// CUDA when an NVIDIA driver and enough devices are present, else the CPU.
    Auto,
    /// One NVIDIA GPU per tensor-parallel rank (bf16).
    Cuda,
    /// The CPU backend (f32).
    Cpu,
}

/// The model and how it is loaded.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Model")]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Model: a HF checkpoint directory or a `.gguf` file. Absent: the built-in
    /// SmolLM2-135M-Instruct GGUF (fetched into the cache directory on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weight format: `auto` reads what the model path holds; `dummy` uses random weights of the
    /// model's shapes (config.json still required).
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    pub load_format: LoadFormat,
    /// Compute dtype (`auto`: the checkpoint's). The CPU backend computes in float32 and the
    /// CUDA backend in bfloat16 whatever is asked (a warning says so).
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,
    /// Longest sequence (prompt + output), in tokens.
    #[arg(long, default_value_t = 2048)]
    pub max_model_len: u32,
    /// Seed of the workers' global sampling stream and of dummy weights.
    #[arg(long, default_value_t = 0)]
    pub engine_seed: u64,
    /// Where downloaded models are cached (default `$HOME/.cache/omni-engine`; env
    /// `OMNI_CACHE_DIR`).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

/// The KV cache.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Cache")]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Fraction of each GPU's memory the engine may use (weights, activations, KV cache); the
    /// KV cache gets what is left after loading.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// KV cache bytes per rank, e.g. `256MiB`, `1GiB`, `1000000` (CPU default 256MiB; on a GPU
    /// the default is what `--gpu-memory-utilization` leaves).
    #[arg(long, value_parser = parse_bytes)]
    pub kv_cache_memory: Option<u64>,
    /// Use exactly this many KV blocks instead of the byte budget.
    #[arg(long)]
    pub num_gpu_blocks_override: Option<u32>,
    /// Reuse the KV blocks of shared prompt prefixes (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    #[serde(skip)]
    pub enable_prefix_caching: bool,
    /// Turn prefix caching off.
    #[arg(long, alias = "no-prefix-caching")]
    pub no_enable_prefix_caching: bool,
}

impl CacheConfig {
    /// Whether prefix caching is on (the last of the two flags wins; default on).
    pub fn prefix_caching(&self) -> bool {
        !self.no_enable_prefix_caching
    }
}

/// How the model is split across processes and devices.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Parallelism")]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    /// Tensor-parallel size: worker processes (also `-tp`).
    #[arg(
        long = "tensor-parallel-size",
        visible_alias = "tp",
        default_value_t = 1
    )]
    pub tensor_parallel_size: u32,
    /// Pipeline-parallel size (also `-pp`): the decoder's layers split into this many stages of
    /// `-tp` ranks each (text decoders; CPU workers so far).
    #[arg(
        long = "pipeline-parallel-size",
        visible_alias = "pp",
        default_value_t = 1
    )]
    pub pipeline_parallel_size: u32,
    /// Nodes of the deployment (vLLM's `--nnodes`, also `-n`): the `tp x pp` ranks are spread
    /// over them, consecutive ranks per node. Node 0 (the leader) runs the API server and the
    /// engine core; the others run `--headless`.
    #[arg(long, visible_short_alias = 'n', default_value_t = 1)]
    pub nnodes: u32,
    /// This node's rank (0: the leader; also `-r`).
    #[arg(long, visible_short_alias = 'r', default_value_t = 0)]
    pub node_rank: u32,
    /// The leader's address, where followers join (a name is resolved on every try).
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// The leader's rendezvous port.
    #[arg(long, default_value_t = 29501)]
    pub master_port: u16,
    /// Run only this node's workers, joined to the leader at `--master-addr` (no API server,
    /// no engine core): every node but 0.
    #[arg(long)]
    pub headless: bool,
    /// This node's address for its peers (env `VLLM_HOST_IP`); default: the address its
    /// connection to the leader leaves from (a follower) or arrives at (the leader).
    #[arg(long)]
    pub host_ip: Option<std::net::IpAddr>,
    /// Longest wait for every node to join, in seconds (followers retry until then).
    #[arg(long, default_value_t = 300)]
    pub distributed_timeout_seconds: u64,
    /// Executor: one process per rank (`mp`) or the model in the engine's process (`uni`).
    #[arg(
        long,
        visible_alias = "distributed-executor-backend",
        value_enum,
        default_value_t = ExecutorKind::Mp
    )]
    pub executor: ExecutorKind,
    /// Run the engine core (scheduler, KV cache manager, executor) in a process of its own,
    /// `omni-engine-core`, which spawns the workers, instead of on a thread of this process
    /// (env `VLLM_ENABLE_V1_MULTIPROCESSING`, vLLM's name). vLLM defaults to its own process;
    /// here the default is the thread (off) until the extra hop is measured as free.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        default_value_t = false,
        default_missing_value = "true",
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub enable_multiprocessing: bool,
}

/// The scheduler's budgets.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Scheduler")]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Most requests in a batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Schedule the next step while the current one runs (vLLM's `--async-scheduling`): the
    /// workers feed each request the token they just sampled, so the scheduler, the output
    /// path and the queue hand-off no longer sit between two steps on the device. On by
    /// default where it works (one pipeline stage), as in vLLM; `--no-async-scheduling` or
    /// `--async-scheduling false` turns it off. A request that stops on a token costs one
    /// discarded step.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new(),
        overrides_with = "no_async_scheduling"
    )]
    #[serde(default)]
    pub async_scheduling: Option<bool>,
    /// Turn async scheduling off.
    #[arg(long, overrides_with = "async_scheduling")]
    #[serde(default)]
    pub no_async_scheduling: bool,
}

impl SchedulerConfig {
    /// Async scheduling as asked for: `Some(false)` after `--no-async-scheduling`, `None`
    /// when neither flag was given (then it is on wherever the engine supports it).
    pub fn async_scheduling_requested(&self) -> Option<bool> {
        if self.no_async_scheduling {
            Some(false)
        } else {
            self.async_scheduling
        }
    }
}

/// The device backend.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Device")]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// Device: `auto` takes CUDA when an NVIDIA driver is present, else the CPU.
    #[arg(long, value_enum, default_value_t = DeviceKind::Auto)]
    pub device: DeviceKind,
    /// Run every step eagerly (no CUDA graphs for decode).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Print per-kernel GPU times of this many eager steps (env `OMNI_CUDA_PROFILE`; 0: off).
    #[arg(long, default_value_t = 0)]
    pub cuda_profile_steps: u32,
    /// Seconds between an omni stage's `stage profile` log lines (its steps' phases, inputs,
    /// sends and idle time; env `OMNI_STAGE_PROFILE_INTERVAL_S`; 0: off).
    #[arg(long, default_value_t = 10.0)]
    pub stage_profile_interval_s: f32,
}

/// The broadcast queue (scheduler -> workers) and the workers' response queues.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "IPC")]
#[serde(deny_unknown_fields)]
pub struct IpcConfig {
    /// Ring slot size of the broadcast queue in MiB (env `VLLM_MQ_MAX_CHUNK_BYTES_MB`, vLLM's
    /// name). A message larger than one slot goes over ZeroMQ.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub mq_max_chunk_bytes_mb: u64,
    /// Ring slots of the broadcast queue: how far the scheduler may run ahead of the slowest
    /// worker (env `OMNI_IPC_MAX_CHUNKS`).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub ipc_max_chunks: u64,
    /// Microseconds a waiting queue reader spins before it parks (env `OMNI_IPC_SPIN_US`).
    #[arg(long, default_value_t = 200)]
    pub ipc_spin_us: u64,
    /// Seconds between "No available shared memory broadcast block" warnings of a blocked
    /// writer (env `OMNI_IPC_WARN_INTERVAL_S`).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub ipc_warn_interval_s: u64,
    /// Ring slot size of each worker's response queue in MiB (responses are a few KB per
    /// step; the broadcast chunk size does not apply to them).
    #[arg(
        long,
        default_value_t = (omni_ipc::config::SMALL_QUEUE_CHUNK_BYTES >> 20) as u64,
        value_parser = clap::value_parser!(u64).range(1..=1024)
    )]
    pub ipc_response_chunk_bytes_mb: u64,
}

impl IpcConfig {
    /// The broadcast queue's configuration.
    pub fn broadcast(&self) -> MessageQueueConfig {
        let d = MessageQueueConfig::default();
        let max_chunk_bytes = (self.mq_max_chunk_bytes_mb as usize) << 20;
        MessageQueueConfig {
            max_chunk_bytes,
            max_chunks: self.ipc_max_chunks as usize,
            spin: Duration::from_micros(self.ipc_spin_us),
            warn_interval: Duration::from_secs(self.ipc_warn_interval_s),
            max_message_bytes: d.max_message_bytes.max(max_chunk_bytes),
            ..d
        }
    }

    /// A worker's response queue: the broadcast's timings, small slots, few of them.
    pub fn response(&self) -> MessageQueueConfig {
        let max_chunk_bytes = (self.ipc_response_chunk_bytes_mb as usize) << 20;
        MessageQueueConfig {
            max_chunk_bytes,
            max_chunks: omni_ipc::config::SMALL_QUEUE_CHUNKS,
            ..self.broadcast()
        }
    }
}

/// Every setting of one engine (one stage of a pipeline).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// The model and how it is loaded.
    #[command(flatten)]
    pub model: ModelConfig,
    /// The KV cache.
    #[command(flatten)]
    pub cache: CacheConfig,
    /// Parallelism.
    #[command(flatten)]
    pub parallel: ParallelConfig,
    /// The scheduler's budgets.
    #[command(flatten)]
    pub scheduler: SchedulerConfig,
    /// The device backend.
    #[command(flatten)]
    pub device: DeviceConfig,
    /// The queues between the processes.
    #[command(flatten)]
    pub ipc: IpcConfig,
}

impl Default for EngineConfig {
    /// The defaults, as clap's attributes write them (the one place they are written).
    fn default() -> Self {
        clap_defaults()
    }
}

/// A clap argument group parsed from no arguments: its defaults as its attributes write them.
pub(crate) fn clap_defaults<T: Args + FromArgMatches>() -> T {
    let cmd = T::augment_args(clap::Command::new("defaults").no_binary_name(true));
    let m = cmd
        .try_get_matches_from(std::iter::empty::<String>())
        .unwrap_or_default();
    // Every field has a default or is optional, so parsing no arguments cannot fail; this is
    // reached only if a future field forgets its default, which the tests catch.
    T::from_arg_matches(&m).unwrap_or_else(|e| {
        panic!(
            "{} has a required field without a default: {e}",
            std::any::type_name::<T>()
        )
    })
}

impl EngineConfig {
    /// Checks the values together; every problem is reported, not just the first.
    pub fn validate(&self) -> Result<(), Error> {
        let mut p = Vec::new();
        let u = self.cache.gpu_memory_utilization;
        if !(u > 0.0 && u <= 1.0) {
            p.push(format!(
                "--gpu-memory-utilization must be in (0, 1], got {u}"
            ));
        }
        if self.parallel.tensor_parallel_size == 0 {
            p.push("--tensor-parallel-size must be at least 1".into());
        }
        if self.parallel.pipeline_parallel_size == 0 {
            p.push("--pipeline-parallel-size must be at least 1".into());
        }
        let par = &self.parallel;
        let world = par.tensor_parallel_size * par.pipeline_parallel_size;
        if par.nnodes == 0 {
            p.push("--nnodes must be at least 1".into());
        } else if !world.is_multiple_of(par.nnodes) {
            p.push(format!(
                "-tp {} x -pp {} = {world} ranks do not split evenly over --nnodes {}",
                par.tensor_parallel_size, par.pipeline_parallel_size, par.nnodes
            ));
        }
        if par.node_rank >= par.nnodes.max(1) {
            p.push(format!(
                "--node-rank {} must be below --nnodes {}",
                par.node_rank, par.nnodes
            ));
        }
        if par.headless != (par.node_rank > 0) {
            p.push(if par.headless {
                "--headless runs a follower node: give it --node-rank 1 or more".into()
            } else {
                format!(
                    "--node-rank {} is a follower: run it with --headless",
                    par.node_rank
                )
            });
        }
        if par.nnodes > 1 && par.executor == ExecutorKind::Uni {
            p.push("--nnodes > 1 needs --executor mp".into());
        }
        if self.parallel.executor == ExecutorKind::Uni
            && (self.parallel.tensor_parallel_size != 1
                || self.parallel.pipeline_parallel_size != 1)
        {
            p.push(
                "--executor uni runs one rank; use --executor mp for tensor or pipeline \
                 parallelism"
                    .into(),
            );
        }
        if self.cache.block_size == 0 || !self.cache.block_size.is_power_of_two() {
            p.push(format!(
                "--block-size must be a power of two, got {}",
                self.cache.block_size
            ));
        }
        if self.model.max_model_len == 0 {
            p.push("--max-model-len must be at least 1".into());
        }
        if self.scheduler.max_num_seqs == 0 {
            p.push("--max-num-seqs must be at least 1".into());
        }
        if self.scheduler.max_num_batched_tokens == 0 {
            p.push("--max-num-batched-tokens must be at least 1".into());
        }
        if let Err(e) = self.ipc.broadcast().validate() {
            p.push(e.to_string());
        }
        if p.is_empty() {
            Ok(())
        } else {
            Err(Error::Invalid(p))
        }
    }
}

/// `256MiB`, `1GiB`, `64KiB`, `100MB`, or a plain byte count.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("not a size: {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => return Err(format!("unknown size unit {other:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size too large: {s:?}"))
}
