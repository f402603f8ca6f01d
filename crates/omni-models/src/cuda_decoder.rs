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

use std::collections::BTreeMap;
use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::{CudaGraph, CudaSlice, DevicePtr, sys as driver_sys};
use omni_backend::cuda::{
    AttnShape, CudaContext, CudaError, DeviceAllReduce, MoeShape, QkvBuffers, QkvShape,
    ResidualUpdate, bf16, fused_moe_workspace_bytes, paged_attention_workspace_len,
};
use omni_backend::rope::Rope;

use crate::ModelError;
use crate::batch::ForwardBatch;
use crate::decoder::{DecoderLayer, DecoderSpec, HeadLayout, Linear, Loader, Mlp, load_shaped};
use crate::weights::WeightSource;

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

#[derive(Debug)]
struct DLinear {
    w: CudaSlice<bf16>,
    b: Option<CudaSlice<bf16>>,
    out: usize,
    inp: usize,
}

#[derive(Debug)]
enum DMlp {
    Dense {
        gate_up: DLinear,
        down: DLinear,
        inter: usize,
    },
    Moe {
        /// `[E, H]` in f32: routing is a top-k over nearly equal logits, computed in f32 from
        /// the unrounded normed hidden state so it picks the experts the f32 reference picks.
        router: CudaSlice<f32>,
        /// `[E, 2 I, H]`: per expert, I gate rows then I up rows.
        w13: CudaSlice<bf16>,
        /// `[E, H, I]`.
        w2: CudaSlice<bf16>,
        inter: usize,
        num_experts: usize,
        top_k: usize,
        renormalize: bool,
    },
}

#[derive(Debug)]
struct DLayer {
    input_norm: CudaSlice<bf16>,
    post_norm: CudaSlice<bf16>,
    qkv: DLinear,
    o: DLinear,
    qk_norm: Option<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    mlp: DMlp,
}

/// Per-step inputs uploaded before each forward (sized for [`StepLimits`]).
#[derive(Debug)]
struct StepInputs {
    ids: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    slots: CudaSlice<i64>,
    query_start_loc: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
    /// `[max_seqs, max_blocks_per_seq]`.
    block_tables: CudaSlice<i32>,
    /// Rows of the final hidden state whose logits to compute.
    logits_rows: CudaSlice<i32>,
}

/// Activations, sized for [`StepLimits`].
#[derive(Debug)]
struct Activations {
    /// The residual stream, f32 (bf16 rounding of the sum over dozens of layers would cost more
    /// accuracy than the few bytes per token it saves).
    x: CudaSlice<f32>,
    h: CudaSlice<bf16>,
    qkv: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    /// Row-parallel GEMM outputs (o_proj, down_proj, MoE) in f32: all-reduced in f32 so that
    /// tensor-parallel ranks sum unrounded partials.
    proj: CudaSlice<f32>,
    /// The fused MoE block's bf16 output, widened into `proj`.
    moe_out: CudaSlice<bf16>,
    gate_up: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    sel: CudaSlice<bf16>,
    /// The embedding output, `[max_tokens, hidden]` bf16 (the residual stream starts from it).
    sel_embed: CudaSlice<bf16>,
    logits: CudaSlice<f32>,
    attn_workspace: CudaSlice<f32>,
    /// Router logits in f32 (routing is a top-k: bf16 logits would flip near-ties).
    router_logits: CudaSlice<f32>,
    /// The MoE layers' normed input, unrounded, for the router.
    h32: CudaSlice<f32>,
    topk_ids: CudaSlice<i32>,
    topk_weights: CudaSlice<f32>,
    moe_workspace: CudaSlice<u8>,
}

/// One step's host-side shape (what a launch sequence depends on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StepShape {
    tokens: usize,
    seqs: usize,
    rows: usize,
    max_query_len: usize,
    max_seq_len: usize,
}

/// The decoder on one device, with its KV cache.
#[derive(Debug)]
pub struct CudaDecoderModel {
    cx: Arc<CudaContext>,
    spec: DecoderSpec,
    heads: HeadLayout,
    rank: usize,
    all_reduce: Option<Arc<dyn DeviceAllReduce>>,
    embed: CudaSlice<bf16>,
    lm_head: Option<CudaSlice<bf16>>,
    norm: CudaSlice<bf16>,
    layers: Vec<DLayer>,
    inv_freq: CudaSlice<f32>,
    limits: StepLimits,
    inputs: StepInputs,
    act: Activations,
    /// Per layer, K and V: `[num_blocks, block_size, local_kv_heads, head_dim]`.
    kv: Vec<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    num_blocks: usize,
    /// Decode graphs by padded batch size.
    graphs: BTreeMap<usize, DecodeGraph>,
    /// Rows of logits the last forward left in `act.logits`.
    last_rows: usize,
    /// Per-op timing of eager steps, when [`Self::enable_profiler`] was called.
    profiler: Option<StepProfiler>,
}

/// Copies host f32 weights to the device as bf16 through a pinned staging buffer.
struct Uploader<'a> {
    cx: &'a CudaContext,
}

impl Uploader<'_> {
    fn upload(&self, host: &[f32]) -> Result<CudaSlice<bf16>, ModelError> {
        let v: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
        Ok(self.cx.upload_bf16_pinned(&v)?)
    }

    fn linear(&self, l: &Linear) -> Result<DLinear, ModelError> {
        Ok(DLinear {
            w: self.upload(&l.w)?,
            b: l.bias.as_deref().map(|b| self.upload(b)).transpose()?,
            out: l.out,
            inp: l.inp,
        })
    }

    fn layer(&self, l: &DecoderLayer) -> Result<DLayer, ModelError> {
        let mlp = match &l.mlp {
            Mlp::Dense(m) => DMlp::Dense {
                gate_up: self.linear(&m.gate_up)?,
                down: self.linear(&m.down)?,
                inter: m.inter,
            },
            Mlp::Moe(m) => {
                let inter = m.experts.first().map_or(0, |e| e.inter);
                let mut w13 = Vec::new();
                let mut w2 = Vec::new();
                for e in &m.experts {
                    w13.extend_from_slice(&e.gate_up.w);
                    w2.extend_from_slice(&e.down.w);
                }
                DMlp::Moe {
                    router: self.cx.stream().clone_htod(&m.router)?,
                    w13: self.upload(&w13)?,
                    w2: self.upload(&w2)?,
                    inter,
                    num_experts: m.experts.len(),
                    top_k: m.top_k,
                    renormalize: m.norm_topk_prob,
                }
            }
        };
        Ok(DLayer {
            input_norm: self.upload(&l.input_norm)?,
            post_norm: self.upload(&l.post_norm)?,
            qkv: self.linear(&l.qkv)?,
            o: self.linear(&l.o)?,
            qk_norm: match (&l.q_norm, &l.k_norm) {
                (Some(q), Some(k)) => Some((self.upload(q)?, self.upload(k)?)),
                _ => None,
            },
            mlp,
        })
    }
}

/// Makes dummy weights on the device, one seed per tensor.
struct DummyMaker<'a> {
    cx: &'a CudaContext,
    seed: u64,
    next: u64,
}

impl DummyMaker<'_> {
    fn tensor(&mut self, len: usize, lo: f32, hi: f32) -> Result<CudaSlice<bf16>, ModelError> {
        let mut t = self.cx.zeros_bf16(len)?;
        self.next += 1;
        let seed = self
            .seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(self.next);
        self.cx.fill_uniform_bf16(&mut t, seed, lo, hi)?;
        Ok(t)
    }

    fn weight(&mut self, len: usize) -> Result<CudaSlice<bf16>, ModelError> {
        self.tensor(len, -0.02, 0.02)
    }

    fn ones(&mut self, len: usize) -> Result<CudaSlice<bf16>, ModelError> {
        self.tensor(len, 1.0, 1.0)
    }

    fn linear(&mut self, out: usize, inp: usize, bias: bool) -> Result<DLinear, ModelError> {
        Ok(DLinear {
            w: self.weight(out * inp)?,
            b: if bias { Some(self.weight(out)?) } else { None },
            out,
            inp,
        })
    }

    fn layer(
        &mut self,
        spec: &DecoderSpec,
        heads: &HeadLayout,
        tp_size: usize,
        i: usize,
    ) -> Result<DLayer, ModelError> {
        let (h, hd) = (spec.hidden_size, spec.head_dim);
        let qkv_out = (heads.local_heads + 2 * heads.local_kv_heads) * hd;
        let split = |n: usize, what: &str| {
            if n.is_multiple_of(tp_size) {
                Ok(n / tp_size)
            } else {
                Err(ModelError::TensorParallel(format!(
                    "{what} {n} does not split over {tp_size} ranks"
                )))
            }
        };
        let mlp = match (&spec.moe, spec.is_moe_layer(i)) {
            (Some(m), true) => {
                let inter = split(m.moe_intermediate_size, "moe_intermediate_size")?;
                let router_bf16 = self.weight(m.num_experts * h)?;
                let mut router = self.cx.stream().alloc_zeros::<f32>(m.num_experts * h)?;
                self.cx
                    .bf16_to_f32(&router_bf16, &mut router, m.num_experts * h)?;
                DMlp::Moe {
                    router,
                    w13: self.weight(m.num_experts * 2 * inter * h)?,
                    w2: self.weight(m.num_experts * h * inter)?,
                    inter,
                    num_experts: m.num_experts,
                    top_k: m.top_k,
                    renormalize: m.norm_topk_prob,
                }
            }
            _ => {
                let inter = split(spec.intermediate_size, "intermediate size")?;
                DMlp::Dense {
                    gate_up: self.linear(2 * inter, h, false)?,
                    down: self.linear(h, inter, false)?,
                    inter,
                }
            }
        };
        Ok(DLayer {
            input_norm: self.ones(h)?,
            post_norm: self.ones(h)?,
            qkv: self.linear(qkv_out, h, spec.attention_bias)?,
            o: DLinear {
                w: self.weight(h * heads.local_heads * hd)?,
                b: if spec.attention_bias {
                    Some(self.weight(h)?)
                } else {
                    None
                },
                out: h,
                inp: heads.local_heads * hd,
            },
            qk_norm: if spec.qk_norm {
                Some((self.ones(hd)?, self.ones(hd)?))
            } else {
                None
            },
            mlp,
        })
    }
}

impl CudaDecoderModel {
    /// Loads rank `rank` of `tp_size`'s shard onto `cx`'s device and allocates the step buffers
    /// for `limits`. `all_reduce` must be given (with `world_size() == tp_size`) when
    /// `tp_size > 1`. `on_layer(done, total)` is called after each layer.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        cx: Arc<CudaContext>,
        spec: DecoderSpec,
        ws: &dyn WeightSource,
        init: DeviceWeightInit,
        rank: usize,
        tp_size: usize,
        all_reduce: Option<Arc<dyn DeviceAllReduce>>,
        limits: StepLimits,
        on_layer: &dyn Fn(usize, usize),
    ) -> Result<Self, ModelError> {
        let heads = spec.head_layout(rank, tp_size)?;
        match (&all_reduce, tp_size) {
            (_, 1) => {}
            (Some(ar), n) if ar.world_size() == n => {}
            (ar, n) => {
                return Err(ModelError::TensorParallel(format!(
                    "tp_size {n} needs an all-reduce group of {n} ranks, got {:?}",
                    ar.as_ref().map(|a| a.world_size())
                )));
            }
        }
        let (v, h) = (spec.vocab_size, spec.hidden_size);
        let total = spec.num_layers;
        let (embed, lm_head, norm, layers) = match init {
            DeviceWeightInit::Host => {
                let up = Uploader { cx: &cx };
                let embed =
                    up.upload(&load_shaped(ws, "model.embed_tokens.weight", &[v, h])?.data)?;
                let lm_head = if spec.tie_word_embeddings {
                    None
                } else {
                    Some(up.upload(&load_shaped(ws, "lm_head.weight", &[v, h])?.data)?)
                };
                let loader = Loader::new(ws, &spec, rank, tp_size)?;
                let norm = up.upload(&loader.vector("model.norm.weight", h)?)?;
                let mut layers = Vec::with_capacity(total);
                for i in 0..total {
                    layers.push(up.layer(&loader.layer(i)?)?);
                    on_layer(i + 1, total);
                }
                (embed, lm_head, norm, layers)
            }
            DeviceWeightInit::Dummy { seed } => {
                let mut mk = DummyMaker {
                    cx: &cx,
                    seed,
                    next: 0,
                };
                let embed = mk.weight(v * h)?;
                let lm_head = if spec.tie_word_embeddings {
                    None
                } else {
                    Some(mk.weight(v * h)?)
                };
                let norm = mk.ones(h)?;
                let mut layers = Vec::with_capacity(total);
                for i in 0..total {
                    layers.push(mk.layer(&spec, &heads, tp_size, i)?);
                    on_layer(i + 1, total);
                }
                (embed, lm_head, norm, layers)
            }
        };
        let rope = Rope::new(spec.head_dim, spec.rope_theta, &spec.rope_scaling)?;
        let inv_freq = cx.stream().clone_htod(rope.inv_freq())?;
        let (inputs, act) = Self::alloc_step_buffers(&cx, &spec, &heads, &layers, limits)?;
        let profiler = None;
        cx.synchronize()?;
        tracing::info!(
            architecture = spec.architecture,
            layers = spec.num_layers,
            tp_rank = rank,
            tp_size,
            device = %cx.info().name,
            "model loaded on the GPU"
        );
        Ok(Self {
            cx,
            spec,
            heads,
            rank,
            all_reduce,
            embed,
            lm_head,
            norm,
            layers,
            inv_freq,
            limits,
            inputs,
            act,
            kv: Vec::new(),
            num_blocks: 0,
            graphs: BTreeMap::new(),
            last_rows: 0,
            profiler,
        })
    }

    fn alloc_step_buffers(
        cx: &CudaContext,
        spec: &DecoderSpec,
        heads: &HeadLayout,
        layers: &[DLayer],
        limits: StepLimits,
    ) -> Result<(StepInputs, Activations), ModelError> {
        let s = cx.stream();
        let (t, n) = (limits.max_tokens.max(1), limits.max_seqs.max(1));
        let (h, hd) = (spec.hidden_size, spec.head_dim);
        let mbps = limits.max_blocks_per_seq();
        let mut inter = 0;
        let mut moe_shape: Option<MoeShape> = None;
        for l in layers {
            match &l.mlp {
                DMlp::Dense { inter: i, .. } => inter = inter.max(*i),
                DMlp::Moe {
                    inter: i,
                    num_experts,
                    top_k,
                    ..
                } => {
                    moe_shape = Some(MoeShape {
                        tokens: t,
                        hidden: h,
                        inter: *i,
                        num_experts: *num_experts,
                        top_k: *top_k,
                    })
                }
            }
        }
        // The decode path's split-KV workspace is the only one; the number of partitions
        // depends on the batch, so size it for the worst batch size.
        let attn_workspace = (1..=n)
            .map(|seqs| {
                paged_attention_workspace_len(&AttnShape {
                    num_seqs: seqs,
                    num_tokens: seqs,
                    num_heads: heads.local_heads,
                    num_kv_heads: heads.local_kv_heads,
                    head_dim: hd,
                    block_size: limits.block_size,
                    max_blocks_per_seq: mbps,
                    max_query_len: 1,
                    max_seq_len: limits.max_model_len,
                    scale: 1.0,
                })
            })
            .max()
            .unwrap_or(0);
        let inputs = StepInputs {
            ids: s.alloc_zeros(t)?,
            positions: s.alloc_zeros(t)?,
            slots: s.alloc_zeros(t)?,
            query_start_loc: s.alloc_zeros(n + 1)?,
            seq_lens: s.alloc_zeros(n)?,
            block_tables: s.alloc_zeros(n * mbps)?,
            logits_rows: s.alloc_zeros(n)?,
        };
        let (e, k) = moe_shape.map_or((0, 0), |m| (m.num_experts, m.top_k));
        let act = Activations {
            x: s.alloc_zeros(t * h)?,
            h: s.alloc_zeros(t * h)?,
            qkv: s.alloc_zeros(t * (heads.local_heads + 2 * heads.local_kv_heads) * hd)?,
            q: s.alloc_zeros(t * heads.local_heads * hd)?,
            attn: s.alloc_zeros(t * heads.local_heads * hd)?,
            proj: s.alloc_zeros(t * h)?,
            moe_out: s.alloc_zeros(if moe_shape.is_some() { t * h } else { 1 })?,
            gate_up: s.alloc_zeros((t * 2 * inter).max(1))?,
            act: s.alloc_zeros((t * inter).max(1))?,
            sel: s.alloc_zeros(n * h)?,
            sel_embed: s.alloc_zeros(t * h)?,
            logits: s.alloc_zeros(n * spec.vocab_size)?,
            attn_workspace: s.alloc_zeros(attn_workspace.max(1))?,
            router_logits: s.alloc_zeros((t * e).max(1))?,
            h32: s.alloc_zeros(if moe_shape.is_some() { t * h } else { 1 })?,
            topk_ids: s.alloc_zeros((t * k).max(1))?,
            topk_weights: s.alloc_zeros((t * k).max(1))?,
            moe_workspace: s.alloc_zeros(moe_shape.map_or(1, fused_moe_workspace_bytes))?,
        };
        Ok((inputs, act))
    }

    /// Whether [`CudaDecoderModel::init_cache`] ran.
    pub fn has_cache(&self) -> bool {
        !self.kv.is_empty()
    }

    /// Logs each op's mean GPU time over every `every` eager steps of one kind (decode at a
    /// batch size, or prefill); graph replay is off from now on (`every` 0: off).
    pub fn enable_profiler(&mut self, every: u64) {
        self.profiler = (every > 0).then(|| StepProfiler::new(&self.cx, every));
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

    /// KV bytes of one block of `block_size` tokens on this rank (all layers, K and V, bf16).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> u64 {
        (2 * block_size
            * self.heads.local_kv_heads
            * self.spec.head_dim
            * std::mem::size_of::<bf16>()
            * self.spec.num_layers) as u64
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
        self.kv.clear();
        let per_layer = num_blocks * block_size * self.heads.local_kv_heads * self.spec.head_dim;
        for _ in 0..self.spec.num_layers {
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

    /// Captures decode graphs for each batch size in `sizes` that fits the limits (each is
    /// first run once eagerly, so kernels are loaded and cuBLAS has chosen its algorithms).
    /// Returns the sizes captured.
    pub fn capture_decode_graphs(&mut self, sizes: &[usize]) -> Result<Vec<usize>, ModelError> {
        if self.kv.is_empty() {
            return Err(ModelError::Batch("capture before init_cache".into()));
        }
        let mut done = Vec::new();
        for &g in sizes {
            if g == 0 || g > self.limits.max_seqs || g > self.limits.max_tokens {
                continue;
            }
            let shape = self.pad_decode_inputs(g, &[])?;
            self.run_kernels(shape)?;
            self.cx.synchronize()?;
            let stream = self.cx.stream().clone();
            stream
                .begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(CudaError::from)?;
            let run = self.run_kernels(shape);
            let graph = stream
                .end_capture(driver_sys::CUgraphInstantiate_flags(0))
                .map_err(CudaError::from)?;
            run?;
            let graph = graph.ok_or_else(|| {
                ModelError::Device(format!("capturing the decode graph of {g} gave no graph"))
            })?;
            graph.upload().map_err(CudaError::from)?;
            self.graphs.insert(g, DecodeGraph(graph));
            done.push(g);
        }
        self.cx.synchronize()?;
        Ok(done)
    }

    /// Batch sizes with a captured decode graph.
    pub fn graph_sizes(&self) -> Vec<usize> {
        self.graphs.keys().copied().collect()
    }

    /// Uploads a decode batch padded to `g` sequences (one token each): the real sequences
    /// first (`real`: (token id, position, slot, seq_len, block table) each), then padding rows
    /// that write no cache slot and read one token of block 0.
    fn pad_decode_inputs(
        &mut self,
        g: usize,
        real: &[DecodeRow<'_>],
    ) -> Result<StepShape, ModelError> {
        let mbps = self.limits.max_blocks_per_seq();
        let mut ids = vec![0i32; g];
        let mut pos = vec![0i32; g];
        let mut slots = vec![-1i64; g];
        let qsl: Vec<i32> = (0..=g as i32).collect();
        let mut seq_lens = vec![1i32; g];
        let mut tables = vec![0i32; g * mbps];
        let mut max_seq = 1;
        for (i, r) in real.iter().enumerate() {
            ids[i] = r.token as i32;
            pos[i] = r.position as i32;
            slots[i] = r.slot;
            seq_lens[i] = r.seq_len as i32;
            max_seq = max_seq.max(r.seq_len);
            for (j, &b) in r.block_table.iter().take(mbps).enumerate() {
                tables[i * mbps + j] = b as i32;
            }
        }
        let rows: Vec<i32> = (0..g as i32).collect();
        self.upload_inputs(&ids, &pos, &slots, &qsl, &seq_lens, &tables, &rows)?;
        Ok(StepShape {
            tokens: g,
            seqs: g,
            rows: g,
            max_query_len: 1,
            max_seq_len: if real.is_empty() {
                self.limits.max_model_len
            } else {
                max_seq
            },
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn upload_inputs(
        &mut self,
        ids: &[i32],
        pos: &[i32],
        slots: &[i64],
        qsl: &[i32],
        seq_lens: &[i32],
        tables: &[i32],
        rows: &[i32],
    ) -> Result<(), ModelError> {
        let s = self.cx.stream().clone();
        let i = &mut self.inputs;
        s.memcpy_htod(ids, &mut i.ids.slice_mut(..ids.len()))
            .map_err(CudaError::from)?;
        s.memcpy_htod(pos, &mut i.positions.slice_mut(..pos.len()))
            .map_err(CudaError::from)?;
        s.memcpy_htod(slots, &mut i.slots.slice_mut(..slots.len()))
            .map_err(CudaError::from)?;
        s.memcpy_htod(qsl, &mut i.query_start_loc.slice_mut(..qsl.len()))
            .map_err(CudaError::from)?;
        s.memcpy_htod(seq_lens, &mut i.seq_lens.slice_mut(..seq_lens.len()))
            .map_err(CudaError::from)?;
        s.memcpy_htod(tables, &mut i.block_tables.slice_mut(..tables.len()))
            .map_err(CudaError::from)?;
        s.memcpy_htod(rows, &mut i.logits_rows.slice_mut(..rows.len()))
            .map_err(CudaError::from)?;
        Ok(())
    }

    /// Runs one step and leaves the logits of its output rows (`batch.output_rows()`) on the
    /// device ([`CudaDecoderModel::logits`]); returns the number of rows. Pure decode batches
    /// replay a captured graph when one fits.
    pub fn forward(&mut self, batch: &ForwardBatch) -> Result<usize, ModelError> {
        if self.kv.is_empty() {
            return Err(ModelError::Batch("forward before init_cache".into()));
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
        if let Some(&id) = batch.input_ids.iter().find(|&&id| id as usize >= v) {
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
        let graph = if self.profiler.is_some() {
            None
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
            self.pad_decode_inputs(g, &real)?;
            let graph = self
                .graphs
                .get(&g)
                .ok_or_else(|| ModelError::Device("graph vanished".into()))?;
            graph.0.launch().map_err(CudaError::from)?;
            self.last_rows = t;
            return Ok(t);
        }
        let mbps = self.limits.max_blocks_per_seq();
        let mut tables = vec![0i32; n * mbps];
        for (s, bt) in batch.attn.block_tables.iter().enumerate() {
            for (j, &b) in bt.iter().take(mbps).enumerate() {
                tables[s * mbps + j] = b as i32;
            }
        }
        let ids: Vec<i32> = batch.input_ids.iter().map(|&x| x as i32).collect();
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
        self.run_kernels(StepShape {
            tokens: t,
            seqs: n,
            rows: rows.len(),
            max_query_len,
            max_seq_len,
        })?;
        self.last_rows = rows.len();
        Ok(rows.len())
    }

    /// The f32 logits of the last forward's rows, `[rows, vocab]`, on the device.
    pub fn logits(&self) -> omni_backend::cuda::cudarc::driver::CudaView<'_, f32> {
        self.act
            .logits
            .slice(..self.last_rows * self.spec.vocab_size)
    }

    /// Copies the last forward's logits to the host (synchronizes).
    pub fn logits_to_host(&self) -> Result<Vec<f32>, ModelError> {
        let view = self.logits();
        let mut host = vec![0f32; view.len()];
        self.cx
            .stream()
            .memcpy_dtoh(&view, &mut host)
            .map_err(CudaError::from)?;
        Ok(host)
    }

    fn linear(
        cx: &CudaContext,
        l: &DLinear,
        x: &impl DevicePtr<bf16>,
        out: &mut CudaSlice<bf16>,
        tokens: usize,
    ) -> Result<(), ModelError> {
        let mut o = out.slice_mut(..tokens * l.out);
        cx.matmul_nt_bf16(x, &l.w, &mut o, tokens, l.inp, l.out)?;
        if let Some(b) = &l.b {
            cx.add_bias_bf16(&mut o, b, tokens)?;
        }
        Ok(())
    }

    /// Sums `proj[..n]` over the tensor-parallel group (nothing for one rank).
    fn all_reduce(
        ar: &Option<Arc<dyn DeviceAllReduce>>,
        proj: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), ModelError> {
        if let Some(ar) = ar
            && ar.world_size() > 1
        {
            ar.all_reduce_sum_f32(&mut proj.slice_mut(..n))?;
        }
        Ok(())
    }

    /// A row-parallel linear layer into the f32 `out` (its bias added once: on rank 0).
    fn linear_f32(
        cx: &CudaContext,
        l: &DLinear,
        x: &impl DevicePtr<bf16>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        add_bias: bool,
    ) -> Result<(), ModelError> {
        let mut o = out.slice_mut(..tokens * l.out);
        cx.matmul_nt_bf16_f32(x, &l.w, &mut o, tokens, l.inp, l.out)?;
        if add_bias && let Some(b) = &l.b {
            cx.add_bias_f32(&mut o, b, tokens)?;
        }
        Ok(())
    }

    /// Queues one step's kernels on the stream (no host sync: capturable).
    fn run_kernels(&mut self, st: StepShape) -> Result<(), ModelError> {
        let cx = self.cx.clone();
        let (h, hd) = (self.spec.hidden_size, self.spec.head_dim);
        let (lq, lkv) = (self.heads.local_heads, self.heads.local_kv_heads);
        let eps = self.spec.rms_norm_eps;
        let t = st.tokens;
        let attn_shape = AttnShape {
            num_seqs: st.seqs,
            num_tokens: t,
            num_heads: lq,
            num_kv_heads: lkv,
            head_dim: hd,
            block_size: self.limits.block_size,
            max_blocks_per_seq: self.limits.max_blocks_per_seq(),
            max_query_len: st.max_query_len,
            max_seq_len: st.max_seq_len,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let rank0 = self.rank == 0;
        let mut prof = self.profiler.take();
        let stream = cx.stream().clone();
        macro_rules! mark {
            ($label:expr) => {
                if let Some(p) = prof.as_mut() {
                    p.mark(&stream, $label)?;
                }
            };
        }
        mark!("start");
        cx.embedding_ids_bf16(&self.embed, h, &self.inputs.ids, t, &mut self.act.sel_embed)?;
        mark!("embedding");
        for li in 0..self.layers.len() {
            let a = &mut self.act;
            let l = &self.layers[li];
            // h = norm(x += proj of the previous sub-block); the first layer starts x from
            // the embedding.
            let update = if li == 0 {
                ResidualUpdate::Set(a.sel_embed.slice(..t * h))
            } else {
                ResidualUpdate::Add(a.proj.slice(..t * h))
            };
            cx.fused_add_rms_norm(&mut a.x, update, &l.input_norm, &mut a.h, t, h, eps)?;
            mark!("rms_norm");
            Self::linear(&cx, &l.qkv, &a.h.slice(..t * h), &mut a.qkv, t)?;
            mark!("qkv_proj");
            let (kc, vc) = &mut self.kv[li];
            cx.qkv_rope_cache_bf16(
                QkvShape {
                    tokens: t,
                    q_heads: lq,
                    kv_heads: lkv,
                    head_dim: hd,
                    eps,
                },
                QkvBuffers {
                    qkv: &a.qkv,
                    q_out: &mut a.q,
                    k_cache: kc,
                    v_cache: vc,
                    positions: &self.inputs.positions,
                    slot_mapping: &self.inputs.slots,
                    inv_freq: &self.inv_freq,
                    qk_norm: l.qk_norm.as_ref().map(|(q, k)| (q, k)),
                },
            )?;
            mark!("qk_norm_rope_cache");
            cx.paged_attention_bf16(
                &a.q,
                &*kc,
                &*vc,
                &mut a.attn,
                &self.inputs.query_start_loc,
                &self.inputs.seq_lens,
                &self.inputs.block_tables,
                &mut a.attn_workspace,
                &attn_shape,
            )?;
            mark!("attention");
            Self::linear_f32(
                &cx,
                &l.o,
                &a.attn.slice(..t * lq * hd),
                &mut a.proj,
                t,
                rank0,
            )?;
            mark!("o_proj");
            Self::all_reduce(&self.all_reduce, &mut a.proj, t * h)?;
            mark!("all_reduce");
            let is_moe = matches!(l.mlp, DMlp::Moe { .. });
            cx.fused_add_rms_norm_f32_out(
                &mut a.x,
                ResidualUpdate::Add(a.proj.slice(..t * h)),
                &l.post_norm,
                &mut a.h,
                is_moe.then(|| a.h32.slice_mut(..t * h)).as_mut(),
                t,
                h,
                eps,
            )?;
            mark!("rms_norm");
            match &l.mlp {
                DMlp::Dense {
                    gate_up,
                    down,
                    inter,
                } => {
                    Self::linear(&cx, gate_up, &a.h.slice(..t * h), &mut a.gate_up, t)?;
                    mark!("gate_up_proj");
                    let mut act = a.act.slice_mut(..t * inter);
                    cx.silu_and_mul_bf16(&a.gate_up.slice(..t * 2 * inter), &mut act, *inter)?;
                    mark!("silu_and_mul");
                    Self::linear_f32(&cx, down, &a.act.slice(..t * inter), &mut a.proj, t, rank0)?;
                    mark!("down_proj");
                }
                DMlp::Moe {
                    router,
                    w13,
                    w2,
                    inter,
                    num_experts,
                    top_k,
                    renormalize,
                } => {
                    let mut logits = a.router_logits.slice_mut(..t * num_experts);
                    cx.matmul_nt_f32(
                        &a.h32.slice(..t * h),
                        router,
                        &mut logits,
                        t,
                        h,
                        *num_experts,
                    )?;
                    mark!("moe_router");
                    let (e, k) = (*num_experts, *top_k);
                    cx.moe_topk_softmax(
                        &a.router_logits.slice(..t * e),
                        &mut a.topk_ids.slice_mut(..t * k),
                        &mut a.topk_weights.slice_mut(..t * k),
                        t,
                        e,
                        k,
                        *renormalize,
                    )?;
                    mark!("moe_topk");
                    cx.fused_moe_bf16(
                        &a.h.slice(..t * h),
                        w13,
                        w2,
                        &a.topk_ids.slice(..t * k),
                        &a.topk_weights.slice(..t * k),
                        &mut a.moe_out.slice_mut(..t * h),
                        &mut a.moe_workspace,
                        MoeShape {
                            tokens: t,
                            hidden: h,
                            inter: *inter,
                            num_experts: *num_experts,
                            top_k: *top_k,
                        },
                    )?;
                    cx.bf16_to_f32(&a.moe_out, &mut a.proj, t * h)?;
                    mark!("fused_moe");
                }
            }
            Self::all_reduce(&self.all_reduce, &mut a.proj, t * h)?;
            mark!("all_reduce");
        }
        let a = &mut self.act;
        cx.fused_add_rms_norm(
            &mut a.x,
            ResidualUpdate::Add(a.proj.slice(..t * h)),
            &self.norm,
            &mut a.h,
            t,
            h,
            eps,
        )?;
        mark!("rms_norm");
        cx.embedding_ids_bf16(&a.h, h, &self.inputs.logits_rows, st.rows, &mut a.sel)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let v = self.spec.vocab_size;
        let mut logits = a.logits.slice_mut(..st.rows * v);
        cx.matmul_nt_bf16_f32(
            &a.sel.slice(..st.rows * h),
            head,
            &mut logits,
            st.rows,
            h,
            v,
        )?;
        mark!("lm_head");
        if let Some(mut p) = prof {
            let kind = if st.max_query_len == 1 {
                format!("decode batch {}", st.seqs)
            } else {
                format!("prefill {} tokens", st.tokens)
            };
            p.finish(kind)?;
            self.profiler = Some(p);
        }
        Ok(())
    }
}

/// Per-kernel GPU time of eager steps (`--cuda-profile-steps <steps>`, env `OMNI_CUDA_PROFILE`,
/// arriving in the load spec): an event after every op;
/// each op's time is the gap to the previous event. Every `<steps>` steps of one kind (decode at
/// batch B, or prefill) it logs the mean time per step of each op and resets. Graph replay is
/// off while profiling, so the sum is the eager step's GPU time.
struct StepProfiler {
    every: u64,
    ctx: Arc<omni_backend::cuda::cudarc::driver::CudaContext>,
    marks: Vec<(&'static str, omni_backend::cuda::cudarc::driver::CudaEvent)>,
    kinds: BTreeMap<String, (u64, BTreeMap<&'static str, f64>)>,
}

impl StepProfiler {
    fn new(cx: &CudaContext, every: u64) -> Self {
        Self {
            every,
            ctx: cx.raw().clone(),
            marks: Vec::new(),
            kinds: BTreeMap::new(),
        }
    }

    fn mark(
        &mut self,
        stream: &omni_backend::cuda::cudarc::driver::CudaStream,
        label: &'static str,
    ) -> Result<(), ModelError> {
        let ev = self
            .ctx
            .new_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        ev.record(stream)?;
        self.marks.push((label, ev));
        Ok(())
    }

    fn finish(&mut self, kind: String) -> Result<(), ModelError> {
        let marks = std::mem::take(&mut self.marks);
        let Some((_, last)) = marks.last() else {
            return Ok(());
        };
        last.synchronize()?;
        let entry = self.kinds.entry(kind.clone()).or_default();
        entry.0 += 1;
        for w in marks.windows(2) {
            *entry.1.entry(w[1].0).or_default() += f64::from(w[0].1.elapsed_ms(&w[1].1)?);
        }
        if entry.0 >= self.every {
            let steps = entry.0 as f64;
            let total: f64 = entry.1.values().sum();
            let mut rows: Vec<(&str, f64)> = entry.1.iter().map(|(k, v)| (*k, *v)).collect();
            rows.sort_by(|a, b| b.1.total_cmp(&a.1));
            let table: Vec<String> = rows
                .iter()
                .map(|(k, v)| format!("{k} {:.3} ms ({:.0}%)", v / steps, 100.0 * v / total))
                .collect();
            tracing::info!(
                "profile {kind}: {:.3} ms GPU time per step over {} steps: {}",
                total / steps,
                entry.0,
                table.join(", ")
            );
            self.kinds.remove(&kind);
        }
        Ok(())
    }
}

impl std::fmt::Debug for StepProfiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepProfiler")
            .field("every", &self.every)
            .finish()
    }
}

/// A captured decode step (cudarc's graph has no `Debug`).
struct DecodeGraph(CudaGraph);

// SAFETY: a graph exec is a driver handle with no thread affinity: it may be launched from any
// thread whose current context is the graph's (cudarc binds the context before launching). The
// model owning it is stepped by one thread at a time (`&mut self`).
unsafe impl Send for DecodeGraph {}

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DecodeGraph")
    }
}

/// One real sequence of a padded decode batch.
#[derive(Debug, Clone, Copy)]
struct DecodeRow<'a> {
    token: u32,
    position: usize,
    slot: i64,
    seq_len: usize,
    block_table: &'a [u32],
}
