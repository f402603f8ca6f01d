//! The pre-norm encoder block both towers are made of, on the device (the twin of
//! [`crate::qwen3_omni::encoder_block::EncoderBlock`]), and the activation buffers one call
//! uses.

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::encoder::{
    AttnScratch, EncoderAct, Rows, SegmentAttnShape, segment_attention_scratch_len,
};
use omni_backend::cuda::{CudaContext, bf16};

use super::{Up, zeros_f32};
use crate::ModelError;
use crate::qwen3_omni::encoder_block::Activation;

/// The host tower's activation as the kernels name it.
pub(super) fn act_of(a: Activation) -> EncoderAct {
    match a {
        Activation::Gelu => EncoderAct::Gelu,
        Activation::GeluTanh => EncoderAct::GeluTanh,
    }
}

/// The sizes of a block.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockDims {
    pub(super) dim: usize,
    pub(super) heads: usize,
    pub(super) inter: usize,
    pub(super) act: EncoderAct,
    pub(super) eps: f32,
}

impl BlockDims {
    pub(super) fn attn(&self) -> SegmentAttnShape {
        let head_dim = self.dim / self.heads;
        SegmentAttnShape {
            heads: self.heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }
}

/// The checkpoint names of one block's tensors.
pub(super) struct BlockNames {
    pub(super) norm1: String,
    /// The fused `[q; k; v]` weight names (one, or three to stack) without `.weight`.
    pub(super) qkv: Vec<String>,
    pub(super) proj: String,
    pub(super) norm2: String,
    pub(super) fc1: String,
    pub(super) fc2: String,
}

/// One block's weights.
pub(super) struct DBlock {
    norm1: (CudaSlice<f32>, CudaSlice<f32>),
    /// `[3 dim, dim]`.
    qkv_w: CudaSlice<bf16>,
    qkv_b: CudaSlice<f32>,
    proj_w: CudaSlice<bf16>,
    proj_b: CudaSlice<f32>,
    norm2: (CudaSlice<f32>, CudaSlice<f32>),
    fc1_w: CudaSlice<bf16>,
    fc1_b: CudaSlice<f32>,
    fc2_w: CudaSlice<bf16>,
    fc2_b: CudaSlice<f32>,
}

fn with(names: &[String], suffix: &str) -> Vec<String> {
    names.iter().map(|n| format!("{n}.{suffix}")).collect()
}

impl DBlock {
    pub(super) fn load(u: &Up<'_>, n: &BlockNames, d: BlockDims) -> Result<Self, ModelError> {
        let (dim, inter) = (d.dim, d.inter);
        let one = |s: &str| vec![s.to_string()];
        let qkv_rows = if n.qkv.len() == 1 { 3 * dim } else { dim };
        Ok(Self {
            norm1: u.norm(&n.norm1, dim)?,
            qkv_w: u.mat(&with(&n.qkv, "weight"), &[qkv_rows, dim], |v| v)?,
            qkv_b: u.vec(&with(&n.qkv, "bias"), qkv_rows)?,
            proj_w: u.mat(&with(&one(&n.proj), "weight"), &[dim, dim], |v| v)?,
            proj_b: u.vec(&with(&one(&n.proj), "bias"), dim)?,
            norm2: u.norm(&n.norm2, dim)?,
            fc1_w: u.mat(&with(&one(&n.fc1), "weight"), &[inter, dim], |v| v)?,
            fc1_b: u.vec(&with(&one(&n.fc1), "bias"), inter)?,
            fc2_w: u.mat(&with(&one(&n.fc2), "weight"), &[dim, inter], |v| v)?,
            fc2_b: u.vec(&with(&one(&n.fc2), "bias"), dim)?,
        })
    }

    /// Runs the block on the f32 residual rows `x` (`[tokens, dim]`, tokens =
    /// `cu_seqlens.last()`) in place; `cos_sin` is the rotary table (`[tokens, head_dim]`).
    pub(super) fn forward(
        &self,
        cx: &CudaContext,
        x: &mut CudaSlice<f32>,
        cu_seqlens: &[usize],
        cos_sin: Option<&CudaSlice<f32>>,
        d: BlockDims,
        w: &mut Work,
    ) -> Result<(), ModelError> {
        let t = cu_seqlens.last().copied().unwrap_or(0);
        let (dim, inter) = (d.dim, d.inter);
        let rows = Rows { rows: t, cols: dim };
        cx.enc_layer_norm(&*x, (&self.norm1.0, &self.norm1.1), &mut w.h, rows, d.eps)?;
        cx.matmul_nt_bf16_f32(&w.h, &self.qkv_w, &mut w.y, t, dim, 3 * dim)?;
        cx.enc_qkv_rope(&w.y, &self.qkv_b, cos_sin, &mut w.qkv, t, d.attn())?;
        cx.enc_segment_attention(&w.qkv, &mut w.a, cu_seqlens, d.attn(), &mut w.scratch)?;
        cx.matmul_nt_bf16_f32(&w.a, &self.proj_w, &mut w.y, t, dim, dim)?;
        cx.enc_add_rows(x, Some(&w.y), &self.proj_b, rows, 1)?;
        cx.enc_layer_norm(&*x, (&self.norm2.0, &self.norm2.1), &mut w.h, rows, d.eps)?;
        cx.matmul_nt_bf16_f32(&w.h, &self.fc1_w, &mut w.y, t, dim, inter)?;
        let wide = Rows {
            rows: t,
            cols: inter,
        };
        cx.enc_bias_act(&w.y, &self.fc1_b, &mut w.m, wide, d.act)?;
        cx.matmul_nt_bf16_f32(&w.m, &self.fc2_w, &mut w.y, t, inter, dim)?;
        cx.enc_add_rows(x, Some(&w.y), &self.fc2_b, rows, 1)?;
        Ok(())
    }
}

/// One call's activation buffers for `tokens` rows.
pub(super) struct Work {
    /// bf16 `[tokens, dim]`: normed rows.
    pub(super) h: CudaSlice<bf16>,
    /// f32 GEMM outputs: `[tokens, max(3 dim, inter, extra)]`.
    pub(super) y: CudaSlice<f32>,
    /// bf16 `[tokens, 3 dim]`.
    pub(super) qkv: CudaSlice<bf16>,
    /// bf16 `[tokens, dim]`: attention output.
    pub(super) a: CudaSlice<bf16>,
    /// bf16 `[tokens, inter]`: the MLP's hidden rows.
    pub(super) m: CudaSlice<bf16>,
    pub(super) scratch: AttnScratch,
}

impl Work {
    /// Buffers for the blocks over `cu_seqlens`, with `y` at least `y_min` elements (the
    /// towers' heads reuse them).
    pub(super) fn new(
        cx: &CudaContext,
        cu_seqlens: &[usize],
        d: BlockDims,
        y_min: usize,
    ) -> Result<Self, ModelError> {
        let t = cu_seqlens.last().copied().unwrap_or(0).max(1);
        Ok(Self {
            h: cx.zeros_bf16(t * d.dim)?,
            y: zeros_f32(cx, (t * (3 * d.dim).max(d.inter)).max(y_min))?,
            qkv: cx.zeros_bf16(t * 3 * d.dim)?,
            a: cx.zeros_bf16(t * d.dim)?,
            m: cx.zeros_bf16(t * d.inter)?,
            scratch: AttnScratch::new(cx, segment_attention_scratch_len(cu_seqlens, d.heads))?,
        })
    }
}
