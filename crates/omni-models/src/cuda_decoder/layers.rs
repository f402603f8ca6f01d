//! One step's launch sequence: per layer the attention block (fused add + RMSNorm, QKV GEMM,
//! q/k norm + RoPE + cache write, paged attention, o_proj, all-reduce) and the MLP or MoE block.

use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::{CudaSlice, DevicePtr};
use omni_backend::cuda::{
    AttnShape, CudaContext, CudaError, DeviceAllReduce, MoeShape, QkvBuffers, QkvShape,
    ResidualUpdate, bf16,
};

use super::weights::{DLinear, DMlp};
use super::{CudaDecoderModel, StepShape};
use crate::ModelError;

impl CudaDecoderModel {
    fn linear(
        cx: &CudaContext,
        gemv: bool,
        l: &DLinear,
        x: &impl DevicePtr<bf16>,
        out: &mut CudaSlice<bf16>,
        tokens: usize,
    ) -> Result<(), ModelError> {
        let mut o = out.slice_mut(..tokens * l.out);
        if gemv && CudaContext::gemv_fits(tokens, l.inp) {
            cx.gemv_nt_bf16(x, &l.w, &mut o, tokens, l.inp, l.out)?;
        } else {
            cx.matmul_nt_bf16(x, &l.w, &mut o, tokens, l.inp, l.out)?;
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
        gemv: bool,
        l: &DLinear,
        x: &impl DevicePtr<bf16>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
        add_bias: bool,
    ) -> Result<(), ModelError> {
        let mut o = out.slice_mut(..tokens * l.out);
        if gemv && CudaContext::gemv_fits(tokens, l.inp) {
            cx.gemv_nt_bf16_f32(x, &l.w, &mut o, tokens, l.inp, l.out)?;
        } else {
            cx.matmul_nt_bf16_f32(x, &l.w, &mut o, tokens, l.inp, l.out)?;
        }
        if add_bias && let Some(b) = &l.b {
            cx.add_bias_f32(&mut o, b, tokens)?;
        }
        Ok(())
    }

    /// Queues one step's kernels on the stream (no host sync: capturable).
    pub(super) fn run_kernels(&mut self, st: StepShape) -> Result<(), ModelError> {
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
        let gemv = self.small_batch_gemv;
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
        if !st.embeds {
            let table = self.embed.as_ref().ok_or_else(|| {
                ModelError::Batch(format!("{} has no token embedding", self.spec.architecture))
            })?;
            cx.embedding_ids_bf16(table, h, &self.inputs.ids, t, &mut self.act.sel_embed)?;
            mark!("embedding");
        }
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
            // `x` now holds the residual stream after `li` layers.
            if let Some((n, buf)) = self.capture.as_mut()
                && *n == li
            {
                stream
                    .memcpy_dtod(&a.x.slice(..t * h), &mut buf.slice_mut(..t * h))
                    .map_err(CudaError::from)?;
                mark!("capture");
            }
            Self::linear(&cx, gemv, &l.qkv, &a.h.slice(..t * h), &mut a.qkv, t)?;
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
                gemv,
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
                    router,
                    w13,
                    w2,
                    inter,
                    num_experts,
                    top_k,
                    renormalize,
                    shared,
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
        if let Some(mut p) = prof {
            let kind = if st.max_query_len == 1 {
                format!("{}decode batch {}", p.name(), st.seqs)
            } else {
                format!("{}prefill {} tokens", p.name(), st.tokens)
            };
            p.finish(kind)?;
            self.profiler = Some(p);
        }
        Ok(())
    }
}
