//! Starting an engine from one [`EngineConfig`]: layer L3, the one place that links the engine
//! core (scheduler, KV cache manager, executor) with the worker and model crates. `serve`,
//! `generate` and every `bench` command start their engine through [`launch`]; the binary only
//! parses flags and dispatches.
//!
//! `--enable-multiprocessing` (env `VLLM_ENABLE_V1_MULTIPROCESSING`) picks where the engine
//! core runs: on a thread of this process ([`omni_core::InprocClient`], the default) or in a
//! process of its own ([`omni_core::MpClient`]): this same binary as `omni-engine engine-core`,
//! which receives the resolved config in its handshake and calls [`run_engine_core_process`],
//! which builds the engine core with the same function ([`build_engine_core`]) and spawns the
//! workers from there. Either way the caller gets an `Arc<dyn EngineCoreClient>`.
//!
//! ```no_run
//! # fn main() -> Result<(), omni_launch::LaunchError> {
//! let mut config = omni_config::EngineConfig::default();
//! config.model.model = Some("path/to/hf-dir".into());
//! config.validate()?;
//! let started = omni_launch::launch(&config, &std::env::current_exe().unwrap())?;
//! let client = started.engine.clone(); // submit requests, read their streams
//! # drop(client); Ok(()) }
//! ```

pub mod omni;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use omni_config::{DeviceKind, Dtype, EngineConfig, ExecutorKind, LoadFormat as LoadFormatCfg};
use omni_core::{
    DEFAULT_KV_CACHE_MEMORY_BYTES, EngineCore, EngineCoreClient, EngineCoreProc, Executor,
    InprocClient, MpClient, MpClientConfig, MultiprocConfig, MultiprocExecutor, SchedulerConfig,
    StartupSpec, UniprocExecutor,
};
use omni_protocol::{DType, Device, LoadFormat, LoadModelSpec};

/// Why an engine did not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The configuration is not usable (every problem listed).
    #[error(transparent)]
    Config(#[from] omni_config::Error),
    /// `--device cuda` cannot be honoured.
    #[error("--device cuda: {0}")]
    Device(String),
    /// The built-in default model could not be located or fetched.
    #[error("locating the default model (run scripts/fetch-default-model.sh): {0}")]
    DefaultModel(#[from] omni_gguf::Error),
    /// The executor (workers, model load, KV cache) failed to start.
    #[error(transparent)]
    Executor(#[from] omni_core::ExecutorStartError),
    /// The scheduler rejected the configuration.
    #[error(transparent)]
    Scheduler(#[from] omni_core::SchedulerConfigError),
    /// The engine-core process did not start (`--enable-multiprocessing`).
    #[error(transparent)]
    EngineCore(#[from] omni_core::EngineCoreStartError),
    /// The engine-core process's side of its handshake or queues failed.
    #[error(transparent)]
    EngineCoreProc(#[from] omni_core::EngineCoreProcError),
    /// An omni pipeline cannot be set up (`serve --omni`).
    #[error("omni: {0}")]
    Omni(String),
}

/// A started engine: the client of its engine core, and what start-up decided.
#[derive(Debug)]
pub struct StartedEngine {
    /// The engine core, on a thread here or in its own process
    /// ([`EngineCoreClient::shutdown`], or dropping the last clone, stops it and the workers).
    pub engine: Arc<dyn EngineCoreClient>,
    /// The scheduler's configuration, KV blocks included.
    pub scheduler: SchedulerConfig,
    /// The model path that was loaded (the default model's when none was given).
    pub model: PathBuf,
    /// The device the model runs on (`--device auto` resolved).
    pub device: Device,
}

/// The model path: `config.model.model` when given, else the built-in default model (fetched
/// into the cache on first use; its path is logged).
pub fn resolve_model(config: &EngineConfig) -> Result<PathBuf, LaunchError> {
    if let Some(m) = &config.model.model {
        return Ok(m.clone());
    }
    let path = omni_gguf::default_model::locate_or_fetch_in(config.model.cache_dir.as_deref())?;
    tracing::info!(
        path = %path.display(),
        "no model given: using the built-in default model {}",
        omni_gguf::default_model::MODEL_NAME
    );
    Ok(path)
}

/// What the engine's model load asks of every worker.
pub fn load_spec(config: &EngineConfig, model: &Path, device: Device) -> LoadModelSpec {
    LoadModelSpec {
        model: model.display().to_string(),
        load_format: match config.model.load_format {
            LoadFormatCfg::Auto => LoadFormat::Auto,
            LoadFormatCfg::Safetensors => LoadFormat::Safetensors,
            LoadFormatCfg::Gguf => LoadFormat::Gguf,
            LoadFormatCfg::Dummy => LoadFormat::Dummy,
        },
        dtype: match config.model.dtype {
            Dtype::Auto => None,
            Dtype::Float32 => Some(DType::F32),
            Dtype::Float16 => Some(DType::F16),
            Dtype::Bfloat16 => Some(DType::Bf16),
        },
        max_model_len: config.model.max_model_len,
        block_size: config.cache.block_size,
        gpu_memory_utilization: config.cache.gpu_memory_utilization,
        tensor_parallel_size: config.parallel.tensor_parallel_size,
        pipeline_parallel_size: config.parallel.pipeline_parallel_size,
        seed: config.model.engine_seed,
        device,
        max_num_batched_tokens: u32::try_from(config.scheduler.max_num_batched_tokens)
            .unwrap_or(u32::MAX),
        max_num_seqs: u32::try_from(config.scheduler.max_num_seqs).unwrap_or(u32::MAX),
        enforce_eager: config.device.enforce_eager,
        cuda_profile_steps: config.device.cuda_profile_steps,
    }
}

/// Starts the engine of `config`: the engine core on a thread of this process, or (with
/// `config.parallel.enable_multiprocessing`) in a process of its own that `exe` runs as
/// `omni-engine engine-core`. `exe` is also the binary that runs as `omni-engine worker` for
/// each rank.
///
/// Call it on a thread that lives as long as the engine (the main thread): worker processes
/// (and the engine-core process) get `PR_SET_PDEATHSIG` and die with the thread that spawned
/// them.
pub fn launch(config: &EngineConfig, exe: &Path) -> Result<StartedEngine, LaunchError> {
    config.validate()?;
    if config.parallel.enable_multiprocessing {
        return launch_engine_core_process(config, exe);
    }
    let built = build_engine_core(config, exe)?;
    Ok(StartedEngine {
        engine: Arc::new(InprocClient::spawn(built.core)),
        scheduler: built.scheduler,
        model: built.model,
        device: built.device,
    })
}

/// An engine core assembled from a config, not yet running.
pub struct BuiltEngineCore {
    /// The scheduler over the started executor.
    pub core: EngineCore<Box<dyn Executor + Send>>,
    /// The scheduler's configuration, KV blocks included.
    pub scheduler: SchedulerConfig,
    /// The model path that was loaded.
    pub model: PathBuf,
    /// The device the model runs on.
    pub device: Device,
}

impl std::fmt::Debug for BuiltEngineCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuiltEngineCore")
            .field("scheduler", &self.scheduler)
            .field("model", &self.model)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// Starts the workers (one process per rank, or the model in-process with `--executor uni`),
/// loads the model, sizes the KV cache and builds the engine core over them: what both an
/// in-process engine and the engine-core process run.
pub fn build_engine_core(
    config: &EngineConfig,
    exe: &Path,
) -> Result<BuiltEngineCore, LaunchError> {
    config.validate()?;
    let device = resolve_device(config)?;
    if config.model.dtype != Dtype::Auto {
        tracing::warn!(
            "--dtype {:?}: the {device:?} backend computes in {} regardless",
            config.model.dtype,
            if device == Device::Cpu {
                "float32"
            } else {
                "bfloat16"
            }
        );
    }
    let model = resolve_model(config)?;
    tracing::info!(
        config = %serde_json::to_string(config).unwrap_or_default(),
        "resolved engine config"
    );
    let startup = StartupSpec {
        load: load_spec(config, &model, device),
        kv_cache_memory_bytes: match (config.cache.kv_cache_memory, device) {
            (Some(b), _) if b > 0 => Some(b),
            (_, Device::Cpu) => Some(DEFAULT_KV_CACHE_MEMORY_BYTES),
            (_, Device::Cuda) => None,
        },
        num_blocks_override: config.cache.num_gpu_blocks_override,
    };
    let (executor, num_blocks): (Box<dyn Executor + Send>, u32) = match config.parallel.executor {
        ExecutorKind::Mp => {
            let mut mp = MultiprocConfig::new(
                exe.to_path_buf(),
                config.parallel.tensor_parallel_size,
                startup,
            );
            mp.pipeline_parallel_size = config.parallel.pipeline_parallel_size;
            let par = &config.parallel;
            mp.nodes = (par.nnodes > 1).then(|| omni_core::NodeConfig {
                nnodes: par.nnodes,
                master_addr: par.master_addr.clone(),
                master_port: par.master_port,
                host_ip: par.host_ip,
                join_timeout: std::time::Duration::from_secs(par.distributed_timeout_seconds),
            });
            if mp.nodes.is_some() {
                mp.startup_timeout = mp.startup_timeout.max(std::time::Duration::from_secs(
                    par.distributed_timeout_seconds,
                ));
            }
            mp.ipc = config.ipc.broadcast();
            mp.response = config.ipc.response();
            tracing::info!(
                max_chunk_bytes = mp.ipc.max_chunk_bytes,
                max_chunks = mp.ipc.max_chunks,
                "broadcast queue"
            );
            let ex = MultiprocExecutor::start(mp)?;
            let n = ex.num_blocks();
            (Box::new(ex), n)
        }
        ExecutorKind::Uni => {
            let worker =
                omni_worker::Worker::in_process(0, Arc::new(omni_models::IdentityAllReduce));
            let ex = UniprocExecutor::start(worker, &startup)?;
            let n = ex.num_blocks();
            (Box::new(ex), n)
        }
    };
    let scheduler = scheduler_config(config, num_blocks);
    let core = EngineCore::new(scheduler.clone(), executor)?;
    Ok(BuiltEngineCore {
        core,
        scheduler,
        model,
        device,
    })
}

/// The scheduler's configuration for `num_blocks` KV blocks.
pub fn scheduler_config(config: &EngineConfig, num_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: config.scheduler.max_num_batched_tokens,
        max_num_seqs: config.scheduler.max_num_seqs,
        max_model_len: config.model.max_model_len as usize,
        block_size: config.cache.block_size as usize,
        num_blocks: num_blocks as usize,
        enable_prefix_caching: config.cache.prefix_caching(),
        enable_chunked_prefill: true,
        // vLLM's default: on where the executor supports it (one pipeline stage); asked for
        // with more, the engine core says why it schedules synchronously.
        async_scheduling: config
            .scheduler
            .async_scheduling_requested()
            .unwrap_or(config.parallel.pipeline_parallel_size <= 1),
    }
}

/// `launch` with the engine core in its own process: the model path is resolved here (so the
/// child never fetches), the rest of start-up happens there.
fn launch_engine_core_process(
    config: &EngineConfig,
    exe: &Path,
) -> Result<StartedEngine, LaunchError> {
    let mut resolved = config.clone();
    resolved.model.model = Some(resolve_model(config)?);
    let mut cfg = MpClientConfig::new(exe.to_path_buf());
    // Small slots (a message is one request or one step's outputs), and no spin before a
    // reader parks: the client's reader waits once per step beside the busy engine core and
    // workers, and on an oversubscribed machine its spinning cost more than a futex wake
    // (2-core VM, tiny fixture, batch-1 decode over in-process: about +0.15-0.2 ms/step
    // spinning 200 us, +0.08 ms parking at once).
    let mut queue = config.ipc.response();
    queue.spin = std::time::Duration::ZERO;
    cfg.input_queue = queue.clone();
    cfg.output_queue = queue;
    let (client, ready) = MpClient::start(&cfg, &resolved)?;
    Ok(StartedEngine {
        engine: Arc::new(client),
        scheduler: scheduler_config(config, ready.num_gpu_blocks),
        model: PathBuf::from(ready.model),
        device: ready.device,
    })
}

/// How an engine-core process ended without an error of its own to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineCoreExit {
    /// It served until its client shut it down.
    Served,
    /// Its start-up failed and the client was told why (and says so itself): exit non-zero
    /// without printing the error a second time.
    StartupFailed,
}

/// The main of `omni-engine engine-core`: the handshake on stdin/stdout (the resolved config
/// comes in it), [`build_engine_core`] (which spawns the workers from this process, with `exe`
/// as their binary), then the busy loop over the two queues until the client shuts it down.
/// A start-up error goes to the client, which reports it.
pub fn run_engine_core_process(exe: &Path) -> Result<EngineCoreExit, LaunchError> {
    let (proc, config): (EngineCoreProc, EngineConfig) = EngineCoreProc::accept()?;
    match build_engine_core(&config, exe) {
        Ok(built) => {
            let model = built.model.display().to_string();
            proc.run(built.core, &model, built.device)?;
            Ok(EngineCoreExit::Served)
        }
        Err(e) => {
            proc.fail(&e.to_string())?;
            Ok(EngineCoreExit::StartupFailed)
        }
    }
}

/// The GPU this binary can use: its name and how many devices the driver sees.
#[derive(Debug)]
pub struct CudaStatus {
    /// Device 0's name.
    pub name: String,
    /// Devices the driver sees.
    pub device_count: usize,
}

/// Whether CUDA is usable here, and with how many devices.
#[cfg(feature = "cuda")]
pub fn cuda_status() -> Result<CudaStatus, String> {
    omni_backend::cuda::driver_status()
        .map(|i| CudaStatus {
            name: i.name,
            device_count: i.device_count,
        })
        .map_err(|e| e.to_string())
}

/// Whether CUDA is usable here (never, in a build without the `cuda` feature).
#[cfg(not(feature = "cuda"))]
pub fn cuda_status() -> Result<CudaStatus, String> {
    Err("this omni-engine was built without the CUDA backend (feature `cuda`)".into())
}

/// GPUs this node's ranks need: one each (its share of `tp x pp` over `--nnodes`), or, when
/// devices may be shared (`OMNI_CUDA_SHARE_DEVICES=1`), one per rank of a tensor-parallel group.
pub fn gpus_needed(config: &EngineConfig, share: bool) -> usize {
    let p = &config.parallel;
    let world = (p.tensor_parallel_size.max(1) * p.pipeline_parallel_size.max(1)) as usize;
    let local = world.div_ceil(p.nnodes.max(1) as usize);
    if share {
        local.min(p.tensor_parallel_size.max(1) as usize)
    } else {
        local
    }
}

/// `--device`: `auto` is CUDA when a driver and enough devices are usable, else the CPU
/// (logged); `cuda` without a usable driver is a start-up error that says why.
pub fn resolve_device(config: &EngineConfig) -> Result<Device, LaunchError> {
    let need = gpus_needed(config, omni_worker::share_devices());
    let p = &config.parallel;
    match config.device.device {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => match cuda_status() {
            Ok(info) if info.device_count >= need => Ok(Device::Cuda),
            Ok(info) => Err(LaunchError::Device(format!(
                "-tp {} -pp {} over {} node(s) needs {need} GPUs on this node; this machine has {}",
                p.tensor_parallel_size, p.pipeline_parallel_size, p.nnodes, info.device_count
            ))),
            Err(e) => Err(LaunchError::Device(e)),
        },
        DeviceKind::Auto => match cuda_status() {
            Ok(info) if info.device_count >= need => {
                tracing::info!(
                    gpu = %info.name,
                    count = info.device_count,
                    "CUDA device found: running on the GPU"
                );
                Ok(Device::Cuda)
            }
            Ok(info) => {
                tracing::warn!(
                    "{} GPUs for -tp {need}: running on the CPU",
                    info.device_count
                );
                Ok(Device::Cpu)
            }
            Err(e) => {
                tracing::info!("running on the CPU ({e})");
                Ok(Device::Cpu)
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::gpus_needed;

    #[test]
    fn a_node_needs_a_gpu_per_local_rank_unless_stages_share_them() {
        let mut c = omni_config::EngineConfig::default();
        let set = |c: &mut omni_config::EngineConfig, tp, pp, nnodes| {
            c.parallel.tensor_parallel_size = tp;
            c.parallel.pipeline_parallel_size = pp;
            c.parallel.nnodes = nnodes;
        };
        set(&mut c, 1, 1, 1);
        assert_eq!(gpus_needed(&c, false), 1);
        set(&mut c, 2, 2, 1);
        assert_eq!(gpus_needed(&c, false), 4);
        assert_eq!(gpus_needed(&c, true), 2);
        set(&mut c, 2, 2, 2);
        assert_eq!(gpus_needed(&c, false), 2);
        set(&mut c, 1, 2, 1);
        assert_eq!(gpus_needed(&c, true), 1);
        set(&mut c, 8, 1, 1);
        assert_eq!(gpus_needed(&c, true), 8);
    }
}
