//! One step's launch sequence: per layer the attention block (fused add + RMSNorm, QKV GEMM,
//! q/k norm + RoPE + cache write, paged attention, o_proj, all-reduce) and the MLP or MoE block.
//! Steps the fused small-batch path takes go to `fused.rs` from [`CudaDecoderModel::run_kernels`].

use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use omni_backend::cuda::{
    AttnShape, CudaContext, CudaError, DeviceAllReduce, GemvIn, L2Prefetch, MoeShape, MropeAxes,
    NormExtra, QkvBuffers, QkvShape, ROUTE_MMA_MIN_TOKENS, ResidualUpdate, RouteMmaBuffers, bf16,
    moe_route_mma_enabled,
};

use super::buffers::{Activations, StepInputs};
use super::weights::{DLayer, DLinear, DMlp};
use super::{CudaDecoderModel, MoeOneLaunch, StepProfiler, StepShape};
use crate::ModelError;

/// One layer's attention core: q/k norm + RoPE + cache write, then paged attention into
/// `a.attn` (the same launches on the fused and the unfused path).
pub(super) struct AttnCore<'a> {
    pub(super) cx: &'a CudaContext,
    pub(super) inputs: &'a StepInputs,
    pub(super) inv_freq: &'a CudaSlice<f32>,
    /// The step's M-RoPE axes, when its positions hold three rows.
    pub(super) mrope: Option<MropeAxes<'a>>,
    pub(super) shape: &'a AttnShape,
    pub(super) eps: f32,
}

impl AttnCore<'_> {
    /// The q/k norm + RoPE + cache write, then attention into `a.attn`: one launch where the
    /// decode kernel takes the first part ([`CudaContext::decode_fuses_rope`]; `prefetch` is
    /// then dropped), else two; the step profile (when on) marks each launch.
    pub(super) fn run(
        &self,
        a: &mut Activations,
        l: &DLayer,
        kv: &mut (CudaSlice<bf16>, CudaSlice<bf16>),
        prefetch: L2Prefetch,
        (prof, stream): (&mut Option<StepProfiler>, &CudaStream),
    ) -> Result<(), ModelError> {
        let mut mark = |label| match prof.as_mut() {
            Some(p) => p.mark(stream, label),
            None => Ok(()),
        };
        let sh = self.shape;
        let (kc, vc) = kv;
        let fused = self.cx.decode_fuses_rope(sh);
        let qkv_shape = QkvShape {
            tokens: sh.num_tokens,
            q_heads: sh.num_heads,
            kv_heads: sh.num_kv_heads,
            head_dim: sh.head_dim,
            eps: self.eps,
        };
        let bufs = QkvBuffers {
            qkv: &a.qkv,
            q_out: &mut a.q,
            k_cache: kc,
            v_cache: vc,
            positions: &self.inputs.positions,
            slot_mapping: &self.inputs.slots,
            inv_freq: self.inv_freq,
            qk_norm: l.qk_norm.as_ref().map(|(q, k)| (q, k)),
            mrope: self.mrope,
            prefetch,
        };
        let meta = (
            &self.inputs.query_start_loc,
            &self.inputs.seq_lens,
            &self.inputs.block_tables,
        );
        if fused {
            self.cx.paged_attention_rope_bf16(
                qkv_shape,
                bufs,
                &mut a.attn,
                meta.0,
                meta.1,
                meta.2,
                &mut a.attn_workspace,
                sh,
            )?;
            return mark("qk_norm_rope+attention");
        }
        self.cx.qkv_rope_cache_bf16(qkv_shape, bufs)?;
        mark("qk_norm_rope_cache")?;
        self.cx.paged_attention_bf16(
            &a.q,
            &*kc,
            &*vc,
            &mut a.attn,
            meta.0,
            meta.1,
            meta.2,
            &mut a.attn_workspace,
            sh,
        )?;
        mark("attention")
    }
}

/// Bytes one kernel's L2 prefetch hint may name: half the L2 of an H100 / H200 (50 MB), so the
/// kernels it overlaps keep the other half.
const L2_PREFETCH_BUDGET: usize = 24 << 20;

/// The L2 prefetch hints of one layer's decode step ([`CudaDecoderModel::set_l2_prefetch_tokens`]):
/// the input norm prefetches the QKV weights, the q/k norm + RoPE kernel those of o_proj and
/// the MoE router, which then stream in during RoPE and attention (latency-bound kernels that
/// leave the memory bus idle) instead of after them.
struct LayerPrefetch {
    qkv: L2Prefetch,
    attn: L2Prefetch,
}

impl LayerPrefetch {
    /// `qkv_done`: the previous layer's MoE down kernel already prefetched this layer's QKV
    /// weights ([`LayerPrefetch::qkv_of`]).
    fn of(l: &DLayer, on: bool, qkv_done: bool, stream: &CudaStream) -> Self {
        if !on {
            return Self {
                qkv: L2Prefetch::NONE,
                attn: L2Prefetch::NONE,
            };
        }
        let qkv = if qkv_done {
            L2Prefetch::NONE
        } else {
            Self::qkv_of(l, stream)
        };
        let mut attn = L2Prefetch::with_budget(L2_PREFETCH_BUDGET).and(&l.o.w, stream);
        if let DMlp::Moe { router, .. } = &l.mlp {
            attn = attn.and(router, stream);
        }
        Self { qkv, attn }
    }

    /// The hint naming layer `l`'s QKV weights.
    fn qkv_of(l: &DLayer, stream: &CudaStream) -> L2Prefetch {
        L2Prefetch::with_budget(L2_PREFETCH_BUDGET).and(&l.qkv.w, stream)
    }
}

/// Which kernel runs a linear layer of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gemm {
    /// cuBLAS.
    Cublas,
    /// The small-batch GEMV ([`CudaContext::gemv_nt_bf16`]).
    Gemv,
    /// The staged GEMV ([`CudaContext::gemv_staged_bf16`]).
    Staged,
}

impl Gemm {
    /// This kind where it takes `tokens` rows of `l`'s width (the staged GEMV also only where
    /// its plan stages all of `l`'s weights), else cuBLAS.
    fn fit(self, cx: &CudaContext, tokens: usize, l: &DLinear) -> Self {
        let fits = match self {
            Self::Cublas => false,
            Self::Gemv => CudaContext::gemv_fits(tokens, l.inp),
            Self::Staged => {
                CudaContext::gemv_fits(tokens, l.inp)
                    && cx.staged_plan(l.out, l.inp, tokens).is_whole()
            }
        };
        if fits { self } else { Self::Cublas }
    }
}

impl CudaDecoderModel {
    fn linear(
        cx: &CudaContext,
        kind: Gemm,
        l: &DLinear,
        x: &impl DevicePtr<bf16>,
        out: &mut CudaSlice<bf16>,
        tokens: usize,
    ) -> Result<(), ModelError> {
        let mut o = out.slice_mut(..tokens * l.out);
        match kind.fit(cx, tokens, l) {
            Gemm::Staged => cx.gemv_staged_bf16(x, &l.w, &mut o, tokens, l.inp, l.out)?,
            Gemm::Gemv => cx.gemv_nt_bf16(x, &l.w, &mut o, tokens, l.inp, l.out)?,
            Gemm::Cublas => cx.matmul_nt_bf16(x, &l.w, &mut o, tokens, l.inp, l.out)?,
        }
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
    #[allow(clippy::too_many_arguments)]
    fn linear_f32(
        cx: &CudaContext,
        kind: Gemm,
        l: &DLinear,
        x: &impl DevicePtr<bf16>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        add_bias: bool,
    ) -> Result<(), ModelError> {
        let mut o = out.slice_mut(..tokens * l.out);
        match kind.fit(cx, tokens, l) {
            Gemm::Staged => cx.gemv_staged_f32(x, &l.w, &mut o, tokens, l.inp, l.out)?,
            Gemm::Gemv => cx.gemv_nt_bf16_f32(x, &l.w, &mut o, tokens, l.inp, l.out)?,
            Gemm::Cublas => cx.matmul_nt_bf16_f32(x, &l.w, &mut o, tokens, l.inp, l.out)?,
        }
        if add_bias && let Some(b) = &l.b {
            cx.add_bias_f32(&mut o, b, tokens)?;
        }
        Ok(())
    }

    /// The paged-attention shape of step `st` on this rank (both step paths).
    pub(super) fn attn_shape(&self, st: &StepShape) -> AttnShape {
        let hd = self.spec.head_dim;
        AttnShape {
            num_seqs: st.seqs,
            num_tokens: st.tokens,
            num_heads: self.heads.local_heads,
            num_kv_heads: self.heads.local_kv_heads,
            head_dim: hd,
            block_size: self.limits.block_size,
            max_blocks_per_seq: self.limits.max_blocks_per_seq(),
            max_query_len: st.max_query_len,
            max_seq_len: st.max_seq_len,
            scale: 1.0 / (hd as f32).sqrt(),
        }
    }

    /// The embedding rows of the step's `t` token ids into `act.sel_embed`.
    pub(super) fn embed_step_ids(&mut self, t: usize) -> Result<(), ModelError> {
        let table = self.embed.as_ref().ok_or_else(|| {
            ModelError::Batch(format!("{} has no token embedding", self.spec.architecture))
        })?;
        let h = self.spec.hidden_size;
        self.cx
            .embedding_ids_bf16(table, h, &self.inputs.ids, t, &mut self.act.sel_embed)?;
        Ok(())
    }

    /// Queues one step's kernels on the stream (no host sync: capturable).
    pub(super) fn run_kernels(&mut self, st: StepShape) -> Result<(), ModelError> {
        if self.fused_fits(&st) {
            return self.run_fused_kernels(st);
        }
        let cx = self.cx.clone();
        let (h, hd) = (self.spec.hidden_size, self.spec.head_dim);
        let lq = self.heads.local_heads;
        let eps = self.spec.rms_norm_eps;
        let t = st.tokens;
        let attn_shape = self.attn_shape(&st);
        let rank0 = self.rank == 0;
        let gemv = if self.small_batch_gemv {
            Gemm::Gemv
        } else {
            Gemm::Cublas
        };
        // The attention projections of steps of a few tokens may run on the staged GEMV,
        // whose weight copies overlap the latency-bound kernels before them.
        let proj = if t <= cx.staged_gemv_tokens() {
            Gemm::Staged
        } else {
            gemv
        };
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
        let first_stage = self.stage.is_first();
        if !first_stage {
            // The previous stage's residual stream is in `proj`: x = 0 + proj below, the same
            // f32 values the whole model would hold after those layers.
            stream
                .memset_zeros(&mut self.act.x.slice_mut(..t * h))
                .map_err(CudaError::from)?;
        } else if !st.embeds {
            self.embed_step_ids(t)?;
            mark!("embedding");
        }
        // MoE layers of this step may run the small-batch experts, which add into x
        // themselves (one rank: nothing to all-reduce; no deepstack rows to add).
        let small_moe =
            t <= self.small_moe_tokens && self.one_rank() && self.residual_adds.is_none();
        let prefetch = t <= self.l2_prefetch_tokens;
        // Whether x already holds the previous sub-block's output.
        let mut kept = false;
        // Whether the previous layer's MoE down kernel prefetched this layer's QKV weights.
        let mut qkv_prefetched = false;
        // The one-launch attention block's shape, when this step may run it.
        let attn1 = self.attn_block1_step(&st);
        let mrope = match (&self.mrope_axes, st.mrope) {
            (Some(axes), true) => Some(MropeAxes {
                axes,
                row_stride: self.limits.max_tokens.max(1),
            }),
            _ => None,
        };
        for li in 0..self.layers.len() {
            let a = &mut self.act;
            let l = &self.layers[li];
            // h = norm(x += proj of the previous sub-block); the first layer of the model
            // starts x from the embedding.
            let update = if li == 0 && first_stage {
                ResidualUpdate::Set(a.sel_embed.slice(..t * h))
            } else if std::mem::take(&mut kept) {
                ResidualUpdate::Keep
            } else {
                ResidualUpdate::Add(a.proj.slice(..t * h))
            };
            let pf = LayerPrefetch::of(l, prefetch, std::mem::take(&mut qkv_prefetched), &stream);
            // The whole attention block in one launch (`attn_block1.rs`) where the residual is
            // kept or set and the projections have no bias.
            let one = attn1.filter(|_| {
                !matches!(update, ResidualUpdate::Add(_)) && l.qkv.b.is_none() && l.o.b.is_none()
            });
            // The input norm folds into a staged QKV projection when it only normalises (the
            // residual kept, or set from the embedding): every block normalises the rows itself.
            let fold_norm = one.is_none()
                && proj.fit(&cx, t, &l.qkv) == Gemm::Staged
                && !prefetch
                && cx.staged_gemv_folds_norm()
                && l.qkv.b.is_none()
                && !matches!(update, ResidualUpdate::Add(_))
                && CudaContext::gemv_fits(t, h);
            if let Some(shape) = one {
                let set = matches!(update, ResidualUpdate::Set(_));
                let kv = &mut self.kv[li];
                Self::attn_block1(
                    &cx,
                    shape,
                    a,
                    l,
                    kv,
                    &self.inputs,
                    (&self.inv_freq, mrope),
                    set,
                )?;
                mark!("attn_block1");
            } else if fold_norm {
                let input = match update {
                    ResidualUpdate::Set(init) => GemvIn::SetNorm {
                        init,
                        residual: &mut a.x,
                        weight: &l.input_norm,
                        eps,
                    },
                    _ => GemvIn::Norm {
                        residual: &mut a.x,
                        weight: &l.input_norm,
                        eps,
                    },
                };
                let mut out = a.qkv.slice_mut(..t * l.qkv.out);
                cx.gemv_staged_norm_bf16(&l.qkv.w, input, &mut out, (t, h, l.qkv.out), None)?;
                mark!("norm_qkv_proj");
            } else {
                cx.fused_add_rms_norm_prefetch(
                    &mut a.x,
                    update,
                    &l.input_norm,
                    &mut a.h,
                    NormExtra::default(),
                    (t, h, eps),
                    pf.qkv,
                )?;
                mark!("rms_norm");
            }
            // `x` now holds the residual stream after `li` layers.
            if let Some((n, buf)) = self.capture.as_mut()
                && *n == li
            {
                stream
                    .memcpy_dtod(&a.x.slice(..t * h), &mut buf.slice_mut(..t * h))
                    .map_err(CudaError::from)?;
                mark!("capture");
            }
            if one.is_none() {
                if !fold_norm {
                    Self::linear(&cx, proj, &l.qkv, &a.h.slice(..t * h), &mut a.qkv, t)?;
                    mark!("qkv_proj");
                }
                let core = AttnCore {
                    cx: &cx,
                    inputs: &self.inputs,
                    inv_freq: &self.inv_freq,
                    mrope,
                    shape: &attn_shape,
                    eps,
                };
                core.run(a, l, &mut self.kv[li], pf.attn, (&mut prof, &stream))?;
                Self::linear_f32(
                    &cx,
                    proj,
                    &l.o,
                    &a.attn.slice(..t * lq * hd),
                    &mut a.proj,
                    t,
                    rank0,
                )?;
                mark!("o_proj");
            }
            Self::all_reduce(&self.all_reduce, &mut a.proj, t * h)?;
            mark!("all_reduce");
            // One-token steps: the whole MoE block in one launch, adding into x.
            if small_moe
                && self.moe_one_launch != MoeOneLaunch::Off
                && Self::moe_block1_fits(&cx, &l.mlp, t, h)
            {
                let evict_first = self.moe_one_launch == MoeOneLaunch::EvictFirst;
                Self::moe_block1(&cx, a, l, (h, eps), evict_first)?;
                mark!("moe_block1");
                kept = true;
                continue;
            }
            // x += attention output, h = norm(x): in the router's launch on MoE decode steps.
            let routed = Self::routes_fused(&l.mlp, t, h);
            if routed {
                Self::small_moe_route(&cx, a, l, (t, h), eps, true)?;
                mark!("rms_norm+moe_router+topk");
            } else {
                // A MoE layer's router takes the normed rows past bf16 too, and a shared
                // expert's gate the f32 rows.
                let (is_moe, shared) = match &l.mlp {
                    DMlp::Moe { shared, .. } => (true, shared.is_some()),
                    DMlp::Dense { .. } => (false, false),
                };
                cx.fused_add_rms_norm_prefetch(
                    &mut a.x,
                    ResidualUpdate::Add(a.proj.slice(..t * h)),
                    &l.post_norm,
                    &mut a.h,
                    NormExtra {
                        out32: shared.then(|| a.h32.slice_mut(..t * h)).as_mut(),
                        out_lo: is_moe.then(|| a.h_lo.slice_mut(..2 * t * h)).as_mut(),
                    },
                    (t, h, eps),
                    L2Prefetch::NONE,
                )?;
                mark!("rms_norm");
            }
            match &l.mlp {
                DMlp::Dense {
                    gate_up,
                    down,
                    inter,
                } => {
                    Self::linear(&cx, gemv, gate_up, &a.h.slice(..t * h), &mut a.gate_up, t)?;
                    mark!("gate_up_proj");
                    let mut act = a.act.slice_mut(..t * inter);
                    cx.silu_and_mul_bf16(&a.gate_up.slice(..t * 2 * inter), &mut act, *inter)?;
                    mark!("silu_and_mul");
                    Self::linear_f32(
                        &cx,
                        gemv,
                        down,
                        &a.act.slice(..t * inter),
                        &mut a.proj,
                        t,
                        rank0,
                    )?;
                    mark!("down_proj");
                }
                DMlp::Moe {
                    router_split,
                    w13,
                    w2,
                    inter,
                    num_experts,
                    top_k,
                    renormalize,
                    shared,
                    ..
                } => {
                    let (e, k) = (*num_experts, *top_k);
                    if routed && small_moe && Self::small_moe_fits(&l.mlp, t, h) {
                        let next = self.layers.get(li + 1);
                        let pf = match next {
                            Some(n) if prefetch && self.l2_prefetch_qkv_early => {
                                qkv_prefetched = true;
                                LayerPrefetch::qkv_of(n, &stream)
                            }
                            _ => L2Prefetch::NONE,
                        };
                        Self::small_moe_experts(&cx, a, l, (t, h), pf, self.moe_w2_prefetch)?;
                        mark!("moe_experts+residual");
                        kept = true;
                        continue;
                    }
                    if !routed
                        && t >= ROUTE_MMA_MIN_TOKENS
                        && moe_route_mma_enabled()
                        && CudaContext::moe_route_mma_fits(router_split)
                    {
                        cx.moe_route_mma(
                            &a.h.slice(..t * h),
                            &a.h_lo.slice(..2 * t * h),
                            router_split,
                            RouteMmaBuffers {
                                partials: &mut a.route_partials,
                                counters: &mut a.route_counters,
                                logits: Some(&mut a.router_logits.slice_mut(..t * e)),
                                ids: &mut a.topk_ids.slice_mut(..t * k),
                                weights: &mut a.topk_weights.slice_mut(..t * k),
                            },
                            t,
                            k,
                            *renormalize,
                        )?;
                        mark!("moe_route_mma");
                    } else if !routed {
                        let mut logits = a.router_logits.slice_mut(..t * e);
                        cx.moe_router_split(
                            &a.h.slice(..t * h),
                            &a.h_lo.slice(..2 * t * h),
                            router_split,
                            &mut logits,
                            t,
                        )?;
                        mark!("moe_router");
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
                    }
                    cx.fused_moe_bf16(
                        &a.h.slice(..t * h),
                        w13,
                        w2,
                        &a.topk_ids.slice(..t * k),
                        &a.topk_weights.slice(..t * k),
                        &mut a.proj.slice_mut(..t * h),
                        &mut a.moe_workspace,
                        MoeShape {
                            tokens: t,
                            hidden: h,
                            inter: *inter,
                            num_experts: *num_experts,
                            top_k: *top_k,
                        },
                    )?;
                    mark!("fused_moe");
                    if let Some(se) = shared {
                        let si = se.inter;
                        Self::linear(
                            &cx,
                            gemv,
                            &se.gate_up,
                            &a.h.slice(..t * h),
                            &mut a.gate_up,
                            t,
                        )?;
                        let mut act = a.act.slice_mut(..t * si);
                        cx.silu_and_mul_bf16(&a.gate_up.slice(..t * 2 * si), &mut act, si)?;
                        Self::linear_f32(
                            &cx,
                            gemv,
                            &se.down,
                            &a.act.slice(..t * si),
                            &mut a.shared_out,
                            t,
                            rank0,
                        )?;
                        cx.gated_shared_add_f32(
                            &mut a.proj,
                            &a.h32,
                            &se.gate,
                            &a.shared_out,
                            t,
                            h,
                        )?;
                        mark!("shared_expert");
                    }
                }
            }
            Self::all_reduce(&self.all_reduce, &mut a.proj, t * h)?;
            mark!("all_reduce");
            // The deepstack features join the layer's output (every rank holds the whole sum).
            if let Some(adds) = &self.residual_adds
                && self.first_layer + li < adds.levels
            {
                let (m, lv) = (adds.rows_len, adds.rows_len * h);
                let level = self.first_layer + li;
                let src = adds.data.slice(level * lv..(level + 1) * lv);
                cx.add_rows_f32(&mut a.proj, &src, &adds.rows, m, h)?;
                mark!("deepstack_add");
            }
        }
        let a = &mut self.act;
        // x += the last layer's output, then the final norm (on a stage before the last, x is
        // what the next stage starts from and the normed rows go unused).
        let update = if kept {
            ResidualUpdate::Keep
        } else {
            ResidualUpdate::Add(a.proj.slice(..t * h))
        };
        cx.fused_add_rms_norm(&mut a.x, update, &self.norm, &mut a.h, t, h, eps)?;
        mark!("rms_norm");
        if !self.stage.is_last() {
            return Self::finish_profile(&mut self.profiler, prof, &st, "");
        }
        if let Some((n, buf)) = self.capture.as_mut()
            && *n == self.layers.len()
        {
            stream
                .memcpy_dtod(&a.x.slice(..t * h), &mut buf.slice_mut(..t * h))
                .map_err(CudaError::from)?;
            mark!("capture");
        }
        cx.embedding_ids_bf16(&a.h, h, &self.inputs.logits_rows, st.rows, &mut a.sel)?;
        if let Some(head) = self.lm_head.as_ref().or(self.embed.as_ref()) {
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
        }
        Self::finish_profile(&mut self.profiler, prof, &st, "")
    }

    /// Logs a profiled step (when `prof` is some; `path` tells the fused one) and puts the
    /// profiler back into `slot`.
    pub(super) fn finish_profile(
        slot: &mut Option<StepProfiler>,
        prof: Option<StepProfiler>,
        st: &StepShape,
        path: &str,
    ) -> Result<(), ModelError> {
        if let Some(mut p) = prof {
            let kind = if st.max_query_len == 1 {
                format!("{}decode batch {}{path}", p.name(), st.seqs)
            } else {
                format!("{}prefill {} tokens{path}", p.name(), st.tokens)
            };
            p.finish(kind)?;
            *slot = Some(p);
        }
        Ok(())
    }
}
