//! The small-batch GEMV (`kernels/gemv.cu`) and the decoder's fused small-batch path built on
//! it: steps of at most [`GEMV_MAX_ROWS`] rows stream each weight matrix once, one warp per
//! output column, and the work around the GEMVs moves into them:
//!
//! - [`CudaContext::gemv_nt_bf16`] / [`CudaContext::gemv_nt_bf16_f32`]: the plain GEMV;
//! - [`CudaContext::gemv_fused`]: the input RMSNorm of the f32 residual stream as the GEMV's
//!   prologue (each block normalises the rows itself, with the threads and reduction order of
//!   `fused_add_rmsnorm_f32res`, so the bits are the unfused path's), and as its epilogue the
//!   residual add (`residual += y`) or SiLU-and-mul (a warp computes gate column `o` and up
//!   column `o`, rounded to bf16 as the unfused GEMV would store them);
//! - [`CudaContext::rms_norm_rows`]: the final norm of the rows a step outputs, gathered.
//!
//! These kernels are launched with programmatic dependent launch on Hopper and later
//! (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`): a GEMV may start while its
//! predecessor drains, prefetches its first weight loads (weights are constant during a step)
//! and waits (`griddepcontrol.wait`) before it touches an activation. Inside a CUDA graph the
//! captured edges keep that overlap.

use std::ffi::c_void;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, sys,
};
use half::bf16;

use super::kernels::{BF16_HELPERS, kernel_file};
use super::launch::{aligned16, at_least, block_threads, narrow, shape_err};
use super::{CudaContext, CudaError, CudaResult};

/// The GEMV helpers shared with the small-batch MoE kernels.
pub(super) const GEMV_COMMON: &str = kernel_file!("gemv_common.cuh");
const GEMV: &str = kernel_file!("gemv.cu");
/// The GEMV's entries by (SiLU-and-mul pair, the rows' bound R: 1, 2, 4, 8); a step of `rows`
/// rows takes the smallest R >= rows (fewer accumulators: more resident warps).
const GEMV_FNS: [[&str; 4]; 2] = [
    ["gemv_r1", "gemv_r2", "gemv_r4", "gemv_r8"],
    [
        "gemv_silu_r1",
        "gemv_silu_r2",
        "gemv_silu_r4",
        "gemv_silu_r8",
    ],
];
const NORM_ROWS_FN: &str = "rms_norm_rows_f32res";

/// The most rows [`CudaContext::gemv_nt_bf16`] takes.
pub const GEMV_MAX_ROWS: usize = 8;
/// Warps per block of the GEMV (one output column each; the kernel's `GV_WARPS`).
const PLAIN_WARPS: usize = 8;
/// Shared memory a normalising GEMV may use for its rows (the default limit, no opt-in).
const NORM_SMEM_MAX: usize = 48 * 1024 - 256;

/// Full source of the gemv module.
pub(super) fn gemv_source() -> String {
    format!("{BF16_HELPERS}{GEMV_COMMON}{GEMV}")
}

/// The input of a [`CudaContext::gemv_fused`].
#[derive(Debug)]
pub enum GemvIn<'a> {
    /// bf16 `[rows, k]`.
    X(CudaView<'a, bf16>),
    /// `bf16(rms_norm(residual[r]) * weight)` of the f32 residual `[rows, k]`.
    Norm {
        /// The residual stream (read).
        residual: &'a mut CudaSlice<f32>,
        /// `[k]` the norm's weight.
        weight: &'a CudaSlice<bf16>,
        /// The norm's epsilon.
        eps: f32,
    },
    /// The residual set to `init` (bf16 `[rows, k]`, written back by the kernel), then as
    /// [`GemvIn::Norm`]: a first layer's input.
    SetNorm {
        /// The embeddings.
        init: CudaView<'a, bf16>,
        /// The residual stream (written).
        residual: &'a mut CudaSlice<f32>,
        /// `[k]` the norm's weight.
        weight: &'a CudaSlice<bf16>,
        /// The norm's epsilon.
        eps: f32,
    },
}

/// The output of a [`CudaContext::gemv_fused`].
#[derive(Debug)]
pub enum GemvOut<'a> {
    /// bf16 `[rows, n]`.
    Bf16(CudaViewMut<'a, bf16>),
    /// f32 `[rows, n]`.
    F32(CudaViewMut<'a, f32>),
    /// `residual[r, :n] += y[r]` (f32 `[rows, n]`; the input must not be normalised from it).
    AddTo(&'a mut CudaSlice<f32>),
    /// The weight is a fused `[gate | up]` of `2n` rows; out bf16 `[rows, n]` =
    /// `silu(gate) * up` with both rounded to bf16 first.
    SiluMul(CudaViewMut<'a, bf16>),
}

/// The kernel's `in_mode` / `out_mode` values.
const IN_X: i32 = 0;
const IN_NORM: i32 = 1;
const OUT_BF16: i32 = 0;
const OUT_F32: i32 = 1;
const OUT_ADD: i32 = 2;
const OUT_SILU: i32 = 3;

/// One resolved launch of a `gemv_r*` / `gemv_silu_r*` entry.
struct GemvLaunch {
    x: u64,
    residual: u64,
    norm_w: u64,
    w: u64,
    y: u64,
    rows: i32,
    k: i32,
    n: i32,
    in_mode: i32,
    out_mode: i32,
    set: i32,
    eps: f32,
    blocks: u32,
    threads: u32,
    smem: u32,
}

/// The block of a GEMV with `rows` rows of width `k` read as `input`: [`PLAIN_WARPS`] warps;
/// a normalising one holds the normalised rows in shared memory (its block sum plays the
/// threads `fused_add_rmsnorm_f32res` would run with, so the bits are the same). Returns
/// (threads, shared bytes).
pub fn gemv_block(rows: usize, k: usize, normalises: bool) -> (u32, usize) {
    let smem = if normalises { rows * k * 2 } else { 0 };
    ((PLAIN_WARPS * 32) as u32, smem)
}

/// The output columns warp `warp` of block `block` computes for `n` outputs with `warps` warps
/// per block, and the weight rows it streams (two for SiLU-and-mul: gate `o`, up `o + n`);
/// `None` for the last block's idle warps. The host mirror of the kernel's indexing.
pub fn gemv_warp_rows(
    block: usize,
    warp: usize,
    warps: usize,
    n: usize,
    silu: bool,
) -> Option<(usize, Vec<usize>)> {
    let o = block * warps + warp;
    (o < n).then(|| (o, if silu { vec![o, o + n] } else { vec![o] }))
}

/// The chunks (8 weights each) lane `lane` reads of a row of `k`, in the order it adds them
/// (the kernel's unrolled groups keep the plain stride-32 order). The host mirror.
pub fn gemv_lane_chunks(lane: usize, k: usize) -> Vec<usize> {
    const UNROLL: usize = 8;
    let chunks = k / 8;
    let mut v = Vec::new();
    let mut base = 0;
    while base < chunks {
        for u in 0..UNROLL {
            let c = base + lane + 32 * u;
            if c < chunks {
                v.push(c);
            }
        }
        base += 32 * UNROLL;
    }
    v
}

impl CudaContext {
    /// `out[m, n] = a[m, k] @ w[n, k]^T` for `m <= GEMV_MAX_ROWS` rows, bf16 in, f32
    /// accumulation, bf16 out: one warp per output column streaming its weight row (the
    /// small-batch twin of [`CudaContext::matmul_nt_bf16`]). `k` must be a multiple of 8.
    pub fn gemv_nt_bf16(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        m: usize,
        k: usize,
        n: usize,
    ) -> CudaResult<()> {
        at_least("gemv out", out.len(), m * n)?;
        let (o, _g) = out.device_ptr_mut(&self.stream);
        self.gemv_plain(a, w, o, m, k, n, OUT_BF16)
    }

    /// [`CudaContext::gemv_nt_bf16`] with f32 output.
    pub fn gemv_nt_bf16_f32(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<f32>,
        m: usize,
        k: usize,
        n: usize,
    ) -> CudaResult<()> {
        at_least("gemv out", out.len(), m * n)?;
        let (o, _g) = out.device_ptr_mut(&self.stream);
        self.gemv_plain(a, w, o, m, k, n, OUT_F32)
    }

    /// Whether [`CudaContext::gemv_nt_bf16`] takes this shape.
    pub fn gemv_fits(m: usize, k: usize) -> bool {
        (1..=GEMV_MAX_ROWS).contains(&m) && k > 0 && k.is_multiple_of(8)
    }

    /// Whether [`CudaContext::gemv_fused`] takes a normalised input of this shape (the rows
    /// fit in shared memory).
    pub fn gemv_norm_fits(m: usize, k: usize) -> bool {
        Self::gemv_fits(m, k) && gemv_block(m, k, true).1 <= NORM_SMEM_MAX
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv_plain(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: u64,
        m: usize,
        k: usize,
        n: usize,
        out_mode: i32,
    ) -> CudaResult<()> {
        if !Self::gemv_fits(m, k) {
            return Err(shape_err("gemv rows (1..=8) / k (multiple of 8)", 8, m));
        }
        at_least("gemv lhs", a.len(), m * k)?;
        crate::check_len("gemv weight", w.len(), n * k)?;
        if n == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let (ap, _g1) = a.device_ptr(s);
        let (wp, _g2) = w.device_ptr(s);
        aligned16("gemv lhs", ap)?;
        aligned16("gemv weight", wp)?;
        let (threads, _) = gemv_block(m, k, false);
        self.launch_gemv(GemvLaunch {
            x: ap,
            residual: 0,
            norm_w: 0,
            w: wp,
            y: out,
            rows: narrow("m", m)?,
            k: narrow("k", k)?,
            n: narrow("n", n)?,
            in_mode: IN_X,
            out_mode,
            set: 0,
            eps: 0.0,
            blocks: narrow("gemv blocks", n.div_ceil(threads as usize / 32))?,
            threads,
            smem: 0,
        })
    }

    /// `y = x(input)[m, k] @ w^T` for `m <= GEMV_MAX_ROWS` rows with the input normalised on
    /// the fly and the output added to the residual or passed through SiLU-and-mul (see the
    /// module docs). `w` is `[n, k]` (`[2n, k]` for [`GemvOut::SiluMul`]); `k` a multiple of 8.
    pub fn gemv_fused(
        &self,
        w: &impl DevicePtr<bf16>,
        input: GemvIn<'_>,
        out: GemvOut<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> CudaResult<()> {
        if !Self::gemv_fits(m, k) {
            return Err(shape_err("gemv rows (1..=8) / k (multiple of 8)", 8, m));
        }
        let s = &self.stream;
        let silu = matches!(out, GemvOut::SiluMul(_));
        crate::check_len("gemv weight", w.len(), if silu { 2 * n } else { n } * k)?;
        if n == 0 {
            return Ok(());
        }
        let (wp, _gw) = w.device_ptr(s);
        aligned16("gemv weight", wp)?;
        let normalises = !matches!(input, GemvIn::X(_));
        let (threads, smem) = gemv_block(m, k, normalises);
        if smem > NORM_SMEM_MAX {
            return Err(shape_err(
                "gemv normalised rows (shared bytes)",
                NORM_SMEM_MAX,
                smem,
            ));
        }
        let (mut x, mut residual, mut norm_w, mut eps, mut set) = (0u64, 0u64, 0u64, 0f32, 0);
        let mut guards = Vec::new();
        match &input {
            GemvIn::X(v) => {
                at_least("gemv lhs", v.len(), m * k)?;
                let (p, g) = v.device_ptr(s);
                aligned16("gemv lhs", p)?;
                x = p;
                guards.push(g);
            }
            GemvIn::Norm {
                residual: r,
                weight,
                eps: e,
            } => {
                at_least("gemv residual", r.len(), m * k)?;
                crate::check_len("gemv norm weight", weight.len(), k)?;
                let (p, g) = r.device_ptr(s);
                residual = p;
                guards.push(g);
                let (p, g) = weight.device_ptr(s);
                norm_w = p;
                guards.push(g);
                eps = *e;
            }
            GemvIn::SetNorm {
                init,
                residual: r,
                weight,
                eps: e,
            } => {
                at_least("gemv init", init.len(), m * k)?;
                at_least("gemv residual", r.len(), m * k)?;
                crate::check_len("gemv norm weight", weight.len(), k)?;
                let (p, g) = init.device_ptr(s);
                x = p;
                guards.push(g);
                let (p, g) = r.device_ptr(s);
                residual = p;
                guards.push(g);
                let (p, g) = weight.device_ptr(s);
                norm_w = p;
                guards.push(g);
                eps = *e;
                set = 1;
            }
        }
        if normalises {
            aligned16("gemv residual", residual)?;
        }
        let (y, out_mode) = match &out {
            GemvOut::Bf16(v) => {
                at_least("gemv out", v.len(), m * n)?;
                let (p, g) = v.device_ptr(s);
                guards.push(g);
                (p, OUT_BF16)
            }
            GemvOut::F32(v) => {
                at_least("gemv out", v.len(), m * n)?;
                let (p, g) = v.device_ptr(s);
                guards.push(g);
                (p, OUT_F32)
            }
            GemvOut::SiluMul(v) => {
                at_least("gemv out", v.len(), m * n)?;
                let (p, g) = v.device_ptr(s);
                guards.push(g);
                (p, OUT_SILU)
            }
            GemvOut::AddTo(r) => {
                at_least("gemv residual out", r.len(), m * n)?;
                let (p, g) = r.device_ptr(s);
                guards.push(g);
                (p, OUT_ADD)
            }
        };
        if out_mode == OUT_ADD {
            residual = y;
        }
        self.launch_gemv(GemvLaunch {
            x,
            residual,
            norm_w,
            w: wp,
            y,
            rows: narrow("m", m)?,
            k: narrow("k", k)?,
            n: narrow("n", n)?,
            in_mode: if normalises { IN_NORM } else { IN_X },
            out_mode,
            set,
            eps,
            blocks: narrow("gemv blocks", n.div_ceil(threads as usize / 32))?,
            threads,
            smem: narrow("gemv shared bytes", smem)?,
        })
    }

    /// `out[b] = bf16(rms_norm(residual[rows[b]]) * weight)` for `b < n_rows` (width `dim`, a
    /// multiple of 4): a step's final norm of its output rows, gathered. `rows` values must
    /// index rows of `residual` (the step's metadata guarantees it).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_rows(
        &self,
        residual: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        weight: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) -> CudaResult<()> {
        if dim == 0 || !dim.is_multiple_of(4) {
            return Err(shape_err("rms_norm_rows dim (a multiple of 4)", 4, dim));
        }
        at_least("rms_norm_rows rows", rows.len(), n_rows)?;
        at_least("rms_norm_rows out", out.len(), n_rows * dim)?;
        crate::check_len("rms_norm_rows weight", weight.len(), dim)?;
        if n_rows == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let (x, _g1) = residual.device_ptr(s);
        aligned16("rms_norm_rows residual", x)?;
        let (r, _g2) = rows.device_ptr(s);
        let (w, _g3) = weight.device_ptr(s);
        let (o, _g4) = out.device_ptr_mut(s);
        let dim_i = narrow::<i32>("dim", dim)?;
        let f = self.function(gemv_source, NORM_ROWS_FN)?;
        let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (x, r, w, o, dim_i, eps);
        let mut args = kernel_args!(a0, a1, a2, a3, a4, a5);
        // SAFETY: the arguments match `rms_norm_rows_f32res(const float*, const int*, const
        // u16*, u16*, int, float)` in order and type; out holds n_rows rows and weight dim
        // values (checked); the row ids index residual by the caller's contract; one block
        // per output row with the threads of the unfused norm (a multiple of 32).
        unsafe {
            self.launch_programmatic(
                &f,
                (
                    narrow("rows", n_rows)?,
                    block_threads(dim.div_ceil(4), 1024),
                    0,
                ),
                &mut args,
            )
        }
    }

    fn launch_gemv(&self, l: GemvLaunch) -> CudaResult<()> {
        // rows is 1..=8 (checked by the callers): R = 1, 2, 4, 8 at index 0..=3.
        let bound = (l.rows.max(1) as u32).next_power_of_two().trailing_zeros() as usize;
        let entry = GEMV_FNS[usize::from(l.out_mode == OUT_SILU)][bound.min(3)];
        let f = self.function(gemv_source, entry)?;
        let GemvLaunch {
            mut x,
            mut residual,
            mut norm_w,
            mut w,
            mut y,
            mut rows,
            mut k,
            mut n,
            mut in_mode,
            mut out_mode,
            mut set,
            mut eps,
            blocks,
            threads,
            smem,
        } = l;
        let mut args = kernel_args!(
            x, residual, norm_w, w, y, rows, k, n, in_mode, out_mode, set, eps
        );
        // SAFETY: the arguments match each `gemv_*` entry's `(const u16*, float*, const
        // u16*, const u16*, void*, int, int, int, int, int, int, float)` in order and type,
        // and the entry's launch bound holds the block (256 threads) and its R >= rows
        // (chosen above). The callers
        // checked every buffer against rows, k and n: x (or init) holds rows * k bf16, the
        // residual rows * k (normalised input) or rows * n (added output) f32, the weight n *
        // k (2n * k for SiLU-and-mul) bf16, y rows * n of the output's type; k is a multiple
        // of 8 and the vector-loaded pointers are 16-byte aligned. A normalised input has
        // rows * k * 2 bytes of dynamic shared memory (<= 48 KiB - 256, the default limit
        // with the kernel's static 128 bytes); the last block's idle warps exit after the
        // prologue's barriers.
        unsafe { self.launch_programmatic(&f, (blocks, threads, smem), &mut args) }
    }

    /// Launches `f` on the stream with `(grid x, block x, dynamic shared bytes)`, allowed to
    /// overlap its predecessor (programmatic stream serialization) on compute capability 9.0
    /// and later; the kernel must `griddepcontrol.wait` before it touches anything its
    /// predecessors write or read.
    ///
    /// # Safety
    /// `args` must point at the kernel's parameters, in order, with their exact types, and the
    /// kernel's memory accesses must be valid for the launch shape.
    pub(super) unsafe fn launch_programmatic(
        &self,
        f: &CudaFunction,
        (grid, block, smem): (u32, u32, u32),
        args: &mut [*mut c_void],
    ) -> CudaResult<()> {
        // SAFETY: the caller's contract is this function's.
        unsafe { self.launch_ex(f, (grid, 1, 1), (block, smem), true, args) }
    }

    /// Launches `f` on the stream over a 3-D `grid` of `(block x threads, dynamic shared
    /// bytes)`, with programmatic stream serialization when `pdl` and the device is compute
    /// capability 9.0 or later (the CTAs may start while the predecessor drains; such a kernel
    /// must `griddepcontrol.wait` before it touches anything its predecessors write or read).
    ///
    /// # Safety
    /// `args` must point at the kernel's parameters, in order, with their exact types, and the
    /// kernel's memory accesses must be valid for the launch shape.
    pub(super) unsafe fn launch_ex(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        (block, smem): (u32, u32),
        pdl: bool,
        args: &mut [*mut c_void],
    ) -> CudaResult<()> {
        self.ctx.bind_to_thread()?;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: the union is plain data; zeroed is a valid value of each field.
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let pdl = pdl && self.info.compute_capability.0 >= 9;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &raw mut attr,
            numAttrs: u32::from(pdl),
        };
        // SAFETY: cfg and attr outlive the call; the caller vouches for args and the kernel.
        unsafe {
            sys::cuLaunchKernelEx(
                &raw const cfg,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(CudaError::from)
    }
}

mod staged;
pub use staged::*;

#[cfg(test)]
mod staged_tests;
#[cfg(test)]
mod tests;
