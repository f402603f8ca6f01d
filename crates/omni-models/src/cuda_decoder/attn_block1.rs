//! A layer's attention block of a one-token step in one launch
//! ([`CudaContext::attn_block1`], opt-in with `OMNI_CUDA_ATTN_ONE_LAUNCH=1`): the input norm,
//! QKV, q/k norm + RoPE + cache write, attention and o_proj of `run_kernels`' unfused path as
//! one kernel on every SM, for steps of one sequence's one decode token whose residual the
//! previous sub-block left as it is (the one-launch MoE block's output) or that start from the
//! embedding (the first layer). It writes `qkv`, the caches, `attn` and `proj` as the four
//! launches do, so the MoE block after it and the all-reduce are unchanged.

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{
    AttnBlock1Buffers, AttnBlock1Shape, AttnBlock1Weights, CudaContext, MropeAxes, bf16,
};

use super::buffers::{Activations, StepInputs};
use super::weights::DLayer;
use super::{CudaDecoderModel, StepShape};
use crate::ModelError;
use crate::decoder::{DecoderSpec, HeadLayout};

/// The one-launch attention block's shape for a model of `spec` with `heads` on this rank and
/// block tables of `max_blocks_per_seq` blocks of `block_size`.
pub(super) fn attn_block1_shape(
    spec: &DecoderSpec,
    heads: &HeadLayout,
    (block_size, max_blocks_per_seq): (usize, usize),
) -> AttnBlock1Shape {
    AttnBlock1Shape {
        hidden: spec.hidden_size,
        num_heads: heads.local_heads,
        num_kv_heads: heads.local_kv_heads,
        head_dim: spec.head_dim,
        block_size,
        max_blocks_per_seq,
        eps: spec.rms_norm_eps,
        scale: 1.0 / (spec.head_dim as f32).sqrt(),
    }
}

impl CudaDecoderModel {
    /// The one-launch attention block's shape when step `st` may run it (the switch on, one
    /// sequence decoding one token, a shape the device takes, its workspace allocated); each
    /// layer then also needs a residual that is kept or set and no QKV / o_proj bias.
    pub(super) fn attn_block1_step(&self, st: &StepShape) -> Option<AttnBlock1Shape> {
        let shape = attn_block1_shape(
            &self.spec,
            &self.heads,
            (self.limits.block_size, self.limits.max_blocks_per_seq()),
        );
        let on = omni_backend::cuda::attn_one_launch_enabled()
            && st.tokens == 1
            && st.seqs == 1
            && st.max_query_len == 1
            && self.cx.attn_block1_fits(&shape)
            && self.act.attn_block1_ws.len() >= self.cx.attn_block1_workspace_len(&shape);
        on.then_some(shape)
    }

    /// Layer `l`'s attention block in one launch (`set`: the residual starts from the step's
    /// embedding row): `a.qkv`, the caches `kv`, `a.attn` and `a.proj` (o_proj's output, before
    /// any all-reduce) as the unfused path writes them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_block1(
        cx: &CudaContext,
        shape: AttnBlock1Shape,
        a: &mut Activations,
        l: &DLayer,
        kv: &mut (CudaSlice<bf16>, CudaSlice<bf16>),
        inputs: &StepInputs,
        (inv_freq, mrope): (&CudaSlice<f32>, Option<MropeAxes<'_>>),
        set: bool,
    ) -> Result<(), ModelError> {
        let h = shape.hidden;
        let (k_cache, v_cache) = kv;
        cx.attn_block1(
            shape,
            AttnBlock1Weights {
                input_norm: &l.input_norm,
                qkv: &l.qkv.w,
                qk_norm: l.qk_norm.as_ref().map(|(q, k)| (q, k)),
                o: &l.o.w,
            },
            AttnBlock1Buffers {
                residual: &mut a.x,
                init: set.then(|| a.sel_embed.slice(..h)),
                k_cache,
                v_cache,
                positions: &inputs.positions,
                slot_mapping: &inputs.slots,
                seq_lens: &inputs.seq_lens,
                block_table: &inputs.block_tables,
                inv_freq,
                mrope,
                qkv: &mut a.qkv,
                attn: &mut a.attn,
                proj: &mut a.proj,
                workspace: &mut a.attn_block1_ws,
                barrier: &mut a.attn_barrier,
            },
        )?;
        Ok(())
    }
}
