// The small-batch (rows <= 8) weight-streaming GEMV and the decoder's fused small-batch path
// (src/cuda/gemv/mod.rs): y[r, n] = sum_k x[r, k] * w[n, k], one warp per output (one or two
// weight rows), 16-byte weight loads issued GV_UNROLL at a time (independent, so they are in
// flight together), f32 accumulation in the order of the plain loop `for (c = lane; c < chunks;
// c += 32)` (the same bits whatever the unroll), with
//
//   input   GV_IN_X:     x bf16 [rows, k] from global memory;
//           GV_IN_NORM:  x = bf16(rms_norm(residual[r]) * norm_w), the f32 residual stream
//                        normalised per block exactly as `fused_add_rmsnorm_f32res` does it
//                        (its reduction over its thread count, whatever this block's: the
//                        same bits) into shared memory;
//                        with `set`, the residual is first bf16 `init` [rows, k] (the
//                        embedding), which block 0 also writes to `residual`;
//   output  GV_OUT_BF16 / GV_OUT_F32: y [rows, n];
//           GV_OUT_ADD:  residual[r, col] += y (each warp owns its column: race-free);
//           GV_OUT_SILU: the warp computes columns o and o + n of a fused [gate | up] weight
//                        ([2n, k]) and writes bf16(silu(bf16(gate)) * bf16(up)), the rounding
//                        points of the unfused gate_up GEMV + `silu_mul_bf16`.
//
// Programmatic dependent launch: each kernel lets its dependents launch at once
// (`griddepcontrol.launch_dependents`), prefetches its first weight loads (weights are never
// written by a step), then waits for its predecessor (`griddepcontrol.wait`, a no-op when it
// was launched without the attribute) before it reads or writes any activation.
// Prepended by the Rust side: bf16.cuh, gemv_common.cuh.

#define GV_IN_X 0
#define GV_IN_NORM 1
#define GV_OUT_BF16 0
#define GV_OUT_F32 1
#define GV_OUT_ADD 2
#define GV_OUT_SILU 3

// Grid: ceil(n / 8) blocks of GV_WARPS warps; warp o of the grid owns output column o. Dynamic
// shared memory: rows * k bf16 for GV_IN_NORM (none otherwise). R (>= rows) bounds the
// accumulators, indexed by compile-time rows only (unrolled, predicated on `rows`) so they stay
// in registers; PAIR (SiLU-and-mul) streams two weight rows per warp, UNROLL chunks of each in
// flight per lane. Small R keeps the registers low enough for 32 resident warps per SM (the
// weight loads of a one-row step in flight at once, one wave for most widths).
template <bool PAIR, int R, int UNROLL>
__device__ __forceinline__ void gemv_body(const unsigned short* __restrict__ x, float* residual,
        const unsigned short* __restrict__ norm_w, const unsigned short* __restrict__ w, void* y,
        int rows, int k, int n, int in_mode, int out_mode, int set, float eps) {
    extern __shared__ __align__(16) unsigned short gv_xs[];
    __shared__ float sh[32];
    pdl_launch_dependents();
    const int warps = blockDim.x >> 5;
    const int o = blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const bool live = o < n;
    const int chunks = k >> 3;
    const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)(live ? o : 0) * k);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(live ? o + (PAIR ? n : 0) : 0) * k);
    uint4 wa[UNROLL], wb[PAIR ? UNROLL : 1];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int c = lane + 32 * u;
        if (live && c < chunks) {
            wa[u] = w0[c];
            if (PAIR) wb[u] = w1[c];
        }
    }
    pdl_wait();
    if (in_mode == GV_IN_NORM) {
        for (int r = 0; r < rows; ++r)
            gv_norm_row(residual + (size_t)r * k, x + (size_t)r * k, set != 0,
                        set != 0 && blockIdx.x == 0, residual + (size_t)r * k, norm_w,
                        gv_xs + (size_t)r * k, k, eps, sh);
        __syncthreads();
    }
    if (!live) return;
    const uint4* xin = reinterpret_cast<const uint4*>(in_mode == GV_IN_NORM ? gv_xs : x);
    float acc[R], accb[PAIR ? R : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.f;
        if (PAIR) accb[r] = 0.f;
    }
    for (int base = 0; base < chunks; base += 32 * UNROLL) {
        if (base > 0) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = base + lane + 32 * u;
                if (c < chunks) {
                    wa[u] = w0[c];
                    if (PAIR) wb[u] = w1[c];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = base + lane + 32 * u;
            if (c < chunks) {
                float wf[8], wg[8];
                gv_unpack(wa[u], wf);
                if (PAIR) gv_unpack(wb[u], wg);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (r < rows) {
                        const uint4 xv = xin[(size_t)r * chunks + c];
                        acc[r] += gv_dot8(xv, wf);
                        if (PAIR) accb[r] += gv_dot8(xv, wg);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        float v = acc[r], vb = PAIR ? accb[r] : 0.f;
        for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
        if (PAIR) for (int s = 16; s > 0; s >>= 1) vb += __shfl_xor_sync(0xffffffffu, vb, s);
        if (lane == 0) {
            const size_t at = (size_t)r * n + o;
            if (PAIR) {
                const float g = bf2f(f2bf(v)), u = bf2f(f2bf(vb));
                reinterpret_cast<unsigned short*>(y)[at] = f2bf(g / (1.0f + expf(-g)) * u);
            } else if (out_mode == GV_OUT_F32) reinterpret_cast<float*>(y)[at] = v;
            else if (out_mode == GV_OUT_ADD) residual[at] += v;
            else reinterpret_cast<unsigned short*>(y)[at] = f2bf(v);
        }
    }
}

// The entries: {one weight row, SiLU-and-mul pair} x R in {1, 2, 4, 8}, blocks of GV_WARPS
// warps (the host's PLAIN_WARPS). A pair streams UNROLL / 2 chunks of each row at a time: the
// same loads in flight per lane as one row.
#define GV_WARPS 8
#define GV_ARGS const unsigned short* __restrict__ x, float* residual, \
        const unsigned short* __restrict__ norm_w, const unsigned short* __restrict__ w, void* y, \
        int rows, int k, int n, int in_mode, int out_mode, int set, float eps
#define GV_PASS x, residual, norm_w, w, y, rows, k, n, in_mode, out_mode, set, eps
#define GV_ENTRY(name, pair, r, min_blocks)                                                  \
    extern "C" __global__ void __launch_bounds__(32 * GV_WARPS, min_blocks) name(GV_ARGS) { \
        gemv_body<pair, r, pair ? GV_UNROLL / 2 : GV_UNROLL>(GV_PASS);                      \
    }
GV_ENTRY(gemv_r1, false, 1, 4)
GV_ENTRY(gemv_r2, false, 2, 4)
GV_ENTRY(gemv_r4, false, 4, 3)
GV_ENTRY(gemv_r8, false, 8, 3)
GV_ENTRY(gemv_silu_r1, true, 1, 4)
GV_ENTRY(gemv_silu_r2, true, 2, 3)
GV_ENTRY(gemv_silu_r4, true, 4, 3)
GV_ENTRY(gemv_silu_r8, true, 8, 3)

// The staged GEMV (`gemv_staged_r*`, sm_90 copies; plain loads below it): the same
// y[r, o] = sum_k x[r, k] * w[o, k], bf16 or f32 out, with the weights of a block's rows copied
// into shared memory before its dependency wait. Block b owns the `rpb` contiguous output rows
// o0 = b rpb .. (one contiguous weight region); its first `staged_rows` rows come in by the
// copy engine (`cp.async.bulk`, one mbarrier per group of GS_WARPS rows: warp w computes rows
// w, w + GS_WARPS, .. so it waits for group j / GS_WARPS only), issued by thread 0 as the block
// starts. Launched with programmatic dependent launch right behind the latency-bound kernels of
// a decode step (q/k norm + RoPE, decode attention, the input norm), the block lands while they
// run and streams those weights at the copy engine's rate; after the wait only x is read from
// global memory. Rows past `staged_rows` are streamed as `gemv_body` streams them. Each output
// is added in `gemv_body`'s order (lane c, c + 32, .. then the xor shuffle): the same bits as
// `gemv_r*`. After the wait each block copies x into shared memory, or with GV_IN_NORM
// normalises it there (`gemv_body`'s normalised input: x is then the bf16 `init` of a `set`;
// the decoder's input norm folded into the QKV projection). Grid: ceil(n / rpb) blocks of
// GS_WARPS warps, one block per SM by its shared memory: GS_BAR_BYTES of mbarriers, the input
// rows (rows * k bf16 rounded up to 128 bytes), then staged_rows * k bf16.
#define GS_WARPS 8
#define GS_MAX_GROUPS 32
#define GS_BAR_BYTES (GS_MAX_GROUPS * 8)
#define GS_COPY_BYTES 32768u

template <int R>
__device__ __forceinline__ void gemv_staged_body(const unsigned short* __restrict__ x,
        float* residual, const unsigned short* __restrict__ norm_w,
        const unsigned short* __restrict__ w, void* y, int rows, int k, int n, int rpb,
        int staged_rows, int in_mode, int set, float eps, int out_mode) {
    extern __shared__ __align__(128) unsigned char gs_smem[];
    __shared__ float sh[32];
    pdl_launch_dependents();
    const int o0 = blockIdx.x * rpb;
    const int nr = min(rpb, n - o0);
    const size_t row_bytes = (size_t)k * 2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int ns = max(min(nr, min(staged_rows, GS_MAX_GROUPS * GS_WARPS)), 0);
#else
    const int ns = 0;
#endif
    const unsigned bar0 = (unsigned)__cvta_generic_to_shared(gs_smem);
    // The input rows (rows * k bf16: x copied, or normalised) sit between the barriers and the
    // weights, so that after the wait a block makes one pass over global memory for them.
    const size_t xs_bytes = ((size_t)rows * row_bytes + 127) / 128 * 128;
    unsigned short* xs = reinterpret_cast<unsigned short*>(gs_smem + GS_BAR_BYTES);
    const unsigned char* ws = gs_smem + GS_BAR_BYTES + xs_bytes;
    const int groups = (ns + GS_WARPS - 1) / GS_WARPS;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0 && groups > 0) {
        for (int g = 0; g < groups; ++g)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(bar0 + 8u * g) : "memory");
        // The initialised barriers visible to the copy engine before a copy names them.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        // gv_stage_rows (gemv_common.cuh) with GS_WARPS-row groups, written out: calling it
        // changed this measured kernel's sm_90 code (CUBINs compared on the CPU), so the switch
        // waits for a GPU to measure it.
        const char* src = reinterpret_cast<const char*>(w + (size_t)o0 * k);
        const unsigned dst0 = bar0 + GS_BAR_BYTES + (unsigned)xs_bytes;
        for (int g = 0; g < groups; ++g) {
            const unsigned bar = bar0 + 8u * g;
            const size_t begin = (size_t)g * GS_WARPS * row_bytes;
            const size_t end = (size_t)min(ns, (g + 1) * GS_WARPS) * row_bytes;
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                         :: "r"(bar), "r"((unsigned)(end - begin)) : "memory");
            for (size_t off = begin; off < end; off += GS_COPY_BYTES) {
                const unsigned sz = (unsigned)min((size_t)GS_COPY_BYTES, end - off);
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                    :: "r"(dst0 + (unsigned)off), "l"(src + off), "r"(sz), "r"(bar) : "memory");
            }
        }
    }
#endif
    __syncthreads();  // the barriers are initialised before any thread waits on them
    pdl_wait();
    if (in_mode == GV_IN_NORM) {
        // As `gemv_body`: the input norm of the f32 residual (set first from the bf16 `init`
        // in x, block 0 writing it back), the unfused norm's bits.
        for (int r = 0; r < rows; ++r)
            gv_norm_row(residual + (size_t)r * k, x + (size_t)r * k, set != 0,
                        set != 0 && blockIdx.x == 0, residual + (size_t)r * k, norm_w,
                        xs + (size_t)r * k, k, eps, sh);
    } else {
        const uint4* src = reinterpret_cast<const uint4*>(x);
        uint4* dst = reinterpret_cast<uint4*>(xs);
        for (int i = threadIdx.x; i < rows * (k >> 3); i += blockDim.x) dst[i] = src[i];
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunks = k >> 3;
    const uint4* xin = reinterpret_cast<const uint4*>(xs);
    for (int j = warp; j < nr; j += GS_WARPS) {
        const uint4* wr;
        if (j < ns) {
            gv_stage_wait(bar0 + 8u * (unsigned)(j / GS_WARPS));
            wr = reinterpret_cast<const uint4*>(ws + (size_t)j * row_bytes);
        } else {
            wr = reinterpret_cast<const uint4*>(w + (size_t)(o0 + j) * k);
        }
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.f;
        for (int base = 0; base < chunks; base += 32 * GV_UNROLL) {
            uint4 wa[GV_UNROLL];
#pragma unroll
            for (int u = 0; u < GV_UNROLL; ++u) {
                const int c = base + lane + 32 * u;
                if (c < chunks) wa[u] = wr[c];
            }
#pragma unroll
            for (int u = 0; u < GV_UNROLL; ++u) {
                const int c = base + lane + 32 * u;
                if (c < chunks) {
                    float wf[8];
                    gv_unpack(wa[u], wf);
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        if (r < rows) acc[r] += gv_dot8(xin[(size_t)r * chunks + c], wf);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r >= rows) break;
            float v = acc[r];
            for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
            if (lane == 0) {
                const size_t at = (size_t)r * n + o0 + j;
                if (out_mode == GV_OUT_F32) reinterpret_cast<float*>(y)[at] = v;
                else reinterpret_cast<unsigned short*>(y)[at] = f2bf(v);
            }
        }
    }
}

#define GS_ARGS const unsigned short* __restrict__ x, float* residual, \
        const unsigned short* __restrict__ norm_w, const unsigned short* __restrict__ w, void* y, \
        int rows, int k, int n, int rpb, int staged_rows, int in_mode, int set, float eps, \
        int out_mode
#define GS_ENTRY(name, r)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * GS_WARPS, 1) name(GS_ARGS) {        \
        gemv_staged_body<r>(x, residual, norm_w, w, y, rows, k, n, rpb, staged_rows, in_mode, \
                            set, eps, out_mode);                                           \
    }
GS_ENTRY(gemv_staged_r1, 1)
GS_ENTRY(gemv_staged_r2, 2)
GS_ENTRY(gemv_staged_r4, 4)
GS_ENTRY(gemv_staged_r8, 8)

// out[b] = bf16(rms_norm(residual[rows[b]]) * w) for b < n_rows: the final norm of the rows a
// step outputs, gathered (the fused path's `fused_add_rmsnorm_f32res` + `embedding_ids_bf16`;
// the residual already holds the last sub-block's sum). One block per output row, the threads
// of `fused_add_rmsnorm_f32res`.
extern "C" __global__ void rms_norm_rows_f32res(const float* __restrict__ residual,
        const int* __restrict__ rows, const unsigned short* __restrict__ w,
        unsigned short* __restrict__ out, int dim, float eps) {
    __shared__ float sh[32];
    pdl_launch_dependents();
    pdl_wait();
    const int b = blockIdx.x;
    const float* x = residual + (size_t)rows[b] * dim;
    gv_norm_row(x, nullptr, false, false, nullptr, w, out + (size_t)b * dim, dim, eps, sh);
}
