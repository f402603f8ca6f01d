//! Qwen3-Omni's encoder towers on the device (`kernels/encoder.cu`): the ops around the cuBLAS
//! GEMMs of the vision and audio towers, the CUDA twins of the host ops the towers use. The
//! residual stream and every GEMM output are f32 (`matmul_nt_bf16_f32`); what feeds a GEMM is
//! bf16; per-channel vectors are f32.
//!
//! - LayerNorm with weight and bias, f32 rows to bf16 ([`CudaContext::enc_layer_norm`], the twin
//!   of [`crate::activation::layer_norm_inplace`]);
//! - bias + identity / exact GELU / tanh GELU to bf16 ([`CudaContext::enc_bias_act`]);
//! - residual updates and per-row tables ([`CudaContext::enc_add_rows`]);
//! - the fused qkv epilogue: bias and the rotate-half rotary from a `[tokens, head_dim]`
//!   `[cos | sin]` table ([`CudaContext::enc_qkv_rope`], pairing as
//!   [`crate::rope::Rope::apply`]);
//! - bidirectional attention within `cu_seqlens` segments as cuBLAS strided-batched GEMMs over
//!   the heads and a row softmax ([`CudaContext::enc_segment_attention`], the twin of
//!   [`crate::varlen_attention::segment_attention`]; its calls are [`segment_attention_plan`]);
//! - the vision tower's position-table interpolation and rotary table
//!   ([`CudaContext::enc_vision_pos`], [`CudaContext::enc_rope_table`]);
//! - im2col of the audio stem's 3x3 stride-2 convolutions ([`CudaContext::enc_im2col_s2`]; the
//!   GEMM weights come from [`conv3x3_weight_gemm`]).

mod attention;
mod plan;
mod stem;
#[cfg(test)]
mod tests;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::kernels::{BF16_HELPERS, kernel_file};
use super::launch::{at_least, block_threads, elementwise_cfg, narrow};
use super::{CudaContext, CudaResult};

pub use attention::AttnScratch;
pub use plan::{
    AttnStep, MAX_SCRATCH_ELEMS, SegmentAttnShape, StridedGemm, conv3x3_weight_gemm,
    freq_major_columns, segment_attention_plan, segment_attention_scratch_len,
};
pub use stem::ConvImages;

const ENCODER: &str = kernel_file!("encoder.cu");

/// Full source of the encoder module.
pub(super) fn encoder_source() -> String {
    format!("{BF16_HELPERS}{ENCODER}")
}

/// `rows` rows of `cols` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
}

impl Rows {
    /// `rows * cols`.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The activation of [`CudaContext::enc_bias_act`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderAct {
    /// None (a bias only).
    Identity,
    /// Exact (erf) GELU, [`crate::activation::gelu`].
    Gelu,
    /// Tanh GELU, [`crate::gelu_tanh::gelu_tanh`].
    GeluTanh,
}

impl EncoderAct {
    fn code(self) -> i32 {
        match self {
            Self::Identity => 0,
            Self::Gelu => 1,
            Self::GeluTanh => 2,
        }
    }
}

/// One block per row, threads over `work` elements.
fn row_cfg(rows: usize, work: usize) -> CudaResult<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (narrow::<u32>("encoder rows", rows)?, 1, 1),
        block_dim: (block_threads(work, 1024), 1, 1),
        shared_mem_bytes: 0,
    })
}

fn i32_of(what: &'static str, v: usize) -> CudaResult<i32> {
    narrow::<i32>(what, v)
}

fn i64_of(what: &'static str, v: usize) -> CudaResult<i64> {
    narrow::<i64>(what, v)
}

impl CudaContext {
    /// `out = LayerNorm(x) * weight + bias` per row (`x` f32, `out` bf16, biased variance):
    /// `norm` is `(weight, bias)`, `[shape.cols]` each.
    pub fn enc_layer_norm(
        &self,
        x: &impl DevicePtr<f32>,
        norm: (&CudaSlice<f32>, &CudaSlice<f32>),
        out: &mut impl DevicePtrMut<bf16>,
        shape: Rows,
        eps: f32,
    ) -> CudaResult<()> {
        at_least("encoder layer_norm input", x.len(), shape.len())?;
        at_least("encoder layer_norm weight", norm.0.len(), shape.cols)?;
        at_least("encoder layer_norm bias", norm.1.len(), shape.cols)?;
        at_least("encoder layer_norm out", out.len(), shape.len())?;
        if shape.is_empty() {
            return Ok(());
        }
        let f = self.function(encoder_source, "enc_layer_norm")?;
        let (xp, _g1) = x.device_ptr(&self.stream);
        let (wp, _g2) = norm.0.device_ptr(&self.stream);
        let (bp, _g3) = norm.1.device_ptr(&self.stream);
        let (op, _g4) = out.device_ptr_mut(&self.stream);
        let dim = i32_of("layer_norm dim", shape.cols)?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&bp).arg(&op).arg(&dim).arg(&eps);
        // SAFETY: matches `enc_layer_norm(const float*, const float*, const float*, u16*, int,
        // float)`; block r reads row r of x and writes row r of out (rows * cols elements
        // checked), weight and bias hold cols; the block size is a multiple of 32 up to 1024 as
        // `enc_block_reduce` requires.
        unsafe { l.launch(row_cfg(shape.rows, shape.cols)?) }?;
        Ok(())
    }

    /// `out = act(y + bias)` per row (`y` f32, `bias` `[shape.cols]` f32, `out` bf16).
    pub fn enc_bias_act(
        &self,
        y: &impl DevicePtr<f32>,
        bias: &CudaSlice<f32>,
        out: &mut impl DevicePtrMut<bf16>,
        shape: Rows,
        act: EncoderAct,
    ) -> CudaResult<()> {
        let n = shape.len();
        at_least("encoder bias_act input", y.len(), n)?;
        at_least("encoder bias_act bias", bias.len(), shape.cols)?;
        at_least("encoder bias_act out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(encoder_source, "enc_bias_act")?;
        let (yp, _g1) = y.device_ptr(&self.stream);
        let (bp, _g2) = bias.device_ptr(&self.stream);
        let (op, _g3) = out.device_ptr_mut(&self.stream);
        let (n_i, cols, code) = (i64_of("n", n)?, i32_of("cols", shape.cols)?, act.code());
        let mut l = self.stream.launch_builder(&f);
        l.arg(&yp).arg(&bp).arg(&op).arg(&n_i).arg(&cols).arg(&code);
        // SAFETY: matches `enc_bias_act(const float*, const float*, u16*, long long, int, int)`;
        // y and out hold n elements, bias cols (checked); the grid-stride loop stays below n.
        unsafe { l.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// `x[r, c] += y[r, c] + add[(r % period) * cols + c]` (`y` optional): the residual update
    /// with a bias (`period` 1), or a table of `period` rows added cyclically.
    pub fn enc_add_rows(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: Option<&dyn DevicePtr<f32>>,
        add: &CudaSlice<f32>,
        shape: Rows,
        period: usize,
    ) -> CudaResult<()> {
        let n = shape.len();
        at_least("encoder add_rows x", x.len(), n)?;
        at_least(
            "encoder add_rows table",
            add.len(),
            period.min(shape.rows) * shape.cols,
        )?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(encoder_source, "enc_add_rows")?;
        let (yp, _gy) = match y {
            Some(y) => {
                at_least("encoder add_rows y", y.len(), n)?;
                let (p, g) = y.device_ptr(&self.stream);
                (p, Some(g))
            }
            None => (0u64, None),
        };
        let (xp, _g1) = x.device_ptr_mut(&self.stream);
        let (ap, _g2) = add.device_ptr(&self.stream);
        let (n_i, cols) = (i64_of("n", n)?, i32_of("cols", shape.cols)?);
        let period_i = i32_of("period", period.clamp(1, shape.rows.max(1)))?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp)
            .arg(&yp)
            .arg(&ap)
            .arg(&n_i)
            .arg(&cols)
            .arg(&period_i);
        // SAFETY: matches `enc_add_rows(float*, const float*, const float*, long long, int,
        // int)`; x (and y, or null) hold n elements; the table rows read are below
        // min(period, rows) (checked); the grid-stride loop stays below n.
        unsafe { l.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// The fused qkv epilogue: `out = rotary(y + bias)` on `[tokens, 3 * heads * head_dim]` rows
    /// (q | k | v), the rotary (on q and k only) from `cos_sin` rows `[cos | sin]` of width
    /// `head_dim` per token, or none.
    pub fn enc_qkv_rope(
        &self,
        y: &impl DevicePtr<f32>,
        bias: &CudaSlice<f32>,
        cos_sin: Option<&CudaSlice<f32>>,
        out: &mut impl DevicePtrMut<bf16>,
        tokens: usize,
        heads: SegmentAttnShape,
    ) -> CudaResult<()> {
        let dim = heads.heads * heads.head_dim;
        let n = tokens * 3 * dim;
        at_least("encoder qkv input", y.len(), n)?;
        at_least("encoder qkv bias", bias.len(), 3 * dim)?;
        at_least("encoder qkv out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(encoder_source, "enc_qkv_rope")?;
        let (cp, _gc) = match cos_sin {
            Some(t) => {
                at_least("encoder qkv cos_sin", t.len(), tokens * heads.head_dim)?;
                let (p, g) = t.device_ptr(&self.stream);
                (p, Some(g))
            }
            None => (0u64, None),
        };
        let (yp, _g1) = y.device_ptr(&self.stream);
        let (bp, _g2) = bias.device_ptr(&self.stream);
        let (op, _g3) = out.device_ptr_mut(&self.stream);
        let (n_i, dim_i, hd) = (
            i64_of("n", n)?,
            i32_of("dim", dim)?,
            i32_of("head_dim", heads.head_dim)?,
        );
        let mut l = self.stream.launch_builder(&f);
        l.arg(&yp)
            .arg(&bp)
            .arg(&cp)
            .arg(&op)
            .arg(&n_i)
            .arg(&dim_i)
            .arg(&hd);
        // SAFETY: matches `enc_qkv_rope(const float*, const float*, const float*, u16*, long
        // long, int, int)`; y and out hold tokens * 3 dim elements, bias 3 dim, cos_sin (or
        // null) tokens * head_dim (checked); element i reads its partner in its own row only.
        unsafe { l.launch(elementwise_cfg(n)) }?;
        Ok(())
    }
}
