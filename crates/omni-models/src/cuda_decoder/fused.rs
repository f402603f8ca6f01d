//! The fused small-batch step ([`CudaDecoderModel::set_fused_small_batch`]): whether a step
//! takes it and its launch sequence, the per-layer GEMVs carrying the norms and residual adds
//! (`run_kernels` in `layers.rs` is the general path; both share its attention core).

use omni_backend::cuda::{CudaContext, GemvIn, GemvOut, L2Prefetch, MropeAxes};

use super::layers::AttnCore;
use super::weights::DMlp;
use super::{CudaDecoderModel, StepShape};
use crate::ModelError;

impl CudaDecoderModel {
    /// Whether step `st` takes the fused small-batch path
    /// ([`CudaDecoderModel::set_fused_small_batch`]).
    pub(super) fn fused_fits(&self, st: &StepShape) -> bool {
        let (t, h) = (st.tokens, self.spec.hidden_size);
        self.small_batch_gemv
            && self.fused_small_batch
            && self.one_rank()
            && self.stage.size <= 1
            && self.residual_adds.is_none()
            && self.capture.is_none()
            && CudaContext::gemv_norm_fits(t, h)
            && self.layers.iter().all(|l| {
                let dense = match &l.mlp {
                    DMlp::Dense { gate_up, down, .. } => {
                        gate_up.b.is_none()
                            && down.b.is_none()
                            && CudaContext::gemv_fits(t, down.inp)
                    }
                    DMlp::Moe { .. } => Self::small_moe_fits(&l.mlp, t, h),
                };
                dense && l.qkv.b.is_none() && l.o.b.is_none() && CudaContext::gemv_fits(t, l.o.inp)
            })
    }
    /// The fused small-batch step ([`CudaDecoderModel::set_fused_small_batch`]; the caller
    /// checked [`Self::fused_fits`]): per layer QKV (input norm inside; the first layer sets
    /// the residual from the embeddings), q/k norm + RoPE + cache, attention, o_proj adding
    /// into the residual, gate_up (post-attention norm and SiLU-and-mul inside), down_proj
    /// adding into the residual (a MoE layer: router with the norm, routed gate_up, routed
    /// down adding into the residual; `moe_small.rs`); then the final norm of the output rows.
    pub(super) fn run_fused_kernels(&mut self, st: StepShape) -> Result<(), ModelError> {
        let cx = self.cx.clone();
        let h = self.spec.hidden_size;
        let eps = self.spec.rms_norm_eps;
        let t = st.tokens;
        let attn_shape = self.attn_shape(&st);
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
            self.embed_step_ids(t)?;
            mark!("embedding");
        }
        for li in 0..self.layers.len() {
            let a = &mut self.act;
            let l = &self.layers[li];
            let input = if li == 0 {
                GemvIn::SetNorm {
                    init: a.sel_embed.slice(..t * h),
                    residual: &mut a.x,
                    weight: &l.input_norm,
                    eps,
                }
            } else {
                GemvIn::Norm {
                    residual: &mut a.x,
                    weight: &l.input_norm,
                    eps,
                }
            };
            let n = l.qkv.out;
            cx.gemv_fused(
                &l.qkv.w,
                input,
                GemvOut::Bf16(a.qkv.slice_mut(..t * n)),
                t,
                h,
                n,
            )?;
            mark!("rms_norm+qkv_proj");
            let core = AttnCore {
                cx: &cx,
                inputs: &self.inputs,
                inv_freq: &self.inv_freq,
                mrope: match (&self.mrope_axes, st.mrope) {
                    (Some(axes), true) => Some(MropeAxes {
                        axes,
                        row_stride: self.limits.max_tokens.max(1),
                    }),
                    _ => None,
                },
                shape: &attn_shape,
                eps,
            };
            core.run(
                a,
                l,
                &mut self.kv[li],
                L2Prefetch::NONE,
                (&mut prof, &stream),
            )?;
            let k = l.o.inp;
            cx.gemv_fused(
                &l.o.w,
                GemvIn::X(a.attn.slice(..t * k)),
                GemvOut::AddTo(&mut a.x),
                t,
                k,
                h,
            )?;
            mark!("o_proj+residual");
            let DMlp::Dense {
                gate_up,
                down,
                inter,
            } = &l.mlp
            else {
                Self::small_moe_route(&cx, a, l, (t, h), eps, false)?;
                mark!("rms_norm+moe_router+topk");
                Self::small_moe_experts(&cx, a, l, (t, h), L2Prefetch::NONE, self.moe_w2_prefetch)?;
                mark!("moe_experts+residual");
                continue;
            };
            cx.gemv_fused(
                &gate_up.w,
                GemvIn::Norm {
                    residual: &mut a.x,
                    weight: &l.post_norm,
                    eps,
                },
                GemvOut::SiluMul(a.act.slice_mut(..t * inter)),
                t,
                h,
                *inter,
            )?;
            mark!("rms_norm+gate_up_proj+silu");
            cx.gemv_fused(
                &down.w,
                GemvIn::X(a.act.slice(..t * inter)),
                GemvOut::AddTo(&mut a.x),
                t,
                *inter,
                h,
            )?;
            mark!("down_proj+residual");
        }
        let a = &mut self.act;
        cx.rms_norm_rows(
            &a.x,
            &self.inputs.logits_rows,
            &self.norm,
            &mut a.sel,
            st.rows,
            h,
            eps,
        )?;
        mark!("rms_norm");
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
        Self::finish_profile(&mut self.profiler, prof, &st, " (fused)")
    }
}
