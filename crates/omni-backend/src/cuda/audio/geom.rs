//! The shapes and views the Code2Wav launchers take, and the host-side weight reorders for
//! their GEMMs.

use cudarc::driver::CudaSlice;

use super::super::CudaResult;
use super::super::launch::shape_err;

/// `batch` sequences of `len` steps each, stored `[batch, len, channels]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seqs {
    /// Sequences.
    pub batch: usize,
    /// Steps per sequence.
    pub len: usize,
}

impl Seqs {
    /// `batch * len`.
    pub fn rows(&self) -> usize {
        self.batch * self.len
    }
}

/// SnakeBeta's per-channel parameters as the kernels take them: `exp(alpha)` and
/// `1 / (exp(beta) + 1e-9)` ([`snake_params`] computes them from the checkpoint's log-scale
/// values exactly as the CPU's `SnakeBeta::from_log_params`).
#[derive(Debug, Clone, Copy)]
pub struct Snake<'a> {
    /// `exp(alpha)` `[channels]`.
    pub alpha: &'a CudaSlice<f32>,
    /// `1 / (exp(beta) + 1e-9)` `[channels]`.
    pub inv_beta: &'a CudaSlice<f32>,
}

/// `(exp(alpha), 1 / (exp(beta) + 1e-9))` per channel, in f32 as the CPU computes them.
pub fn snake_params(alpha: &[f32], beta: &[f32]) -> (Vec<f32>, Vec<f32>) {
    (
        alpha.iter().map(|a| a.exp()).collect(),
        beta.iter().map(|b| 1.0 / (b.exp() + 1e-9)).collect(),
    )
}

/// A conv weight `[out, in, k]` (PyTorch) as the GEMM matrix `[out, k * in]` whose column
/// `j * in + i` meets im2col's column of tap `j`, channel `i`.
pub fn conv_weight_gemm(w: &[f32], out: usize, inp: usize, k: usize) -> Vec<f32> {
    let mut g = vec![0.0; out * inp * k];
    for o in 0..out {
        for i in 0..inp {
            for j in 0..k {
                g[o * k * inp + j * inp + i] = w[(o * inp + i) * k + j];
            }
        }
    }
    g
}

/// A transposed-conv weight `[in, out, k]` (PyTorch) as the GEMM matrix `[k * out, in]`: row
/// `j * out + o` gives tap `j` of output channel `o`, the layout [`CudaContext::c2w_col2im`]
/// reads.
pub fn transconv_weight_gemm(w: &[f32], inp: usize, out: usize, k: usize) -> Vec<f32> {
    let mut g = vec![0.0; out * inp * k];
    for i in 0..inp {
        for o in 0..out {
            for j in 0..k {
                g[(j * out + o) * inp + i] = w[(i * out + o) * k + j];
            }
        }
    }
    g
}

/// A transposed conv's geometry (kernel `kernel`, stride `stride`, Hugging Face's causal trim
/// of `kernel - stride` per side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransConvGeom {
    /// Input steps per sequence.
    pub len_in: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel size.
    pub kernel: usize,
    /// Stride (`1..=kernel`).
    pub stride: usize,
}

impl TransConvGeom {
    /// Output steps per sequence: `(len_in - 1) * stride + kernel - 2 * (kernel - stride)`.
    pub fn len_out(&self) -> usize {
        if self.len_in == 0 {
            return 0;
        }
        ((self.len_in - 1) * self.stride + self.kernel)
            .saturating_sub(2 * (self.kernel - self.stride))
    }
}

/// A causal stride-1 conv's taps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvTaps {
    /// Input channels.
    pub channels: usize,
    /// Kernel size.
    pub kernel: usize,
    /// Dilation.
    pub dilation: usize,
}

/// The window attention's heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowAttnGeom {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Elements per head (even, at most 128).
    pub head_dim: usize,
    /// Keys per query including itself.
    pub window: usize,
}

impl WindowAttnGeom {
    /// Elements of one `qkv` row: `(heads + 2 * kv_heads) * head_dim`.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    pub(super) fn check(&self) -> CudaResult<()> {
        if self.kv_heads == 0
            || !self.heads.is_multiple_of(self.kv_heads)
            || self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
            || self.head_dim > 128
            || self.window == 0
        {
            return Err(shape_err(
                "c2w attention head_dim (even, <= 128)",
                64,
                self.head_dim,
            ));
        }
        Ok(())
    }
}

/// ConvNeXt's depthwise conv and LayerNorm parameters (all f32).
#[derive(Debug, Clone, Copy)]
pub struct DwConvNorm<'a> {
    /// `[channels, kernel]`.
    pub weight: &'a CudaSlice<f32>,
    /// `[channels]`.
    pub bias: &'a CudaSlice<f32>,
    /// LayerNorm weight `[channels]`.
    pub ln_weight: &'a CudaSlice<f32>,
    /// LayerNorm bias `[channels]`.
    pub ln_bias: &'a CudaSlice<f32>,
    /// Kernel size.
    pub kernel: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
}
