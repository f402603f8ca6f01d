//! The prefill path of the expert block on cuBLAS (batched GEMMs, Hopper's wgmma kernels), for
//! steps with many pairs per expert.
//!
//! 1. `moe_count`: pairs per expert, copied to the host (the one synchronization: cuBLAS takes
//!    each problem's size on the host).
//! 2. The host rounds each expert's count up to a bucket ([`bucket_rows`]), lays the experts
//!    out back to back in buckets of that many rows, uploads each expert's first row as its
//!    cursor and the problems' pointers. Experts of one bucket size form one group, one
//!    batched launch: one launch per expert (all sizes distinct) ran at a fifth of the tensor
//!    cores' rate on an H200 (each expert alone fills a few SMs).
//! 3. `moe_gather`: the token rows into expert order (`xg`), and each pair's row (`inv`).
//! 4. A batched GEMM per bucket over the experts that got pairs: `gate_up_e = xg_e @ w13[e]^T`.
//! 5. SiLU-and-mul (`silu_mul_bf16`) into `act`.
//! 6. A batched GEMM per bucket: `y_e = act_e @ w2[e]^T`.
//! 7. `moe_reduce` reading `y` through `inv`, slots in order.
//!
//! Padding rows (past an expert's count, inside its bucket) are computed and never read. Not
//! capturable in a CUDA graph (step 1 reads the device), so [`CudaContext::fused_moe_bf16`]
//! takes it only outside a capture.

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::launch::MoeOut;
use super::source::{COUNT_FN, GATHER_FN, moe_source};
use super::{MoeShape, align256};
use crate::cuda::launch::{block_threads, elementwise_cfg, narrow, shape_err};
use crate::cuda::{CudaContext, CudaResult, bf16};

/// Set to `0`, prefill steps stay on the in-house grouped GEMM kernels (to measure the cuBLAS
/// path against them in one build). Read once per process.
pub const MOE_CUBLAS_ENV: &str = "OMNI_CUDA_MOE_CUBLAS";

/// Whether [`MOE_CUBLAS_ENV`] leaves the cuBLAS prefill path on (the default).
pub(super) fn cublas_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::cuda::switch_on(MOE_CUBLAS_ENV))
}

/// The smallest bucket quantum the path uses by default: counts round up to multiples of 32
/// rows below 128 rows, then to a quarter of their power of two (on an H200 at 2048 / 4096
/// tokens: 565 / 808 µs against 569 / 823 with 64 and 603 / 881 with 128).
pub(super) const DEFAULT_QUANTUM: usize = 32;
/// The largest quantum a caller may pass (the workspace bound assumes it).
pub(super) const MAX_QUANTUM: usize = 128;

/// The rows an expert with `count` pairs gets: `count` rounded up to a multiple of
/// `max(quantum, 2^floor(log2 count) / 4)`. At most `quantum - 1 + count / 4` padding rows, and
/// at most 4 distinct sizes per power of two above `4 * quantum`, so a skewed routing still
/// makes few groups.
pub(super) fn bucket_rows(count: usize, quantum: usize) -> usize {
    if count == 0 {
        return 0;
    }
    let pow2 = 1usize << (usize::BITS - 1 - count.leading_zeros());
    let q = quantum.max(pow2 / 4);
    count.div_ceil(q) * q
}

/// Rows the buckets of `pairs` pairs over `experts` experts can take at most (any quantum up
/// to [`MAX_QUANTUM`]): each used expert pads at most `MAX_QUANTUM - 1 + count / 4` rows.
fn max_rows(pairs: usize, experts: usize) -> usize {
    pairs + pairs / 4 + MAX_QUANTUM * pairs.min(experts)
}

/// Byte offsets of the cuBLAS path's workspace parts.
#[derive(Debug, Clone, Copy)]
pub(super) struct CublasLayout {
    /// Rows of `xg`, `gate_up` and `act` ([`max_rows`]).
    rows: usize,
    counts: usize,
    cursor: usize,
    /// Six arrays of `E` device pointers: gate_up's weights, inputs, outputs, then down's.
    ptrs: usize,
    inv: usize,
    /// `xg` (`[rows, hidden]`), later reused for `y` (xg is dead after the first GEMM).
    xg_y: usize,
    gate_up: usize,
    act: usize,
    pub(super) total: usize,
}

impl CublasLayout {
    pub(super) fn new(shape: &MoeShape) -> Self {
        let (p, e) = (shape.pairs(), shape.num_experts);
        let rows = max_rows(p, e);
        let counts = 0;
        let cursor = align256(counts + e * 4);
        let ptrs = align256(cursor + e * 4);
        let inv = align256(ptrs + 6 * e * 8);
        let xg_y = align256(inv + p * 4);
        let gate_up = align256(xg_y + rows * shape.hidden * 2);
        let act = align256(gate_up + rows * 2 * shape.inter * 2);
        let total = align256(act + rows * shape.inter * 2);
        Self {
            rows,
            counts,
            cursor,
            ptrs,
            inv,
            xg_y,
            gate_up,
            act,
            total,
        }
    }
}

/// One grouped GEMM's problems in cuBLAS's column-major terms: for each used expert,
/// `C (m x n) = op_T(A_e) (m x k) * B_e (k x n)`, i.e. row-major `out_e [n, m] = in_e [n, k] @
/// w_e [m, k]^T`, where group `j` has `sizes[j]` problems of `n = ns[j]` rows (a bucket).
struct Grouped<'a> {
    m: i32,
    k: i32,
    ns: &'a [i32],
    sizes: &'a [i32],
}

impl CudaContext {
    /// The cuBLAS path of [`CudaContext::fused_moe_bf16`] (same contract; the caller checked
    /// the shapes and lengths, that the stream is not capturing and that `workspace` holds
    /// [`CublasLayout::total`] bytes). Synchronizes once.
    /// `quantum` is the smallest bucket ([`bucket_rows`]; at most [`MAX_QUANTUM`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_moe_cublas(
        &self,
        x: &impl DevicePtr<bf16>,
        w13: &impl DevicePtr<bf16>,
        w2: &impl DevicePtr<bf16>,
        topk_ids: &impl DevicePtr<i32>,
        topk_weights: &impl DevicePtr<f32>,
        out: MoeOut,
        workspace: &mut impl DevicePtrMut<u8>,
        shape: MoeShape,
        quantum: usize,
    ) -> CudaResult<()> {
        if quantum == 0 || quantum > MAX_QUANTUM {
            return Err(shape_err("moe bucket quantum", MAX_QUANTUM, quantum));
        }
        let MoeShape {
            tokens,
            hidden,
            inter,
            num_experts,
            top_k,
        } = shape;
        let pairs = shape.pairs();
        let lay = CublasLayout::new(&shape);
        if workspace.len() < lay.total {
            return Err(shape_err(
                "fused moe workspace bytes (at least fused_moe_workspace_bytes)",
                lay.total,
                workspace.len(),
            ));
        }
        if tokens == 0 {
            return Ok(());
        }
        let (mut h_i, i_i, mut e_i, mut k_i, mut p_i) = (
            narrow::<i32>("hidden", hidden)?,
            narrow::<i32>("inter", inter)?,
            narrow::<i32>("num_experts", num_experts)?,
            narrow::<i32>("top_k", top_k)?,
            narrow::<i32>("tokens * top_k", pairs)?,
        );
        let two_i = narrow::<i32>("2 * inter", 2 * inter)?;
        let (mut x_p, _gx) = x.device_ptr(&self.stream);
        let (w13_p, _g13) = w13.device_ptr(&self.stream);
        let (w2_p, _g2) = w2.device_ptr(&self.stream);
        let (mut ids_p, _gi) = topk_ids.device_ptr(&self.stream);
        let (tw_p, _gw) = topk_weights.device_ptr(&self.stream);
        let (ws_p, _gws) = workspace.device_ptr_mut(&self.stream);
        let at = |off: usize| ws_p + off as u64;
        let (mut counts_p, mut cursor_p, ptrs_p, mut inv_p) =
            (at(lay.counts), at(lay.cursor), at(lay.ptrs), at(lay.inv));
        let (mut xg_p, gu_p, act_p) = (at(lay.xg_y), at(lay.gate_up), at(lay.act));

        // 1. Counts, to the host.
        let f_count = self.function(moe_source, COUNT_FN)?;
        let threads = block_threads(pairs.max(num_experts), 1024);
        let mut args = kernel_args![ids_p, p_i, e_i, counts_p];
        // SAFETY: `args` points at the arguments of `moe_count(const int*, int, int, int*)` in
        // order; ids hold `pairs` ints (checked by the caller); counts (E ints) lies in the
        // workspace, whose length was checked against the layout; one CTA of a multiple of 32
        // threads (at most 1024) with E ints of dynamic shared memory (E <= MOE_MAX_EXPERTS).
        unsafe {
            self.launch_ex(
                &f_count,
                (1, 1, 1),
                (threads, (num_experts * 4) as u32),
                false,
                &mut args,
            )
        }?;
        let mut counts = vec![0i32; num_experts];
        // SAFETY: `counts_p` holds E ints written by the kernel queued before on this stream;
        // the host slice has E elements; the synchronize below completes the copy before the
        // host reads it.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut counts,
                counts_p,
                self.stream.cu_stream(),
            )
        }?;
        self.stream.synchronize()?;

        // 2. Buckets: used experts by bucket size (stable: expert order inside a bucket), laid
        // out back to back; each one's first row, and the problems' pointers in group order.
        let mut used: Vec<(usize, usize)> = counts
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(e, &c)| (e, bucket_rows(c as usize, quantum)))
            .collect();
        used.sort_by_key(|&(_, rows)| rows);
        let mut first = vec![0i32; num_experts];
        let (mut ns, mut sizes) = (Vec::<i32>::new(), Vec::<i32>::new());
        let g = used.len();
        let mut ptrs = vec![0u64; 6 * g];
        let bytes = |elems: usize| (elems * 2) as u64;
        let mut row = 0usize;
        for (j, &(e, rows)) in used.iter().enumerate() {
            first[e] = narrow::<i32>("moe sorted rows", row)?;
            let n = narrow::<i32>("moe bucket rows", rows)?;
            match sizes.last_mut() {
                Some(size) if ns.last() == Some(&n) => *size += 1,
                _ => {
                    ns.push(n);
                    sizes.push(1);
                }
            }
            ptrs[j] = w13_p + bytes(e * 2 * inter * hidden);
            ptrs[g + j] = xg_p + bytes(row * hidden);
            ptrs[2 * g + j] = gu_p + bytes(row * 2 * inter);
            ptrs[3 * g + j] = w2_p + bytes(e * hidden * inter);
            ptrs[4 * g + j] = act_p + bytes(row * inter);
            ptrs[5 * g + j] = xg_p + bytes(row * hidden);
            row += rows;
        }
        if row > lay.rows {
            return Err(shape_err(
                "moe bucket rows (the workspace bound)",
                lay.rows,
                row,
            ));
        }
        // SAFETY: the cursor array (E ints) and the pointer arrays (6 E u64 >= 6 g) lie in the
        // workspace; pageable sources are staged by the driver before the calls return.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(cursor_p, &first, self.stream.cu_stream())?;
            if g > 0 {
                cudarc::driver::result::memcpy_htod_async(ptrs_p, &ptrs, self.stream.cu_stream())?;
            }
        }

        // 3. Token rows into expert order.
        let f_gather = self.function(moe_source, GATHER_FN)?;
        let cfg = elementwise_cfg(pairs * 32);
        let mut args = kernel_args![x_p, ids_p, p_i, e_i, k_i, h_i, cursor_p, xg_p, inv_p];
        // SAFETY: `args` points at the arguments of `moe_gather(const u16*, const int*, int,
        // int, int, int, int*, u16*, int*)` in order; x holds tokens * hidden elements and every
        // row read is p / k < tokens; the cursors start at the experts' first rows, laid out
        // from buckets of at least the counts of the same ids, so the rows handed out to expert
        // e stay in [first[e], first[e] + count[e]) and below `row` <= lay.rows: xg (lay.rows
        // * hidden) and inv (pairs) lie in the workspace; hidden is a multiple of 8 and x / xg
        // 16-byte aligned (checked by the caller, layout offsets are multiples of 256).
        unsafe {
            self.launch_ex(
                &f_gather,
                cfg.grid_dim,
                (cfg.block_dim.0, 0),
                false,
                &mut args,
            )
        }?;

        if g > 0 {
            let at_ptr = |j: usize| ptrs_p + (j * g * 8) as u64;
            // 4. gate_up for every used expert: out [n, 2I] = xg_e [n, H] @ w13[e]^T.
            self.grouped_gemm(
                &Grouped {
                    m: two_i,
                    k: h_i,
                    ns: &ns,
                    sizes: &sizes,
                },
                (at_ptr(0), at_ptr(1), at_ptr(2)),
            )?;
            // 5. SiLU-and-mul into act (every bucket row; padding rows are never read).
            // SAFETY: gate_up holds row * 2I and act row * I elements of the workspace (row <=
            // lay.rows), both device pointers on this context.
            unsafe { self.silu_and_mul_ptrs(gu_p, act_p, row * inter, inter) }?;
            // 6. down: y_e [n_e, H] = act_e [n_e, I] @ w2[e]^T (y over xg, dead by now).
            self.grouped_gemm(
                &Grouped {
                    m: h_i,
                    k: i_i,
                    ns: &ns,
                    sizes: &sizes,
                },
                (at_ptr(3), at_ptr(4), at_ptr(5)),
            )?;
        }

        // 7. Weighted reduction through inv.
        // SAFETY: the pairs of valid experts have inv rows < row <= lay.rows written by the
        // gather, and their y rows (y holds lay.rows * hidden, over xg) by step 6; other pairs
        // are skipped; ids / weights hold pairs elements and out tokens * hidden of its type
        // (checked by the caller); hidden is a multiple of 8 and the pointers 16-byte aligned.
        unsafe { self.moe_reduce_launch((xg_p, ids_p, tw_p, inv_p), out, &shape, false) }?;
        Ok(())
    }

    /// The problems of `p` (`p.sizes[j]` problems of `p.ns[j]` rows each), bf16 in and out
    /// with f32 accumulation, as one `cublasGemmBatchedEx` per group; `(a, b, c)` are device
    /// arrays of the problems' pointers, in group order. (`cublasGemmGroupedBatchedEx` over the
    /// same groups measured 1.4-1.9x slower on an H200 at 1024-4096 tokens.)
    fn grouped_gemm(&self, p: &Grouped<'_>, (a, b, c): (u64, u64, u64)) -> CudaResult<()> {
        let bf = blas_sys::cudaDataType_t::CUDA_R_16BF;
        let (alpha, beta) = (1f32, 0f32);
        let mut done = 0u64;
        for (&n, &size) in p.ns.iter().zip(p.sizes) {
            let off = done * 8;
            // SAFETY: the pointer arrays hold every problem's pointers in group order, so this
            // group's `size` entries start `done` entries in; weights m x k (ld k), inputs n
            // rows of k (ld k), outputs n rows of m (ld m), inside their allocations as for
            // the grouped call; alpha / beta are f32 (CUBLAS_COMPUTE_32F).
            unsafe {
                blas_sys::cublasGemmBatchedEx(
                    *self.blas.handle(),
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    p.m,
                    n,
                    p.k,
                    (&raw const alpha).cast(),
                    (a + off) as *const *const std::ffi::c_void,
                    bf,
                    p.k,
                    (b + off) as *const *const std::ffi::c_void,
                    bf,
                    p.k,
                    (&raw const beta).cast(),
                    (c + off) as *const *mut std::ffi::c_void,
                    bf,
                    p.m,
                    size,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .result()?;
            done += size as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_counts_with_bounded_padding_and_few_sizes() {
        for quantum in [1usize, 32, 64, MAX_QUANTUM] {
            let mut sizes = std::collections::BTreeSet::new();
            for c in 0..5000usize {
                let b = bucket_rows(c, quantum);
                assert!(b >= c, "count {c} quantum {quantum}: bucket {b}");
                assert!(b - c < quantum.max(1) + c / 4, "count {c}: bucket {b}");
                if (1024..2048).contains(&c) {
                    sizes.insert(b);
                }
            }
            // One power of two of counts (above 4 quanta) takes at most 5 bucket sizes.
            assert!(sizes.len() <= 5, "quantum {quantum}: {sizes:?}");
        }
        assert_eq!(bucket_rows(0, 64), 0);
        assert_eq!(bucket_rows(1, 64), 64);
        assert_eq!(bucket_rows(129, 64), 192);
        assert_eq!(bucket_rows(600, 64), 640);
        // Every routing's buckets fit the workspace bound: the worst is many tiny experts.
        let (pairs, experts) = (4096usize, 128usize);
        let tiny: usize = (0..experts).map(|_| bucket_rows(1, MAX_QUANTUM)).sum();
        let spread: usize = (0..experts)
            .map(|_| bucket_rows(pairs / experts + 1, MAX_QUANTUM))
            .sum();
        assert!(tiny.max(spread) <= max_rows(pairs, experts));
    }
}
