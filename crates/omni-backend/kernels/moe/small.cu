// The small-batch MoE layer (tokens <= 8; src/cuda/moe/small.rs): three weight-streaming
// kernels in the style of the fused GEMV (gemv.cu), launched with programmatic dependent launch,
// that read all routing from device memory (graph capturable), use no float atomics and sum in a
// fixed order (deterministic):
//
//   moe_route_r*:      one block per (tile of RT tokens, group of experts), any token count:
//                      the post-attention RMSNorm of the f32 residual (optionally after adding
//                      the attention output to it; the threads and reduction order of
//                      `fused_add_rmsnorm_f32res`: the same bits), h = bf16 of it (group 0
//                      writes it), the group's f32 router logits from the unrounded normed rows
//                      (one warp per expert), then the tile's last block to finish (an int
//                      counter per tile, left at 0) routes its tokens with `moe_topk_warp`;
//   moe_small_gate_up: one block per (pair, chunk of 8 intermediate columns): the first pair
//                      routed to an expert streams that expert's gate and up rows once for every
//                      pair routed to it (other pairs' blocks exit), one warp per column, and
//                      writes act[pair] = bf16(silu(gate) * up) (the grouped GEMM's rounding);
//                      one entry per bound R on the members (<= tokens) an expert can have,
//                      and a `_pf` twin of each that prefetches the routed experts' w2 into
//                      L2 for the down kernel (its w13 loads evict-first);
//   moe_small_down:    one warp per output row n: for each distinct routed expert (pair order)
//                      it streams that expert's w2 row n once, up to MS_DOWN_SLOTS 16-byte chunks
//                      per lane in flight (the first group issued before the wait),
//                      y[pair] = bf16(act[pair] . w2 row) for the pairs routed to it, then
//                      residual[t, n] += bf16(sum over the token's slots in order of w * y) (the
//                      rounding of `moe_reduce`); one entry per V = ceil(inter / 256), the
//                      chunks of a w2 row a lane holds. It may name a later kernel's weights
//                      (`L2_PREFETCH_ARGS`) to prefetch into L2 before its wait.
//
// Dot products accumulate in f32 in the order of the plain loop `for (c = lane; c < chunks;
// c += 32)` over 8-wide chunks, then the xor-shuffle warp reduction (as gemv.cu).
// Prepended by the Rust side: bf16.cuh, gemv_common.cuh, moe/topk_warp.cuh.

#define MS_MAX_PAIRS 256
#define MS_DOWN_ROWS 8
#define MS_DOWN_SLOTS 24
#define MS_ROUTE_UNROLL 16

// Grid: tiles * groups blocks of block_threads(hidden / 4) threads (the unfused norm's); block
// (tile, g) serves tokens tile * RT .. + RT (fewer in the last tile) and warp w of it expert
// g * warps + w. With `delta` (not null) the row normalised is residual + delta (the add of
// `fused_add_rmsnorm_f32res`, mode 0), and the tile's last block writes it back into the
// residual once every block of the tile has read the old rows. Dynamic shared memory:
// RT * (hidden + num_experts) floats. counters: one int per tile, left at 0.
template <int RT>
__device__ __forceinline__ void ms_route(float* residual, const float* __restrict__ delta,
        const unsigned short* __restrict__ norm_w, const float* __restrict__ router,
        unsigned short* __restrict__ h_out, float* logits, int* __restrict__ ids,
        float* __restrict__ wts, int* counters, int tokens, int hidden, int num_experts,
        int top_k, int groups, int renorm, float eps) {
    extern __shared__ __align__(16) float ms_route_smem[];
    __shared__ float sh[RT][32];
    __shared__ int s_last;
    float* xs = ms_route_smem;                  // [RT][hidden]
    float* probs = ms_route_smem + RT * hidden;  // [RT][num_experts]
    pdl_launch_dependents();
    const int tile = blockIdx.x / groups, g = blockIdx.x - tile * groups;
    const int t0 = tile * RT, rows = min(RT, tokens - t0);
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int e = g * warps + wid;
    const bool live = e < num_experts;
    const int chunks = hidden >> 2;
    const float4* wr = reinterpret_cast<const float4*>(router + (size_t)(live ? e : 0) * hidden);
    float4 wv[MS_ROUTE_UNROLL];
#pragma unroll
    for (int u = 0; u < MS_ROUTE_UNROLL; ++u) {
        const int c = lane + 32 * u;
        if (live && c < chunks) wv[u] = wr[c];
    }
    pdl_wait();
    // The norm of each row: `fused_add_rmsnorm_f32res` (the same per-thread partial sums and
    // the same block reduction, here for the tile's rows at once).
    float ss[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        ss[r] = 0.f;
        if (r < rows) {
            const float* x = residual + (size_t)(t0 + r) * hidden;
            const float* d = delta ? delta + (size_t)(t0 + r) * hidden : nullptr;
            for (int i = threadIdx.x * 4; i < hidden; i += blockDim.x * 4) {
                float4 v = *reinterpret_cast<const float4*>(x + i);
                if (d) {
                    const float4 dv = *reinterpret_cast<const float4*>(d + i);
                    v.x += dv.x; v.y += dv.y; v.z += dv.z; v.w += dv.w;
                }
                *reinterpret_cast<float4*>(xs + (size_t)r * hidden + i) = v;
                ss[r] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r)
        for (int o = 16; o > 0; o >>= 1) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], o);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RT; ++r) sh[r][wid] = ss[r];
    }
    __syncthreads();
    if (wid == 0) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            float v = lane < warps ? sh[r][lane] : 0.f;
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) sh[r][0] = v;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        if (r >= rows) break;
        const float inv = rsqrtf(sh[r][0] / (float)hidden + eps);
        float* xr = xs + (size_t)r * hidden;
        // Each thread rewrites the elements it wrote above: no barrier between.
        for (int i = threadIdx.x * 4; i < hidden; i += blockDim.x * 4) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float v = bf2f(norm_w[i + j]) * (xr[i + j] * inv);
                xr[i + j] = v;
                if (g == 0) h_out[(size_t)(t0 + r) * hidden + i + j] = f2bf(v);
            }
        }
    }
    __syncthreads();
    if (live) {
        float acc[RT];
#pragma unroll
        for (int r = 0; r < RT; ++r) acc[r] = 0.f;
        for (int base = 0; base < chunks; base += 32 * MS_ROUTE_UNROLL) {
            if (base > 0) {
#pragma unroll
                for (int u = 0; u < MS_ROUTE_UNROLL; ++u) {
                    const int c = base + lane + 32 * u;
                    if (c < chunks) wv[u] = wr[c];
                }
            }
#pragma unroll
            for (int u = 0; u < MS_ROUTE_UNROLL; ++u) {
                const int c = base + lane + 32 * u;
                if (c < chunks) {
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        if (r < rows) {
                            const float4 xv = reinterpret_cast<const float4*>(xs + (size_t)r * hidden)[c];
                            acc[r] += xv.x * wv[u].x;
                            acc[r] += xv.y * wv[u].y;
                            acc[r] += xv.z * wv[u].z;
                            acc[r] += xv.w * wv[u].w;
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            if (r >= rows) break;
            float a = acc[r];
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) logits[(size_t)(t0 + r) * num_experts + e] = a;
        }
    }
    // The tile's last block routes it: every block publishes its logits (fence) before it
    // counts itself; the one that sees groups - 1 reads them all back past L1. Its count also
    // tells it every block of the tile has read the residual rows, so it may write them.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counters + tile, 1) == groups - 1;
    __syncthreads();
    if (!s_last) return;
    if (threadIdx.x == 0) counters[tile] = 0;
    __threadfence();
    if (delta) {
        for (int r = 0; r < rows; ++r) {
            float* x = residual + (size_t)(t0 + r) * hidden;
            const float* d = delta + (size_t)(t0 + r) * hidden;
            for (int i = threadIdx.x * 4; i < hidden; i += blockDim.x * 4) {
                float4 v = *reinterpret_cast<const float4*>(x + i);
                const float4 dv = *reinterpret_cast<const float4*>(d + i);
                v.x += dv.x; v.y += dv.y; v.z += dv.z; v.w += dv.w;
                *reinterpret_cast<float4*>(x + i) = v;
            }
        }
    }
    // Warp w routes rows w, w + warps, ... in its own slice of probs (RT slices).
    for (int r = wid; r < rows; r += warps) {
        float* pr = probs + (size_t)r * num_experts;
        const volatile float* row = logits + (size_t)(t0 + r) * num_experts;
        for (int i = lane; i < num_experts; i += 32) pr[i] = row[i];
        __syncwarp();
        moe_topk_warp(pr, pr, ids + (size_t)(t0 + r) * top_k, wts + (size_t)(t0 + r) * top_k,
                      num_experts, top_k, renorm, lane);
    }
}

#define MS_ROUTE_ARGS float* residual, const float* __restrict__ delta, \
        const unsigned short* __restrict__ norm_w, const float* __restrict__ router, \
        unsigned short* __restrict__ h_out, float* logits, int* __restrict__ ids, \
        float* __restrict__ wts, int* counters, int tokens, int hidden, int num_experts, \
        int top_k, int groups, int renorm, float eps
#define MS_ROUTE_PASS residual, delta, norm_w, router, h_out, logits, ids, wts, counters, \
        tokens, hidden, num_experts, top_k, groups, renorm, eps
extern "C" __global__ void __launch_bounds__(512) moe_route_r1(MS_ROUTE_ARGS) {
    ms_route<1>(MS_ROUTE_PASS);
}
extern "C" __global__ void __launch_bounds__(512) moe_route_r4(MS_ROUTE_ARGS) {
    ms_route<4>(MS_ROUTE_PASS);
}

// Warp 0 of the block of pair p: the pairs q >= p routed to p's expert, in order, into
// members (shared), and their count; 0 when p's id is outside [0, E) or an earlier pair has the
// same expert (that pair's blocks do the work).
__device__ __forceinline__ int ms_members(const int* __restrict__ ids, int p, int pairs,
        int num_experts, int* members) {
    const int lane = threadIdx.x & 31;
    const int e = ids[p];
    if (e < 0 || e >= num_experts) return 0;
    int n = 0;
    bool first = true;
    for (int base = 0; base < pairs; base += 32) {
        const int q = base + lane;
        const bool m = q < pairs && ids[q] == e;
        if (__ballot_sync(0xffffffffu, m && q < p)) first = false;
        const unsigned after = __ballot_sync(0xffffffffu, m && q >= p);
        if (m && q >= p) members[n + __popc(after & ((1u << lane) - 1u))] = q;
        n += __popc(after);
    }
    return first ? n : 0;
}

// A w13 chunk: with PF the load is marked evict-first in L2 (`ld.global.cs`: the rows are read
// once), so that the w2 rows prefetched meanwhile stay resident for the down kernel.
template <bool PF>
__device__ __forceinline__ uint4 ms_w13_load(const uint4* p) {
    if constexpr (PF) return __ldcs(p);
    else return *p;
}

// Grid: pairs * col_blocks blocks of 256 threads (8 warps); block b serves pair b / col_blocks
// and columns (b % col_blocks) * 8 + warp. act is [pairs, inter] bf16 (rows of pairs whose id
// is invalid are not written). R bounds the accumulators: members are taken R at a time.
// With PF, w2 (the down kernel's weights, [num_experts, hidden, inter]) is prefetched into L2
// while the gate and up rows stream: the working block of column block cb of an expert issues
// slice cb of that expert's w2 (col_blocks slices in all), so the down kernel reads its rows
// from L2 instead of memory.
template <int R, bool PF>
__device__ __forceinline__ void ms_gate_up(const unsigned short* __restrict__ x,
        const unsigned short* __restrict__ w13, const int* __restrict__ ids,
        unsigned short* __restrict__ act, int pairs, int top_k, int hidden, int inter,
        int num_experts, int col_blocks, const unsigned short* __restrict__ w2) {
    __shared__ int s_members[MS_MAX_PAIRS];
    __shared__ int s_n;
    pdl_wait();
    // Triggered after the wait: when the down kernel launches, the routing this grid waited for
    // is complete, so the down kernel may read it before its own wait.
    pdl_launch_dependents();
    const int p = blockIdx.x / col_blocks, cb = blockIdx.x - p * col_blocks;
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        const int n = ms_members(ids, p, pairs, num_experts, s_members);
        if (lane == 0) s_n = n;
    }
    __syncthreads();
    const int n = s_n;
    if constexpr (PF) {
        // One slice of 16-byte multiples per column block, in chunks over warp 0's lanes.
        if (n > 0 && threadIdx.x < 32) {
            const unsigned long long bytes = (unsigned long long)hidden * inter * 2ull;
            const unsigned long long slice = ((bytes + col_blocks - 1) / col_blocks + 15ull) & ~15ull;
            const unsigned long long lo = (unsigned long long)cb * slice;
            const unsigned long long hi = lo + slice < bytes ? lo + slice : bytes;
            const char* base = reinterpret_cast<const char*>(w2) + (size_t)ids[p] * bytes;
            for (unsigned long long off = lo + L2_PREFETCH_CHUNK * lane; off < hi;
                 off += L2_PREFETCH_CHUNK * 32ull)
                l2_prefetch_chunk(base, off, hi);
        }
    }
    const int o = cb * warps + (threadIdx.x >> 5);
    if (n == 0 || o >= inter) return;
    const int e = ids[p];
    const int chunks = hidden >> 3;
    const uint4* w0 = reinterpret_cast<const uint4*>(w13 + ((size_t)e * 2 * inter + o) * hidden);
    const uint4* w1 = w0 + (size_t)inter * chunks;  // up row o
    const uint4* xb = reinterpret_cast<const uint4*>(x);
    for (int mb = 0; mb < n; mb += R) {
        const int rows = min(R, n - mb);
        float acc[R], accb[R];
        int xo[R];  // the member's token row of x, in uint4 chunks
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = 0.f;
            accb[r] = 0.f;
            xo[r] = (s_members[mb + min(r, rows - 1)] / top_k) * chunks;
        }
        for (int base = 0; base < chunks; base += 32 * GV_UNROLL) {
            uint4 wa[GV_UNROLL], wb[GV_UNROLL];
#pragma unroll
            for (int u = 0; u < GV_UNROLL; ++u) {
                const int c = base + lane + 32 * u;
                if (c < chunks) {
                    wa[u] = ms_w13_load<PF>(w0 + c);
                    wb[u] = ms_w13_load<PF>(w1 + c);
                }
            }
#pragma unroll
            for (int u = 0; u < GV_UNROLL; ++u) {
                const int c = base + lane + 32 * u;
                if (c < chunks) {
                    float wf[8], wg[8];
                    gv_unpack(wa[u], wf);
                    gv_unpack(wb[u], wg);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        if (r < rows) {
                            const uint4 xv = xb[xo[r] + c];
                            acc[r] += gv_dot8(xv, wf);
                            accb[r] += gv_dot8(xv, wg);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < rows) {
                float g = acc[r], u = accb[r];
                for (int s = 16; s > 0; s >>= 1) g += __shfl_xor_sync(0xffffffffu, g, s);
                for (int s = 16; s > 0; s >>= 1) u += __shfl_xor_sync(0xffffffffu, u, s);
                if (lane == 0)
                    act[(size_t)s_members[mb + r] * inter + o] = f2bf(g / (1.0f + expf(-g)) * u);
            }
        }
    }
}

#define MS_GATE_UP_ARGS const unsigned short* __restrict__ x, \
        const unsigned short* __restrict__ w13, const int* __restrict__ ids, \
        unsigned short* __restrict__ act, int pairs, int top_k, int hidden, int inter, \
        int num_experts, int col_blocks, const unsigned short* __restrict__ w2
#define MS_GATE_UP_PASS x, w13, ids, act, pairs, top_k, hidden, inter, num_experts, col_blocks, w2
// Single-member blocks fit three per SM (24 warps, 8 KiB of weights in flight each). The
// `_pf` entries prefetch w2 (`w2` is not read by the others).
#define MS_GATE_UP_ENTRY(name, r, pf, min_blocks) \
    extern "C" __global__ void __launch_bounds__(256, min_blocks) name(MS_GATE_UP_ARGS) { \
        ms_gate_up<r, pf>(MS_GATE_UP_PASS); \
    }
MS_GATE_UP_ENTRY(moe_small_gate_up_r1, 1, false, 3)
MS_GATE_UP_ENTRY(moe_small_gate_up_r2, 2, false, 2)
MS_GATE_UP_ENTRY(moe_small_gate_up_r4, 4, false, 2)
MS_GATE_UP_ENTRY(moe_small_gate_up_r8, 8, false, 2)
MS_GATE_UP_ENTRY(moe_small_gate_up_r1_pf, 1, true, 3)
MS_GATE_UP_ENTRY(moe_small_gate_up_r2_pf, 2, true, 2)
MS_GATE_UP_ENTRY(moe_small_gate_up_r4_pf, 4, true, 2)
MS_GATE_UP_ENTRY(moe_small_gate_up_r8_pf, 8, true, 2)

// Grid: ceil(hidden / MS_DOWN_ROWS) blocks of MS_MAX_PAIRS (256) threads: thread q first owns
// pair q (its id, whether it is the first pair of its expert), then warp w owns output row
// blockIdx.x * MS_DOWN_ROWS + w and streams the w2 rows of G = MS_DOWN_SLOTS / V distinct
// experts at a time (V chunks of each per lane), then lane t < tokens sums token t's slots.
// inter <= 32 * 8 * V.
template <int V>
__device__ __forceinline__ void ms_down(const unsigned short* __restrict__ act,
        const unsigned short* __restrict__ w2, const int* __restrict__ ids,
        const float* __restrict__ wts, float* __restrict__ residual, int tokens, int top_k,
        int hidden, int inter, int num_experts, int stage_act, L2_PREFETCH_ARGS) {
    constexpr int G = MS_DOWN_SLOTS / V;
    extern __shared__ __align__(16) uint4 ms_down_act[];
    __shared__ int s_ids[MS_MAX_PAIRS];
    __shared__ int s_own[MS_MAX_PAIRS];
    __shared__ int s_wcount[MS_MAX_PAIRS / 32];
    __shared__ float s_y[MS_DOWN_ROWS][MS_MAX_PAIRS];
    pdl_launch_dependents();
    // The routing (moe_small_route's) is complete before this grid launches: the gate_up
    // kernel between them triggers it only after its own wait. Read past L1 all the same.
    const int pairs = tokens * top_k;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, warps = blockDim.x >> 5;
    int e = -1;
    if (tid < pairs) {
        e = __ldcg(ids + tid);
        if (e < 0 || e >= num_experts) e = -1;
    }
    s_ids[tid] = e;
    __syncthreads();
    bool first = e >= 0;
    for (int r = 0; first && r < tid; ++r) first = s_ids[r] != e;
    const unsigned bal = __ballot_sync(0xffffffffu, first);
    if (lane == 0) s_wcount[wid] = __popc(bal);
    __syncthreads();
    int off = 0, owners = 0;
    for (int w = 0; w < warps; ++w) {
        if (w < wid) off += s_wcount[w];
        owners += s_wcount[w];
    }
    if (first) s_own[off + __popc(bal & ((1u << lane) - 1u))] = tid;
    __syncthreads();
    const int n = blockIdx.x * MS_DOWN_ROWS + wid;
    const bool live = n < hidden;  // warp-uniform
    const int chunks = inter >> 3;
    uint4 wa[G * V];
    // The w2 rows n of the distinct experts u0 .. u0 + G - 1 (weights: readable before the wait).
#define MS_DOWN_LOAD(u0)                                                                     \
    _Pragma("unroll") for (int g = 0; g < G; ++g) {                                          \
        const int u = (u0) + g;                                                              \
        if (live && u < owners) {                                                            \
            const uint4* wr = reinterpret_cast<const uint4*>(                                \
                w2 + ((size_t)s_ids[s_own[u]] * hidden + n) * inter);                        \
            _Pragma("unroll") for (int v = 0; v < V; ++v) {                                  \
                const int c = lane + 32 * v;                                                 \
                if (c < chunks) wa[g * V + v] = wr[c];                                       \
            }                                                                                \
        }                                                                                    \
    }
    MS_DOWN_LOAD(0)
    // A later kernel's weights (the next layer's QKV) into L2 while this grid waits and streams.
    if (l2_prefetch(pf0, pf0_bytes, pf1, pf1_bytes, pf_work_blocks)) return;
    pdl_wait();
    // With stage_act the pairs' act rows (pairs * inter bf16, the dynamic shared memory) are
    // copied in once by the whole block: every warp reads every row, and from shared memory
    // the dot products of one warp's experts do not wait on L2 one after another.
    const uint4* act_rows = reinterpret_cast<const uint4*>(act);
    if (stage_act) {
        const uint4* src = act_rows;
        for (int i = tid; i < pairs * chunks; i += blockDim.x) ms_down_act[i] = src[i];
        __syncthreads();
        act_rows = ms_down_act;
    }
    for (int u0 = 0; u0 < owners; u0 += G) {
        if (u0 > 0) { MS_DOWN_LOAD(u0) }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const int u = u0 + g;
            if (!live || u >= owners) break;  // warp-uniform
            const int p = s_own[u], ex = s_ids[p];
            for (int q = p; q < pairs; ++q) {
                if (s_ids[q] != ex) continue;  // warp-uniform (shared broadcast)
                const uint4* ar = act_rows + (size_t)q * chunks;
                float acc = 0.f;
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    const int c = lane + 32 * v;
                    if (c < chunks) {
                        float wf[8];
                        gv_unpack(wa[g * V + v], wf);
                        acc += gv_dot8(ar[c], wf);
                    }
                }
                for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
                if (lane == 0) s_y[wid][q] = bf2f(f2bf(acc));
            }
        }
    }
#undef MS_DOWN_LOAD
    __syncwarp();
    if (live && lane < tokens) {
        const int t = lane;
        float acc = 0.f;
        for (int s = 0; s < top_k; ++s) {
            const int q = t * top_k + s;
            if (s_ids[q] < 0) continue;
            acc += wts[q] * s_y[wid][q];
        }
        residual[(size_t)t * hidden + n] += bf2f(f2bf(acc));
    }
}

#define MS_DOWN_ARGS const unsigned short* __restrict__ act, \
        const unsigned short* __restrict__ w2, const int* __restrict__ ids, \
        const float* __restrict__ wts, float* __restrict__ residual, int tokens, int top_k, \
        int hidden, int inter, int num_experts, int stage_act, L2_PREFETCH_ARGS
#define MS_DOWN_PASS act, w2, ids, wts, residual, tokens, top_k, hidden, inter, num_experts, \
        stage_act, pf0, pf0_bytes, pf1, pf1_bytes, pf_work_blocks
#define MS_DOWN_ENTRY(name, v) \
    extern "C" __global__ void __launch_bounds__(256) name(MS_DOWN_ARGS) { \
        ms_down<v>(MS_DOWN_PASS); \
    }
MS_DOWN_ENTRY(moe_small_down_v1, 1)
MS_DOWN_ENTRY(moe_small_down_v2, 2)
MS_DOWN_ENTRY(moe_small_down_v3, 3)
MS_DOWN_ENTRY(moe_small_down_v4, 4)
MS_DOWN_ENTRY(moe_small_down_v5, 5)
MS_DOWN_ENTRY(moe_small_down_v6, 6)
MS_DOWN_ENTRY(moe_small_down_v7, 7)
MS_DOWN_ENTRY(moe_small_down_v8, 8)
