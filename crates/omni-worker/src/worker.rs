//! [`Worker`]: one rank's command handler. It owns the [`ModelRunner`] and answers every
//! [`WorkerCommand`]; the process around it ([`crate::process`]) only moves messages.

use std::path::Path;
use std::sync::Arc;

use omni_backend::comm::AllReduce;
use omni_models::gguf::GgufWeights;
use omni_models::registry::{self, LoadFormat as RegistryFormat};
use omni_models::weights::LoadProgressFn;
use omni_models::{CausalLm, TpContext};
use omni_protocol::{
    Device, LoadFormat, LoadModelSpec, SchedulerOutput, WorkerCommand, WorkerResponse,
};

use crate::ShmAllReduce;
use crate::WorkerError;
use crate::load_progress::LoadProgress;
use crate::model_runner::ModelRunner;
use crate::step_model::{CpuStepModel, StepModel};

/// One tensor-parallel rank: loads its shard, holds its KV cache, runs steps.
///
/// Every rank computes the whole step (the all-reduce keeps them in lockstep and they sample the
/// same tokens from the same seed), but only the output rank 0 answers
/// [`WorkerCommand::ExecuteModel`] with the
/// [`ModelRunnerOutput`](omni_protocol::ModelRunnerOutput); other ranks answer with a small
/// [`WorkerResponse::Ready`] acknowledgement. The executor reads every rank's answer, so a rank
/// that fails is noticed at once and no response queue ever fills up.
#[derive(Debug)]
pub struct Worker {
    rank: u32,
    group: TpGroup,
    runner: Option<ModelRunner>,
}

/// How a worker reaches its tensor-parallel peers.
#[derive(Debug)]
enum TpGroup {
    /// An all-reduce made by the caller (in-process ranks, tests).
    Given(Arc<dyn AllReduce>),
    /// The executor's segment: the CPU backend opens a [`ShmAllReduce`] on it, the CUDA backend
    /// exchanges the NCCL id through it. `None` for a single rank.
    Segment { world: usize, name: Option<String> },
}

impl Worker {
    /// Rank `rank` running inside the engine's own process (`UniprocExecutor`, tests), joined to
    /// its peers by `all_reduce` (an identity for one rank). CPU only.
    pub fn in_process(rank: u32, all_reduce: Arc<dyn AllReduce>) -> Self {
        Self {
            rank,
            group: TpGroup::Given(all_reduce),
            runner: None,
        }
    }

    /// Rank `rank` of `world` worker processes (`omni-engine worker`, one per rank, started by
    /// the `MultiprocExecutor`); `segment` is the executor's tensor-parallel
    /// segment (required when `world > 1`). The backend is chosen at `LoadModel`.
    pub fn in_worker_process(rank: u32, world: usize, segment: Option<String>) -> Self {
        Self {
            rank,
            group: TpGroup::Segment {
                world,
                name: segment,
            },
            runner: None,
        }
    }

    fn cpu_all_reduce(&self) -> Result<Arc<dyn AllReduce>, WorkerError> {
        match &self.group {
            TpGroup::Given(ar) => Ok(ar.clone()),
            TpGroup::Segment { world, .. } if *world <= 1 => {
                Ok(Arc::new(omni_backend::comm::IdentityAllReduce))
            }
            TpGroup::Segment {
                world,
                name: Some(name),
            } => Ok(Arc::new(
                ShmAllReduce::open(name, self.rank as usize, *world)
                    .map_err(|e| WorkerError::Load(e.to_string()))?,
            )),
            TpGroup::Segment { world, name: None } => Err(WorkerError::Load(format!(
                "{world} ranks but no all-reduce segment"
            ))),
        }
    }

    fn world_size(&self) -> usize {
        match &self.group {
            TpGroup::Given(ar) => ar.world_size(),
            TpGroup::Segment { world, .. } => *world,
        }
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The model runner, once the model is loaded.
    pub fn runner(&self) -> Option<&ModelRunner> {
        self.runner.as_ref()
    }

    /// Answers one command; `None` for [`WorkerCommand::Shutdown`] (which has no answer).
    pub fn handle(&mut self, cmd: &WorkerCommand) -> Option<WorkerResponse> {
        let result = match cmd {
            WorkerCommand::LoadModel(spec) => self.load_model(spec),
            WorkerCommand::InitCache {
                num_blocks,
                block_size,
            } => self
                .runner_mut()
                .and_then(|r| r.init_cache(*num_blocks as usize, *block_size as usize))
                .map(|()| WorkerResponse::Ready { rank: self.rank }),
            WorkerCommand::ExecuteModel(so) => return Some(self.execute_model(so, &[])),
            WorkerCommand::Health => Ok(WorkerResponse::Ready { rank: self.rank }),
            WorkerCommand::Shutdown => return None,
        };
        Some(result.unwrap_or_else(|e| self.error(e)))
    }

    /// Runs one step over the batch and its out-of-band tensor `buffers` (see the type's docs
    /// for what each rank answers).
    pub fn execute_model(&mut self, so: &SchedulerOutput, buffers: &[&[u8]]) -> WorkerResponse {
        let rank = self.rank;
        match self.runner_mut().and_then(|r| r.execute_model(so, buffers)) {
            Ok(out) if rank == 0 => WorkerResponse::ModelRunnerOutput(out),
            Ok(_) => WorkerResponse::Ready { rank },
            Err(e) => self.error(e),
        }
    }

    fn error(&self, e: WorkerError) -> WorkerResponse {
        tracing::error!(rank = self.rank, "worker command failed: {e}");
        WorkerResponse::Error {
            rank: self.rank,
            message: e.to_string(),
        }
    }

    fn runner_mut(&mut self) -> Result<&mut ModelRunner, WorkerError> {
        self.runner.as_mut().ok_or(WorkerError::NotLoaded)
    }

    fn load_model(&mut self, spec: &LoadModelSpec) -> Result<WorkerResponse, WorkerError> {
        let world = spec.tensor_parallel_size.max(1) as usize;
        if world != self.world_size() {
            return Err(WorkerError::Load(format!(
                "tensor_parallel_size {world} but the all-reduce group has {} ranks",
                self.world_size()
            )));
        }
        let progress = LoadProgress::for_rank(self.rank);
        let step_model: Box<dyn StepModel> = match spec.device {
            Device::Cpu => {
                let tp = TpContext::new(self.rank as usize, world, self.cpu_all_reduce()?);
                let on_load = |done, total| progress.on_load(done, total);
                match load_stage_model(spec, tp.clone(), &on_load)? {
                    Some(m) => Box::new(m),
                    None => {
                        let model = load_model_with_progress(spec, tp, &on_load)?;
                        Box::new(CpuStepModel::new(model, mem_available_bytes()))
                    }
                }
            }
            Device::Cuda => self.load_cuda(spec, world, &progress)?,
        };
        let runner = ModelRunner::new(step_model, spec.seed);
        let kv_bytes_per_block = runner.kv_bytes_per_block(spec.block_size as usize);
        let available_memory_bytes = runner.available_kv_bytes()?;
        self.runner = Some(runner);
        Ok(WorkerResponse::ModelLoaded {
            kv_bytes_per_block,
            available_memory_bytes,
        })
    }
}

impl Worker {
    #[cfg(feature = "cuda")]
    fn load_cuda(
        &self,
        spec: &LoadModelSpec,
        world: usize,
        progress: &LoadProgress,
    ) -> Result<Box<dyn StepModel>, WorkerError> {
        let segment = match &self.group {
            TpGroup::Segment { name, .. } => name.clone(),
            TpGroup::Given(_) if world == 1 => None,
            TpGroup::Given(_) => {
                return Err(WorkerError::Load(
                    "CUDA tensor parallelism runs one worker process per GPU (--executor mp)"
                        .into(),
                ));
            }
        };
        Ok(Box::new(crate::cuda_model::load_cuda_model(
            spec,
            self.rank as usize,
            world,
            segment.as_deref(),
            &|done, total| progress.on_load(done, total),
        )?))
    }

    #[cfg(not(feature = "cuda"))]
    fn load_cuda(
        &self,
        _spec: &LoadModelSpec,
        _world: usize,
        _progress: &LoadProgress,
    ) -> Result<Box<dyn StepModel>, WorkerError> {
        Err(WorkerError::Load(
            "this omni-engine was built without the CUDA backend (feature `cuda`)".into(),
        ))
    }
}

impl omni_protocol::WorkerBase for Worker {
    fn handle(&mut self, cmd: &WorkerCommand) -> Option<WorkerResponse> {
        Worker::handle(self, cmd)
    }

    fn execute_model(&mut self, so: &SchedulerOutput, buffers: &[&[u8]]) -> WorkerResponse {
        Worker::execute_model(self, so, buffers)
    }
}

/// Builds rank `tp.rank`'s model from a HF directory (safetensors or dummy weights) or a GGUF
/// file (its weights, or dummy weights of its shapes).
pub fn load_model(spec: &LoadModelSpec, tp: TpContext) -> Result<Box<dyn CausalLm>, WorkerError> {
    load_model_with_progress(spec, tp, &|_, _| {})
}

/// [`load_model`], calling `on_load(tensors read, tensors in all)` after each tensor read.
pub fn load_model_with_progress(
    spec: &LoadModelSpec,
    tp: TpContext,
    on_load: LoadProgressFn<'_>,
) -> Result<Box<dyn CausalLm>, WorkerError> {
    let path = Path::new(&spec.model);
    let is_gguf = path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let dummy = RegistryFormat::Dummy { seed: spec.seed };
    let model = match (spec.load_format, is_gguf) {
        (LoadFormat::Gguf, false) => {
            return Err(WorkerError::Load(format!(
                "{} is not a .gguf file",
                spec.model
            )));
        }
        (LoadFormat::Safetensors, true) => {
            return Err(WorkerError::Load(format!(
                "{} is a GGUF file, not a safetensors directory",
                spec.model
            )));
        }
        (LoadFormat::Auto | LoadFormat::Gguf, true) => {
            let weights = GgufWeights::open(path)?;
            let config = weights.hf_config()?;
            registry::build_model_with_progress(&config, &weights, tp, on_load)?
        }
        (LoadFormat::Dummy, true) => {
            let config = GgufWeights::open(path)?.hf_config()?;
            let weights = registry::dummy_weights(&config, spec.seed)?;
            registry::build_model_with_progress(&config, &weights, tp, on_load)?
        }
        (LoadFormat::Auto | LoadFormat::Safetensors, false) => {
            registry::load_model_dir_with_progress(path, RegistryFormat::Safetensors, tp, on_load)?
        }
        (LoadFormat::Dummy, false) => {
            registry::load_model_dir_with_progress(path, dummy, tp, on_load)?
        }
    };
    Ok(model)
}

/// A model directory whose architecture runs as a stage network in an engine worker
/// ([`registry::engine_stage`]: Qwen3-Omni's Thinker with the encoder towers its checkpoint
/// has, text out), loaded as one; `None` for every other model (a text LLM, a GGUF file).
fn load_stage_model(
    spec: &LoadModelSpec,
    tp: TpContext,
    on_load: LoadProgressFn<'_>,
) -> Result<Option<CpuStepModel>, WorkerError> {
    let dir = Path::new(&spec.model);
    let format = match spec.load_format {
        LoadFormat::Auto | LoadFormat::Safetensors => RegistryFormat::Safetensors,
        LoadFormat::Dummy => RegistryFormat::Dummy { seed: spec.seed },
        LoadFormat::Gguf => return Ok(None),
    };
    if !dir.is_dir() {
        return Ok(None);
    }
    let config = registry::read_config(dir)?;
    let Some(stage) = registry::engine_stage(&config) else {
        return Ok(None);
    };
    let vocab = registry::decoder_spec(&config)?.vocab_size;
    let model = registry::load_stage_model_dir_with_progress(dir, stage, format, tp, on_load)?;
    Ok(Some(CpuStepModel::from_stage_model(
        model,
        vocab,
        mem_available_bytes(),
    )?))
}

/// `MemAvailable` of `/proc/meminfo` in bytes (0 when unreadable): what the CPU KV cache may use.
fn mem_available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
