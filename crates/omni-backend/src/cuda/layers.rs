//! The fused per-layer kernels of the decoder on the GPU (bf16 in and out, f32 math):
//!
//! - [`CudaContext::fused_add_rms_norm`]: `residual += delta; out = rms_norm(residual)`
//!   (vLLM's `fused_add_rms_norm`) on an f32 residual stream, one pass per sub-block;
//! - [`CudaContext::qkv_rope_cache_bf16`] (its own file, `qkv_rope.rs`, on the same kernel
//!   module): the q/k norm + RoPE + KV-cache write;
//! - [`CudaContext::embedding_ids_bf16`]: the embedding gather with ids already on the device;
//! - [`CudaContext::add_bias_bf16`], [`CudaContext::bf16_to_f32`],
//!   [`CudaContext::fill_uniform_bf16`] (dummy weights made on the device: a 60 GB model never
//!   passes through the host), and [`CudaContext::matmul_nt_bf16_f32`] (the `lm_head` GEMM with f32
//!   logits).
//!
//! Every launch here depends only on host scalars and device buffers, never on host reads of
//! device data, so they can all be captured in a CUDA graph.

use cudarc::cublas::{result as blas_result, sys as blas_sys};
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::kernels::{BF16_HELPERS, ROPE_HELPERS, kernel_file};
use super::launch::{at_least, block_threads, elementwise_cfg, narrow};
use super::{CudaContext, CudaResult, L2Prefetch};

/// The fused per-layer kernels (`kernels/layers.cu`).
const LAYERS: &str = kernel_file!("layers.cu");

const FUSED_ADD_RMSNORM_FN: &str = "fused_add_rmsnorm_f32res";
const ADD_BIAS_F32_FN: &str = "add_bias_f32";
/// `fused_add_rmsnorm_f32res` keeps a row in registers and stores 4 elements at a time (the same
/// bits; where dim <= 16 x the block and the outputs are aligned) unless this is `0` (the
/// shared-memory form). On by default since measured (H100, 2026-12-07: batch-1 decode +0.5%,
/// prefill unchanged; bench/results/gpu-h200-2026-12-07.md). Read once per process.
pub const NORM_REGS_ENV: &str = "OMNI_CUDA_NORM_REGS";

/// Whether the register form runs ([`NORM_REGS_ENV`] is not `0`).
fn norm_regs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::cuda::switch_on(NORM_REGS_ENV))
}

const EMBEDDING_IDS_FN: &str = "embedding_ids_bf16";
const ADD_ROWS_F32_FN: &str = "add_rows_f32";
const ADD_BIAS_FN: &str = "add_bias_bf16";
const BF16_TO_F32_FN: &str = "bf16_to_f32";
const FILL_UNIFORM_FN: &str = "fill_uniform_bf16";

/// Full source of the layers module.
pub(super) fn layers_source() -> String {
    format!("{BF16_HELPERS}{ROPE_HELPERS}{LAYERS}")
}

impl CudaContext {
    /// The pre-norm of a decoder sub-block on an f32 residual stream: updates `residual` by
    /// `update`, then `out = rms_norm(residual) * weight` (bf16) per row of width `dim`
    /// (Hugging Face `RMSNorm`, f32 math).
    #[allow(clippy::too_many_arguments)]
    pub fn fused_add_rms_norm(
        &self,
        residual: &mut impl DevicePtrMut<f32>,
        update: ResidualUpdate<'_>,
        weight: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> CudaResult<()> {
        self.fused_add_rms_norm_f32_out(residual, update, weight, out, None, rows, dim, eps)
    }

    /// [`CudaContext::fused_add_rms_norm`] that also writes the normed rows unrounded to
    /// `out32` (f32), for consumers that need more than bf16 (the MoE router: a top-k over
    /// nearly equal logits flips on bf16 rounding).
    #[allow(clippy::too_many_arguments)]
    pub fn fused_add_rms_norm_f32_out(
        &self,
        residual: &mut impl DevicePtrMut<f32>,
        update: ResidualUpdate<'_>,
        weight: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        out32: Option<&mut CudaViewMut<'_, f32>>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> CudaResult<()> {
        let extra = NormExtra {
            out32,
            out_lo: None,
        };
        self.fused_add_rms_norm_prefetch(
            residual,
            update,
            weight,
            out,
            extra,
            (rows, dim, eps),
            L2Prefetch::NONE,
        )
    }

    /// [`CudaContext::fused_add_rms_norm`] (`shape`: rows, dim, eps) that also writes `extra`
    /// and issues `prefetch` (a later kernel's weights) into L2 before it waits for its
    /// predecessor.
    #[allow(clippy::too_many_arguments)]
    pub fn fused_add_rms_norm_prefetch(
        &self,
        residual: &mut impl DevicePtrMut<f32>,
        update: ResidualUpdate<'_>,
        weight: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        extra: NormExtra<'_, '_>,
        (rows, dim, eps): (usize, usize, f32),
        prefetch: L2Prefetch,
    ) -> CudaResult<()> {
        crate::check_len("cuda rms_norm weight", weight.len(), dim)?;
        let n = rows * dim;
        at_least("cuda rms_norm residual", residual.len(), n)?;
        at_least("cuda rms_norm out", out.len(), n)?;
        let s = &self.stream;
        let (mode, init, delta) = match &update {
            ResidualUpdate::Set(v) => {
                at_least("cuda rms_norm init", v.len(), n)?;
                (1i32, v.device_ptr(s).0, 0u64)
            }
            ResidualUpdate::Add(v) => {
                at_least("cuda rms_norm delta", v.len(), n)?;
                (2, 0, v.device_ptr(s).0)
            }
            ResidualUpdate::Keep => (0, 0, 0),
        };
        if rows == 0 || dim == 0 {
            return Ok(());
        }
        let (grid, threads) = (
            narrow::<u32>("rows", rows)?,
            block_threads(dim.div_ceil(4), 1024),
        );
        let mut o32 = match extra.out32 {
            Some(o) => {
                at_least("cuda rms_norm out32", o.len(), n)?;
                o.device_ptr_mut(s).0
            }
            None => 0u64,
        };
        let mut olo = match extra.out_lo {
            Some(o) => {
                at_least("cuda rms_norm out_lo", o.len(), 2 * n)?;
                o.device_ptr_mut(s).0
            }
            None => 0u64,
        };
        let mut dim_i = narrow::<i32>("dim", dim)?;
        let f = self.function(layers_source, FUSED_ADD_RMSNORM_FN)?;
        let (mut x, _gx) = residual.device_ptr_mut(s);
        let (mut w, _gw) = weight.device_ptr(s);
        let (mut y, _gy) = out.device_ptr_mut(s);
        let (mut init, mut delta, mut mode, mut eps) = (init, delta, mode, eps);
        // The register path (the default; OMNI_CUDA_NORM_REGS=0 turns it off) and its 4-element stores: w, out and out_lo 8-byte, out32
        // 16-byte aligned (rows start at multiples of dim, a multiple of 4).
        let mut vec = i32::from(
            norm_regs()
                && dim.is_multiple_of(4)
                && w.is_multiple_of(8)
                && y.is_multiple_of(8)
                && olo.is_multiple_of(8)
                && o32.is_multiple_of(16),
        );
        let (grid, (mut pf0, mut pf0_bytes, mut pf1, mut pf1_bytes, mut pf_work)) =
            prefetch.launch(grid, self.info.sm_count);
        let mut args = kernel_args!(
            x, init, delta, mode, w, y, o32, olo, dim_i, eps, vec, pf0, pf0_bytes, pf1, pf1_bytes,
            pf_work
        );
        // SAFETY: the arguments match `fused_add_rmsnorm_f32res(float*, const u16*, const
        // float*, int, const u16*, u16*, float*, u16*, int, float, int, L2_PREFETCH_ARGS)` (the
        // prefetch regions: `L2Prefetch`'s aligned read-only device ranges, or null / 0, only
        // prefetched, never dereferenced); residual, out, out32 (or null)
        // and the buffer of the mode (the others are null and unread) hold at least rows * dim
        // elements, out_lo (or null) 2 rows * dim and weight dim (checked above); the kernel
        // writes out_lo's row r at 2 r dim .. 2 (r + 1) dim; one block per row (blocks past `rows`, when
        // there is a region to prefetch, only prefetch and exit), block size a multiple of
        // 32 and at most 1024 as `block_sum` requires. float4 accesses are only taken when dim
        // is a multiple of 4, so rows start 16-byte aligned in the (256-byte aligned) f32
        // allocations; the 4-element bf16 and out32 stores only with `vec`, whose alignments
        // were checked on the pointers just above. The kernel touches nothing before its wait
        // but the prefetch regions, which no kernel writes, as a programmatic launch requires.
        unsafe { self.launch_programmatic(&f, (grid, threads, 0), &mut args) }
    }

    /// `x[r, :] += bias` on f32 rows (`bias` bf16, `[cols]`).
    pub fn add_bias_f32(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        bias: &impl DevicePtr<bf16>,
        rows: usize,
    ) -> CudaResult<()> {
        self.add_bias_rows(x, bias, rows, ADD_BIAS_F32_FN)
    }

    /// Launches the bias kernel `name`, whose signature is `(T*, const u16*, long long, long
    /// long)` with `T` the element type of `x` (`add_bias_bf16` or `add_bias_f32`).
    fn add_bias_rows<T>(
        &self,
        x: &mut impl DevicePtrMut<T>,
        bias: &impl DevicePtr<bf16>,
        rows: usize,
        name: &'static str,
    ) -> CudaResult<()> {
        let cols = bias.len();
        let n = rows * cols;
        at_least("cuda add_bias x", x.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (c, n_i) = (narrow::<i64>("cols", cols)?, narrow::<i64>("n", n)?);
        let f = self.function(layers_source, name)?;
        let (xp, _g1) = x.device_ptr_mut(&self.stream);
        let (bp, _g2) = bias.device_ptr(&self.stream);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&xp).arg(&bp).arg(&c).arg(&n_i);
        // SAFETY: the arguments match the kernel `name`'s `(T*, const u16*, long long, long
        // long)` (the callers pair each name with its element type); x holds at least
        // n = rows * cols elements and bias cols (checked above).
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// Gathers embedding rows for device-resident `ids` (`[tokens]` i32, each `< vocab`: the
    /// caller validates ids on the host before uploading them).
    pub fn embedding_ids_bf16(
        &self,
        table: &impl DevicePtr<bf16>,
        hidden: usize,
        ids: &impl DevicePtr<i32>,
        tokens: usize,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> CudaResult<()> {
        at_least("cuda embedding ids", ids.len(), tokens)?;
        at_least("cuda embedding out", out.len(), tokens * hidden)?;
        let n = tokens * hidden;
        if n == 0 {
            return Ok(());
        }
        let (h, n_i) = (narrow::<i64>("hidden", hidden)?, narrow::<i64>("n", n)?);
        let f = self.function(layers_source, EMBEDDING_IDS_FN)?;
        let (t, _g1) = table.device_ptr(&self.stream);
        let (i, _g2) = ids.device_ptr(&self.stream);
        let (o, _g3) = out.device_ptr_mut(&self.stream);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&t).arg(&i).arg(&o).arg(&h).arg(&n_i);
        // SAFETY: the arguments match `embedding_ids_bf16(const u16*, const int*, u16*, long
        // long, long long)`; out and ids hold at least n / hidden rows (checked above); ids are
        // `< vocab` by the caller's contract, so every table row read is inside the table.
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// `dst[rows[r], :] += src[r, :]` for `r < m` (`src` `[m, hidden]`; `rows` `[m]` distinct
    /// row indices of `dst`, each below its row count: the caller validates them on the host).
    pub fn add_rows_f32(
        &self,
        dst: &mut impl DevicePtrMut<f32>,
        src: &impl DevicePtr<f32>,
        rows: &impl DevicePtr<i32>,
        m: usize,
        hidden: usize,
    ) -> CudaResult<()> {
        at_least("cuda add_rows src", src.len(), m * hidden)?;
        at_least("cuda add_rows rows", rows.len(), m)?;
        let n = m * hidden;
        if n == 0 {
            return Ok(());
        }
        let (h, n_i) = (narrow::<i64>("hidden", hidden)?, narrow::<i64>("n", n)?);
        let f = self.function(layers_source, ADD_ROWS_F32_FN)?;
        let (d, _g1) = dst.device_ptr_mut(&self.stream);
        let (sp, _g2) = src.device_ptr(&self.stream);
        let (r, _g3) = rows.device_ptr(&self.stream);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&d).arg(&sp).arg(&r).arg(&h).arg(&n_i);
        // SAFETY: the arguments match `add_rows_f32(float*, const float*, const int*, long long,
        // long long)`; src holds m rows and rows m indices (checked above); each index is a row
        // of dst by the caller's contract, and distinct, so no two threads add to one element.
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// `x[r, :] += bias` for every row of `x` (`[rows, cols]`).
    pub fn add_bias_bf16(
        &self,
        x: &mut impl DevicePtrMut<bf16>,
        bias: &impl DevicePtr<bf16>,
        rows: usize,
    ) -> CudaResult<()> {
        self.add_bias_rows(x, bias, rows, ADD_BIAS_FN)
    }

    /// Widens `n` bf16 values to f32.
    pub fn bf16_to_f32(
        &self,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<f32>,
        n: usize,
    ) -> CudaResult<()> {
        at_least("cuda bf16_to_f32 input", x.len(), n)?;
        at_least("cuda bf16_to_f32 output", y.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n_i = narrow::<i64>("n", n)?;
        let f = self.function(layers_source, BF16_TO_F32_FN)?;
        let (xp, _g1) = x.device_ptr(&self.stream);
        let (yp, _g2) = y.device_ptr_mut(&self.stream);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&xp).arg(&yp).arg(&n_i);
        // SAFETY: the arguments match `bf16_to_f32(const u16*, float*, long long)`; both buffers
        // hold at least n elements (checked above).
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// Fills `x` with values uniform in `[lo, hi)` from a stateless hash of `(seed, index)`:
    /// dummy weights made on the device, the same for the same seed everywhere.
    pub fn fill_uniform_bf16(
        &self,
        x: &mut impl DevicePtrMut<bf16>,
        seed: u64,
        lo: f32,
        hi: f32,
    ) -> CudaResult<()> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n_i = narrow::<i64>("n", n)?;
        let f = self.function(layers_source, FILL_UNIFORM_FN)?;
        let (xp, _g) = x.device_ptr_mut(&self.stream);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&xp).arg(&n_i).arg(&seed).arg(&lo).arg(&hi);
        // SAFETY: the arguments match `fill_uniform_bf16(u16*, long long, unsigned long long,
        // float, float)`; x holds n elements and the grid-stride loop stays below n.
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// `out[m, n] = a[m, k] @ w[n, k]^T` with bf16 inputs and **f32** output (cuBLAS
    /// `gemm_ex`, f32 compute): the `lm_head` GEMM, so logits keep f32 precision for sampling.
    pub fn matmul_nt_bf16_f32(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<f32>,
        m: usize,
        k: usize,
        n: usize,
    ) -> CudaResult<()> {
        at_least("cuda matmul lhs", a.len(), m * k)?;
        crate::check_len("cuda matmul weight", w.len(), n * k)?;
        at_least("cuda matmul out", out.len(), m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (ap, _g1) = a.device_ptr(&self.stream);
        let (wp, _g2) = w.device_ptr(&self.stream);
        let (op, _g3) = out.device_ptr_mut(&self.stream);
        let g = BlasGemm {
            a: ap,
            lda: k.max(1),
            w: wp,
            ldw: k.max(1),
            m,
            k,
            n,
            beta: 0.0,
        };
        // SAFETY: the three pointers are device allocations of this context's stream whose
        // lengths were checked above against the shapes (a: m k, w: n k, out: m n), with
        // leading dimensions k.
        unsafe { self.gemm_bf16_f32(g, op) }?;
        Ok(())
    }

    /// `out[m, n] = a[m, :k] @ w[n, :k]^T + beta out` (row strides `lda`, `ldw`; bf16 in, f32
    /// out and compute).
    ///
    /// # Safety
    /// `a` holds `(m - 1) lda + k` bf16, `w` `(n - 1) ldw + k`, `out` `m n` f32, all device
    /// memory of this context's stream, `k <= lda` and `k <= ldw`.
    pub(super) unsafe fn gemm_bf16_f32(&self, g: BlasGemm, out: u64) -> CudaResult<()> {
        let (mi, ki, ni) = (
            narrow::<i32>("m", g.m)?,
            narrow::<i32>("k", g.k)?,
            narrow::<i32>("n", g.n)?,
        );
        let (lda, ldw) = (narrow::<i32>("lda", g.lda)?, narrow::<i32>("ldw", g.ldw)?);
        let alpha = 1.0f32;
        // SAFETY: the caller's contract; cuBLAS's column-major view is the transposed product
        // (see `matmul_nt_bf16`): out^T [n, m] = w [n, k] . a^T [k, m], w read transposed
        // with leading dimension ldw, a with lda, out with n; alpha and beta are f32 as
        // CUBLAS_COMPUTE_32F requires and outlive the call.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha) as *const f32 as *const _,
                g.w as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ldw,
                g.a as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                lda,
                (&g.beta) as *const f32 as *const _,
                out as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                ni,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}

impl CudaContext {
    /// `out[m, n] = a[m, k] @ w[n, k]^T` all in f32 (cuBLAS SGEMM, no TF32): small GEMMs whose
    /// result decides something discrete (MoE routing).
    pub fn matmul_nt_f32(
        &self,
        a: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        m: usize,
        k: usize,
        n: usize,
    ) -> CudaResult<()> {
        at_least("cuda sgemm lhs", a.len(), m * k)?;
        crate::check_len("cuda sgemm weight", w.len(), n * k)?;
        at_least("cuda sgemm out", out.len(), m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ki, ni) = (
            narrow::<i32>("m", m)?,
            narrow::<i32>("k", k)?,
            narrow::<i32>("n", n)?,
        );
        let cfg = cudarc::cublas::GemmConfig {
            transa: blas_sys::cublasOperation_t::CUBLAS_OP_T,
            transb: blas_sys::cublasOperation_t::CUBLAS_OP_N,
            m: ni,
            n: mi,
            k: ki,
            alpha: 1.0f32,
            lda: ki.max(1),
            ldb: ki.max(1),
            beta: 0.0f32,
            ldc: ni,
        };
        // SAFETY: the buffers are device allocations whose lengths were checked above against
        // the shape and leading dimensions (the row-major to column-major mapping of
        // `matmul_nt_bf16`).
        unsafe { cudarc::cublas::Gemm::gemm(&self.blas, cfg, w, a, out) }?;
        Ok(())
    }
}

/// What [`CudaContext::fused_add_rms_norm_prefetch`] writes besides the bf16 normed rows.
#[derive(Debug, Default)]
pub struct NormExtra<'a, 'b> {
    /// The normed rows unrounded (f32, `rows * dim`).
    pub out32: Option<&'a mut CudaViewMut<'b, f32>>,
    /// The rest of each normed value past its bf16 as two more bf16 terms (`rows * 2 dim`, row
    /// r = `[mid | lo]`; bf16 + mid + lo is the f32 value exactly): the input of
    /// [`CudaContext::moe_router_split`].
    pub out_lo: Option<&'a mut CudaViewMut<'b, bf16>>,
}

/// How [`CudaContext::fused_add_rms_norm`] updates the residual stream before the norm.
#[derive(Debug)]
pub enum ResidualUpdate<'a> {
    /// Start it from bf16 rows (the embedding output).
    Set(CudaView<'a, bf16>),
    /// Add f32 rows (the previous sub-block's all-reduced output).
    Add(CudaView<'a, f32>),
    /// Leave it as it is (a sub-block that added its output itself: the small-batch MoE
    /// experts).
    Keep,
}

/// One bf16 GEMM with f32 output of [`CudaContext::gemm_bf16_f32`]: device pointers, row
/// strides, shape and beta.
pub(super) struct BlasGemm {
    pub(super) a: u64,
    pub(super) lda: usize,
    pub(super) w: u64,
    pub(super) ldw: usize,
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) beta: f32,
}
