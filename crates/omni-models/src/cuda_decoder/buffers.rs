//! The step buffers, allocated once for the largest step ([`StepLimits`]): per-step inputs
//! and activations, and the upload of one step's host metadata into them.

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{
    AttnShape, CudaContext, CudaError, MOE_SMALL_MAX_TOKENS, MoeShape, attn_one_launch_enabled,
    bf16, fused_moe_workspace_bytes, moe_route_mma_enabled, moe_route_mma_workspace_len,
    moe_small_act_len, paged_attention_workspace_len,
};

use super::weights::{DLayer, DMlp};
use super::{CudaDecoderModel, StepLimits};
use crate::ModelError;
use crate::decoder::{DecoderSpec, HeadLayout};

/// Per-step inputs uploaded before each forward (sized for [`StepLimits`]).
#[derive(Debug)]
pub(crate) struct StepInputs {
    pub(crate) ids: CudaSlice<i32>,
    /// `[max_tokens]`, or three such rows for a spec with M-RoPE.
    pub(crate) positions: CudaSlice<i32>,
    pub(crate) slots: CudaSlice<i64>,
    pub(crate) query_start_loc: CudaSlice<i32>,
    pub(crate) seq_lens: CudaSlice<i32>,
    /// `[max_seqs, max_blocks_per_seq]`.
    pub(crate) block_tables: CudaSlice<i32>,
    /// Rows of the final hidden state whose logits to compute.
    pub(crate) logits_rows: CudaSlice<i32>,
}

/// Activations, sized for [`StepLimits`].
#[derive(Debug)]
pub(super) struct Activations {
    /// The residual stream, f32 (bf16 rounding of the sum over dozens of layers would cost more
    /// accuracy than the few bytes per token it saves).
    pub(super) x: CudaSlice<f32>,
    pub(super) h: CudaSlice<bf16>,
    pub(super) qkv: CudaSlice<bf16>,
    pub(super) q: CudaSlice<bf16>,
    pub(super) attn: CudaSlice<bf16>,
    /// Row-parallel GEMM outputs (o_proj, down_proj, MoE) in f32: all-reduced in f32 so that
    /// tensor-parallel ranks sum unrounded partials.
    pub(super) proj: CudaSlice<f32>,
    pub(super) gate_up: CudaSlice<bf16>,
    pub(super) act: CudaSlice<bf16>,
    pub(super) sel: CudaSlice<bf16>,
    /// The embedding output, `[max_tokens, hidden]` bf16 (the residual stream starts from it).
    pub(super) sel_embed: CudaSlice<bf16>,
    pub(super) logits: CudaSlice<f32>,
    pub(super) attn_workspace: CudaSlice<f32>,
    /// Router logits in f32 (routing is a top-k: bf16 logits would flip near-ties).
    pub(super) router_logits: CudaSlice<f32>,
    /// The MoE layers' normed input, unrounded, for a shared expert's gate.
    pub(super) h32: CudaSlice<f32>,
    /// The MoE layers' normed input past its bf16 `h`, as two more bf16 terms per element
    /// (`[tokens, 2 hidden]`, [`omni_backend::cuda::NormExtra::out_lo`]): the router's input
    /// on steps the small-batch router does not take.
    pub(super) h_lo: CudaSlice<bf16>,
    pub(super) topk_ids: CudaSlice<i32>,
    pub(super) topk_weights: CudaSlice<f32>,
    pub(super) moe_workspace: CudaSlice<u8>,
    /// The one-launch router's split partial sums and per-block counters (zero between
    /// launches), sized only with `OMNI_CUDA_MOE_ROUTE_MMA=1`.
    pub(super) route_partials: CudaSlice<f32>,
    pub(super) route_counters: CudaSlice<i32>,
    /// The shared expert's f32 output before its gate scales it into `proj`.
    pub(super) shared_out: CudaSlice<f32>,
    /// The small-batch MoE router's per-token counters (zero between launches).
    pub(super) moe_counters: CudaSlice<i32>,
    /// The small-batch MoE path's `[tokens * top_k, inter]` expert activations.
    pub(super) moe_act: CudaSlice<bf16>,
    /// The one-launch MoE block's grid barrier state (an arrival count, zero between
    /// launches, and a generation).
    pub(super) moe_barrier: CudaSlice<i32>,
    /// The one-launch attention block's partials (sized only with
    /// `OMNI_CUDA_ATTN_ONE_LAUNCH=1` on a device that takes the shape).
    pub(super) attn_block1_ws: CudaSlice<f32>,
    /// Its grid barrier word and per-KV-head merge counters (zero between launches).
    pub(super) attn_barrier: CudaSlice<i32>,
}

impl CudaDecoderModel {
    pub(super) fn alloc_step_buffers(
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
        let mut shared = false;
        for l in layers {
            match &l.mlp {
                DMlp::Dense { inter: i, .. } => inter = inter.max(*i),
                DMlp::Moe {
                    inter: i,
                    num_experts,
                    top_k,
                    shared: se,
                    ..
                } => {
                    if let Some(se) = se {
                        shared = true;
                        inter = inter.max(se.inter);
                    }
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
        // The decode path's split-KV workspace is the only one; sized for the most sequences
        // of the longest context, it holds every decode step's partitions.
        let attn_workspace = paged_attention_workspace_len(&AttnShape {
            num_seqs: n,
            num_tokens: n,
            num_heads: heads.local_heads,
            num_kv_heads: heads.local_kv_heads,
            head_dim: hd,
            block_size: limits.block_size,
            max_blocks_per_seq: mbps,
            max_query_len: 1,
            max_seq_len: limits.max_model_len,
            scale: 1.0,
        });
        let inputs = StepInputs {
            ids: s.alloc_zeros(t)?,
            // Three rows (temporal, height, width) `t` apart under M-RoPE.
            positions: s.alloc_zeros(if spec.mrope.is_some() { 3 * t } else { t })?,
            slots: s.alloc_zeros(t)?,
            query_start_loc: s.alloc_zeros(n + 1)?,
            seq_lens: s.alloc_zeros(n)?,
            block_tables: s.alloc_zeros(n * mbps)?,
            logits_rows: s.alloc_zeros(n)?,
        };
        let (e, k) = moe_shape.map_or((0, 0), |m| (m.num_experts, m.top_k));
        let attn1 = super::attn_block1::attn_block1_shape(spec, heads, (limits.block_size, mbps));
        let attn1_ws = if attn_one_launch_enabled() && cx.attn_block1_fits(&attn1) {
            cx.attn_block1_workspace_len(&attn1)
        } else {
            1
        };
        let (route_part, route_cnt) = match moe_shape {
            Some(m) if moe_route_mma_enabled() => moe_route_mma_workspace_len(t, h, m.num_experts),
            _ => (1, 1),
        };
        let act = Activations {
            x: s.alloc_zeros(t * h)?,
            h: s.alloc_zeros(t * h)?,
            qkv: s.alloc_zeros(t * (heads.local_heads + 2 * heads.local_kv_heads) * hd)?,
            q: s.alloc_zeros(t * heads.local_heads * hd)?,
            attn: s.alloc_zeros(t * heads.local_heads * hd)?,
            proj: s.alloc_zeros(t * h)?,
            gate_up: s.alloc_zeros((t * 2 * inter).max(1))?,
            act: s.alloc_zeros((t * inter).max(1))?,
            sel: s.alloc_zeros(n * h)?,
            sel_embed: s.alloc_zeros(t * h)?,
            logits: s.alloc_zeros(if spec.embed_and_head {
                n * spec.vocab_size
            } else {
                1
            })?,
            attn_workspace: s.alloc_zeros(attn_workspace.max(1))?,
            router_logits: s.alloc_zeros((t * e).max(1))?,
            h32: s.alloc_zeros(if moe_shape.is_some() && shared {
                t * h
            } else {
                1
            })?,
            h_lo: s.alloc_zeros(if moe_shape.is_some() { 2 * t * h } else { 1 })?,
            topk_ids: s.alloc_zeros((t * k).max(1))?,
            topk_weights: s.alloc_zeros((t * k).max(1))?,
            moe_workspace: s.alloc_zeros(moe_shape.map_or(1, fused_moe_workspace_bytes))?,
            route_partials: s.alloc_zeros(route_part)?,
            route_counters: s.alloc_zeros(route_cnt)?,
            shared_out: s.alloc_zeros(if shared { t * h } else { 1 })?,
            moe_counters: s.alloc_zeros(t.clamp(1, super::moe_small::MOE_ROUTE_MAX_TOKENS))?,
            moe_act: s.alloc_zeros(moe_shape.map_or(1, |m| {
                moe_small_act_len(MoeShape {
                    tokens: t.min(MOE_SMALL_MAX_TOKENS),
                    ..m
                })
                .max(1)
            }))?,
            moe_barrier: s.alloc_zeros(2)?,
            attn_block1_ws: s.alloc_zeros(attn1_ws)?,
            attn_barrier: s.alloc_zeros(1 + heads.local_kv_heads)?,
        };
        Ok((inputs, act))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn upload_inputs(
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
}
