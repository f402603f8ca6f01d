//! Qwen3-Omni's Code2Wav (codec decoder) on the device (`kernels/audio.cu`): the ops of the
//! pre-transformer and of the convolution stack, on time-major bf16 `[batch, len, channels]`
//! activations (row `b * len + t`), f32 math, f32 per-channel vectors. Every convolution is
//! causal per sequence (a tap before `t = 0` of its own sequence reads zero), so sequences of
//! one batch never see each other.
//!
//! - dense causal conv1d (stride 1, dilation, one group) = [`CudaContext::c2w_im2col`] (a
//!   scatter that applies SnakeBeta once per input element on the way) + one cuBLAS GEMM
//!   ([`CudaContext::c2w_gemm`]) against the weight reordered by [`conv_weight_gemm`];
//! - causal transposed conv1d = one GEMM against [`transconv_weight_gemm`] (every tap's
//!   output channels) + [`CudaContext::c2w_col2im`] (overlap-add, `k - s` trim per side, bias);
//! - depthwise causal conv + LayerNorm fused ([`CudaContext::c2w_dwconv_ln`], ConvNeXt);
//! - SnakeBeta with the bias before it and the next residual's bias
//!   ([`CudaContext::c2w_bias_snake`]), exact-erf GELU ([`CudaContext::c2w_bias_gelu`]),
//!   residual updates ([`CudaContext::c2w_bias_residual`]);
//! - the code embedding mean ([`CudaContext::c2w_embed`]), LayerScale residual + RMSNorm
//!   ([`CudaContext::c2w_scale_add_rms_norm`]), RoPE ([`CudaContext::c2w_rope`]), causal
//!   sliding-window attention ([`CudaContext::c2w_window_attention`]);
//! - the last conv to one channel with the clamp, f32 out ([`CudaContext::c2w_conv_out_clamp`]).
//!
//! Group counts other than 1 and `channels` (depthwise) are not supported; Code2Wav has none.

mod geom;
#[cfg(test)]
mod tests;

use cudarc::cublas::{result as blas_result, sys as blas_sys};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::kernels::{BF16_HELPERS, kernel_file};
use super::launch::{at_least, block_threads, elementwise_cfg, grid_yz, narrow, shape_err};
use super::{CudaContext, CudaResult};

pub use geom::{
    ConvTaps, DwConvNorm, Seqs, Snake, TransConvGeom, WindowAttnGeom, conv_weight_gemm,
    snake_params, transconv_weight_gemm,
};

const AUDIO: &str = kernel_file!("audio.cu");

/// Full source of the audio module.
pub(super) fn audio_source() -> String {
    format!("{BF16_HELPERS}{AUDIO}")
}

/// Vector width of the element kernels for `channels`: 8 (16-byte moves) when it divides.
fn vec_width(channels: usize) -> usize {
    if channels.is_multiple_of(8) { 8 } else { 1 }
}

/// One block per row, threads over `work` items.
fn row_cfg(rows: usize, work: usize, shared: u32) -> CudaResult<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (narrow::<u32>("c2w rows", rows)?, 1, 1),
        block_dim: (block_threads(work, 1024), 1, 1),
        shared_mem_bytes: shared,
    })
}

fn i32_of(what: &'static str, v: usize) -> CudaResult<i32> {
    narrow::<i32>(what, v)
}

impl CudaContext {
    /// `out[m, n] (+)= a[m, k] @ w[n, k]^T`, bf16 in and out, f32 accumulation (cuBLAS
    /// `gemm_ex`); `accumulate` adds to `out` (beta = 1) instead of overwriting it. Buffers may
    /// be longer than the shape (sized for a larger batch).
    #[allow(clippy::too_many_arguments)]
    pub fn c2w_gemm(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> CudaResult<()> {
        at_least("c2w gemm lhs", a.len(), m * k)?;
        at_least("c2w gemm weight", w.len(), n * k)?;
        at_least("c2w gemm out", out.len(), m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ki, ni) = (i32_of("m", m)?, i32_of("k", k)?, i32_of("n", n)?);
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let (ap, _g1) = a.device_ptr(&self.stream);
        let (wp, _g2) = w.device_ptr(&self.stream);
        let (op, _g3) = out.device_ptr_mut(&self.stream);
        // SAFETY: the handle is bound to this context's stream; the pointers are device
        // allocations at least as long as the (m, k, n) shape needs (checked above), read with
        // the leading dimensions of `matmul_nt_bf16`'s row-major mapping; alpha and beta are f32
        // as CUBLAS_COMPUTE_32F requires and outlive the call.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ki.max(1),
                ap as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ki.max(1),
                (&beta) as *const f32 as *const _,
                op as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ni,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    /// `h[b * frames + t, :]` = the mean over the `nq` quantizers of table rows
    /// `codes[b, q, t] + codebook * q` (f32 out). `codes` `[batch, nq, frames]`, each below
    /// `codebook` (the caller checks: the kernel does not).
    #[allow(clippy::too_many_arguments)]
    pub fn c2w_embed(
        &self,
        codes: &impl DevicePtr<i32>,
        table: &impl DevicePtr<bf16>,
        h: &mut impl DevicePtrMut<f32>,
        seqs: Seqs,
        nq: usize,
        codebook: usize,
        hidden: usize,
    ) -> CudaResult<()> {
        let rows = seqs.rows();
        at_least("c2w embed codes", codes.len(), rows * nq)?;
        at_least("c2w embed table", table.len(), nq * codebook * hidden)?;
        at_least("c2w embed out", h.len(), rows * hidden)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(audio_source, "c2w_embed")?;
        let (c, _g1) = codes.device_ptr(&self.stream);
        let (t, _g2) = table.device_ptr(&self.stream);
        let (o, _g3) = h.device_ptr_mut(&self.stream);
        let ints = [
            i32_of("frames", seqs.len)?,
            i32_of("nq", nq)?,
            i32_of("codebook", codebook)?,
            i32_of("hidden", hidden)?,
        ];
        let mut l = self.stream.launch_builder(&f);
        l.arg(&c).arg(&t).arg(&o);
        for v in &ints {
            l.arg(v);
        }
        // SAFETY: matches `c2w_embed(const int*, const u16*, float*, int, int, int, int)`; the
        // block of row r reads codes[b, :, t] and writes h[r, :] (lengths checked above); table
        // rows are below nq * codebook for codes below codebook (the caller's contract).
        unsafe { l.launch(row_cfg(rows, hidden, 0)?) }?;
        Ok(())
    }

    /// With `update = Some((t, scale))` first `h += scale * t` (f32 rows), then
    /// `out = rms_norm(h) * weight` in bf16, per row of width `dim`.
    #[allow(clippy::too_many_arguments)]
    pub fn c2w_scale_add_rms_norm(
        &self,
        h: &mut impl DevicePtrMut<f32>,
        update: Option<(&dyn DevicePtr<f32>, &dyn DevicePtr<f32>)>,
        weight: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> CudaResult<()> {
        at_least("c2w rms_norm residual", h.len(), rows * dim)?;
        at_least("c2w rms_norm weight", weight.len(), dim)?;
        at_least("c2w rms_norm out", out.len(), rows * dim)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(audio_source, "c2w_scale_add_rms_norm")?;
        let (tp, sp, _gt, _gs) = match update {
            Some((t, s)) => {
                at_least("c2w rms_norm update", t.len(), rows * dim)?;
                at_least("c2w rms_norm scale", s.len(), dim)?;
                let (tp, gt) = t.device_ptr(&self.stream);
                let (sp, gs) = s.device_ptr(&self.stream);
                (tp, sp, Some(gt), Some(gs))
            }
            None => (0u64, 0u64, None, None),
        };
        let (hp, _g1) = h.device_ptr_mut(&self.stream);
        let (wp, _g2) = weight.device_ptr(&self.stream);
        let (op, _g3) = out.device_ptr_mut(&self.stream);
        let dim_i = i32_of("dim", dim)?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&hp)
            .arg(&tp)
            .arg(&sp)
            .arg(&wp)
            .arg(&op)
            .arg(&dim_i)
            .arg(&eps);
        // SAFETY: matches `c2w_scale_add_rms_norm(float*, const float*, const float*, const
        // float*, u16*, int, float)`; h, t (or null), out hold rows * dim and weight, scale dim
        // elements (checked above); block r touches row r only.
        unsafe { l.launch(row_cfg(rows, dim, 0)?) }?;
        Ok(())
    }

    /// RoPE (rotate-half) in place on the q and k heads of `qkv` rows (`[q heads | k heads | v
    /// heads]`), row `b * len + t` at position `t`; `cos_sin` rows `[cos | sin]` of width
    /// `head_dim` for positions `0..len` at least.
    pub fn c2w_rope(
        &self,
        qkv: &mut impl DevicePtrMut<bf16>,
        cos_sin: &impl DevicePtr<f32>,
        seqs: Seqs,
        geom: WindowAttnGeom,
    ) -> CudaResult<()> {
        geom.check()?;
        let rows = seqs.rows();
        at_least("c2w rope qkv", qkv.len(), rows * geom.qkv_width())?;
        at_least("c2w rope cos_sin", cos_sin.len(), seqs.len * geom.head_dim)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(audio_source, "c2w_rope")?;
        let (q, _g1) = qkv.device_ptr_mut(&self.stream);
        let (cs, _g2) = cos_sin.device_ptr(&self.stream);
        let ints = [
            i32_of("len", seqs.len)?,
            i32_of("heads", geom.heads)?,
            i32_of("kv_heads", geom.kv_heads)?,
            i32_of("head_dim", geom.head_dim)?,
        ];
        let mut l = self.stream.launch_builder(&f);
        l.arg(&q).arg(&cs);
        for v in &ints {
            l.arg(v);
        }
        let work = (geom.heads + geom.kv_heads) * geom.head_dim / 2;
        // SAFETY: matches `c2w_rope(u16*, const float*, int, int, int, int)`; block r rotates
        // row r of qkv in place (rows * width elements checked) with cos_sin row t < len.
        unsafe { l.launch(row_cfg(rows, work, 0)?) }?;
        Ok(())
    }

    /// Causal sliding-window attention of every sequence over its own rotated `qkv` rows into
    /// `out` (`[rows, heads * head_dim]`): query `i` sees keys `i - window < j <= i`; query
    /// head `h` reads KV head `h / (heads / kv_heads)`; scores times `scale`.
    pub fn c2w_window_attention(
        &self,
        qkv: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        seqs: Seqs,
        geom: WindowAttnGeom,
        scale: f32,
    ) -> CudaResult<()> {
        geom.check()?;
        let rows = seqs.rows();
        at_least("c2w attention qkv", qkv.len(), rows * geom.qkv_width())?;
        at_least(
            "c2w attention out",
            out.len(),
            rows * geom.heads * geom.head_dim,
        )?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(audio_source, "c2w_window_attention")?;
        let (q, _g1) = qkv.device_ptr(&self.stream);
        let (o, _g2) = out.device_ptr_mut(&self.stream);
        let ints = [
            i32_of("len", seqs.len)?,
            i32_of("heads", geom.heads)?,
            i32_of("kv_heads", geom.kv_heads)?,
            i32_of("head_dim", geom.head_dim)?,
            i32_of("window", geom.window)?,
        ];
        let mut l = self.stream.launch_builder(&f);
        l.arg(&q).arg(&o);
        for v in &ints {
            l.arg(v);
        }
        l.arg(&scale);
        let warps = geom.heads.min(8);
        let cfg = LaunchConfig {
            grid_dim: (
                narrow::<u32>("c2w rows", rows)?,
                grid_yz("c2w head blocks", geom.heads.div_ceil(warps))?,
                1,
            ),
            block_dim: ((32 * warps) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `c2w_window_attention(const u16*, u16*, int, int, int, int, int,
        // float)`; warp (row, head) reads qkv rows of its own sequence up to row and writes its
        // head of out row `row` (lengths checked above; head_dim <= 128 as the kernel holds 4
        // elements per lane; heads past `heads` return).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// `x = gelu(x + bias)` (exact erf) on `[rows, channels]`.
    pub fn c2w_bias_gelu(
        &self,
        x: &mut impl DevicePtrMut<bf16>,
        bias: &impl DevicePtr<f32>,
        rows: usize,
        channels: usize,
    ) -> CudaResult<()> {
        let n = rows * channels;
        at_least("c2w gelu x", x.len(), n)?;
        at_least("c2w gelu bias", bias.len(), channels)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(audio_source, "c2w_bias_gelu")?;
        let (xp, _g1) = x.device_ptr_mut(&self.stream);
        let (bp, _g2) = bias.device_ptr(&self.stream);
        let (n_i, c_i) = (narrow::<i64>("n", n)?, i32_of("channels", channels)?);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp).arg(&bp).arg(&n_i).arg(&c_i);
        // SAFETY: matches `c2w_bias_gelu(u16*, const float*, long long, int)`; x holds n and
        // bias channels elements; the grid-stride loop stays below n.
        unsafe { l.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// `x += gamma * (y + bias)` on `[rows, channels]`; no `y`: `x += bias`; no `gamma`: scale 1.
    #[allow(clippy::too_many_arguments)]
    pub fn c2w_bias_residual(
        &self,
        x: &mut impl DevicePtrMut<bf16>,
        y: Option<&dyn DevicePtr<bf16>>,
        bias: &impl DevicePtr<f32>,
        gamma: Option<&dyn DevicePtr<f32>>,
        rows: usize,
        channels: usize,
    ) -> CudaResult<()> {
        let n = rows * channels;
        at_least("c2w residual x", x.len(), n)?;
        at_least("c2w residual bias", bias.len(), channels)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(audio_source, "c2w_bias_residual")?;
        let (yp, _gy) = match y {
            Some(y) => {
                at_least("c2w residual y", y.len(), n)?;
                let (p, g) = y.device_ptr(&self.stream);
                (p, Some(g))
            }
            None => (0u64, None),
        };
        let (gp, _gg) = match gamma {
            Some(g) => {
                at_least("c2w residual gamma", g.len(), channels)?;
                let (p, g) = g.device_ptr(&self.stream);
                (p, Some(g))
            }
            None => (0u64, None),
        };
        let (xp, _g1) = x.device_ptr_mut(&self.stream);
        let (bp, _g2) = bias.device_ptr(&self.stream);
        let (n_i, c_i) = (narrow::<i64>("n", n)?, i32_of("channels", channels)?);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp).arg(&yp).arg(&bp).arg(&gp).arg(&n_i).arg(&c_i);
        // SAFETY: matches `c2w_bias_residual(u16*, const u16*, const float*, const float*, long
        // long, int)`; x and y (or null) hold n, bias and gamma (or null) channels elements.
        unsafe { l.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// ConvNeXt's depthwise causal conv (`p.kernel` taps, dilation 1, with bias) then
    /// LayerNorm over the channels, `x` to `out` (both `[rows, channels]`, distinct).
    pub fn c2w_dwconv_ln(
        &self,
        x: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        p: DwConvNorm<'_>,
        seqs: Seqs,
        channels: usize,
    ) -> CudaResult<()> {
        let rows = seqs.rows();
        at_least("c2w dwconv x", x.len(), rows * channels)?;
        at_least("c2w dwconv out", out.len(), rows * channels)?;
        at_least("c2w dwconv weight", p.weight.len(), channels * p.kernel)?;
        at_least("c2w dwconv bias", p.bias.len(), channels)?;
        at_least("c2w layer_norm weight", p.ln_weight.len(), channels)?;
        at_least("c2w layer_norm bias", p.ln_bias.len(), channels)?;
        if rows == 0 {
            return Ok(());
        }
        if channels > 12 * 1024 {
            return Err(shape_err(
                "c2w dwconv channels (shared memory)",
                12 * 1024,
                channels,
            ));
        }
        let f = self.function(audio_source, "c2w_dwconv_ln")?;
        let (xp, _g1) = x.device_ptr(&self.stream);
        let (op, _g2) = out.device_ptr_mut(&self.stream);
        let (wp, _g3) = p.weight.device_ptr(&self.stream);
        let (bp, _g4) = p.bias.device_ptr(&self.stream);
        let (lwp, _g5) = p.ln_weight.device_ptr(&self.stream);
        let (lbp, _g6) = p.ln_bias.device_ptr(&self.stream);
        let ints = [
            i32_of("len", seqs.len)?,
            i32_of("channels", channels)?,
            i32_of("kernel", p.kernel)?,
            1i32,
        ];
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp).arg(&op).arg(&wp).arg(&bp).arg(&lwp).arg(&lbp);
        for v in &ints {
            l.arg(v);
        }
        l.arg(&p.eps);
        // SAFETY: matches `c2w_dwconv_ln(const u16*, u16*, const float*, const float*, const
        // float*, const float*, int, int, int, int, float)`; block r reads rows of its own
        // sequence up to r and writes row r (lengths checked above); `channels` floats of
        // dynamic shared memory (at most 48 KiB).
        unsafe { l.launch(row_cfg(rows, channels, (channels * 4) as u32)?) }?;
        Ok(())
    }

    /// im2col of a causal stride-1 conv: `cols[r, j * C + c] = f(x[r - (k - 1 - j) * d, c])`
    /// within each sequence (zero before its start), `f` = SnakeBeta with `snake`, else the
    /// identity. `cols` `[rows, k * C]` then meets [`conv_weight_gemm`]'s matrix in one GEMM.
    pub fn c2w_im2col(
        &self,
        x: &impl DevicePtr<bf16>,
        cols: &mut impl DevicePtrMut<bf16>,
        snake: Option<Snake<'_>>,
        seqs: Seqs,
        taps: ConvTaps,
    ) -> CudaResult<()> {
        let (rows, c, k) = (seqs.rows(), taps.channels, taps.kernel);
        at_least("c2w im2col x", x.len(), rows * c)?;
        at_least("c2w im2col cols", cols.len(), rows * k * c)?;
        if rows == 0 || c == 0 || k == 0 {
            return Ok(());
        }
        let v = vec_width(c);
        let name = if v == 8 {
            "c2w_im2col_v8"
        } else {
            "c2w_im2col_v1"
        };
        let f = self.function(audio_source, name)?;
        let (ap, ip, _ga, _gi) = match snake {
            Some(s) => {
                at_least("c2w im2col snake alpha", s.alpha.len(), c)?;
                at_least("c2w im2col snake beta", s.inv_beta.len(), c)?;
                let (ap, ga) = s.alpha.device_ptr(&self.stream);
                let (ip, gi) = s.inv_beta.device_ptr(&self.stream);
                (ap, ip, Some(ga), Some(gi))
            }
            None => (0u64, 0u64, None, None),
        };
        let (xp, _g1) = x.device_ptr(&self.stream);
        let (cp, _g2) = cols.device_ptr_mut(&self.stream);
        if v == 8 {
            super::launch::aligned16("c2w im2col x", xp)?;
            super::launch::aligned16("c2w im2col cols", cp)?;
        }
        let ints = [
            i32_of("len", seqs.len)?,
            i32_of("channels", c)?,
            i32_of("kernel", k)?,
            i32_of("dilation", taps.dilation)?,
        ];
        let rows_i = narrow::<i64>("rows", rows)?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp).arg(&cp).arg(&ap).arg(&ip);
        for v in &ints {
            l.arg(v);
        }
        l.arg(&rows_i);
        // SAFETY: matches `c2w_im2col_v{1,8}(const u16*, u16*, const float*, const float*, int,
        // int, int, int, long long)`; the thread of (r, c) reads x[r, c..c+v] and writes column
        // blocks of rows r..r+(k-1)d of its own sequence, all inside rows * k * C (checked);
        // the v8 kernel's 16-byte moves are aligned (pointers checked, C % 8 == 0).
        unsafe { l.launch(elementwise_cfg(rows * c / v)) }?;
        Ok(())
    }

    /// `y = SnakeBeta(y + b1)` in place on `[rows, channels]` (no `b1`: no bias); with
    /// `res = Some((r, b2))` also `r += b2` (the residual unit's last bias, so its 1x1-conv GEMM
    /// can accumulate straight into the residual stream).
    #[allow(clippy::too_many_arguments)]
    pub fn c2w_bias_snake(
        &self,
        y: &mut impl DevicePtrMut<bf16>,
        b1: Option<&dyn DevicePtr<f32>>,
        snake: Snake<'_>,
        res: Option<(&mut dyn DevicePtrMut<bf16>, &dyn DevicePtr<f32>)>,
        rows: usize,
        channels: usize,
    ) -> CudaResult<()> {
        let len = y.len();
        let (yp, _gy) = y.device_ptr_mut(&self.stream);
        self.bias_snake_raw(yp, len, yp, b1, snake, res, rows, channels)
    }

    /// `y = SnakeBeta(x)` on `[rows, channels]` (`x`, `y` distinct).
    pub fn c2w_snake(
        &self,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        snake: Snake<'_>,
        rows: usize,
        channels: usize,
    ) -> CudaResult<()> {
        at_least("c2w snake x", x.len(), rows * channels)?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let len = y.len();
        let (yp, _gy) = y.device_ptr_mut(&self.stream);
        self.bias_snake_raw(xp, len, yp, None, snake, None, rows, channels)
    }

    #[allow(clippy::too_many_arguments)]
    fn bias_snake_raw(
        &self,
        xp: u64,
        y_len: usize,
        yp: u64,
        b1: Option<&dyn DevicePtr<f32>>,
        snake: Snake<'_>,
        res: Option<(&mut dyn DevicePtrMut<bf16>, &dyn DevicePtr<f32>)>,
        rows: usize,
        channels: usize,
    ) -> CudaResult<()> {
        let n = rows * channels;
        at_least("c2w snake y", y_len, n)?;
        at_least("c2w snake alpha", snake.alpha.len(), channels)?;
        at_least("c2w snake beta", snake.inv_beta.len(), channels)?;
        if n == 0 {
            return Ok(());
        }
        let v = vec_width(channels);
        let name = if v == 8 {
            "c2w_bias_snake_v8"
        } else {
            "c2w_bias_snake_v1"
        };
        let f = self.function(audio_source, name)?;
        let (b1p, _g0) = match b1 {
            Some(b) => {
                at_least("c2w snake bias", b.len(), channels)?;
                let (p, g) = b.device_ptr(&self.stream);
                (p, Some(g))
            }
            None => (0u64, None),
        };
        let (rp, b2p, _gr, _gb) = match res {
            Some((r, b2)) => {
                at_least("c2w snake residual", r.len(), n)?;
                at_least("c2w snake residual bias", b2.len(), channels)?;
                let (bp, gb) = b2.device_ptr(&self.stream);
                let (rp, gr) = r.device_ptr_mut(&self.stream);
                (rp, bp, Some(gr), Some(gb))
            }
            None => (0u64, 0u64, None, None),
        };
        if v == 8 {
            for (what, p) in [("c2w snake x", xp), ("c2w snake y", yp)] {
                super::launch::aligned16(what, p)?;
            }
            if rp != 0 {
                super::launch::aligned16("c2w snake residual", rp)?;
            }
        }
        let (ap, _g1) = snake.alpha.device_ptr(&self.stream);
        let (ip, _g2) = snake.inv_beta.device_ptr(&self.stream);
        let (n_i, c_i) = (narrow::<i64>("n", n)?, i32_of("channels", channels)?);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp)
            .arg(&yp)
            .arg(&b1p)
            .arg(&ap)
            .arg(&ip)
            .arg(&rp)
            .arg(&b2p);
        l.arg(&n_i).arg(&c_i);
        // SAFETY: matches `c2w_bias_snake_v{1,8}(const u16*, u16*, const float*, const float*,
        // const float*, u16*, const float*, long long, int)`; x, y and res (or null) hold n
        // elements (x checked by the callers, y and res above), the vectors `channels`; x and y
        // are the same buffer or distinct ones (each element is read before it is written by
        // the same thread); v8 moves are 16-byte aligned (checked, channels % 8 == 0).
        unsafe { l.launch(elementwise_cfg(n / v)) }?;
        Ok(())
    }

    /// col2im of a causal transposed conv computed as `z = x @ W^T` (`z` `[batch, len_in, k *
    /// out]`, [`transconv_weight_gemm`]'s rows): `y[b, u, o] = bias[o] + sum z[b, t, j, o]`
    /// over `t * s + j = u + (k - s)` (the causal trim), `y` `[batch, len_out, out]`.
    pub fn c2w_col2im(
        &self,
        z: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        bias: &impl DevicePtr<f32>,
        batch: usize,
        geom: TransConvGeom,
    ) -> CudaResult<()> {
        let TransConvGeom {
            len_in,
            out_channels: co,
            kernel: k,
            stride: s,
        } = geom;
        if s == 0 || k < s {
            return Err(shape_err("c2w col2im stride (1..=kernel)", k, s));
        }
        let lout = geom.len_out();
        let n = batch * lout * co;
        at_least("c2w col2im z", z.len(), batch * len_in * k * co)?;
        at_least("c2w col2im y", y.len(), n)?;
        at_least("c2w col2im bias", bias.len(), co)?;
        if n == 0 {
            return Ok(());
        }
        let v = vec_width(co);
        let name = if v == 8 {
            "c2w_col2im_v8"
        } else {
            "c2w_col2im_v1"
        };
        let f = self.function(audio_source, name)?;
        let (zp, _g1) = z.device_ptr(&self.stream);
        let (yp, _g2) = y.device_ptr_mut(&self.stream);
        let (bp, _g3) = bias.device_ptr(&self.stream);
        if v == 8 {
            super::launch::aligned16("c2w col2im z", zp)?;
            super::launch::aligned16("c2w col2im y", yp)?;
        }
        let ints = [
            i32_of("len_in", len_in)?,
            i32_of("len_out", lout)?,
            i32_of("out_channels", co)?,
            i32_of("kernel", k)?,
            i32_of("stride", s)?,
            i32_of("trim", k - s)?,
        ];
        let n_i = narrow::<i64>("n", n)?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&zp).arg(&yp).arg(&bp);
        for v in &ints {
            l.arg(v);
        }
        l.arg(&n_i);
        // SAFETY: matches `c2w_col2im_v{1,8}(const u16*, u16*, const float*, int, int, int, int,
        // int, int, long long)`; output element (b, u, o) reads z rows b * len_in + t with
        // 0 <= t < len_in only (inside batch * len_in * k * out, checked) and writes y below n;
        // v8 moves are 16-byte aligned (checked, out % 8 == 0).
        unsafe { l.launch(elementwise_cfg(n / v)) }?;
        Ok(())
    }

    /// The last causal conv (`taps.channels` -> 1, weights `[k * C]` tap-major, scalar bias)
    /// and the clamp to `[-1, 1]`: `wav` `[rows]` f32.
    pub fn c2w_conv_out_clamp(
        &self,
        x: &impl DevicePtr<bf16>,
        wav: &mut impl DevicePtrMut<f32>,
        weight: &impl DevicePtr<f32>,
        bias: f32,
        seqs: Seqs,
        taps: ConvTaps,
    ) -> CudaResult<()> {
        let (rows, c, k) = (seqs.rows(), taps.channels, taps.kernel);
        at_least("c2w conv_out x", x.len(), rows * c)?;
        at_least("c2w conv_out wav", wav.len(), rows)?;
        at_least("c2w conv_out weight", weight.len(), k * c)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(audio_source, "c2w_conv_out_clamp")?;
        let (xp, _g1) = x.device_ptr(&self.stream);
        let (wp, _g2) = wav.device_ptr_mut(&self.stream);
        let (kp, _g3) = weight.device_ptr(&self.stream);
        let ints = [
            i32_of("len", seqs.len)?,
            i32_of("channels", c)?,
            i32_of("kernel", k)?,
            i32_of("dilation", taps.dilation)?,
        ];
        let rows_i = narrow::<i64>("rows", rows)?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&kp).arg(&bias);
        for v in &ints {
            l.arg(v);
        }
        l.arg(&rows_i);
        let warps = 8usize;
        let cfg = LaunchConfig {
            grid_dim: (
                narrow::<u32>("c2w conv_out blocks", rows.div_ceil(warps))?,
                1,
                1,
            ),
            block_dim: ((32 * warps) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `c2w_conv_out_clamp(const u16*, float*, const float*, float, int,
        // int, int, int, long long)`; warp r (< rows) reads x rows of its own sequence up to r
        // and writes wav[r] (lengths checked above).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
}
