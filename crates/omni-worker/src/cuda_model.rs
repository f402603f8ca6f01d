//! The GPU backend of a worker (feature `cuda`): [`CudaStepModel`] runs the decoder on device
//! `rank` (one GPU per rank), joined to its peers by NCCL.
//!
//! # NCCL set-up
//! NCCL needs one 128-byte unique id on every rank. Rank 0 makes it and publishes it in the
//! executor's tensor-parallel segment (`omni.<instance>.allreduce`, created 0600 by the executor
//! and removed by it; the CPU backend uses the same segment for its shared-memory all-reduce):
//! bytes `64..192` hold the id, then rank 0 stores `1` into the `u32` at offset 0 with release
//! ordering. The other ranks poll that word with acquire ordering (so the id bytes they read
//! after seeing `1` are the ones written before it), for at most [`NCCL_ID_TIMEOUT`].

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{
    CudaContext, CudaError, DeviceAllReduce, DeviceSamplingParams, NcclAllReduce, NcclComm,
};
use omni_ipc::shm::ShmSegment;
use omni_models::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, StepLimits};
use omni_models::cuda_encoders::{DeviceTowers, TowerWeights};
use omni_models::gguf::GgufWeights;
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::thinker_mm::ThinkerMm;
use omni_models::registry;
use omni_models::weights::WeightSource;
use omni_models::{EncoderOutput, ForwardBatch, MropePositions, MultiModalFeature, MultiModalKind};
use omni_protocol::{LoadFormat, LoadModelSpec};

use crate::WorkerError;
use crate::step_model::{DeviceSample, StepModel};

/// How long ranks other than 0 wait for the NCCL id.
pub const NCCL_ID_TIMEOUT: Duration = Duration::from_secs(120);

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
    /// Kept alive for the model's all-reduce (dropped after the model).
    _comm: Option<Arc<NcclAllReduce>>,
}

/// Publishes (rank 0) or reads (other ranks) the NCCL unique id through the tensor-parallel
/// segment (see the module docs for the protocol).
fn exchange_nccl_id(segment: &str, rank: usize) -> Result<[u8; 128], WorkerError> {
    let seg = ShmSegment::open(segment)
        .map_err(|e| WorkerError::Load(format!("opening {segment} for the NCCL id: {e}")))?;
    if seg.len() < 192 {
        return Err(WorkerError::Load(format!(
            "segment {segment} is too small ({} bytes) for the NCCL id",
            seg.len()
        )));
    }
    let base = seg.as_ptr();
    // SAFETY: the mapping is at least 192 bytes and page-aligned, so offset 0 is a valid,
    // 4-byte-aligned u32 for the segment's lifetime (`seg` outlives `flag`); every process
    // touches it only atomically.
    let flag = unsafe { AtomicU32::from_ptr(base.cast::<u32>()) };
    // SAFETY: bytes 64..192 lie inside the mapping; they are written only by rank 0 before it
    // publishes the flag (release) and read by the others only after they observe it (acquire).
    let id_bytes = unsafe { std::slice::from_raw_parts_mut(base.add(64), 128) };
    if rank == 0 {
        let id = NcclComm::unique_id().map_err(|e| WorkerError::Load(e.to_string()))?;
        id_bytes.copy_from_slice(&id);
        flag.store(1, Ordering::Release);
        return Ok(id);
    }
    let deadline = Instant::now() + NCCL_ID_TIMEOUT;
    while flag.load(Ordering::Acquire) != 1 {
        if Instant::now() > deadline {
            return Err(WorkerError::Load(format!(
                "rank 0 did not publish the NCCL id in {NCCL_ID_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut id = [0u8; 128];
    id.copy_from_slice(id_bytes);
    Ok(id)
}

/// Loads rank `rank` of `world`'s shard on GPU `rank`. `segment` is the executor's
/// tensor-parallel segment (needed when `world > 1`).
pub fn load_cuda_model(
    spec: &LoadModelSpec,
    rank: usize,
    world: usize,
    segment: Option<&str>,
    on_layer: &dyn Fn(usize, usize),
) -> Result<CudaStepModel, WorkerError> {
    let cx = Arc::new(CudaContext::new(rank).map_err(|e| WorkerError::Load(e.to_string()))?);
    let comm = if world > 1 {
        let segment = segment.ok_or_else(|| {
            WorkerError::Load("tensor parallelism on CUDA needs the executor's segment".into())
        })?;
        let id = exchange_nccl_id(segment, rank)?;
        let comm = NcclComm::new(&cx, rank, world, &id)
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
    let view = registry::causal_lm_weights(&config, ws.as_ref())?;
    let mut model = CudaDecoderModel::load(
        cx, dspec, &view, init, rank, world, all_reduce, limits, on_layer,
    )?;
    model.enable_profiler(u64::from(spec.cuda_profile_steps));
    Ok(CudaStepModel {
        model,
        mm,
        towers,
        gpu_memory_utilization: spec.gpu_memory_utilization,
        enforce_eager: spec.enforce_eager,
        max_num_seqs: limits.max_seqs,
        sampled,
        _comm: comm,
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
        Ok(())
    }

    fn has_cache(&self) -> bool {
        self.model.has_cache()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<usize, WorkerError> {
        Ok(self.model.forward(batch)?)
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

impl CudaStepModel {
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
