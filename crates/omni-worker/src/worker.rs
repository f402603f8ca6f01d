//! [`Worker`]: one rank's command handler. It owns the [`ModelRunner`] and answers every
//! [`WorkerCommand`]; the process around it ([`crate::process`]) only moves messages.

use std::path::Path;
use std::sync::Arc;

use omni_backend::comm::AllReduce;
use omni_models::gguf::GgufWeights;
use omni_models::registry::{self, LoadFormat as RegistryFormat};
use omni_models::weights::LoadProgressFn;
use omni_models::{CausalLm, PipelineStage, TpContext};
use omni_protocol::{
    Device, LoadFormat, LoadModelSpec, ParallelLayout, SchedulerOutput, WorkerCommand,
    WorkerHandshake, WorkerResponse,
};

use crate::ShmAllReduce;
use crate::WorkerError;
use crate::load_progress::LoadProgress;
use crate::model_runner::ModelRunner;
use crate::peers::{PeerLinks, PipelineLink};
use crate::step_model::{CpuStepModel, StepModel};
use crate::step_timing::StepTiming;

/// One rank: loads its shard (its tensor-parallel slice of its pipeline stage's layers), holds
/// its KV cache, runs steps.
///
/// Every rank of the last pipeline stage computes the whole step's logits (the all-reduce keeps
/// them in lockstep and they sample the same tokens from the same seed); earlier stages pass
/// their activations on and sample nothing. Only the output rank (TP rank 0 of the last
/// stage) answers
/// [`WorkerCommand::ExecuteModel`] with the
/// [`ModelRunnerOutput`](omni_protocol::ModelRunnerOutput); other ranks answer with a small
/// [`WorkerResponse::Ready`] acknowledgement. The executor reads every rank's answer, so a rank
/// that fails is noticed at once and no response queue ever fills up.
#[derive(Debug)]
pub struct Worker {
    rank: u32,
    group: TpGroup,
    runner: Option<ModelRunner>,
    /// `OMNI_STEP_TIMING` (output rank only).
    timing: Option<StepTiming>,
}

/// How a worker reaches its peers.
#[derive(Debug)]
enum TpGroup {
    /// An all-reduce made by the caller (in-process ranks, tests).
    Given(Arc<dyn AllReduce>),
    /// A worker process: its group's segment (the CPU backend opens a [`ShmAllReduce`] on it,
    /// the CUDA backend exchanges the NCCL id through it; `None` for a group of one, or one
    /// spread over nodes), and its queue links to other ranks (taken at `LoadModel`).
    Process {
        layout: ParallelLayout,
        segment: Option<String>,
        links: Option<Box<PeerLinks>>,
    },
}

impl Worker {
    /// Rank `rank` running inside the engine's own process (`UniprocExecutor`, tests), joined to
    /// its peers by `all_reduce` (an identity for one rank). CPU only.
    pub fn in_process(rank: u32, all_reduce: Arc<dyn AllReduce>) -> Self {
        Self {
            rank,
            group: TpGroup::Given(all_reduce),
            runner: None,
            timing: None,
        }
    }

    /// A worker process (`omni-engine worker`, one per rank, started by the
    /// `MultiprocExecutor` or a follower node's launcher) with the layout, segment and rank of
    /// its handshake and its connected peer `links`. The backend is chosen at `LoadModel`.
    pub fn in_worker_process(hs: &WorkerHandshake, links: PeerLinks) -> Self {
        Self {
            rank: hs.rank,
            group: TpGroup::Process {
                layout: hs.layout.clone(),
                segment: hs.all_reduce_segment.clone(),
                links: Some(Box::new(links)),
            },
            runner: None,
            timing: StepTiming::from_env(),
        }
    }

    /// The tensor-parallel all-reduce of this rank's group and its pipeline link (taken from
    /// the process's links; a second call gets an empty link).
    fn cpu_group(&mut self) -> Result<(Arc<dyn AllReduce>, PipelineLink), WorkerError> {
        let rank = self.rank as usize;
        match &mut self.group {
            TpGroup::Given(ar) => Ok((ar.clone(), PipelineLink::default())),
            TpGroup::Process {
                layout,
                segment,
                links,
            } => {
                let links = links.take().map(|l| *l).unwrap_or_default();
                let size = layout.tp_group(rank).len();
                let ar: Arc<dyn AllReduce> = match (links.all_reduce, segment.as_deref()) {
                    (Some(queues), _) => Arc::new(queues),
                    (None, _) if size <= 1 => Arc::new(omni_backend::comm::IdentityAllReduce),
                    (None, Some(name)) => Arc::new(
                        ShmAllReduce::open(name, layout.tp_rank(rank), size)
                            .map_err(|e| WorkerError::Load(e.to_string()))?,
                    ),
                    (None, None) => {
                        return Err(WorkerError::Load(format!(
                            "{size} tensor-parallel ranks but no all-reduce segment"
                        )));
                    }
                };
                Ok((ar, links.pipeline))
            }
        }
    }

    /// `(tp, pp)` of the group this worker was started in.
    fn parallel_sizes(&self) -> (usize, usize) {
        match &self.group {
            TpGroup::Given(ar) => (ar.world_size(), 1),
            TpGroup::Process { layout, .. } => (
                layout.tensor_parallel_size as usize,
                layout.pipeline_parallel_size as usize,
            ),
        }
    }

    /// Whether this rank answers steps with their output.
    fn is_output_rank(&self) -> bool {
        match &self.group {
            TpGroup::Given(_) => self.rank == 0,
            TpGroup::Process { layout, .. } => self.rank as usize == layout.output_rank(),
        }
    }

    /// This rank's pipeline stage.
    fn pipeline_stage(&self) -> PipelineStage {
        match &self.group {
            TpGroup::Given(_) => PipelineStage::default(),
            TpGroup::Process { layout, .. } => PipelineStage {
                rank: layout.pp_rank(self.rank as usize),
                size: layout.pipeline_parallel_size as usize,
            },
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
        let output_rank = self.is_output_rank();
        let start = std::time::Instant::now();
        let result = self.runner_mut().and_then(|r| r.execute_model(so, buffers));
        if let Some(t) = self
            .timing
            .as_mut()
            .filter(|_| output_rank && !so.is_empty())
        {
            let tokens = u64::from(so.total_num_scheduled_tokens);
            let decode = so.num_scheduled_tokens.values().all(|&n| n == 1);
            if let Some(line) = t.record(start, tokens, decode) {
                tracing::info!(rank, "step timing: {line}");
            }
        }
        match result {
            Ok(out) if output_rank => WorkerResponse::ModelRunnerOutput(out),
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
        let stages = spec.pipeline_parallel_size.max(1) as usize;
        if (world, stages) != self.parallel_sizes() {
            return Err(WorkerError::Load(format!(
                "tensor_parallel_size {world} x pipeline_parallel_size {stages}, but the worker \
                 group is {:?}",
                self.parallel_sizes()
            )));
        }
        let progress = LoadProgress::for_rank(self.rank);
        let stage = self.pipeline_stage();
        let step_model: Box<dyn StepModel> = match spec.device {
            Device::Cpu => {
                let (ar, pipeline) = self.cpu_group()?;
                let tp_rank = self.rank as usize % world;
                let tp = TpContext::new(tp_rank, world, ar).with_pipeline(stage);
                let on_load = |done, total| progress.on_load(done, total);
                match load_stage_model(spec, tp.clone(), &on_load)? {
                    Some(m) => Box::new(m),
                    None => {
                        let model = load_model_with_progress(spec, tp, &on_load)?;
                        Box::new(
                            CpuStepModel::new(model, mem_available_bytes()).with_pipeline(pipeline),
                        )
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
        &mut self,
        spec: &LoadModelSpec,
        world: usize,
        progress: &LoadProgress,
    ) -> Result<Box<dyn StepModel>, WorkerError> {
        use crate::cuda_group::{CudaPlace, NcclIdSource};
        use crate::cuda_model::load_cuda_model;
        let rank = self.rank as usize;
        let (place, nccl, pipeline) = match &mut self.group {
            TpGroup::Given(_) if world == 1 => (
                CudaPlace::single(),
                NcclIdSource::None,
                PipelineLink::default(),
            ),
            TpGroup::Given(_) => {
                return Err(WorkerError::Load(
                    "CUDA tensor parallelism runs one worker process per GPU (--executor mp)"
                        .into(),
                ));
            }
            TpGroup::Process {
                layout,
                segment,
                links,
            } => {
                let links = links.take().map(|l| *l).unwrap_or_default();
                let nccl = match (links.all_reduce, segment.clone()) {
                    (Some(queues), _) => NcclIdSource::Queues(Box::new(queues)),
                    (None, Some(name)) => NcclIdSource::Segment(name),
                    (None, None) => NcclIdSource::None,
                };
                (CudaPlace::of(layout, rank)?, nccl, links.pipeline)
            }
        };
        Ok(Box::new(load_cuda_model(
            spec,
            place,
            nccl,
            pipeline,
            &|done, total| progress.on_load(done, total),
        )?))
    }

    #[cfg(not(feature = "cuda"))]
    fn load_cuda(
        &mut self,
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
