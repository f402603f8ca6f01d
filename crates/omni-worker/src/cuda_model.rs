//! The GPU backend of a worker (feature `cuda`): [`CudaStepModel`] runs the decoder (its
//! pipeline stage's layers) on the device of the rank's local index on its node (one GPU per
//! rank), joined to its tensor-parallel group by NCCL and to the neighbouring pipeline stages by
//! the worker's peer queues (the residual stream copied to the host and sent as f32, the path
//! the CPU backend takes; NCCL send/recv would keep it on the device).
//!
//! Its place (device, groups) and NCCL set-up: [`crate::cuda_group`].

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{
    CudaContext, CudaError, DeviceAllReduce, DeviceSamplingParams, MOE_ONE_LAUNCH_ENV,
    NcclAllReduce, NcclComm,
};
use omni_models::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, MoeOneLaunch, StepLimits};
use omni_models::cuda_encoders::{DeviceTowers, TowerWeights};
use omni_models::gguf::GgufWeights;
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::thinker_mm::ThinkerMm;
use omni_models::registry;
use omni_models::weights::WeightSource;
use omni_models::{EncoderOutput, ForwardBatch, MropePositions, MultiModalFeature, MultiModalKind};
use omni_protocol::{LoadFormat, LoadModelSpec};

use crate::WorkerError;
use crate::cuda_group::{CudaPlace, NcclIdSource, group_nccl_id};
use crate::peers::{PipelineLink, QueueAllReduce};
use crate::step_model::{DeviceSample, STAGE_INPUT_TIMEOUT, StepModel};

/// Bytes the KV budget leaves free for CUDA graphs, NCCL buffers and allocator slack.
const GRAPH_AND_NCCL_RESERVE: u64 = 1 << 30;

/// Decode batch sizes captured as CUDA graphs (as vLLM: 1, 2, 4, then multiples of 8, then
/// coarser), up to `max_num_seqs`.
pub fn decode_graph_sizes(max_num_seqs: usize) -> Vec<usize> {
    let mut v = vec![1, 2, 4];
    v.extend((8..=64).step_by(8));
    v.extend((80..=256).step_by(16));
    v.extend((288..=512).step_by(32));
    v.retain(|&g| g <= max_num_seqs.max(1));
    if !v.contains(&max_num_seqs) && max_num_seqs <= 512 {
        v.push(max_num_seqs);
    }
    v
}

/// The decoder on this rank's GPU.
#[derive(Debug)]
pub struct CudaStepModel {
    model: CudaDecoderModel,
    /// A Qwen3-Omni Thinker's placeholders and M-RoPE prompt settings.
    mm: Option<ThinkerMm>,
    /// Its encoder towers on this device.
    towers: Option<DeviceTowers>,
    gpu_memory_utilization: f32,
    enforce_eager: bool,
    max_num_seqs: usize,
    /// `[max_num_seqs]` sampled token ids on the device.
    sampled: CudaSlice<i32>,
    /// The residual stream from the previous pipeline stage and to the next.
    pipeline: PipelineLink,
    /// Kept alive for the model's all-reduce (dropped after the model).
    _comm: Option<Arc<NcclAllReduce>>,
    /// The queues the NCCL id came over (kept open until the group shuts down).
    _id_queues: Option<Box<QueueAllReduce>>,
}

/// Loads `place`'s shard (its tensor-parallel slice of its pipeline stage's layers) on its GPU,
/// joined to its group by NCCL (the id from `nccl`) and to its pipeline neighbours by
/// `pipeline`.
pub fn load_cuda_model(
    spec: &LoadModelSpec,
    place: CudaPlace,
    nccl: NcclIdSource,
    pipeline: PipelineLink,
    on_layer: &dyn Fn(usize, usize),
) -> Result<CudaStepModel, WorkerError> {
    let CudaPlace {
        rank,
        device,
        tp_rank,
        tp_size,
        stage,
    } = place;
    let cx = Arc::new(CudaContext::new(device).map_err(|e| WorkerError::Load(e.to_string()))?);
    let comm = if tp_size > 1 {
        let id = group_nccl_id(&place, &nccl)?;
        let comm = NcclComm::new(&cx, tp_rank, tp_size, &id)
            .map_err(|e| WorkerError::Load(format!("NCCL init on rank {rank}: {e}")))?;
        Some(Arc::new(NcclAllReduce::new(comm)))
    } else {
        None
    };
    let path = Path::new(&spec.model);
    let is_gguf = path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let (config, source): (serde_json::Value, Option<Box<dyn WeightSource>>) = if is_gguf {
        let w = GgufWeights::open(path)?;
        (w.hf_config()?, Some(Box::new(w)))
    } else {
        let config = registry::read_config(path)?;
        let ws: Option<Box<dyn WeightSource>> = match spec.load_format {
            LoadFormat::Dummy => None,
            _ => Some(Box::new(SafetensorsDir::open(path)?)),
        };
        (config, ws)
    };
    let dspec = registry::decoder_spec(&config)?;
    let (init, ws): (DeviceWeightInit, Box<dyn WeightSource>) = match (spec.load_format, source) {
        (LoadFormat::Dummy, _) | (_, None) => (
            DeviceWeightInit::Dummy { seed: spec.seed },
            Box::new(registry::dummy_weights(&config, spec.seed)?),
        ),
        (_, Some(ws)) => (DeviceWeightInit::Host, ws),
    };
    let limits = StepLimits {
        max_tokens: spec.max_num_batched_tokens.max(1) as usize,
        max_seqs: spec.max_num_seqs.max(1) as usize,
        max_model_len: spec.max_model_len.max(1) as usize,
        block_size: spec.block_size.max(1) as usize,
    };
    let all_reduce = comm.clone().map(|c| c as Arc<dyn DeviceAllReduce>);
    let sampled = cx
        .stream()
        .alloc_zeros::<i32>(limits.max_seqs)
        .map_err(|e| WorkerError::Model(CudaError::from(e).into()))?;
    // A Qwen3-Omni Thinker's towers run on this rank's device (replicated on every rank).
    let (mm, towers) = if dspec.architecture == omni_models::qwen3_omni::config::ARCHITECTURE {
        let weights = match init {
            DeviceWeightInit::Dummy { seed } => TowerWeights::Dummy { seed },
            DeviceWeightInit::Host => TowerWeights::Checkpoint(ws.as_ref()),
        };
        let towers = DeviceTowers::load(cx.clone(), &config, weights)?;
        (
            Some(ThinkerMm::load(&config, None)?),
            (!towers.is_empty()).then_some(towers),
        )
    } else {
        (None, None)
    };
    if stage.size > 1 && dspec.architecture == omni_models::qwen3_omni::config::ARCHITECTURE {
        return Err(WorkerError::Load(format!(
            "{} with pipeline parallelism on CUDA is not supported yet",
            dspec.architecture
        )));
    }
    let view = registry::causal_lm_weights(&config, ws.as_ref())?;
    let mut model = CudaDecoderModel::load_stage(
        cx, dspec, &view, init, tp_rank, tp_size, all_reduce, limits, stage, on_layer,
    )?;
    model.enable_profiler(u64::from(spec.cuda_profile_steps));
    model.set_small_batch_gemv(small_batch_gemv_from_env());
    if let Some(n) = std::env::var(SMALL_MOE_TOKENS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        model.set_small_moe_tokens(n);
    }
    if let Some(n) = std::env::var(L2_PREFETCH_TOKENS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        model.set_l2_prefetch_tokens(n);
    }
    model.set_l2_prefetch_qkv_early(
        std::env::var(L2_PREFETCH_QKV_EARLY_ENV).is_ok_and(|v| v == "1"),
    );
    model.set_moe_w2_prefetch(std::env::var(MOE_W2_PREFETCH_ENV).is_ok_and(|v| v == "1"));
    if let Some(mode) = std::env::var(MOE_ONE_LAUNCH_ENV)
        .ok()
        .and_then(|v| MoeOneLaunch::parse(&v))
    {
        model.set_moe_one_launch(mode);
    }
    Ok(CudaStepModel {
        model,
        mm,
        towers,
        gpu_memory_utilization: spec.gpu_memory_utilization,
        // The profiler's timing events cannot be recorded inside a graph capture: profiled
        // steps run eagerly (LoadModelSpec::cuda_profile_steps says so).
        enforce_eager: spec.enforce_eager || spec.cuda_profile_steps > 0,
        max_num_seqs: limits.max_seqs,
        sampled,
        pipeline,
        _comm: comm,
        _id_queues: match nccl {
            NcclIdSource::Queues(q) => Some(q),
            _ => None,
        },
    })
}

impl StepModel for CudaStepModel {
    fn architecture(&self) -> &str {
        self.model.spec().architecture
    }

    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn kv_bytes_per_block(&self, block_size: usize) -> u64 {
        self.model.kv_bytes_per_block(block_size)
    }

    fn available_kv_bytes(&self) -> Result<u64, WorkerError> {
        Ok(self
            .model
            .available_kv_bytes(self.gpu_memory_utilization, GRAPH_AND_NCCL_RESERVE)?)
    }

    fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), WorkerError> {
        self.model.init_cache(num_blocks, block_size)?;
        if !self.enforce_eager {
            let t0 = Instant::now();
            let sizes = self
                .model
                .capture_decode_graphs(&decode_graph_sizes(self.max_num_seqs))?;
            tracing::info!(
                graphs = sizes.len(),
                largest = sizes.last().copied().unwrap_or(0),
                seconds = t0.elapsed().as_secs_f32(),
                "captured CUDA graphs for decode"
            );
        }
        self.warm_up()
    }

    fn has_cache(&self) -> bool {
        self.model.has_cache()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<usize, WorkerError> {
        if !self.pipeline.has_prev() && !self.pipeline.has_next() {
            return Ok(self.model.forward(batch)?);
        }
        let t = batch.input_ids.len();
        let hidden = if self.pipeline.has_prev() {
            Some(self.pipeline.recv(t, STAGE_INPUT_TIMEOUT)?)
        } else {
            None
        };
        let rows = self.model.forward_stage(batch, hidden.as_deref())?;
        if self.pipeline.has_next() {
            let x = self.model.stage_output_to_host()?;
            self.pipeline.send(&x, t, self.model.spec().hidden_size)?;
        }
        Ok(rows)
    }

    fn samples(&self) -> bool {
        !self.pipeline.has_next()
    }

    fn logits_host(&mut self) -> Result<Vec<f32>, WorkerError> {
        Ok(self.model.logits_to_host()?)
    }

    fn sample_on_device(&mut self, rows: &[DeviceSample]) -> Result<Option<Vec<u32>>, WorkerError> {
        sample_rows(&self.model, &mut self.sampled, rows).map(Some)
    }

    fn mrope_positions(
        &self,
        ids: &[u32],
        items: &[MultiModalKind],
    ) -> Result<Option<(MropePositions, i64)>, WorkerError> {
        match &self.mm {
            Some(mm) => Ok(Some(mm.mrope_positions(ids, items)?)),
            None => Ok(None),
        }
    }

    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, WorkerError> {
        let towers = self
            .towers
            .as_ref()
            .ok_or_else(|| self.no_mm(feature.modality))?;
        Ok(towers.encode(feature)?)
    }

    fn forward_mm(
        &mut self,
        batch: &ForwardBatch,
        positions: Option<&MropePositions>,
        features: &[MultiModalFeature<'_>],
        encoded: &[&EncoderOutput],
    ) -> Result<usize, WorkerError> {
        let mm = self.mm.as_ref().ok_or_else(|| self.no_mm("multimodal"))?;
        let t = batch.input_ids.len();
        let plan = mm.plan(
            t,
            self.model.spec().hidden_size,
            Some(&batch.input_ids),
            features,
            encoded,
        )?;
        Ok(self.model.forward_merged(batch, positions, &plan)?)
    }
}

/// Prefill sizes of the start-up warm-up: powers of two from this one up to the step limit
/// (cuBLAS picks a GEMM's kernels by the token count's range), and the limit itself.
const WARM_UP_SMALLEST_PREFILL: usize = 16;

/// `1`: steps of at most 8 tokens run their linear layers as weight-streaming GEMVs, and a
/// one-rank, one-stage model without biases takes the fused small-batch path (dense and MoE
/// layers; [`CudaDecoderModel::set_small_batch_gemv`]); `0`: cuBLAS for every step.
pub const SMALL_BATCH_GEMV_ENV: &str = "OMNI_CUDA_SMALL_BATCH_GEMV";

/// Whether [`SMALL_BATCH_GEMV_ENV`] turns the small-batch GEMVs on (default off).
fn small_batch_gemv_from_env() -> bool {
    std::env::var(SMALL_BATCH_GEMV_ENV).is_ok_and(|v| v == "1")
}

/// The most tokens a step may have for MoE layers to run the small-batch expert kernels on
/// the unfused path ([`CudaDecoderModel::set_small_moe_tokens`]; default
/// [`omni_models::cuda_decoder::DEFAULT_SMALL_MOE_TOKENS`], `0` turns it off).
pub const SMALL_MOE_TOKENS_ENV: &str = "OMNI_CUDA_MOE_SMALL_TOKENS";

/// The most tokens a step may have to issue L2 prefetch hints of its weights
/// ([`CudaDecoderModel::set_l2_prefetch_tokens`]; default
/// [`omni_models::cuda_decoder::DEFAULT_L2_PREFETCH_TOKENS`], `0` turns them off).
pub const L2_PREFETCH_TOKENS_ENV: &str = "OMNI_CUDA_L2_PREFETCH_TOKENS";

/// Set to `1`, MoE layers on the small-batch expert kernels prefetch the next layer's QKV
/// weights from their down kernel ([`CudaDecoderModel::set_l2_prefetch_qkv_early`]).
pub const L2_PREFETCH_QKV_EARLY_ENV: &str = "OMNI_CUDA_L2_PREFETCH_QKV_EARLY";

/// Set to `1`, MoE layers on the small-batch expert kernels prefetch the routed experts' down
/// weights into L2 from the gate_up kernel ([`CudaDecoderModel::set_moe_w2_prefetch`]). Off by
/// default: on an H100 it made the experts 9% slower at batch 1
/// (`bench/results/gpu-l2-prefetch-2026-12-06.md`).
pub const MOE_W2_PREFETCH_ENV: &str = "OMNI_CUDA_MOE_W2_PREFETCH";

/// Set to `0`, a CUDA worker skips its start-up warm-up (to measure what it saves:
/// `scripts/bench-cold-start.sh`).
pub const WARM_UP_ENV: &str = "OMNI_CUDA_WARMUP";

impl CudaStepModel {
    /// Runs each path a first request takes once, so that it is no slower than the tenth (as
    /// vLLM's dummy runs): NVRTC compiles a kernel source at its first launch and cuBLAS loads
    /// a GEMM shape's kernels at its first use. Prefills of every power of two up to the
    /// largest step, a step mixing a prefill chunk after context with decode rows, and on the last
    /// stage the device sampler (greedy and random) and the logits copy. Nothing is written
    /// into the KV cache (every slot is padding); every rank of a group runs the same steps,
    /// so the collectives warm up too; a pipeline stage runs alone (zero input, nothing sent).
    fn warm_up(&mut self) -> Result<(), WorkerError> {
        if std::env::var(WARM_UP_ENV).is_ok_and(|v| v == "0") {
            tracing::info!("{WARM_UP_ENV}=0: no warm-up");
            return Ok(());
        }
        let t0 = Instant::now();
        let limits = self.model.limits();
        let max_t = limits.max_tokens.min(limits.max_model_len);
        let mut sizes: Vec<usize> =
            std::iter::successors(Some(WARM_UP_SMALLEST_PREFILL.min(max_t)), |&t| {
                (t * 2 < max_t).then_some(t * 2)
            })
            .collect();
        sizes.push(max_t);
        sizes.dedup();
        let mut steps: Vec<Vec<(usize, usize)>> = sizes.into_iter().map(|t| vec![(0, t)]).collect();
        if limits.max_seqs >= 3 && max_t >= 10 && limits.max_model_len >= 40 {
            steps.push(vec![(32, 8), (16, 1), (16, 1)]);
        }
        let h = self.model.spec().hidden_size;
        let first = self.model.pipeline_stage().is_first();
        let greedy = DeviceSample {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            offset: 0,
        };
        let random = DeviceSample {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.05,
            seed: 1,
            ..greedy
        };
        for seqs in &steps {
            let batch = ForwardBatch::dummy(seqs, limits.block_size, self.model.vocab_size())?;
            let zeros = (!first).then(|| vec![0f32; batch.input_ids.len() * h]);
            let rows = self.model.forward_stage(&batch, zeros.as_deref())?;
            if rows > 0 {
                for p in [greedy, random] {
                    sample_rows(&self.model, &mut self.sampled, &vec![p; rows])?;
                }
                self.model.logits_to_host()?;
            }
        }
        self.model
            .context()
            .synchronize()
            .map_err(|e| WorkerError::Model(e.into()))?;
        tracing::info!(
            steps = steps.len(),
            largest = max_t,
            seconds = t0.elapsed().as_secs_f32(),
            "warmed up the prefill, sampling and collective paths"
        );
        Ok(())
    }

    fn no_mm(&self, what: &str) -> WorkerError {
        WorkerError::Batch(format!(
            "{} on CUDA takes no {what} input (it has no encoder towers)",
            self.model.spec().architecture
        ))
    }
}

/// One token per output row of `model`'s last step, drawn on its device by the sampler kernel
/// (`rows[r]` row `r`'s settings; `out` holds at least `rows.len()` tokens): the text engine's
/// device sampling, shared with the omni Thinker stage.
pub fn sample_rows(
    model: &CudaDecoderModel,
    out: &mut CudaSlice<i32>,
    rows: &[DeviceSample],
) -> Result<Vec<u32>, WorkerError> {
    let params: Vec<DeviceSamplingParams> = rows
        .iter()
        .map(|r| DeviceSamplingParams {
            temperature: r.temperature,
            top_k: r.top_k,
            top_p: r.top_p,
            min_p: r.min_p,
            seed: r.seed,
            offset: r.offset,
        })
        .collect();
    let vocab = model.vocab_size();
    let cx = model.context().clone();
    let mut out = out.slice_mut(..params.len());
    let tokens = cx
        .sample_rows_f32(&model.logits(), &params, vocab, &mut out)
        .map_err(|e| WorkerError::Model(e.into()))?;
    tokens
        .into_iter()
        .enumerate()
        .map(|(row, t)| {
            t.ok_or_else(|| {
                WorkerError::Batch(format!(
                    "row {row}: no token can be sampled (all logits -inf or NaN)"
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::decode_graph_sizes;

    #[test]
    fn decode_graph_sizes_cover_every_batch_up_to_max_num_seqs() {
        assert_eq!(decode_graph_sizes(1), vec![1]);
        assert_eq!(decode_graph_sizes(6), vec![1, 2, 4, 6]);
        let v = decode_graph_sizes(256);
        assert_eq!(&v[..5], &[1, 2, 4, 8, 16]);
        assert_eq!(v.last(), Some(&256));
        assert!(v.windows(2).all(|w| w[0] < w[1]), "{v:?}");
        // Every batch size has a graph at least as large (the padded replay).
        for b in 1..=256 {
            assert!(v.iter().any(|&g| g >= b), "batch {b}");
        }
        assert_eq!(decode_graph_sizes(1000).last(), Some(&512));
    }
}
