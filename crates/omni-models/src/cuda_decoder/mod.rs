//! The Llama-family decoder ([`crate::decoder`]) on one CUDA device (feature `cuda`): bf16
//! weights and activations, f32 accumulation, the KV cache in device memory, CUDA graphs for
//! decode steps.
//!
//! The tensor-parallel split is the CPU decoder's (the same loader shards the checkpoint); the
//! row-parallel partial sums are combined by a [`DeviceAllReduce`] (NCCL in the engine).
//!
//! One step ([`CudaDecoderModel::forward`]):
//! ```text
//! x = embed(ids)                                          residual stream, bf16
//! per layer: h = rms_norm(x += proj)                      fused_add_rms_norm, x and proj f32
//!            qkv = h Wqkv^T; q, cache <- rope(norm(qkv))   one GEMM, one fused kernel
//!            attn = paged_attention(q, cache)
//!            proj = all_reduce(attn Wo^T)
//!            h = rms_norm(x += proj)
//!            proj = all_reduce(mlp(h))                    dense: GEMM, SiLU-mul, GEMM; MoE: fused
//! logits = (rms_norm(x += proj))[rows] lm_head^T          f32
//! ```
//! Every launch depends only on host scalars and on buffers allocated once, for the largest
//! batch ([`StepLimits`]), so a decode step of a given padded batch size can be captured in a
//! CUDA graph and replayed with new inputs copied into the same buffers.
//!
//! Besides token ids, a step can start from input embeddings already in the device's input
//! buffer ([`CudaDecoderModel::forward_embeds`], [`CudaDecoderModel::forward_device_embeds`]:
//! a Talker's codec sums); a spec without `embed_and_head` (a code predictor) has no embedding
//! or head and ends at the final-norm state of its output rows
//! ([`CudaDecoderModel::final_norm`], kept for every spec). MoE layers may have a gated shared
//! expert (`sigmoid(x . gate) * shared_mlp(x)` added to the routed sum).

use std::collections::BTreeMap;
use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{CudaContext, CudaError, DeviceAllReduce, MOE_SMALL_MAX_TOKENS, bf16};

use crate::ModelError;
use crate::batch::ForwardBatch;
use crate::decoder::{DecoderSpec, HeadLayout, PipelineStage};

mod attn_block1;
mod buffers;
mod fused;
mod graphs;
mod host;
mod layers;
mod load;
mod mm;
mod moe_small;
mod profile;
mod weights;

use buffers::Activations;
pub(crate) use buffers::StepInputs;
use graphs::{DecodeGraph, DecodeRow};
pub use mm::MmStep;
use profile::StepProfiler;
use weights::DLayer;

impl From<CudaError> for ModelError {
    fn from(e: CudaError) -> Self {
        ModelError::Device(e.to_string())
    }
}

impl From<omni_backend::cuda::cudarc::driver::DriverError> for ModelError {
    fn from(e: omni_backend::cuda::cudarc::driver::DriverError) -> Self {
        ModelError::Device(CudaError::from(e).to_string())
    }
}

/// The largest step the buffers are sized for (from the scheduler's limits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLimits {
    /// Tokens in one step (`max_num_batched_tokens`).
    pub max_tokens: usize,
    /// Sequences in one step (`max_num_seqs`); also the most logits rows a step returns.
    pub max_seqs: usize,
    /// Longest sequence (`max_model_len`).
    pub max_model_len: usize,
    /// Tokens per KV block (sizes the block tables).
    pub block_size: usize,
}

impl StepLimits {
    /// Entries of one sequence's block table: enough blocks for `max_model_len` tokens.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_model_len.div_ceil(self.block_size.max(1)).max(1)
    }
}

/// How the weights are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceWeightInit {
    /// Read from a [`WeightSource`] on the host, converted to bf16, uploaded through pinned
    /// memory one layer at a time.
    Host,
    /// Random values of the right shapes made on the device (`--load-format dummy`): norms 1,
    /// everything else uniform in `[-0.02, 0.02)` from the seed.
    Dummy {
        /// Seed of the values.
        seed: u64,
    },
}

/// One step's host-side shape (what a launch sequence depends on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepShape {
    pub(crate) tokens: usize,
    pub(crate) seqs: usize,
    pub(crate) rows: usize,
    pub(crate) max_query_len: usize,
    pub(crate) max_seq_len: usize,
    /// The step starts from the input-embedding buffer, not from token ids.
    pub(crate) embeds: bool,
    /// The positions buffer holds three M-RoPE rows for this step.
    pub(crate) mrope: bool,
}

/// Where a step's input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepInput {
    /// `batch.input_ids` through the embedding table.
    Ids,
    /// `[tokens, hidden]` rows already in the input-embedding buffer.
    Embeds,
    /// The previous pipeline stage's residual stream, `[tokens, hidden]` f32, already in the
    /// `proj` buffer (a stage after the first).
    Hidden,
}

/// The decoder on one device, with its KV cache.
#[derive(Debug)]
pub struct CudaDecoderModel {
    cx: Arc<CudaContext>,
    spec: DecoderSpec,
    heads: HeadLayout,
    rank: usize,
    all_reduce: Option<Arc<dyn DeviceAllReduce>>,
    /// This rank's pipeline stage: which layers it holds, whether it embeds the tokens (the
    /// first) and runs the final norm and the head (the last).
    stage: PipelineStage,
    /// `[vocab, hidden]`; `None` without `embed_and_head`, and on a pipeline stage that neither
    /// embeds nor runs a tied head.
    embed: Option<CudaSlice<bf16>>,
    lm_head: Option<CudaSlice<bf16>>,
    norm: CudaSlice<bf16>,
    /// The stage's layers (all of them without pipeline parallelism); `layers[0]` is decoder
    /// layer `first_layer`.
    layers: Vec<DLayer>,
    first_layer: usize,
    inv_freq: CudaSlice<f32>,
    /// `[head_dim / 2]` M-RoPE position row of each frequency, for a spec with M-RoPE.
    mrope_axes: Option<CudaSlice<u8>>,
    /// The current step's deepstack additions ([`CudaDecoderModel::forward_mm`]).
    residual_adds: Option<mm::DeviceResidualAdds>,
    limits: StepLimits,
    inputs: StepInputs,
    act: Activations,
    /// Per layer, K and V: `[num_blocks, block_size, local_kv_heads, head_dim]`.
    kv: Vec<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    num_blocks: usize,
    /// Decode graphs by padded batch size (token-id input).
    graphs: BTreeMap<usize, DecodeGraph>,
    /// Decode graphs by padded batch size (input-embedding input).
    embed_graphs: BTreeMap<usize, DecodeGraph>,
    /// Rows of logits the last forward left in `act.logits`.
    last_rows: usize,
    /// Tokens the last forward computed (the rows of the captured states).
    last_tokens: usize,
    /// The residual stream after this many layers, copied every step into the buffer
    /// ([`CudaDecoderModel::set_capture_after_layers`]; the Thinker's export).
    capture: Option<(usize, CudaSlice<f32>)>,
    /// Per-op timing of eager steps, when [`Self::enable_profiler`] was called.
    profiler: Option<StepProfiler>,
    /// Steps of at most 8 tokens run their linear layers as GEMVs
    /// ([`CudaDecoderModel::set_small_batch_gemv`]).
    small_batch_gemv: bool,
    /// Such steps take the fused path where they can
    /// ([`CudaDecoderModel::set_fused_small_batch`]).
    fused_small_batch: bool,
    /// Unfused steps of at most this many tokens run MoE layers' experts on the small-batch
    /// kernels ([`CudaDecoderModel::set_small_moe_tokens`]).
    small_moe_tokens: usize,
    /// Unfused steps of at most this many tokens issue L2 prefetch hints
    /// ([`CudaDecoderModel::set_l2_prefetch_tokens`]).
    l2_prefetch_tokens: usize,
    /// Whether the small-batch MoE down kernel prefetches the next layer's QKV weights
    /// ([`CudaDecoderModel::set_l2_prefetch_qkv_early`]).
    l2_prefetch_qkv_early: bool,
    /// Whether the small-batch MoE gate_up kernel prefetches the down weights
    /// ([`CudaDecoderModel::set_moe_w2_prefetch`]).
    moe_w2_prefetch: bool,
    /// Whether one-token steps run a MoE layer's block in one launch where the device takes
    /// it, and its L2 hints ([`CudaDecoderModel::set_moe_one_launch`]).
    moe_one_launch: MoeOneLaunch,
}

/// How one-token steps run a MoE layer's block ([`CudaDecoderModel::set_moe_one_launch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeOneLaunch {
    /// The router, gate_up and down launches.
    Off,
    /// One launch ([`CudaContext::moe_block1`]) where the device takes the shape.
    Plain,
    /// One launch reading the routed experts' rows evict-first in L2 (the default).
    EvictFirst,
}

impl MoeOneLaunch {
    /// `0`: off, `plain`, `1` or `ef`: evict-first; `None` for anything else.
    pub fn parse(v: &str) -> Option<Self> {
        match v.trim() {
            "0" => Some(Self::Off),
            "plain" => Some(Self::Plain),
            "1" | "ef" => Some(Self::EvictFirst),
            _ => None,
        }
    }
}

/// [`CudaDecoderModel::set_moe_one_launch`]'s default: one launch, evict-first (H200, batch 1:
/// +1.4% on the plain launch, `bench/results/gpu-h200-2026-12-07.md`).
pub const DEFAULT_MOE_ONE_LAUNCH: MoeOneLaunch = MoeOneLaunch::EvictFirst;

/// [`CudaDecoderModel::set_small_moe_tokens`]'s default: one-token steps (decode at batch 1),
/// where the small-batch experts beat the grouped GEMM on an H200 (`bench/results/`).
pub const DEFAULT_SMALL_MOE_TOKENS: usize = 1;

/// [`CudaDecoderModel::set_l2_prefetch_tokens`]'s default: none. The hints' first version
/// made decode at batch 1 40% slower on an H100; the version spread over every SM, 3.4%
/// (qkv_proj and o_proj read L2 and take 15-17% less, but the input norm and the q/k norm +
/// RoPE kernels that issue the hints take 0.18 ms a step more each;
/// `bench/results/gpu-l2-prefetch-2026-12-06.md`), so it stays opt-in (64: decode steps up to
/// batch 64).
pub const DEFAULT_L2_PREFETCH_TOKENS: usize = 0;

impl CudaDecoderModel {
    /// Whether [`CudaDecoderModel::init_cache`] ran.
    pub fn has_cache(&self) -> bool {
        !self.kv.is_empty()
    }

    /// Logs each op's mean GPU time over every `every` eager steps of one kind (decode at a
    /// batch size, or prefill); graph replay is off from now on (`every` 0: off).
    pub fn enable_profiler(&mut self, every: u64) {
        self.enable_profiler_named(every, "");
    }

    /// [`CudaDecoderModel::enable_profiler`] whose log lines name the network (`name`).
    pub fn enable_profiler_named(&mut self, every: u64, name: &str) {
        self.profiler = (every > 0).then(|| StepProfiler::new(&self.cx, every).named(name));
    }

    /// Runs the linear layers of steps of at most 8 tokens as weight-streaming GEMVs
    /// ([`CudaContext::gemv_nt_bf16`]) instead of cuBLAS (off by default). Recapture graphs
    /// after changing it.
    pub fn set_small_batch_gemv(&mut self, on: bool) {
        self.small_batch_gemv = on;
    }

    /// Whether [`CudaDecoderModel::set_small_batch_gemv`] is on.
    pub fn small_batch_gemv(&self) -> bool {
        self.small_batch_gemv
    }

    /// Whether the model runs on one tensor-parallel rank (nothing to all-reduce).
    fn one_rank(&self) -> bool {
        self.all_reduce
            .as_ref()
            .is_none_or(|ar| ar.world_size() == 1)
    }

    /// With the small-batch GEMVs on, steps of a model whose layers are bias-free and dense or
    /// routed-expert MoE without a shared expert, on one rank with no state capture, run the
    /// fused small-batch path: per layer the input norm inside the QKV GEMV, the residual add
    /// inside o_proj and down_proj, the post-attention norm and SiLU-and-mul inside gate_up,
    /// the final norm gathering the output rows (6 launches per dense layer instead of 9; the
    /// same bits, see [`CudaContext::gemv_fused`]); a MoE layer's MLP is three launches
    /// instead of eight (`moe_small.rs`: the same norm bits and routing code, expert sums
    /// rounded where the grouped-GEMM path rounds them). On by default; off runs the unfused
    /// kernels (for comparison). Recapture graphs after changing it.
    pub fn set_fused_small_batch(&mut self, on: bool) {
        self.fused_small_batch = on;
    }

    /// Steps of at most `tokens` tokens (capped at [`MOE_SMALL_MAX_TOKENS`]; 0: none) that
    /// take the unfused path run each MoE layer without a shared expert as [`moe_route`] (the
    /// attention output added inside), [`moe_small_gate_up`] and [`moe_small_down`] adding the
    /// experts' sum into the residual stream: three launches instead of the grouped-GEMM
    /// path's five, on one rank. Default [`DEFAULT_SMALL_MOE_TOKENS`]. The expert sums round
    /// where the grouped path rounds them (the f32 dot products sum in another order).
    /// Recapture graphs after changing it.
    ///
    /// [`moe_route`]: CudaContext::moe_route
    /// [`moe_small_gate_up`]: CudaContext::moe_small_gate_up
    /// [`moe_small_down`]: CudaContext::moe_small_down
    pub fn set_small_moe_tokens(&mut self, tokens: usize) {
        self.small_moe_tokens = tokens.min(MOE_SMALL_MAX_TOKENS);
    }

    /// Unfused steps of at most `tokens` tokens (0: none, the default
    /// [`DEFAULT_L2_PREFETCH_TOKENS`]) prefetch weights into L2 ahead of the GEMMs that read
    /// them: each layer's input norm the QKV weights, its q/k norm + RoPE kernel those of
    /// o_proj and the MoE router (at most 24 MiB a kernel), so they stream in while the norm,
    /// RoPE and attention run instead of after. Hints: the same values either way. Recapture
    /// graphs after changing it.
    pub fn set_l2_prefetch_tokens(&mut self, tokens: usize) {
        self.l2_prefetch_tokens = tokens;
    }

    /// With prefetch hints on, a MoE layer whose experts run on the small-batch kernels
    /// prefetches the next layer's QKV weights from its down kernel (which streams only its
    /// experts' w2 rows, leaving the memory bus part idle) instead of from the next layer's
    /// input norm, a few microseconds before the QKV GEMM. Default off. Recapture graphs
    /// after changing it.
    pub fn set_l2_prefetch_qkv_early(&mut self, on: bool) {
        self.l2_prefetch_qkv_early = on;
    }

    /// MoE layers on the small-batch expert kernels prefetch the routed experts' down (w2)
    /// weights into L2 from the gate_up kernel, which streams the gate and up rows
    /// evict-first meanwhile, so that the down kernel reads them from L2. The same values.
    /// Default off. Recapture graphs after changing it.
    pub fn set_moe_w2_prefetch(&mut self, on: bool) {
        self.moe_w2_prefetch = on;
    }

    /// One-token steps on the small-batch MoE path run each such layer's block (norm, router,
    /// top-k, experts, residual add) as one launch ([`moe_block1`]) where the device takes
    /// the shape, instead of the router, gate_up and down launches: the same bits, whatever
    /// L2 hints `mode` adds. Default [`DEFAULT_MOE_ONE_LAUNCH`]. Recapture graphs after
    /// changing it.
    ///
    /// [`moe_block1`]: CudaContext::moe_block1
    pub fn set_moe_one_launch(&mut self, mode: MoeOneLaunch) {
        self.moe_one_launch = mode;
    }

    /// The spec this model was built from.
    pub fn spec(&self) -> &DecoderSpec {
        &self.spec
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.cx
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.spec.vocab_size
    }

    /// KV bytes of one block of `block_size` tokens on this rank (its stage's layers, K and V,
    /// bf16).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> u64 {
        (2 * block_size
            * self.heads.local_kv_heads
            * self.spec.head_dim
            * std::mem::size_of::<bf16>()
            * self.layers.len()) as u64
    }

    /// Device bytes the KV cache may take: `gpu_memory_utilization` of the device's memory,
    /// less what is in use now (weights, step buffers, cuBLAS workspace, the CUDA context,
    /// and anything else on the device), less `reserve` for CUDA graphs and NCCL.
    pub fn available_kv_bytes(
        &self,
        gpu_memory_utilization: f32,
        reserve: u64,
    ) -> Result<u64, ModelError> {
        self.cx.synchronize()?;
        let (free, total) = self.cx.raw().mem_get_info().map_err(CudaError::from)?;
        let used = (total - free) as u64;
        let budget = (total as f64 * gpu_memory_utilization as f64) as u64;
        Ok(budget.saturating_sub(used).saturating_sub(reserve))
    }

    /// Allocates `num_blocks` zeroed KV blocks per layer (and the block tables again if
    /// `block_size` differs from the limits'). Drops any captured graphs (they point at the old
    /// buffers).
    pub fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), ModelError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(ModelError::Batch(format!(
                "num_blocks {num_blocks} and block_size {block_size} must be positive"
            )));
        }
        self.graphs.clear();
        self.embed_graphs.clear();
        self.kv.clear();
        let per_layer = num_blocks * block_size * self.heads.local_kv_heads * self.spec.head_dim;
        for _ in 0..self.layers.len() {
            let k = self.cx.zeros_bf16(per_layer)?;
            let v = self.cx.zeros_bf16(per_layer)?;
            self.kv.push((k, v));
        }
        if block_size != self.limits.block_size {
            // The block tables were sized for another block size at load.
            self.limits.block_size = block_size;
            let (inputs, act) = Self::alloc_step_buffers(
                &self.cx,
                &self.spec,
                &self.heads,
                &self.layers,
                self.limits,
            )?;
            self.inputs = inputs;
            self.act = act;
        }
        self.num_blocks = num_blocks;
        self.cx.synchronize()?;
        Ok(())
    }

    /// Runs one step and leaves the logits of its output rows (`batch.output_rows()`) on the
    /// device ([`CudaDecoderModel::logits`]) and their final-norm state
    /// ([`CudaDecoderModel::final_norm`]); returns the number of rows. Pure decode batches
    /// replay a captured graph when one fits.
    pub fn forward(&mut self, batch: &ForwardBatch) -> Result<usize, ModelError> {
        if !self.spec.embed_and_head {
            return Err(ModelError::Batch(format!(
                "{} takes input embeddings only (it has no token embedding)",
                self.spec.architecture
            )));
        }
        self.forward_from(batch, StepInput::Ids, None)
    }

    /// [`CudaDecoderModel::forward`] from input embeddings `[tokens, hidden]` (host f32, rounded
    /// to bf16 on upload) instead of the batch's ids.
    pub fn forward_embeds(
        &mut self,
        batch: &ForwardBatch,
        embeds: &[f32],
    ) -> Result<usize, ModelError> {
        let (t, h) = (batch.input_ids.len(), self.spec.hidden_size);
        if embeds.len() != t * h || t > self.limits.max_tokens {
            return Err(ModelError::Batch(format!(
                "{} input-embedding values for {t} tokens of width {h} (at most {} tokens)",
                embeds.len(),
                self.limits.max_tokens
            )));
        }
        let host: Vec<bf16> = embeds.iter().map(|&x| bf16::from_f32(x)).collect();
        self.cx
            .stream()
            .memcpy_htod(&host, &mut self.act.sel_embed.slice_mut(..t * h))
            .map_err(CudaError::from)?;
        self.forward_from(batch, StepInput::Embeds, None)
    }

    /// [`CudaDecoderModel::forward`] from the rows already queued into
    /// [`CudaDecoderModel::input_embeds_mut`] (`[tokens, hidden]` bf16, written on the device).
    pub fn forward_device_embeds(&mut self, batch: &ForwardBatch) -> Result<usize, ModelError> {
        self.forward_from(batch, StepInput::Embeds, None)
    }

    /// The input-embedding buffer, `[max_tokens, hidden]` bf16: what
    /// [`CudaDecoderModel::forward_device_embeds`] starts from.
    pub fn input_embeds_mut(&mut self) -> &mut CudaSlice<bf16> {
        &mut self.act.sel_embed
    }

    /// This rank's pipeline stage.
    pub fn pipeline_stage(&self) -> PipelineStage {
        self.stage
    }

    /// One step of a pipeline stage. The first stage embeds the batch's ids (`hidden` is
    /// `None`); a later one starts from `hidden`, the previous stage's residual stream
    /// `[tokens, hidden_size]` (f32, exact: no rounding between stages). The last stage leaves
    /// the logits of the output rows as [`CudaDecoderModel::forward`] does and returns their
    /// number; an earlier one returns 0 and leaves its residual stream for the next stage
    /// ([`CudaDecoderModel::stage_output_to_host`]). Decode steps replay the stage's graphs.
    pub fn forward_stage(
        &mut self,
        batch: &ForwardBatch,
        hidden: Option<&[f32]>,
    ) -> Result<usize, ModelError> {
        let stage = self.stage;
        match hidden {
            None if stage.is_first() => self.forward(batch),
            Some(x) if !stage.is_first() => {
                let (t, h) = (batch.input_ids.len(), self.spec.hidden_size);
                if x.len() != t * h || t > self.limits.max_tokens {
                    return Err(ModelError::Batch(format!(
                        "{} hidden-state values for {t} tokens of width {h} (at most {} tokens)",
                        x.len(),
                        self.limits.max_tokens
                    )));
                }
                self.cx
                    .stream()
                    .memcpy_htod(x, &mut self.act.proj.slice_mut(..t * h))
                    .map_err(CudaError::from)?;
                self.forward_from(batch, StepInput::Hidden, None)
            }
            None => Err(ModelError::Batch(format!(
                "pipeline stage {} of {} starts from the previous stage's hidden states",
                stage.rank, stage.size
            ))),
            Some(_) => Err(ModelError::Batch(
                "the first pipeline stage embeds its tokens: it takes no hidden states".into(),
            )),
        }
    }

    fn forward_from(
        &mut self,
        batch: &ForwardBatch,
        input: StepInput,
        mm: Option<&MmStep<'_>>,
    ) -> Result<usize, ModelError> {
        let embeds = input == StepInput::Embeds;
        if self.kv.is_empty() {
            return Err(ModelError::Batch("forward before init_cache".into()));
        }
        if (input == StepInput::Hidden) == self.stage.is_first() {
            return Err(ModelError::Batch(format!(
                "pipeline stage {} of {}: {}",
                self.stage.rank,
                self.stage.size,
                if self.stage.is_first() {
                    "the first stage starts from token ids or embeddings"
                } else {
                    "a later stage starts from the previous stage's hidden states"
                }
            )));
        }
        if mm.is_some() && self.stage.size > 1 {
            return Err(ModelError::Batch(
                "multimodal inputs with pipeline parallelism on CUDA are not supported yet".into(),
            ));
        }
        let t = batch.input_ids.len();
        let n = batch.attn.num_seqs();
        batch
            .attn
            .validate(self.limits.block_size, self.num_blocks)?;
        let rows = batch.output_rows();
        if t == 0 || t != batch.positions.len() || batch.attn.num_tokens() != t {
            return Err(ModelError::Batch(format!(
                "{t} tokens, {} positions, query_start_loc ends at {}",
                batch.positions.len(),
                batch.attn.num_tokens()
            )));
        }
        if t > self.limits.max_tokens
            || n > self.limits.max_seqs
            || rows.len() > self.limits.max_seqs
        {
            return Err(ModelError::Batch(format!(
                "step of {t} tokens, {n} sequences, {} logits rows exceeds the limits {:?}",
                rows.len(),
                self.limits
            )));
        }
        if let Some(&bad) = rows.iter().find(|&&r| r >= t) {
            return Err(ModelError::Batch(format!(
                "logits index {bad} out of {t} tokens"
            )));
        }
        let v = self.spec.vocab_size;
        if !embeds && let Some(&id) = batch.input_ids.iter().find(|&&id| id as usize >= v) {
            return Err(ModelError::Batch(format!(
                "token id {id} out of vocabulary ({v})"
            )));
        }
        let max_seq_len = batch.attn.seq_lens.iter().copied().max().unwrap_or(0);
        if max_seq_len > self.limits.max_model_len {
            return Err(ModelError::Batch(format!(
                "sequence of {max_seq_len} tokens exceeds max_model_len {}",
                self.limits.max_model_len
            )));
        }
        let is_decode = n == t
            && batch.logits_indices.is_none()
            && batch
                .attn
                .query_start_loc
                .windows(2)
                .all(|w| w[1] - w[0] == 1);
        let graph = if self.profiler.is_some() || mm.is_some() {
            None
        } else if embeds {
            self.embed_graphs.range(t..).next().map(|(&g, _)| g)
        } else {
            self.graphs.range(t..).next().map(|(&g, _)| g)
        };
        if is_decode && let Some(g) = graph {
            let real: Vec<DecodeRow<'_>> = (0..t)
                .map(|i| DecodeRow {
                    token: batch.input_ids[i],
                    position: batch.positions[i],
                    slot: batch.attn.slot_mapping[i],
                    seq_len: batch.attn.seq_lens[i],
                    block_table: &batch.attn.block_tables[i],
                })
                .collect();
            self.pad_decode_inputs(g, &real, embeds)?;
            let graphs = if embeds {
                &self.embed_graphs
            } else {
                &self.graphs
            };
            let graph = graphs
                .get(&g)
                .ok_or_else(|| ModelError::Device("graph vanished".into()))?;
            graph.0.launch().map_err(CudaError::from)?;
            self.last_rows = if self.stage.is_last() { t } else { 0 };
            self.last_tokens = t;
            return Ok(self.last_rows);
        }
        let mbps = self.limits.max_blocks_per_seq();
        let mut tables = vec![0i32; n * mbps];
        for (s, bt) in batch.attn.block_tables.iter().enumerate() {
            for (j, &b) in bt.iter().take(mbps).enumerate() {
                tables[s * mbps + j] = b as i32;
            }
        }
        let ids: Vec<i32> = if embeds {
            vec![0; t]
        } else {
            batch.input_ids.iter().map(|&x| x as i32).collect()
        };
        let pos: Vec<i32> = batch.positions.iter().map(|&x| x as i32).collect();
        let qsl: Vec<i32> = batch
            .attn
            .query_start_loc
            .iter()
            .map(|&x| x as i32)
            .collect();
        let seq_lens: Vec<i32> = batch.attn.seq_lens.iter().map(|&x| x as i32).collect();
        let rows_i: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        self.upload_inputs(
            &ids,
            &pos,
            &batch.attn.slot_mapping,
            &qsl,
            &seq_lens,
            &tables,
            &rows_i,
        )?;
        let max_query_len = batch
            .attn
            .query_start_loc
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0);
        let mrope = match mm {
            Some(mm) => self.upload_mm(mm, t)?,
            None => false,
        };
        let run = self.run_kernels(StepShape {
            tokens: t,
            seqs: n,
            rows: rows.len(),
            max_query_len,
            max_seq_len,
            embeds,
            mrope,
        });
        self.residual_adds = None;
        run?;
        self.last_rows = if self.stage.is_last() { rows.len() } else { 0 };
        self.last_tokens = t;
        Ok(self.last_rows)
    }

    /// The f32 logits of the last forward's rows, `[rows, vocab]`, on the device.
    /// Empty for a spec without `embed_and_head`.
    pub fn logits(&self) -> omni_backend::cuda::cudarc::driver::CudaView<'_, f32> {
        let n = if self.spec.embed_and_head {
            self.last_rows * self.spec.vocab_size
        } else {
            0
        };
        self.act.logits.slice(..n)
    }

    /// The final-norm state of the last forward's output rows, `[rows, hidden]` bf16, on the
    /// device (where a code predictor starts; for a spec without `embed_and_head`, the output).
    pub fn final_norm(&self) -> omni_backend::cuda::cudarc::driver::CudaView<'_, bf16> {
        self.act.sel.slice(..self.last_rows * self.spec.hidden_size)
    }

    /// The whole f32 logits buffer (`[max_seqs, vocab]`), for kernels queued after a step.
    pub(crate) fn logits_buffer(&self) -> &CudaSlice<f32> {
        &self.act.logits
    }

    /// The whole final-norm buffer (`[max_seqs, hidden]`), for kernels queued in a graph.
    pub(crate) fn final_norm_buffer(&self) -> &CudaSlice<bf16> {
        &self.act.sel
    }

    /// The token-embedding table (`[vocab, hidden]`), without `embed_and_head` `None`.
    pub(crate) fn embed_table(&self) -> Option<&CudaSlice<bf16>> {
        self.embed.as_ref()
    }

    /// The step limits.
    pub fn limits(&self) -> StepLimits {
        self.limits
    }

    /// The step inputs and the input-embedding buffer, for kernels that write a step's
    /// metadata on the device (a code predictor's frame graph).
    pub(crate) fn device_inputs(&mut self) -> (&mut StepInputs, &mut CudaSlice<bf16>) {
        (&mut self.inputs, &mut self.act.sel_embed)
    }

    /// Queues one step whose inputs are already on the device (no host work: capturable).
    pub(crate) fn queue_step(&mut self, st: StepShape) -> Result<(), ModelError> {
        if self.kv.is_empty() {
            return Err(ModelError::Batch("step before init_cache".into()));
        }
        self.run_kernels(st)?;
        self.last_rows = st.rows;
        self.last_tokens = st.tokens;
        Ok(())
    }

    /// Drops every captured decode graph (a changed capture setting needs new ones).
    pub fn clear_decode_graphs(&mut self) {
        self.graphs.clear();
        self.embed_graphs.clear();
    }

    /// Copies the residual stream after `layers` decoder layers (HF's
    /// `hidden_states[layers]`, no final norm) of every computed token into a buffer each step,
    /// or stops (`None`). Set it before capturing graphs: a graph replays what it captured.
    pub fn set_capture_after_layers(&mut self, layers: Option<usize>) -> Result<(), ModelError> {
        if self.stage.size > 1 && layers.is_some() {
            return Err(ModelError::Batch(
                "the hidden-state export needs the whole model on one pipeline stage".into(),
            ));
        }
        if !self.graphs.is_empty() || !self.embed_graphs.is_empty() {
            return Err(ModelError::Batch(
                "set the capture before capturing decode graphs".into(),
            ));
        }
        self.capture = match layers {
            None => None,
            Some(n) if n > self.layers.len() => {
                return Err(ModelError::Batch(format!(
                    "cannot capture the state after {n} layers of {}",
                    self.layers.len()
                )));
            }
            Some(n) => {
                let len = self.limits.max_tokens * self.spec.hidden_size;
                let buf = self
                    .cx
                    .stream()
                    .alloc_zeros::<f32>(len)
                    .map_err(CudaError::from)?;
                Some((n, buf))
            }
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::MoeOneLaunch;

    /// The worker's `OMNI_CUDA_MOE_ONE_LAUNCH` values, and anything else left to the default.
    #[test]
    fn moe_one_launch_values() {
        let cases = [
            ("0", Some(MoeOneLaunch::Off)),
            ("plain", Some(MoeOneLaunch::Plain)),
            (" 1 ", Some(MoeOneLaunch::EvictFirst)),
            ("ef", Some(MoeOneLaunch::EvictFirst)),
            ("qkv", None),
            ("", None),
        ];
        for (v, want) in cases {
            assert_eq!(MoeOneLaunch::parse(v), want, "{v:?}");
        }
    }
}
