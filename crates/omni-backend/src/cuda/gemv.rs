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
/// The GEMV's entries by (SiLU-and-mul pair, blocks of up to 1024 threads); blocks of at most
/// 512 threads take the first pair (twice the registers per thread).
const GEMV_FNS: [[&str; 2]; 2] = [
    ["gemv_fused_bf16", "gemv_fused_bf16_1024"],
    ["gemv_fused_silu_bf16", "gemv_fused_silu_bf16_1024"],
];
const NORM_ROWS_FN: &str = "rms_norm_rows_f32res";

/// The most rows [`CudaContext::gemv_nt_bf16`] takes.
pub const GEMV_MAX_ROWS: usize = 8;
/// Warps per block of the plain GEMV (one output column each).
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

/// One resolved launch of `gemv_fused_bf16`.
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

/// The block of a GEMV with `rows` rows of width `k` read as `input`: a normalising one uses
/// the threads `fused_add_rmsnorm_f32res` would (the same reduction, so the same bits) and
/// holds the normalised rows in shared memory. Returns (threads, shared bytes).
pub fn gemv_block(rows: usize, k: usize, normalises: bool) -> (u32, usize) {
    if normalises {
        (block_threads(k.div_ceil(4), 1024), rows * k * 2)
    } else {
        ((PLAIN_WARPS * 32) as u32, 0)
    }
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
        let entry = GEMV_FNS[usize::from(l.out_mode == OUT_SILU)][usize::from(l.threads > 512)];
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
        // SAFETY: the arguments match each `gemv_fused_*` entry's `(const u16*, float*, const
        // u16*, const u16*, void*, int, int, int, int, int, int, float)` in order and type,
        // and the entry's launch bound holds the block (512 or 1024 threads, chosen above). The callers
        // checked every buffer against rows, k and n: x (or init) holds rows * k bf16, the
        // residual rows * k (normalised input) or rows * n (added output) f32, the weight n *
        // k (2n * k for SiLU-and-mul) bf16, y rows * n of the output's type; k is a multiple
        // of 8 and the vector-loaded pointers are 16-byte aligned; rows <= 8 (the kernel's
        // accumulators). A normalised input has `block_threads(k / 4)` threads (a multiple of
        // 32) and rows * k * 2 bytes of dynamic shared memory (<= 48 KiB - 256, the default
        // limit with the kernel's static 128 bytes); the last block's idle warps exit after
        // the prologue's barriers.
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The kernel's indexing on the host: every output column is owned by exactly one warp,
    /// every chunk of a row is read once per lane set, in the plain loop's order; a SiLU
    /// warp pairs gate `o` with up `o + n`; the norm block is the unfused norm's.
    #[test]
    fn gemv_indexing_covers_each_column_and_chunk_once() {
        for (n, silu) in [
            (1usize, false),
            (37, false),
            (1024, false),
            (64, true),
            (3072, true),
        ] {
            let warps = PLAIN_WARPS;
            let blocks = n.div_ceil(warps);
            let mut owner = vec![0usize; if silu { 2 * n } else { n }];
            for b in 0..blocks {
                for w in 0..warps {
                    if let Some((o, rows)) = gemv_warp_rows(b, w, warps, n, silu) {
                        assert!(o < n);
                        for r in rows {
                            owner[r] += 1;
                        }
                    }
                }
            }
            assert!(owner.iter().all(|&c| c == 1), "n {n} silu {silu}");
        }
        for k in [8usize, 64, 1024, 2048, 3072, 8192, 8200] {
            let mut seen = vec![0usize; k / 8];
            for lane in 0..32 {
                let c = gemv_lane_chunks(lane, k);
                // The plain loop: lane, lane + 32, ...
                let plain: Vec<usize> = (lane..k / 8).step_by(32).collect();
                assert_eq!(c, plain, "k {k} lane {lane}");
                for i in c {
                    seen[i] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "k {k}");
        }
        assert_eq!(gemv_block(8, 1024, true), (256, 16384));
        assert_eq!(gemv_block(1, 64, true), (32, 128));
        assert_eq!(gemv_block(8, 3072, false), (256, 0));
        assert!(CudaContext::gemv_norm_fits(8, 2048));
        assert!(!CudaContext::gemv_norm_fits(8, 3072));
    }

    /// A host emulation of the fused GEMV (chunks per lane in kernel order, the lane sums
    /// reduced as the warp shuffle does) equals a plain dot product up to f32 reassociation,
    /// and the SiLU pairing reads gate and up rows of the fused weight.
    #[test]
    fn emulated_silu_gemv_pairs_gate_and_up() {
        let (rows, k, n) = (3usize, 64usize, 5usize);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let w: Vec<f32> = (0..2 * n * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 16.0)
            .collect();
        let dot = |r: usize, row: usize| -> f32 {
            let mut lanes = [0f32; 32];
            for (lane, acc) in lanes.iter_mut().enumerate() {
                for c in gemv_lane_chunks(lane, k) {
                    let mut s = 0f32;
                    for j in 0..8 {
                        s += x[r * k + c * 8 + j] * w[row * k + c * 8 + j];
                    }
                    *acc += s;
                }
            }
            let mut step = 16;
            while step > 0 {
                let prev = lanes;
                for l in 0..32 {
                    lanes[l] = prev[l] + prev[l ^ step];
                }
                step /= 2;
            }
            lanes[0]
        };
        let silu = |g: f32| g / (1.0 + (-g).exp());
        for o in 0..n {
            let (_, wr) = gemv_warp_rows(0, o, PLAIN_WARPS, n, true).unwrap();
            for r in 0..rows {
                let got = silu(dot(r, wr[0])) * dot(r, wr[1]);
                let g: f32 = (0..k).map(|i| x[r * k + i] * w[o * k + i]).sum();
                let u: f32 = (0..k).map(|i| x[r * k + i] * w[(n + o) * k + i]).sum();
                let want = silu(g) * u;
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{got} {want}"
                );
            }
        }
    }

    /// On the device: every fused form equals the unfused kernels it replaces, bit for bit
    /// (the same rounding points and reduction orders).
    #[test]
    fn fused_gemv_equals_the_unfused_kernels_bitwise() {
        use crate::cuda::ResidualUpdate;
        use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32};
        let Some(cx) = ctx_or_skip("fused_gemv_equals_the_unfused_kernels_bitwise") else {
            return;
        };
        let s = cx.stream().clone();
        let (n, eps) = (100usize, 1e-6f32);
        // k = 1024 normalises with 256 threads, 4096 with 1024 (the other kernel entries).
        for (k, rows) in [
            (1024usize, 1usize),
            (1024, 3),
            (1024, 8),
            (4096, 1),
            (4096, 5),
        ] {
            let w = cx.upload_f32_as_bf16(&rand_bf16_f32(2 * n * k, 1)).unwrap();
            let wn: Vec<f32> = rand_bf16_f32(k, 2).iter().map(|x| 1.0 + x / 4.0).collect();
            let wn = cx.upload_f32_as_bf16(&wn).unwrap();
            let init = cx.upload_f32_as_bf16(&rand_bf16_f32(rows * k, 3)).unwrap();
            let attn = cx.upload_f32_as_bf16(&rand_bf16_f32(rows * k, 4)).unwrap();
            let w1 = w.slice(..n * k);
            // Unfused: x = init; h = norm(x); y = h W1; x += attn W1 (f32); h = norm(x);
            // gu = h W; act = silu_mul(gu); final = norm(x) gathered.
            let mut x = s.alloc_zeros::<f32>(rows * k).unwrap();
            let mut h = s.alloc_zeros::<bf16>(rows * k).unwrap();
            let mut y = s.alloc_zeros::<bf16>(rows * n).unwrap();
            cx.fused_add_rms_norm(
                &mut x,
                ResidualUpdate::Set(init.slice(..)),
                &wn,
                &mut h,
                rows,
                k,
                eps,
            )
            .unwrap();
            cx.gemv_nt_bf16(&h, &w1, &mut y, rows, k, n).unwrap();
            let mut proj = s.alloc_zeros::<f32>(rows * k).unwrap();
            let wo = cx.upload_f32_as_bf16(&rand_bf16_f32(k * k, 5)).unwrap();
            cx.gemv_nt_bf16_f32(&attn, &wo, &mut proj, rows, k, k)
                .unwrap();
            cx.fused_add_rms_norm(
                &mut x,
                ResidualUpdate::Add(proj.slice(..)),
                &wn,
                &mut h,
                rows,
                k,
                eps,
            )
            .unwrap();
            let mut gu = s.alloc_zeros::<bf16>(rows * 2 * n).unwrap();
            cx.gemv_nt_bf16(&h, &w, &mut gu, rows, k, 2 * n).unwrap();
            let mut act = s.alloc_zeros::<bf16>(rows * n).unwrap();
            cx.silu_and_mul_bf16(&gu, &mut act, n).unwrap();
            // Fused.
            let mut fx = s.alloc_zeros::<f32>(rows * k).unwrap();
            let mut fy = s.alloc_zeros::<bf16>(rows * n).unwrap();
            cx.gemv_fused(
                &w1,
                GemvIn::SetNorm {
                    init: init.slice(..),
                    residual: &mut fx,
                    weight: &wn,
                    eps,
                },
                GemvOut::Bf16(fy.slice_mut(..)),
                rows,
                k,
                n,
            )
            .unwrap();
            cx.gemv_fused(
                &wo,
                GemvIn::X(attn.slice(..)),
                GemvOut::AddTo(&mut fx),
                rows,
                k,
                k,
            )
            .unwrap();
            let mut fact = s.alloc_zeros::<bf16>(rows * n).unwrap();
            cx.gemv_fused(
                &w,
                GemvIn::Norm {
                    residual: &mut fx,
                    weight: &wn,
                    eps,
                },
                GemvOut::SiluMul(fact.slice_mut(..)),
                rows,
                k,
                n,
            )
            .unwrap();
            let pick: Vec<i32> = (0..rows as i32).rev().collect();
            let pick_d = s.clone_htod(&pick).unwrap();
            let mut fin = s.alloc_zeros::<bf16>(rows * k).unwrap();
            cx.rms_norm_rows(&fx, &pick_d, &wn, &mut fin, rows, k, eps)
                .unwrap();
            let bits = |v: &CudaSlice<bf16>| -> Vec<u16> {
                s.clone_dtoh(v)
                    .unwrap()
                    .iter()
                    .map(|b| b.to_bits())
                    .collect()
            };
            let xb = |v: &CudaSlice<f32>| -> Vec<u32> {
                s.clone_dtoh(v)
                    .unwrap()
                    .iter()
                    .map(|b| b.to_bits())
                    .collect()
            };
            assert_eq!(bits(&fy), bits(&y), "rows {rows}: normed GEMV");
            assert_eq!(xb(&fx), xb(&x), "rows {rows}: residual add epilogue");
            assert_eq!(
                bits(&fact),
                bits(&act),
                "rows {rows}: SiLU-and-mul epilogue"
            );
            let (hb, fb) = (bits(&h), bits(&fin));
            for (b, &r) in pick.iter().enumerate() {
                let r = r as usize;
                assert_eq!(
                    fb[b * k..(b + 1) * k],
                    hb[r * k..(r + 1) * k],
                    "rows {rows}: final norm"
                );
            }
            println!("fused gemv k {k} rows {rows}: bitwise equal to the unfused kernels");
        }
    }

    /// Timing lines, not a check: the fused GEMV against cuBLAS on the decoder's real shapes
    /// (Qwen3-30B-A3B and Qwen3-8B projections) in a CUDA graph, each call on another copy of
    /// the weights so that none is found in L2 (as in a model's layer sequence).
    #[test]
    fn gemv_real_shape_timing() {
        use crate::cuda::tests::{ctx_or_skip, graph_us, rand_bf16_f32};
        let Some(cx) = ctx_or_skip("gemv_real_shape_timing") else {
            return;
        };
        let s = cx.stream().clone();
        // (name, k, n, normalised input, SiLU pair)
        let shapes = [
            ("30b qkv", 2048usize, 5120usize, true, false),
            ("30b o", 4096, 2048, false, false),
            ("8b qkv", 4096, 6144, true, false),
            ("8b o", 4096, 4096, false, false),
            ("8b gate_up", 4096, 12288, true, true),
            ("8b down", 12288, 4096, false, false),
        ];
        for (name, k, n, norm, silu) in shapes {
            let wrows = if silu { 2 * n } else { n };
            let bytes = wrows * k * 2;
            let copies = (200_000_000 / bytes).clamp(1, 16);
            let ws: Vec<CudaSlice<bf16>> = (0..copies)
                .map(|c| s.alloc_zeros::<bf16>(wrows * k + c).unwrap())
                .collect();
            let wn = cx.upload_f32_as_bf16(&vec![1.0; k]).unwrap();
            for rows in [1usize, 4, 8] {
                if norm && !CudaContext::gemv_norm_fits(rows, k) {
                    continue;
                }
                let x = cx.upload_f32_as_bf16(&rand_bf16_f32(rows * k, 9)).unwrap();
                let mut res = s.clone_htod(&rand_bf16_f32(rows * k.max(n), 10)).unwrap();
                let mut y = s.alloc_zeros::<bf16>(rows * wrows).unwrap();
                let mut y32 = s.alloc_zeros::<f32>(rows * n).unwrap();
                let mut i = 0usize;
                let us_gemv = graph_us(&cx, &mut || {
                    let w = ws[i % copies].slice(..wrows * k);
                    i += 1;
                    let input = if norm {
                        GemvIn::Norm {
                            residual: &mut res,
                            weight: &wn,
                            eps: 1e-6,
                        }
                    } else {
                        GemvIn::X(x.slice(..))
                    };
                    let out = if silu {
                        GemvOut::SiluMul(y.slice_mut(..rows * n))
                    } else if norm {
                        GemvOut::Bf16(y.slice_mut(..rows * n))
                    } else {
                        GemvOut::F32(y32.slice_mut(..))
                    };
                    cx.gemv_fused(&w, input, out, rows, k, n).unwrap();
                });
                let us_cublas = graph_us(&cx, &mut || {
                    let w = ws[i % copies].slice(..wrows * k);
                    i += 1;
                    cx.matmul_nt_bf16(&x, &w, &mut y, rows, k, wrows).unwrap();
                });
                let mb = bytes as f64 / 1e6;
                println!(
                    "gemv {name} rows {rows}: fused {us_gemv:.1} µs ({:.2} TB/s), cuBLAS {us_cublas:.1} µs ({:.2} TB/s)",
                    mb / us_gemv,
                    mb / us_cublas
                );
            }
        }
    }
}
