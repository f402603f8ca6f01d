//! Mixture-of-experts on the GPU (Qwen3-MoE): top-k softmax routing and a fused,
//! CUDA-graph-capturable expert MLP.
//!
//! [`CudaContext::fused_moe_bf16`] queues four kernels, none of which reads routing on the host:
//!
//! 1. `moe_align` (one CTA): counts the `(token, slot)` pairs per expert, pads every expert's
//!    count to a multiple of the tile height `BM`, prefix-sums the padded counts and scatters the
//!    pair indices `t * top_k + slot` into `sorted_ids` (padding rows are `-1`), with the expert of
//!    each `BM`-row block in `block_expert` (`-1` for blocks past the used ones). Like vLLM's
//!    `moe_align_block_size`.
//! 2. A grouped GEMM `gate_up = x[token] @ w13[e]^T` over the sorted rows, gathering token rows of
//!    `x`, with SiLU-and-mul fused in the epilogue (each CTA owns matching gate and up columns),
//!    into `act` (`[sorted rows, inter]`).
//! 3. A grouped GEMM `y[pair] = act @ w2[e]^T`, scattering rows back to pair order.
//! 4. `moe_reduce`: `out[t] = sum_slot w[t, slot] * y[t * top_k + slot]` in f32, slots in order
//!    (deterministic, no float atomics).
//!
//! Both GEMMs run on tensor cores (`mma.sync.m16n8k16` bf16 -> f32, `ldmatrix`, a multi-stage
//! `cp.async` pipeline). Launch grids depend only on host scalars: the number of `BM`-row blocks
//! is bounded by `min(P, ceil((P + min(E, P) * (BM - 1)) / BM))` for `P = tokens * top_k`
//! pairs, and unused blocks exit at once. Two tile shapes exist: a decode tile (`BM = 16`, narrow
//! `N` tiles so a handful of experts still spreads over every SM and streams its weights once)
//! and a prefill tile (`BM = 64`, `BN = 256`, 64 x 64 warp tiles); the choice depends only on the
//! average number of pairs per expert.

use cudarc::driver::sys::CUfunction_attribute_enum as FnAttr;
use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::kernels::BF16_HELPERS;
use super::{CudaContext, CudaError, CudaResult, bf16, elementwise_cfg, to_i32};

/// Largest expert count the routing and alignment kernels support (their per-expert tables live
/// in shared memory).
pub const MOE_MAX_EXPERTS: usize = 1024;

/// Dimensions of one fused MoE call (one layer, one tensor-parallel rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Tokens `T` (rows of `x` and `out`).
    pub tokens: usize,
    /// Hidden size `H` (a positive multiple of 8).
    pub hidden: usize,
    /// This rank's expert intermediate size `I` (a positive multiple of 8).
    pub inter: usize,
    /// Experts `E` (`1..=`[`MOE_MAX_EXPERTS`]).
    pub num_experts: usize,
    /// Experts per token `k` (`1..=E`).
    pub top_k: usize,
}

impl MoeShape {
    fn pairs(&self) -> usize {
        self.tokens * self.top_k
    }
}

/// One tile configuration of the grouped GEMMs (must match the template arguments emitted into
/// the kernel source by [`gemm_entry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TileCfg {
    gate_up_fn: &'static str,
    down_fn: &'static str,
    /// Rows (sorted pairs) per CTA.
    bm: usize,
    /// Weight rows per CTA (for gate_up: `bn / 2` gate rows and the matching `bn / 2` up rows).
    bn: usize,
    /// K per pipeline stage.
    bk: usize,
    warps_m: usize,
    warps_n: usize,
    stages: usize,
    /// `__launch_bounds__` minimum CTAs per SM.
    min_ctas: usize,
}

/// Decode tile: 16 sorted rows x 32 weight rows, 2 warps, 128-wide K stages (8 KiB of weights
/// per stage), 4 stages; ~52 KiB of shared memory, 4 CTAs per SM.
const SMALL: TileCfg = TileCfg {
    gate_up_fn: "moe_gate_up_small",
    down_fn: "moe_down_small",
    bm: 16,
    bn: 32,
    bk: 128,
    warps_m: 1,
    warps_n: 2,
    stages: 4,
    min_ctas: 4,
};

/// Prefill tile: 64 sorted rows x 256 weight rows, 4 warps of 64 x 64, 32-wide K stages, 4
/// stages; 100 KiB of shared memory, 2 CTAs per SM.
const LARGE: TileCfg = TileCfg {
    gate_up_fn: "moe_gate_up_large",
    down_fn: "moe_down_large",
    bm: 64,
    bn: 256,
    bk: 32,
    warps_m: 1,
    warps_n: 4,
    stages: 4,
    min_ctas: 2,
};

impl TileCfg {
    /// The tile the public entry point uses: the decode tile while the average expert gets at
    /// most 16 pairs, the prefill tile above.
    fn select(shape: &MoeShape) -> Self {
        if shape.pairs() <= 16 * shape.num_experts {
            SMALL
        } else {
            LARGE
        }
    }

    fn threads(&self) -> usize {
        32 * self.warps_m * self.warps_n
    }

    fn smem_bytes(&self) -> usize {
        self.stages * (self.bm + self.bn) * (self.bk + 8) * 2 + self.bm * 4
    }

    /// Upper bound on the `bm`-row blocks the alignment can use for `pairs` pairs over
    /// `experts` experts: each non-empty expert wastes at most `bm - 1` padding rows, and every
    /// used block holds at least one pair.
    fn max_blocks(&self, pairs: usize, experts: usize) -> usize {
        let bound = (pairs + pairs.min(experts) * (self.bm - 1)).div_ceil(self.bm);
        bound.min(pairs)
    }
}

/// Byte offsets of the workspace parts for one tile configuration.
#[derive(Debug, Clone, Copy)]
struct Layout {
    max_blocks: usize,
    sorted: usize,
    block_expert: usize,
    act: usize,
    y: usize,
    total: usize,
}

fn align256(x: usize) -> usize {
    x.div_ceil(256) * 256
}

impl Layout {
    fn new(shape: &MoeShape, cfg: &TileCfg) -> Self {
        let max_blocks = cfg.max_blocks(shape.pairs(), shape.num_experts);
        let rows = max_blocks * cfg.bm;
        let sorted = 0;
        let block_expert = align256(sorted + rows * 4);
        let act = align256(block_expert + max_blocks * 4);
        let y = align256(act + rows * shape.inter * 2);
        let total = align256(y + shape.pairs() * shape.hidden * 2);
        Self {
            max_blocks,
            sorted,
            block_expert,
            act,
            y,
            total,
        }
    }
}

/// Bytes of device workspace [`CudaContext::fused_moe_bf16`] needs for `shape`. The size grows
/// with `tokens` (other dimensions fixed), so a workspace sized for the largest batch serves every
/// smaller one.
pub fn fused_moe_workspace_bytes(shape: MoeShape) -> usize {
    Layout::new(&shape, &SMALL)
        .total
        .max(Layout::new(&shape, &LARGE).total)
}

fn shape_err(what: &'static str, expected: usize, got: usize) -> CudaError {
    crate::Error::Shape {
        what,
        expected,
        got,
    }
    .into()
}

/// Checks the expert count and top-k of a routing problem.
fn check_routing(num_experts: usize, top_k: usize) -> CudaResult<()> {
    if num_experts == 0 || num_experts > MOE_MAX_EXPERTS {
        return Err(shape_err(
            "moe num_experts (1..=MOE_MAX_EXPERTS)",
            MOE_MAX_EXPERTS,
            num_experts,
        ));
    }
    if top_k == 0 || top_k > num_experts {
        return Err(shape_err("moe top_k (1..=num_experts)", num_experts, top_k));
    }
    Ok(())
}

/// Checks a raw device pointer is 16-byte aligned (the kernels move 16-byte vectors).
fn check_align16(what: &'static str, ptr: u64) -> CudaResult<()> {
    if !ptr.is_multiple_of(16) {
        return Err(shape_err(what, 16, (ptr % 16) as usize));
    }
    Ok(())
}

fn grid_u32(what: &'static str, value: usize) -> CudaResult<u32> {
    u32::try_from(value).map_err(|_| CudaError::TooLarge { what, value })
}

/// Sets the dynamic shared memory limit (and the largest shared-memory carveout) a GEMM tile
/// needs. Host-side function attributes only: legal during stream capture.
fn set_smem(f: &CudaFunction, bytes: usize) -> CudaResult<()> {
    f.set_attribute(
        FnAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        to_i32("moe shared memory", bytes)?,
    )?;
    f.set_attribute(
        FnAttr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        100,
    )?;
    Ok(())
}

/// PTX wrappers (sm_80+): `cp.async` with zero fill, `ldmatrix`, bf16 `mma.sync`.
const PTX_HELPERS: &str = r#"
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(const void* smem, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(s));
}
__device__ __forceinline__ void mma_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"#;

/// The MoE kernels (see the module docs). bf16 is `unsigned short`; all math in f32.
const MOE_BODY: &str = r#"
extern __shared__ uint4 moe_smem[];

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

// ---- routing: softmax over E in f32, top-k by probability (ties: lower expert id first),
// optional renormalisation of the k weights (sum taken in selection order). One warp per token.
extern "C" __global__ void __launch_bounds__(128) moe_topk_softmax(
        const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ wts,
        int tokens, int num_experts, int top_k, int renorm) {
    float* probs = reinterpret_cast<float*>(moe_smem) + (threadIdx.x >> 5) * num_experts;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= tokens) return;  // warp-uniform; only warp-level synchronisation below
    const float* row = logits + (size_t)t * num_experts;
    const float neg_inf = __int_as_float(0xff800000);
    float mx = neg_inf;
    for (int i = lane; i < num_experts; i += 32) {
        const float v = row[i];
        probs[i] = v;
        mx = fmaxf(mx, v);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int i = lane; i < num_experts; i += 32) {
        const float e = mx == neg_inf ? 0.f : expf(probs[i] - mx);
        probs[i] = e;
        sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = mx == neg_inf ? 0.f : 1.f / sum;
    for (int i = lane; i < num_experts; i += 32) probs[i] *= inv;
    __syncwarp();
    int* out_ids = ids + (size_t)t * top_k;
    float* out_w = wts + (size_t)t * top_k;
    float sel_sum = 0.f;
    for (int j = 0; j < top_k; ++j) {
        float bv = -1.f;
        int bi = num_experts;
        for (int i = lane; i < num_experts; i += 32) {
            const float v = probs[i];
            if (v > bv) { bv = v; bi = i; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        sel_sum += bv;
        if (lane == 0) { out_ids[j] = bi; out_w[j] = bv; }
        if (bi < num_experts && lane == (bi & 31)) probs[bi] = -2.f;  // the owning lane
        __syncwarp();
    }
    if (renorm && lane == 0)
        for (int j = 0; j < top_k; ++j) out_w[j] = out_w[j] / sel_sum;
}

// ---- alignment (one CTA, blockDim a multiple of 32, at most 1024). Pairs whose expert id is
// outside [0, E) are dropped. Dynamic shared memory: (32 + 3 E) ints.
extern "C" __global__ void __launch_bounds__(1024) moe_align(
        const int* __restrict__ topk_ids, int pairs, int num_experts, int bm, int max_blocks,
        int* __restrict__ sorted_ids, int* __restrict__ block_expert) {
    int* warp_tot = reinterpret_cast<int*>(moe_smem);
    int* cnt = warp_tot + 32;
    int* boff = cnt + num_experts;
    int* cur = boff + num_experts;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
    for (int e = tid; e < num_experts; e += nt) { cnt[e] = 0; cur[e] = 0; }
    __syncthreads();
    for (int p = tid; p < pairs; p += nt) {
        const int e = topk_ids[p];
        if (e >= 0 && e < num_experts) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    // Exclusive prefix sum of the per-expert block counts, nt experts at a time.
    int carry = 0;
    for (int base = 0; base < num_experts; base += nt) {
        const int e = base + tid;
        const int v = e < num_experts ? (cnt[e] + bm - 1) / bm : 0;
        int x = v;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) warp_tot[warp] = x;
        __syncthreads();
        if (warp == 0) {
            int s = lane < nwarps ? warp_tot[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, s, o);
                if (lane >= o) s += y;
            }
            warp_tot[lane] = s;
        }
        __syncthreads();
        if (e < num_experts) boff[e] = carry + (warp > 0 ? warp_tot[warp - 1] : 0) + x - v;
        carry += warp_tot[31];
        __syncthreads();
    }
    const int total = carry;
    for (int e = tid; e < num_experts; e += nt) {
        const int c = cnt[e];
        const int nb = (c + bm - 1) / bm;
        const int b0 = boff[e];
        for (int b = 0; b < nb; ++b)
            if (b0 + b < max_blocks) block_expert[b0 + b] = e;
        for (int q = c; q < nb * bm; ++q)
            if (b0 + q / bm < max_blocks) sorted_ids[(long long)b0 * bm + q] = -1;
    }
    for (int b = total + tid; b < max_blocks; b += nt) block_expert[b] = -1;
    for (int p = tid; p < pairs; p += nt) {
        const int e = topk_ids[p];
        if (e >= 0 && e < num_experts) {
            const int slot = atomicAdd(&cur[e], 1);
            if (boff[e] + slot / bm < max_blocks) sorted_ids[(long long)boff[e] * bm + slot] = p;
        }
    }
}

// ---- grouped GEMM over the sorted rows of one BM-row block (grid: x = N tile, y = block).
// GATE_UP: A = x [T, H] gathered by token (p / top_k), B = w13[e] [2I, H], the CTA's B tile is
//   BN/2 gate rows then the matching BN/2 up rows; epilogue silu(gate) * up -> act [rows, I].
// else:    A = act [rows, I] (row = sorted position), B = w2[e] [H, I]; epilogue -> y [P, H]
//   at row p. Rows with p < 0 (padding) are zero-filled and not stored.
// Shared memory (dynamic): STAGES x (BM + BN) x (BK + 8) bf16, then BM ints.
template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool GATE_UP>
__device__ __forceinline__ void moe_gemm(
        const unsigned short* __restrict__ a_src, const unsigned short* __restrict__ w,
        const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
        unsigned short* __restrict__ dst, int hidden, int inter, int top_k) {
    constexpr int NT = WM * WN * 32;
    constexpr int WTM = BM / WM;
    constexpr int WTN = BN / WN;
    constexpr int MF = WTM / 16;
    constexpr int NF = WTN / 8;
    constexpr int LDS = BK + 8;
    constexpr int CPR = BK / 8;
    constexpr int RSTEP = NT / CPR;
    constexpr int A_IT = BM / RSTEP;
    constexpr int B_IT = BN / RSTEP;
    static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile: whole m16 and pairs of n8 fragments");
    static_assert(BK % 16 == 0 && NT % CPR == 0, "k tiling");
    static_assert(BM % RSTEP == 0 && BN % RSTEP == 0 && (BN / 2) % RSTEP == 0, "load mapping");

    const int expert = block_expert[blockIdx.y];
    if (expert < 0) return;  // CTA-uniform, before any barrier
    const int K = GATE_UP ? hidden : inter;
    const int N = GATE_UP ? inter : hidden;
    const long long m0 = (long long)blockIdx.y * BM;

    unsigned short* sA = reinterpret_cast<unsigned short*>(moe_smem);
    unsigned short* sB = sA + STAGES * BM * LDS;
    int* s_pair = reinterpret_cast<int*>(sB + STAGES * BN * LDS);
    const int tid = threadIdx.x;
    for (int r = tid; r < BM; r += NT) s_pair[r] = sorted_ids[m0 + r];
    __syncthreads();

    // Each thread copies the same 16-byte chunk column of rows row0 + i * RSTEP every stage.
    const int chunk = tid % CPR;
    const int row0 = tid / CPR;
    const unsigned short* a_ptr[A_IT];
    bool a_ok[A_IT];
#pragma unroll
    for (int i = 0; i < A_IT; ++i) {
        const int r = row0 + i * RSTEP;
        const int p = s_pair[r];
        a_ok[i] = p >= 0;
        long long arow = 0;
        if (a_ok[i]) arow = GATE_UP ? (long long)(p / top_k) : m0 + r;
        a_ptr[i] = a_src + arow * K + chunk * 8;
    }
    const unsigned short* w_e = w + (size_t)expert * (size_t)(GATE_UP ? 2 * inter : hidden) * (size_t)K;
    const unsigned short* b_ptr[B_IT];
    bool b_ok[B_IT];
#pragma unroll
    for (int i = 0; i < B_IT; ++i) {
        const int r = row0 + i * RSTEP;
        int j, grow;
        if (GATE_UP) {
            const int up = r >= BN / 2 ? 1 : 0;
            j = blockIdx.x * (BN / 2) + r - up * (BN / 2);
            grow = up * inter + j;
        } else {
            j = blockIdx.x * BN + r;
            grow = j;
        }
        b_ok[i] = j < N;
        b_ptr[i] = w_e + (size_t)(b_ok[i] ? grow : 0) * K + chunk * 8;
    }

    const int KT = (K + BK - 1) / BK;
    auto load_stage = [&](int slot, int kt) {
        const bool kin = kt * BK + chunk * 8 < K;
        unsigned short* da = sA + slot * (BM * LDS) + row0 * LDS + chunk * 8;
#pragma unroll
        for (int i = 0; i < A_IT; ++i) {
            const bool ok = a_ok[i] && kin;
            cp_async16(da + i * RSTEP * LDS, ok ? (const void*)(a_ptr[i] + kt * BK) : (const void*)a_src, ok);
        }
        unsigned short* db = sB + slot * (BN * LDS) + row0 * LDS + chunk * 8;
#pragma unroll
        for (int i = 0; i < B_IT; ++i) {
            const bool ok = b_ok[i] && kin;
            cp_async16(db + i * RSTEP * LDS, ok ? (const void*)(b_ptr[i] + kt * BK) : (const void*)w, ok);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }

    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    // ldmatrix row addresses: A x4 = rows 0-15 at k 0 / k 8; B x4 = fragments nf (lanes 0-15)
    // and nf + 1 (lanes 16-31), each at k 0 (lanes 0-7) / k 8 (lanes 8-15).
    const int a_off = (wm * WTM + (lane & 15)) * LDS + (lane >> 4) * 8;
    int b_off[NF / 2];
#pragma unroll
    for (int np = 0; np < NF / 2; ++np) {
        const int nf = 2 * np + (lane >> 4);
        int brow;
        if (GATE_UP) brow = (nf / (NF / 2)) * (BN / 2) + wn * (WTN / 2) + (nf % (NF / 2)) * 8;
        else brow = wn * WTN + nf * 8;
        b_off[np] = (brow + (lane & 7)) * LDS + ((lane >> 3) & 1) * 8;
    }

    float acc[MF][NF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mf][nf][q] = 0.f;

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();  // stage kt has landed (this thread's copies)
        __syncthreads();              // ... everyone's; and stage kt - 1 is free to overwrite
        {
            const int nk = kt + STAGES - 1;
            if (nk < KT) load_stage(nk % STAGES, nk);
            cp_async_commit();
        }
        const unsigned short* tA = sA + (kt % STAGES) * (BM * LDS);
        const unsigned short* tB = sB + (kt % STAGES) * (BN * LDS);
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            unsigned af[MF][4];
#pragma unroll
            for (int mf = 0; mf < MF; ++mf)
                ldsm_x4(tA + a_off + mf * 16 * LDS + ks * 16, af[mf][0], af[mf][1], af[mf][2], af[mf][3]);
            unsigned bfr[NF][2];
#pragma unroll
            for (int np = 0; np < NF / 2; ++np)
                ldsm_x4(tB + b_off[np] + ks * 16, bfr[2 * np][0], bfr[2 * np][1], bfr[2 * np + 1][0], bfr[2 * np + 1][1]);
#pragma unroll
            for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                for (int nf = 0; nf < NF; ++nf) mma_16816(acc[mf][nf], af[mf], bfr[nf][0], bfr[nf][1]);
        }
    }
    cp_async_wait<0>();

    // Epilogue: accumulator (mf, nf) holds rows g / g + 8 and columns 2 * t4, 2 * t4 + 1.
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * WTM + mf * 16 + g + h * 8;
            const int p = s_pair[r];
            if (p < 0) continue;
            if constexpr (GATE_UP) {
                unsigned short* orow = dst + (size_t)(m0 + r) * inter;
#pragma unroll
                for (int nf = 0; nf < NF / 2; ++nf) {
                    const int j = blockIdx.x * (BN / 2) + wn * (WTN / 2) + nf * 8 + 2 * t4;
                    if (j < inter) {
                        const float g0 = acc[mf][nf][2 * h], g1 = acc[mf][nf][2 * h + 1];
                        const float u0 = acc[mf][nf + NF / 2][2 * h], u1 = acc[mf][nf + NF / 2][2 * h + 1];
                        const float v0 = g0 / (1.0f + expf(-g0)) * u0;
                        const float v1 = g1 / (1.0f + expf(-g1)) * u1;
                        *reinterpret_cast<unsigned*>(orow + j) = pack_bf16x2(v0, v1);
                    }
                }
            } else {
                unsigned short* orow = dst + (size_t)p * hidden;
#pragma unroll
                for (int nf = 0; nf < NF; ++nf) {
                    const int n = blockIdx.x * BN + wn * WTN + nf * 8 + 2 * t4;
                    if (n < hidden)
                        *reinterpret_cast<unsigned*>(orow + n) = pack_bf16x2(acc[mf][nf][2 * h], acc[mf][nf][2 * h + 1]);
                }
            }
        }
    }
}

// ---- weighted reduction: out[t, :] = sum over slots (in order) of w[t, s] * y[t * k + s, :];
// slots with an expert id outside [0, E) contribute nothing. 8 columns per thread.
extern "C" __global__ void moe_reduce(
        const unsigned short* __restrict__ y, const int* __restrict__ ids, const float* __restrict__ wts,
        unsigned short* __restrict__ out, int tokens, int hidden, int top_k, int num_experts) {
    const int vpr = hidden >> 3;
    const long long n = (long long)tokens * vpr;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / vpr;
        const int c = (int)(i - t * vpr) * 8;
        float acc[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = 0.f;
        for (int s = 0; s < top_k; ++s) {
            const long long p = t * top_k + s;
            const int e = ids[p];
            if (e < 0 || e >= num_experts) continue;
            const float wv = wts[p];
            const uint4 v = *reinterpret_cast<const uint4*>(y + p * hidden + c);
            const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                acc[2 * q] += wv * bf2f((unsigned short)(u[q] & 0xffffu));
                acc[2 * q + 1] += wv * bf2f((unsigned short)(u[q] >> 16));
            }
        }
        uint4 o;
        o.x = pack_bf16x2(acc[0], acc[1]);
        o.y = pack_bf16x2(acc[2], acc[3]);
        o.z = pack_bf16x2(acc[4], acc[5]);
        o.w = pack_bf16x2(acc[6], acc[7]);
        *reinterpret_cast<uint4*>(out + t * hidden + c) = o;
    }
}
"#;

const TOPK_FN: &str = "moe_topk_softmax";
const ALIGN_FN: &str = "moe_align";
const REDUCE_FN: &str = "moe_reduce";

/// The `extern "C"` wrapper instantiating `moe_gemm` for one tile configuration.
fn gemm_entry(cfg: &TileCfg, gate_up: bool) -> String {
    let name = if gate_up { cfg.gate_up_fn } else { cfg.down_fn };
    let TileCfg {
        bm,
        bn,
        bk,
        warps_m,
        warps_n,
        stages,
        min_ctas,
        ..
    } = *cfg;
    let threads = cfg.threads();
    format!(
        r#"
extern "C" __global__ void __launch_bounds__({threads}, {min_ctas}) {name}(
        const unsigned short* __restrict__ a, const unsigned short* __restrict__ w,
        const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
        unsigned short* __restrict__ dst, int hidden, int inter, int top_k) {{
    moe_gemm<{bm}, {bn}, {bk}, {warps_m}, {warps_n}, {stages}, {gate_up}>(a, w, sorted_ids, block_expert, dst, hidden, inter, top_k);
}}
"#
    )
}

/// Full source of the MoE module (every entry point of this file).
pub(crate) fn moe_source() -> String {
    let mut s = format!("{BF16_HELPERS}{PTX_HELPERS}{MOE_BODY}");
    for cfg in [SMALL, LARGE] {
        s.push_str(&gemm_entry(&cfg, true));
        s.push_str(&gemm_entry(&cfg, false));
    }
    s
}

impl CudaContext {
    /// Qwen3-MoE routing on the device: for each of `tokens` rows of `router_logits`
    /// (`[tokens, num_experts]` f32, as the CPU model computes them), softmax over all experts, the `top_k` most probable
    /// experts in decreasing probability (ties: lower expert id first) into `topk_ids`
    /// (`[tokens, top_k]`), and their probabilities into `topk_weights`, renormalised to sum to 1
    /// when `renormalize` (`norm_topk_prob`). The GPU twin of the routing in omni-models'
    /// `DecoderModel::moe`. `num_experts` is at most [`MOE_MAX_EXPERTS`]; one warp per token; no
    /// host synchronization (graph capturable).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_topk_softmax(
        &self,
        router_logits: &impl DevicePtr<f32>,
        topk_ids: &mut impl DevicePtrMut<i32>,
        topk_weights: &mut impl DevicePtrMut<f32>,
        tokens: usize,
        num_experts: usize,
        top_k: usize,
        renormalize: bool,
    ) -> CudaResult<()> {
        check_routing(num_experts, top_k)?;
        crate::check_len(
            "moe router logits",
            router_logits.len(),
            tokens * num_experts,
        )?;
        crate::check_len("moe topk ids", topk_ids.len(), tokens * top_k)?;
        crate::check_len("moe topk weights", topk_weights.len(), tokens * top_k)?;
        if tokens == 0 {
            return Ok(());
        }
        const WARPS: usize = 4;
        let cfg = LaunchConfig {
            grid_dim: (grid_u32("moe tokens", tokens.div_ceil(WARPS))?, 1, 1),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: (WARPS * num_experts * 4) as u32,
        };
        let (t_i, e_i, k_i) = (
            to_i32("tokens", tokens)?,
            to_i32("num_experts", num_experts)?,
            to_i32("top_k", top_k)?,
        );
        let renorm = i32::from(renormalize);
        let f = self.function(moe_source, TOPK_FN)?;
        let (logits_p, _g0) = router_logits.device_ptr(&self.stream);
        let (ids_p, _g1) = topk_ids.device_ptr_mut(&self.stream);
        let (w_p, _g2) = topk_weights.device_ptr_mut(&self.stream);
        let mut launch = self.stream.launch_builder(&f);
        launch
            .arg(&logits_p)
            .arg(&ids_p)
            .arg(&w_p)
            .arg(&t_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&renorm);
        // SAFETY: the arguments match `moe_topk_softmax(const float*, int*, float*, int, int, int,
        // int)`; logits hold tokens * E elements and ids / weights tokens * k (checked above);
        // one warp per token (warps past `tokens` return), 4 warps per block with E floats of
        // dynamic shared memory each (E <= 1024: 16 KiB at most); 1 <= k <= E.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// The Qwen3-MoE expert block on the device, bf16 in and out with f32 accumulation:
    /// `out[t] = sum_s topk_weights[t, s] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` with
    /// `e = topk_ids[t, s]`, where expert `e` has `w13[e]` (`[2 * inter, hidden]`: `inter` gate
    /// rows then `inter` up rows) and `w2[e]` (`[hidden, inter]`), Hugging Face `[out, in]`
    /// layout. `x` and `out` are `[tokens, hidden]`, `topk_ids` / `topk_weights` `[tokens,
    /// top_k]` (e.g. from [`CudaContext::moe_topk_softmax`]); ids outside `0..num_experts` are
    /// skipped (their slot contributes nothing).
    ///
    /// `workspace` must hold at least [`fused_moe_workspace_bytes`]`(shape)` bytes. `hidden` and
    /// `inter` must be positive multiples of 8 (16-byte rows; other sizes are a
    /// [`CudaError::Shape`] error) and need not be multiples of the tiles (ragged edges are
    /// zero-filled and masked); `x`, `w13`, `w2`, `out` and `workspace` must be 16-byte aligned
    /// (whole allocations are). The result is
    /// deterministic (no float atomics), and the call is CUDA-graph capturable: no allocation,
    /// no host synchronization, launch grids that depend only on `shape`.
    #[allow(clippy::too_many_arguments)]
    pub fn fused_moe_bf16(
        &self,
        x: &impl DevicePtr<bf16>,
        w13: &impl DevicePtr<bf16>,
        w2: &impl DevicePtr<bf16>,
        topk_ids: &impl DevicePtr<i32>,
        topk_weights: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<bf16>,
        workspace: &mut impl DevicePtrMut<u8>,
        shape: MoeShape,
    ) -> CudaResult<()> {
        let tile = TileCfg::select(&shape);
        self.fused_moe_with(
            x,
            w13,
            w2,
            topk_ids,
            topk_weights,
            out,
            workspace,
            shape,
            tile,
        )
    }

    /// [`CudaContext::fused_moe_bf16`] with the GEMM tile chosen by the caller (tests run both).
    #[allow(clippy::too_many_arguments)]
    fn fused_moe_with(
        &self,
        x: &impl DevicePtr<bf16>,
        w13: &impl DevicePtr<bf16>,
        w2: &impl DevicePtr<bf16>,
        topk_ids: &impl DevicePtr<i32>,
        topk_weights: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<bf16>,
        workspace: &mut impl DevicePtrMut<u8>,
        shape: MoeShape,
        tile: TileCfg,
    ) -> CudaResult<()> {
        let MoeShape {
            tokens,
            hidden,
            inter,
            num_experts,
            top_k,
        } = shape;
        check_routing(num_experts, top_k)?;
        if hidden == 0 || !hidden.is_multiple_of(8) {
            return Err(shape_err(
                "fused moe hidden (a positive multiple of 8)",
                hidden.div_ceil(8).max(1) * 8,
                hidden,
            ));
        }
        if inter == 0 || !inter.is_multiple_of(8) {
            return Err(shape_err(
                "fused moe inter (a positive multiple of 8)",
                inter.div_ceil(8).max(1) * 8,
                inter,
            ));
        }
        let pairs = shape.pairs();
        crate::check_len("fused moe x", x.len(), tokens * hidden)?;
        crate::check_len("fused moe w13", w13.len(), num_experts * 2 * inter * hidden)?;
        crate::check_len("fused moe w2", w2.len(), num_experts * hidden * inter)?;
        crate::check_len("fused moe topk ids", topk_ids.len(), pairs)?;
        crate::check_len("fused moe topk weights", topk_weights.len(), pairs)?;
        crate::check_len("fused moe out", out.len(), tokens * hidden)?;
        let lay = Layout::new(&shape, &tile);
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
        // Every int the kernels take, and the row products they form in int.
        let (h_i, i_i, e_i, k_i, t_i) = (
            to_i32("hidden", hidden)?,
            to_i32("inter", inter)?,
            to_i32("num_experts", num_experts)?,
            to_i32("top_k", top_k)?,
            to_i32("tokens", tokens)?,
        );
        to_i32("2 * inter", 2 * inter)?;
        let p_i = to_i32("tokens * top_k", pairs)?;
        let bm_i = to_i32("moe tile rows", tile.bm)?;
        let mb_i = to_i32("moe row blocks", lay.max_blocks)?;
        to_i32("moe sorted rows", lay.max_blocks * tile.bm)?;
        let blocks_y = u32::try_from(lay.max_blocks)
            .ok()
            .filter(|&b| b <= 65_535)
            .ok_or(CudaError::TooLarge {
                what: "moe row blocks (grid y, at most 65535)",
                value: lay.max_blocks,
            })?;

        let f_align = self.function(moe_source, ALIGN_FN)?;
        let f_gu = self.function(moe_source, tile.gate_up_fn)?;
        let f_down = self.function(moe_source, tile.down_fn)?;
        let f_red = self.function(moe_source, REDUCE_FN)?;
        let smem = tile.smem_bytes();
        set_smem(&f_gu, smem)?;
        set_smem(&f_down, smem)?;

        let (x_p, _gx) = x.device_ptr(&self.stream);
        let (w13_p, _g13) = w13.device_ptr(&self.stream);
        let (w2_p, _g2) = w2.device_ptr(&self.stream);
        let (ids_p, _gi) = topk_ids.device_ptr(&self.stream);
        let (tw_p, _gw) = topk_weights.device_ptr(&self.stream);
        let (out_p, _go) = out.device_ptr_mut(&self.stream);
        let (ws_p, _gws) = workspace.device_ptr_mut(&self.stream);
        check_align16("fused moe x (pointer alignment)", x_p)?;
        check_align16("fused moe w13 (pointer alignment)", w13_p)?;
        check_align16("fused moe w2 (pointer alignment)", w2_p)?;
        check_align16("fused moe out (pointer alignment)", out_p)?;
        check_align16("fused moe workspace (pointer alignment)", ws_p)?;
        let sorted_p = ws_p + lay.sorted as u64;
        let bexp_p = ws_p + lay.block_expert as u64;
        let act_p = ws_p + lay.act as u64;
        let y_p = ws_p + lay.y as u64;

        // 1. Alignment by expert.
        let align_threads = pairs.max(num_experts).div_ceil(32).clamp(1, 32) * 32;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (align_threads as u32, 1, 1),
            shared_mem_bytes: ((32 + 3 * num_experts) * 4) as u32,
        };
        let mut launch = self.stream.launch_builder(&f_align);
        launch
            .arg(&ids_p)
            .arg(&p_i)
            .arg(&e_i)
            .arg(&bm_i)
            .arg(&mb_i)
            .arg(&sorted_p)
            .arg(&bexp_p);
        // SAFETY: the arguments match `moe_align(const int*, int, int, int, int, int*, int*)`;
        // ids hold `pairs` ints (checked above); sorted_ids (max_blocks * bm ints) and
        // block_expert (max_blocks ints) lie inside the workspace (its length was checked
        // against the layout) and every write is bounded by max_blocks; one CTA of a multiple of
        // 32 threads, at most 1024, with (32 + 3 E) ints of dynamic shared memory (E <= 1024).
        unsafe { launch.launch(cfg) }?;

        // 2. gate_up GEMM + SiLU-and-mul into act.
        let threads = tile.threads() as u32;
        let cfg = LaunchConfig {
            grid_dim: (
                grid_u32("moe inter tiles", inter.div_ceil(tile.bn / 2))?,
                blocks_y,
                1,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut launch = self.stream.launch_builder(&f_gu);
        launch
            .arg(&x_p)
            .arg(&w13_p)
            .arg(&sorted_p)
            .arg(&bexp_p)
            .arg(&act_p)
            .arg(&h_i)
            .arg(&i_i)
            .arg(&k_i);
        // SAFETY: the arguments match the gate_up entry `(const u16*, const u16*, const int*,
        // const int*, u16*, int, int, int)`; x holds tokens * hidden and w13 E * 2I * H elements
        // (checked above) and every row the kernel reads is a token id p / k < tokens (p < pairs
        // comes from the alignment) or an expert e < E; rows or columns past the shapes are
        // zero-filled, not read; act (max_blocks * bm rows of inter) lies in the workspace; the
        // grid's y is max_blocks, blocks the alignment left unused (-1) exit; the block size and
        // dynamic shared memory match the template instance (attribute set above).
        unsafe { launch.launch(cfg) }?;

        // 3. down GEMM into y (pair order).
        let cfg = LaunchConfig {
            grid_dim: (
                grid_u32("moe hidden tiles", hidden.div_ceil(tile.bn))?,
                blocks_y,
                1,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut launch = self.stream.launch_builder(&f_down);
        launch
            .arg(&act_p)
            .arg(&w2_p)
            .arg(&sorted_p)
            .arg(&bexp_p)
            .arg(&y_p)
            .arg(&h_i)
            .arg(&i_i)
            .arg(&k_i);
        // SAFETY: the arguments match the down entry (same signature as gate_up); act rows read
        // are the sorted positions of used blocks, all written by step 2; w2 holds E * H * I
        // elements; y (pairs * hidden, in the workspace) is written at row p < pairs only.
        unsafe { launch.launch(cfg) }?;

        // 4. Weighted reduction into out.
        let n = tokens * (hidden / 8);
        let mut launch = self.stream.launch_builder(&f_red);
        launch
            .arg(&y_p)
            .arg(&ids_p)
            .arg(&tw_p)
            .arg(&out_p)
            .arg(&t_i)
            .arg(&h_i)
            .arg(&k_i)
            .arg(&e_i);
        // SAFETY: the arguments match `moe_reduce(const u16*, const int*, const float*, u16*,
        // int, int, int, int)`; ids / weights hold pairs elements, y pairs * hidden (rows of
        // valid ids were written by step 3, others are skipped), out tokens * hidden; hidden is a
        // multiple of 8 and all pointers 16-byte aligned for the vector accesses; the
        // grid-stride loop stays below tokens * hidden / 8.
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use cudarc::driver::CudaSlice;

    use super::*;
    use crate::cuda::kernels;
    use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
    use crate::{linalg, ops};

    #[test]
    fn moe_kernels_compile_for_sm90() {
        kernels::check_compiles("moe", &moe_source());
    }

    #[test]
    fn moe_workspace_bound_and_tiles() {
        // The row-block bound holds for adversarial routings: all pairs on one expert, one pair
        // per expert, skewed and uniform spreads.
        for cfg in [SMALL, LARGE] {
            for &(pairs, experts) in &[
                (1usize, 8usize),
                (8, 128),
                (128, 128),
                (300, 7),
                (16384, 128),
            ] {
                let bound = cfg.max_blocks(pairs, experts);
                let mut routings: Vec<Vec<usize>> = vec![
                    (0..pairs).map(|_| 0).collect(),
                    (0..pairs).map(|p| p % experts).collect(),
                    (0..pairs).map(|p| (p * p + 7 * p) % experts).collect(),
                ];
                let mut s = 12345u64;
                routings.push(
                    (0..pairs)
                        .map(|_| {
                            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                            (s >> 33) as usize % experts
                        })
                        .collect(),
                );
                for r in routings {
                    let mut count = vec![0usize; experts];
                    for e in r {
                        count[e] += 1;
                    }
                    let used: usize = count.iter().map(|c| c.div_ceil(cfg.bm)).sum();
                    assert!(
                        used <= bound,
                        "{cfg:?} pairs={pairs} experts={experts}: {used} > {bound}"
                    );
                }
            }
        }
        let mut last = 0;
        for t in [1usize, 2, 8, 64, 255, 256, 257, 2048] {
            let s = MoeShape {
                tokens: t,
                hidden: 2048,
                inter: 768,
                num_experts: 128,
                top_k: 8,
            };
            let b = fused_moe_workspace_bytes(s);
            assert!(b >= last && b >= Layout::new(&s, &TileCfg::select(&s)).total);
            last = b;
        }
        assert!(LARGE.smem_bytes() <= 113 * 1024, "two prefill CTAs per SM");
    }

    /// The CPU routing of omni-models' `DecoderModel::moe`: softmax in f32, experts sorted by
    /// probability (ties: lower id), optional renormalisation.
    fn cpu_topk(logits: &[f32], e: usize, k: usize, renorm: bool) -> (Vec<i32>, Vec<f32>) {
        let (mut ids, mut ws) = (Vec::new(), Vec::new());
        for row in logits.chunks_exact(e) {
            let mut p = row.to_vec();
            ops::softmax_inplace(&mut p);
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &order[..k];
            let sum: f32 = top.iter().map(|&i| p[i]).sum();
            for &i in top {
                ids.push(i as i32);
                ws.push(if renorm { p[i] / sum } else { p[i] });
            }
        }
        (ids, ws)
    }

    /// Router logits in [-4, 4), bf16-exact, with exact ties in every third row.
    fn test_logits(t: usize, e: usize, seed: u64) -> Vec<f32> {
        let mut l: Vec<f32> = rand_bf16_f32(t * e, seed).iter().map(|v| 4.0 * v).collect();
        for row in l.chunks_exact_mut(e).step_by(3) {
            let top = 5.0;
            row[e - 1] = top;
            row[e / 2] = top;
            row[0] = top;
            if e > 6 {
                row[5] = row[4];
            }
        }
        l
    }

    fn run_topk(
        cx: &CudaContext,
        logits: &[f32],
        t: usize,
        e: usize,
        k: usize,
        renorm: bool,
    ) -> (Vec<i32>, Vec<f32>) {
        let dl = cx.stream().clone_htod(logits).unwrap();
        let mut di = cx.stream().clone_htod(&vec![-7i32; t * k]).unwrap();
        let mut dw = cx.stream().clone_htod(&vec![f32::NAN; t * k]).unwrap();
        cx.moe_topk_softmax(&dl, &mut di, &mut dw, t, e, k, renorm)
            .unwrap();
        (
            cx.stream().clone_dtoh(&di).unwrap(),
            cx.stream().clone_dtoh(&dw).unwrap(),
        )
    }

    #[test]
    fn moe_topk_softmax_matches_cpu() {
        let Some(cx) = ctx_or_skip("moe_topk_softmax_matches_cpu") else {
            return;
        };
        for &(t, e, k) in &[
            (1usize, 8usize, 2usize),
            (37, 128, 8),
            (5, 256, 8),
            (64, 60, 4),
            (3, 1024, 16),
            (9, 5, 5),
        ] {
            let mut logits = test_logits(t, e, 7 + e as u64);
            if t > 1 {
                // Part of a row at -inf: those experts get probability 0.
                for v in logits[e..2 * e].iter_mut().step_by(2) {
                    *v = f32::NEG_INFINITY;
                }
            }
            for renorm in [false, true] {
                let (want_i, want_w) = cpu_topk(&logits, e, k, renorm);
                let (got_i, got_w) = run_topk(&cx, &logits, t, e, k, renorm);
                assert_eq!(got_i, want_i, "ids t={t} e={e} k={k} renorm={renorm}");
                let max_dw = got_w
                    .iter()
                    .zip(&want_w)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0f32, f32::max);
                println!(
                    "moe topk t={t} e={e} k={k} renorm={renorm}: ids equal, max |dw| {max_dw:.2e}"
                );
                assert!(max_dw <= 1e-5, "weights t={t} e={e} k={k}: {max_dw}");
            }
        }
        let dl = cx.stream().alloc_zeros::<f32>(8).unwrap();
        let mut di = cx.stream().alloc_zeros::<i32>(9).unwrap();
        let mut dw = cx.stream().alloc_zeros::<f32>(9).unwrap();
        let r = cx.moe_topk_softmax(&dl, &mut di, &mut dw, 1, 8, 9, true);
        assert!(matches!(r, Err(CudaError::Shape(_))), "{r:?}");
    }

    /// CPU f32 reference of the expert block for token rows `rows` (inputs bf16-exact), from
    /// the CPU building blocks, each expert's weights widened once.
    #[allow(clippy::too_many_arguments)]
    fn cpu_moe_rows(
        x: &[f32],
        w13: &[bf16],
        w2: &[bf16],
        ids: &[i32],
        ws: &[f32],
        s: MoeShape,
        rows: &[usize],
    ) -> Vec<f32> {
        let (h, i, k, e_n) = (s.hidden, s.inter, s.top_k, s.num_experts);
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_n];
        for (ri, &t) in rows.iter().enumerate() {
            for slot in 0..k {
                let e = ids[t * k + slot];
                if (0..e_n as i32).contains(&e) {
                    routed[e as usize].push((ri, ws[t * k + slot]));
                }
            }
        }
        let mut out = vec![0f32; rows.len() * h];
        for (e, toks) in routed.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let w13e: Vec<f32> = w13[e * 2 * i * h..(e + 1) * 2 * i * h]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let w2e: Vec<f32> = w2[e * h * i..(e + 1) * h * i]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let m = toks.len();
            let mut xg = Vec::with_capacity(m * h);
            for &(ri, _) in toks {
                let t = rows[ri];
                xg.extend_from_slice(&x[t * h..(t + 1) * h]);
            }
            let mut gu = vec![0f32; m * 2 * i];
            linalg::matmul_nt(&xg, &w13e, &mut gu, m, h, 2 * i).unwrap();
            let mut act = vec![0f32; m * i];
            ops::silu_and_mul(&gu, &mut act, i).unwrap();
            let mut y = vec![0f32; m * h];
            linalg::matmul_nt(&act, &w2e, &mut y, m, i, h).unwrap();
            for (r, &(ri, w)) in toks.iter().enumerate() {
                for (d, v) in out[ri * h..(ri + 1) * h]
                    .iter_mut()
                    .zip(&y[r * h..(r + 1) * h])
                {
                    *d += w * v;
                }
            }
        }
        out
    }

    fn rand_bf16_scaled(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
        rand_bf16_f32(n, seed)
            .iter()
            .map(|&v| bf16::from_f32(v * scale))
            .collect()
    }

    /// Device copies of one MoE layer's inputs.
    struct DevMoe {
        x: CudaSlice<bf16>,
        w13: CudaSlice<bf16>,
        w2: CudaSlice<bf16>,
        ids: CudaSlice<i32>,
        ws: CudaSlice<f32>,
    }

    fn upload(
        cx: &CudaContext,
        x: &[f32],
        w13: &[bf16],
        w2: &[bf16],
        ids: &[i32],
        ws: &[f32],
    ) -> DevMoe {
        DevMoe {
            x: cx.upload_f32_as_bf16(x).unwrap(),
            w13: cx.upload_bf16(w13).unwrap(),
            w2: cx.upload_bf16(w2).unwrap(),
            ids: cx.stream().clone_htod(ids).unwrap(),
            ws: cx.stream().clone_htod(ws).unwrap(),
        }
    }

    /// Runs the fused block (with `tile`, or the public selection) into a NaN-poisoned output
    /// with a 0xff-poisoned workspace; returns the raw bf16 output.
    fn run_fused(cx: &CudaContext, d: &DevMoe, s: MoeShape, tile: Option<TileCfg>) -> Vec<bf16> {
        let mut out = cx
            .upload_bf16(&vec![bf16::NAN; s.tokens * s.hidden])
            .unwrap();
        let mut ws = cx
            .stream()
            .clone_htod(&vec![0xffu8; fused_moe_workspace_bytes(s)])
            .unwrap();
        match tile {
            None => cx.fused_moe_bf16(&d.x, &d.w13, &d.w2, &d.ids, &d.ws, &mut out, &mut ws, s),
            Some(t) => {
                cx.fused_moe_with(&d.x, &d.w13, &d.w2, &d.ids, &d.ws, &mut out, &mut ws, s, t)
            }
        }
        .unwrap();
        cx.stream().clone_dtoh(&out).unwrap()
    }

    fn f32s(v: &[bf16]) -> Vec<f32> {
        v.iter().map(|x| x.to_f32()).collect()
    }

    #[test]
    fn fused_moe_matches_cpu() {
        let Some(cx) = ctx_or_skip("fused_moe_matches_cpu") else {
            return;
        };
        // (hidden, inter, experts, top_k): the test fixture, then odd-ish sizes that are ragged
        // against every tile (N and K tails, tiny expert counts).
        for &(h, i, e, k) in &[
            (64usize, 32usize, 8usize, 2usize),
            (136, 40, 5, 3),
            (264, 200, 16, 4),
            (520, 72, 3, 3),
        ] {
            let w13 = rand_bf16_scaled(e * 2 * i * h, 101 + h as u64, 2.0 / (h as f32).sqrt());
            let w2 = rand_bf16_scaled(e * h * i, 103 + i as u64, 2.0 / (i as f32).sqrt());
            for &t in &[1usize, 3, 64, 300] {
                let s = MoeShape {
                    tokens: t,
                    hidden: h,
                    inter: i,
                    num_experts: e,
                    top_k: k,
                };
                let x = rand_bf16_f32(t * h, 107 + t as u64);
                let logits = test_logits(t, e, 109 + t as u64);
                let (mut ids, ws) = cpu_topk(&logits, e, k, t % 2 == 1);
                if h == 136 {
                    // Expert ids outside 0..E (e.g. other ranks' experts) are skipped.
                    for (n, id) in ids.iter_mut().enumerate().skip(2).step_by(5) {
                        *id = if n % 2 == 0 { -1 } else { e as i32 + 2 };
                    }
                }
                let rows: Vec<usize> = (0..t).collect();
                let want = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &rows);
                let d = upload(&cx, &x, &w13, &w2, &ids, &ws);
                let public = run_fused(&cx, &d, s, None);
                for (name, tile) in [
                    ("public", None),
                    ("small", Some(SMALL)),
                    ("large", Some(LARGE)),
                ] {
                    let got = if tile.is_none() {
                        public.clone()
                    } else {
                        run_fused(&cx, &d, s, tile)
                    };
                    let err = rel_err(&f32s(&got), &want);
                    println!(
                        "moe fused t={t} h={h} i={i} e={e} k={k} tile={name}: rel err vs CPU f32 {err:.2e}"
                    );
                    assert!(err <= 2e-2, "t={t} h={h} i={i} e={e} k={k} {name}: {err}");
                }
                // Deterministic: bit-identical on a second run.
                let again = run_fused(&cx, &d, s, None);
                assert!(
                    again
                        .iter()
                        .zip(&public)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "t={t} h={h}: not deterministic"
                );
            }
        }
    }

    /// Routings where one expert receives every token (the qwen3-moe fixture's 5-token prefill:
    /// layer 0 sends tokens 0-2 to [1, 3] and 3-4 to [1, 2]), at token counts around the tile
    /// heights (an expert with exactly 16 / 17 / 64 / 65 rows), on both tiles.
    #[test]
    fn fused_moe_one_expert_gets_every_token() {
        let Some(cx) = ctx_or_skip("fused_moe_one_expert_gets_every_token") else {
            return;
        };
        let (h, i, e, k) = (64usize, 32usize, 8usize, 2usize);
        // Fixture-like weight scale (std ~0.2).
        let w13 = rand_bf16_scaled(e * 2 * i * h, 301, 0.35);
        let w2 = rand_bf16_scaled(e * h * i, 303, 0.45);
        for &t in &[2usize, 4, 5, 6, 7, 9, 16, 17, 64, 65] {
            let s = MoeShape {
                tokens: t,
                hidden: h,
                inter: i,
                num_experts: e,
                top_k: k,
            };
            let x = rand_bf16_f32(t * h, 305 + t as u64);
            let (ids, ws): (Vec<i32>, Vec<f32>) = if t == 5 {
                let p = [
                    (0.41f32, 0.14f32),
                    (0.38, 0.19),
                    (0.88, 0.07),
                    (0.94, 0.02),
                    (0.38, 0.20),
                ];
                (
                    vec![1, 3, 1, 3, 1, 3, 1, 2, 1, 2],
                    p.iter()
                        .flat_map(|&(a, b)| [a / (a + b), b / (a + b)])
                        .collect(),
                )
            } else {
                // Slot 0 always expert 1; slot 1 spread over 2..8 (or the same expert 5 for
                // every token when t is even, so two experts get every token).
                (
                    (0..t)
                        .flat_map(|r| {
                            [
                                1,
                                if t % 2 == 0 {
                                    5
                                } else {
                                    2 + (r * 3 % 6) as i32
                                },
                            ]
                        })
                        .collect(),
                    (0..t)
                        .flat_map(|r| {
                            let a = 0.55 + 0.4 * ((r * 7 % 10) as f32 / 10.0);
                            [a, 1.0 - a]
                        })
                        .collect(),
                )
            };
            let want = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &(0..t).collect::<Vec<_>>());
            let d = upload(&cx, &x, &w13, &w2, &ids, &ws);
            for (name, tile) in [
                ("public", None),
                ("small", Some(SMALL)),
                ("large", Some(LARGE)),
            ] {
                let got = f32s(&run_fused(&cx, &d, s, tile));
                let err = rel_err(&got, &want);
                println!("moe one-expert-all t={t} tile={name}: rel err vs CPU f32 {err:.2e}");
                assert!(err <= 2e-2, "t={t} {name}: {err}");
            }
        }
    }

    #[test]
    fn fused_moe_after_gpu_routing_and_in_a_cuda_graph() {
        let Some(cx) = ctx_or_skip("fused_moe_after_gpu_routing_and_in_a_cuda_graph") else {
            return;
        };
        let (t, h, i, e, k) = (37usize, 128usize, 64usize, 16usize, 4usize);
        let s = MoeShape {
            tokens: t,
            hidden: h,
            inter: i,
            num_experts: e,
            top_k: k,
        };
        let x = rand_bf16_f32(t * h, 201);
        let logits = test_logits(t, e, 203);
        let w13 = rand_bf16_scaled(e * 2 * i * h, 205, 0.2);
        let w2 = rand_bf16_scaled(e * h * i, 207, 0.2);
        let (ids, ws) = cpu_topk(&logits, e, k, true);
        let want = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &(0..t).collect::<Vec<_>>());

        // Routing on the device feeding the fused block, all queued without a host sync.
        let mut d = upload(&cx, &x, &w13, &w2, &vec![0; t * k], &vec![0.0; t * k]);
        let dl = cx.stream().clone_htod(&logits).unwrap();
        let mut out = cx.zeros_bf16(t * h).unwrap();
        let mut wsp = cx
            .stream()
            .alloc_zeros::<u8>(fused_moe_workspace_bytes(s))
            .unwrap();
        let step = |d: &mut DevMoe, out: &mut CudaSlice<bf16>, wsp: &mut CudaSlice<u8>| {
            cx.moe_topk_softmax(&dl, &mut d.ids, &mut d.ws, t, e, k, true)
                .unwrap();
            cx.fused_moe_bf16(&d.x, &d.w13, &d.w2, &d.ids, &d.ws, out, wsp, s)
                .unwrap();
        };
        step(&mut d, &mut out, &mut wsp);
        let eager = cx.stream().clone_dtoh(&out).unwrap();
        let err = rel_err(&f32s(&eager), &want);
        println!("moe routing + fused t={t}: rel err vs CPU f32 {err:.2e}");
        assert!(err <= 2e-2, "{err}");

        // The same step captured into a CUDA graph and replayed over a zeroed output.
        cx.synchronize().unwrap();
        cx.stream()
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .unwrap();
        step(&mut d, &mut out, &mut wsp);
        let graph = cx
            .stream()
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured graph");
        cx.stream().memset_zeros(&mut out).unwrap();
        graph.launch().unwrap();
        let replay = cx.stream().clone_dtoh(&out).unwrap();
        assert!(
            replay
                .iter()
                .zip(&eager)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "graph replay differs from the eager run"
        );
        println!("moe routing + fused t={t}: CUDA graph replay bit-identical");
    }

    #[test]
    fn fused_moe_rejects_bad_shapes() {
        let Some(cx) = ctx_or_skip("fused_moe_rejects_bad_shapes") else {
            return;
        };
        let s = MoeShape {
            tokens: 2,
            hidden: 12,
            inter: 8,
            num_experts: 2,
            top_k: 1,
        };
        let x = cx.zeros_bf16(24).unwrap();
        let w13 = cx.zeros_bf16(2 * 16 * 12).unwrap();
        let w2 = cx.zeros_bf16(2 * 12 * 8).unwrap();
        let ids = cx.stream().alloc_zeros::<i32>(2).unwrap();
        let ws = cx.stream().alloc_zeros::<f32>(2).unwrap();
        let mut out = cx.zeros_bf16(24).unwrap();
        let mut wsp = cx.stream().alloc_zeros::<u8>(1 << 20).unwrap();
        let r = cx.fused_moe_bf16(&x, &w13, &w2, &ids, &ws, &mut out, &mut wsp, s);
        assert!(matches!(r, Err(CudaError::Shape(_))), "hidden 12: {r:?}");
        let s = MoeShape { hidden: 16, ..s };
        let x = cx.zeros_bf16(32).unwrap();
        let w13 = cx.zeros_bf16(2 * 16 * 16).unwrap();
        let w2 = cx.zeros_bf16(2 * 16 * 8).unwrap();
        let mut out = cx.zeros_bf16(32).unwrap();
        let mut small = cx.stream().alloc_zeros::<u8>(16).unwrap();
        let r = cx.fused_moe_bf16(&x, &w13, &w2, &ids, &ws, &mut out, &mut small, s);
        assert!(matches!(r, Err(CudaError::Shape(_))), "workspace: {r:?}");
        cx.fused_moe_bf16(&x, &w13, &w2, &ids, &ws, &mut out, &mut wsp, s)
            .unwrap();
    }

    /// Median time of `per` back-to-back calls of `f`, in µs per call.
    fn time_us(cx: &CudaContext, mut f: impl FnMut()) -> f64 {
        for _ in 0..3 {
            f();
        }
        cx.synchronize().unwrap();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let e0 = cx.raw().new_event(flags).unwrap();
        let e1 = cx.raw().new_event(flags).unwrap();
        let (reps, per) = (7, 10);
        let mut ms = Vec::new();
        for _ in 0..reps {
            e0.record(cx.stream()).unwrap();
            for _ in 0..per {
                f();
            }
            e1.record(cx.stream()).unwrap();
            e1.synchronize().unwrap();
            ms.push(e0.elapsed_ms(&e1).unwrap() as f64 / per as f64);
        }
        ms.sort_by(f64::total_cmp);
        ms[reps / 2] * 1e3
    }

    /// Real Qwen3-30B-A3B layer shape (TP1): checked against the CPU on a sample of rows, then
    /// timed (not asserted) for decode and prefill batch sizes.
    #[test]
    fn fused_moe_real_shape_and_timing() {
        let Some(cx) = ctx_or_skip("fused_moe_real_shape_and_timing") else {
            return;
        };
        let (h, i, e, k) = (2048usize, 768usize, 128usize, 8usize);
        let mut w13 = Vec::with_capacity(e * 2 * i * h);
        let mut w2 = Vec::with_capacity(e * h * i);
        for ex in 0..e as u64 {
            // Power-of-two scales keep the values bf16-exact.
            w13.extend(rand_bf16_scaled(2 * i * h, 1000 + ex, 1.0 / 32.0));
            w2.extend(rand_bf16_scaled(h * i, 3000 + ex, 1.0 / 32.0));
        }
        let dw13 = cx.upload_bf16(&w13).unwrap();
        let dw2 = cx.upload_bf16(&w2).unwrap();
        let shape = |t| MoeShape {
            tokens: t,
            hidden: h,
            inter: i,
            num_experts: e,
            top_k: k,
        };
        // Inputs and device routing for `t` tokens.
        let setup = |t: usize| {
            let x = rand_bf16_f32(t * h, 5000 + t as u64);
            let logits: Vec<f32> = rand_bf16_f32(t * e, 6000 + t as u64)
                .iter()
                .map(|v| 4.0 * v)
                .collect();
            let (ids, ws) = run_topk(&cx, &logits, t, e, k, true);
            (x, ids, ws)
        };
        let mut ws_buf = cx
            .stream()
            .alloc_zeros::<u8>(fused_moe_workspace_bytes(shape(2048)))
            .unwrap();

        for &(t, sample) in &[(4usize, 4usize), (512, 16)] {
            let s = shape(t);
            let (x, ids, ws) = setup(t);
            let rows: Vec<usize> = (0..sample)
                .map(|r| r * t / sample + r % 3)
                .map(|r| r.min(t - 1))
                .collect();
            let want = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &rows);
            let dx = cx.upload_f32_as_bf16(&x).unwrap();
            let dids = cx.stream().clone_htod(&ids).unwrap();
            let dws = cx.stream().clone_htod(&ws).unwrap();
            for (name, tile) in [("small", SMALL), ("large", LARGE)] {
                let mut out = cx.upload_bf16(&vec![bf16::NAN; t * h]).unwrap();
                cx.fused_moe_with(
                    &dx,
                    &dw13,
                    &dw2,
                    &dids,
                    &dws,
                    &mut out,
                    &mut ws_buf,
                    s,
                    tile,
                )
                .unwrap();
                let got = cx.download_f32(&out).unwrap();
                let got_rows: Vec<f32> = rows
                    .iter()
                    .flat_map(|&r| got[r * h..(r + 1) * h].to_vec())
                    .collect();
                let err = rel_err(&got_rows, &want);
                println!(
                    "moe real shape t={t} tile={name}: rel err vs CPU f32 on {sample} rows {err:.2e}"
                );
                assert!(err <= 2e-2, "t={t} {name}: {err}");
            }
        }

        // Timing: the fused block only (routing precomputed on the device).
        let bytes_per_expert = (3 * i * h * 2) as f64;
        for &t in &[1usize, 8, 64, 128, 256, 512, 2048] {
            let s = shape(t);
            let (x, ids, ws) = setup(t);
            let touched = {
                let mut seen = vec![false; e];
                for &id in &ids {
                    seen[id as usize] = true;
                }
                seen.iter().filter(|&&b| b).count()
            };
            let dx = cx.upload_f32_as_bf16(&x).unwrap();
            let dids = cx.stream().clone_htod(&ids).unwrap();
            let dws = cx.stream().clone_htod(&ws).unwrap();
            let mut out = cx.zeros_bf16(t * h).unwrap();
            let mut run = |tile: TileCfg| {
                time_us(&cx, || {
                    cx.fused_moe_with(
                        &dx,
                        &dw13,
                        &dw2,
                        &dids,
                        &dws,
                        &mut out,
                        &mut ws_buf,
                        s,
                        tile,
                    )
                    .unwrap()
                })
            };
            let (us_small, us_large) = (run(SMALL), run(LARGE));
            let chosen = TileCfg::select(&s);
            let us = if chosen == SMALL { us_small } else { us_large };
            let gbs = touched as f64 * bytes_per_expert / (us * 1e-6) / 1e9;
            let tflops = 2.0 * (t * k * 3 * h * i) as f64 / (us * 1e-6) / 1e12;
            if t <= 64 {
                println!(
                    "moe decode T={t}: {us:.1} µs, {gbs:.0} GB/s of expert weights ({touched} experts, {:.1} MB), {tflops:.1} TFLOP/s",
                    touched as f64 * bytes_per_expert / 1e6
                );
            } else {
                println!(
                    "moe prefill T={t}: {us:.1} µs, {tflops:.1} TFLOP/s, {gbs:.0} GB/s of expert weights ({touched} experts)"
                );
            }
            println!(
                "moe tiles T={t}: small {us_small:.1} µs, large {us_large:.1} µs, chosen {}",
                if chosen == SMALL { "small" } else { "large" }
            );
        }
        let logits = cx.stream().clone_htod(&rand_bf16_f32(2048 * e, 9)).unwrap();
        let mut di = cx.stream().alloc_zeros::<i32>(2048 * k).unwrap();
        let mut dw = cx.stream().alloc_zeros::<f32>(2048 * k).unwrap();
        for t in [1usize, 2048] {
            let us = time_us(&cx, || {
                let mut vi = di.slice_mut(..t * k);
                let mut vw = dw.slice_mut(..t * k);
                let vl = logits.slice(..t * e);
                cx.moe_topk_softmax(&vl, &mut vi, &mut vw, t, e, k, true)
                    .unwrap()
            });
            println!("moe topk T={t}: {us:.1} µs");
        }
    }
}
