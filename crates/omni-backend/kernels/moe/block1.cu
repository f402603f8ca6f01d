// The whole MoE block of a one-token decode step in one launch (src/cuda/moe/block1.rs): the
// post-attention norm, router and top-k of `moe_route_r1`, the gate_up of
// `moe_small_gate_up_r1`, and the down projection, weighted sum and residual add of
// `moe_small_down`, with their arithmetic in their order (the same bits), on a grid of one CTA
// per SM that meets at two grid barriers:
//
//   phase 1  every CTA normalises the row itself (residual + delta, f32, into shared memory);
//            CTA c computes the logits of experts c, c + G, ... (one warp each); barrier 1;
//   phase 2  every CTA routes the token from the logits (`moe_topk_warp`), starts copying the
//            routed experts' w2 rows of its output rows into shared memory (cp.async: they
//            stream under the gate_up loads instead of after them), and computes its share of
//            act (one warp per (slot, column)); barrier 2;
//   phase 3  every CTA stages act, and warp w computes output row n0 + w from the staged w2
//            rows: y per slot, the weighted sum in slot order, residual[n] = (residual[n] +
//            delta[n]) + bf16(sum).
//
// Three launches become one: no launch gap or ramp between the router and the experts, and the
// down weights arrive while gate_up streams. Needs every CTA resident at once (the grid is the
// SM count, one CTA per SM by its shared memory) and triggers its dependents only after barrier
// 1, when every CTA is resident, so a dependent grid cannot take an SM one of its CTAs waits
// for. A barrier that waits longer than GRID_TIMEOUT_NS traps (a launch error) instead of hanging.
// `stamps` (null but in a test) takes each CTA's %globaltimer at MB1_STAMPS points.
// The router, gate_up and down loops repeat small.cu's text on purpose: the same statements in
// the same order give the same bits, which `moe_block1_matches_the_three_small_kernels` checks.
// Moving them into shared helpers kept small.cu's SASS byte for byte but changed this kernel's
// (sm_90 CUBINs compared on the CPU), so that waits for a GPU to measure it on.
//
// `moe_block1_ef` (the same code with EF) reads the routed experts' gate/up and down rows with
// the evict-first L2 policy: each is read once a step, so its lines are the first to go and the
// rest of L2 (the next kernels' weights and activations) stays (H200: 34.9 -> 34.3 µs a launch,
// +1.4% at batch 1 in the engine).
// Prepended by the Rust side: bf16.cuh, grid_sync.cuh, gemv_common.cuh, moe/topk_warp.cuh.

#define MB1_THREADS 512
#define MB1_MAX_TOPK 32
#define MB1_ROUTE_UNROLL 16
#define MB1_STAMPS 9
#define MB1_STAMP(i) \
    if (stamps != nullptr && tid == 0) stamps[(size_t)c * MB1_STAMPS + (i)] = grid_now()

__device__ __forceinline__ void mb1_cp16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(gmem) : "memory");
#else
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

// mb1_cp16, with EF evict-first in L2 under `pol` (a createpolicy value).
template <bool EF>
__device__ __forceinline__ void mb1_cp16_w(void* smem, const void* gmem, unsigned long long pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (EF) {
        const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
                     :: "r"(s), "l"(gmem), "l"(pol) : "memory");
        return;
    }
#endif
    mb1_cp16(smem, gmem);
}

// A read-only 16-byte weight load: plain, or with EF under the L2 policy `pol`, not kept in L1.
template <bool EF>
__device__ __forceinline__ uint4 mb1_ld_w(const uint4* p, unsigned long long pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (EF) {
        uint4 v;
        asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
        return v;
    }
#endif
    return *p;
}

// The L2 policy value "every line evict-first".
__device__ __forceinline__ unsigned long long mb1_evict_first() {
    unsigned long long pol = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
    return pol;
}

__device__ __forceinline__ void mb1_cp_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Grid: gridDim.x CTAs (all resident) of MB1_THREADS threads. CTA c owns output rows
// c * rows_per_cta .. + rows_per_cta (clipped to hidden; rows_per_cta <= MB1_THREADS / 32) and
// gate_up outputs [c * K I / G, (c + 1) * K I / G). Dynamic shared memory: rows_per_cta * K *
// inter bf16 (w2 rows), max(hidden f32, K * inter bf16) (the normed row, then act), hidden
// bf16 (h), num_experts floats (probabilities). `bar`: two unsigned, zero before the first
// launch, left with bar[0] = 0. `act` ([K, inter] bf16) is scratch between the phases.
#define MB1_PARAMS                                                                            \
    float *residual, const float *__restrict__ delta, const unsigned short *__restrict__ norm_w, \
        const float *__restrict__ router, const unsigned short *__restrict__ w13,               \
        const unsigned short *__restrict__ w2, unsigned short *__restrict__ h_out,              \
        float *logits, int *__restrict__ ids_out, float *__restrict__ wts_out,                  \
        unsigned short *act, unsigned *bar, int hidden, int inter, int num_experts, int top_k,  \
        int renorm, float eps, int rows_per_cta, unsigned long long *stamps
#define MB1_ARGS                                                                              \
    residual, delta, norm_w, router, w13, w2, h_out, logits, ids_out, wts_out, act, bar, hidden, \
        inter, num_experts, top_k, renorm, eps, rows_per_cta, stamps

extern __shared__ __align__(16) unsigned char mb1_smem[];

// EF: the experts' rows evict-first in L2; without it every load is the plain one.
template <bool EF>
__device__ __forceinline__ void mb1_block(MB1_PARAMS) {
    __shared__ float sh[32];
    __shared__ int s_ids[MB1_MAX_TOPK];
    __shared__ float s_wts[MB1_MAX_TOPK];
    const int K = top_k, ci = inter >> 3, hc = hidden >> 3;
    const size_t w2_bytes = (size_t)rows_per_cta * K * inter * 2;
    const size_t xa_bytes = ((size_t)max(hidden * 4, K * inter * 2) + 15) & ~(size_t)15;
    uint4* s_w2 = reinterpret_cast<uint4*>(mb1_smem);
    float* xs = reinterpret_cast<float*>(mb1_smem + w2_bytes);           // phase 1
    uint4* s_act = reinterpret_cast<uint4*>(mb1_smem + w2_bytes);        // phase 3
    unsigned short* s_h = reinterpret_cast<unsigned short*>(mb1_smem + w2_bytes + xa_bytes);
    float* probs = reinterpret_cast<float*>(mb1_smem + w2_bytes + xa_bytes + (size_t)hidden * 2);
    const int G = gridDim.x, c = blockIdx.x, tid = threadIdx.x;
    const int lane = tid & 31, wid = tid >> 5, warps = MB1_THREADS / 32;
    MB1_STAMP(0);

    // Phase 1. The router row of this warp's first expert (weights: readable before the wait).
    const int chunks4 = hidden >> 2;
    const int e0 = c + G * wid;
    float4 wv[MB1_ROUTE_UNROLL];
    if (e0 < num_experts) {
        const float4* wr = reinterpret_cast<const float4*>(router + (size_t)e0 * hidden);
#pragma unroll
        for (int u = 0; u < MB1_ROUTE_UNROLL; ++u) {
            const int cc = lane + 32 * u;
            if (cc < chunks4) wv[u] = wr[cc];
        }
    }
    pdl_wait();
    MB1_STAMP(1);
    // The norm of `fused_add_rmsnorm_f32res` (moe_route_r1's loops and block sum, played over
    // its own thread count), keeping residual + delta in xs.
    const int vt = gv_norm_threads(hidden);
    const float total = gv_virtual_block_sum(vt, sh, [&](int v) {
        float ss = 0.f;
        for (int i = v * 4; i < hidden; i += vt * 4) {
            float4 x = *reinterpret_cast<const float4*>(residual + i);
            if (delta) {
                const float4 d = *reinterpret_cast<const float4*>(delta + i);
                x.x += d.x; x.y += d.y; x.z += d.z; x.w += d.w;
            }
            *reinterpret_cast<float4*>(xs + i) = x;
            ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        }
        return ss;
    });
    const float inv = rsqrtf(total / (float)hidden + eps);
    // Each element is rewritten by the virtual thread that wrote it: thread v % blockDim.
    for (int v = tid; v < vt; v += MB1_THREADS) {
        for (int i = v * 4; i < hidden; i += vt * 4) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float y = bf2f(norm_w[i + j]) * (xs[i + j] * inv);
                xs[i + j] = y;
                s_h[i + j] = f2bf(y);
            }
        }
    }
    __syncthreads();
    if (c == 0)
        for (int i = tid; i < hidden; i += MB1_THREADS) h_out[i] = s_h[i];
    // Logits: moe_route_r1's warp dot product (its chunk order and reduction).
    for (int e = e0; e < num_experts; e += G * warps) {
        const float4* wr = reinterpret_cast<const float4*>(router + (size_t)e * hidden);
        float acc = 0.f;
        for (int base = 0; base < chunks4; base += 32 * MB1_ROUTE_UNROLL) {
            if (base > 0 || e != e0) {
#pragma unroll
                for (int u = 0; u < MB1_ROUTE_UNROLL; ++u) {
                    const int cc = base + lane + 32 * u;
                    if (cc < chunks4) wv[u] = wr[cc];
                }
            }
#pragma unroll
            for (int u = 0; u < MB1_ROUTE_UNROLL; ++u) {
                const int cc = base + lane + 32 * u;
                if (cc < chunks4) {
                    const float4 xv = reinterpret_cast<const float4*>(xs)[cc];
                    acc += xv.x * wv[u].x;
                    acc += xv.y * wv[u].y;
                    acc += xv.z * wv[u].z;
                    acc += xv.w * wv[u].w;
                }
            }
        }
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) logits[e] = acc;
    }
    MB1_STAMP(2);
    grid_sync(bar, (unsigned)G);
    MB1_STAMP(3);
    // Every CTA is resident: dependents may launch now (they wait for this grid to complete).
    pdl_launch_dependents();

    // Phase 2. Routing, read past L1 (other CTAs wrote the logits).
    if (wid == 0) {
        for (int i = lane; i < num_experts; i += 32) probs[i] = __ldcg(logits + i);
        __syncwarp();
        moe_topk_warp(probs, probs, s_ids, s_wts, num_experts, K, renorm, lane);
        __syncwarp();
        if (c == 0 && lane < K) {
            ids_out[lane] = s_ids[lane];
            wts_out[lane] = s_wts[lane];
        }
    }
    __syncthreads();
    MB1_STAMP(4);
    const unsigned long long pol = EF ? mb1_evict_first() : 0ull;
    // The w2 rows n0 .. n0 + rows of each routed expert into s_w2[(r * K + k) * ci + chunk].
    const int n0 = c * rows_per_cta;
    const int rows = max(0, min(rows_per_cta, hidden - n0));
    for (int i = tid; i < rows * K * ci; i += MB1_THREADS) {
        const int rk = i / ci, ch = i - rk * ci;
        const int r = rk / K, k = rk - r * K;
        const int e = s_ids[k];
        if (e < 0 || e >= num_experts) continue;
        mb1_cp16_w<EF>(s_w2 + i, w2 + ((size_t)e * hidden + n0 + r) * inter + (size_t)ch * 8, pol);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
    // gate_up: moe_small_gate_up_r1's warp per output (its chunk order and reduction).
    {
        const long long total_o = (long long)K * inter;
        const int o0 = (int)(total_o * c / G), o1 = (int)(total_o * (c + 1) / G);
        const uint4* xb = reinterpret_cast<const uint4*>(s_h);
        for (int o = o0 + wid; o < o1; o += warps) {
            const int k = o / inter, j = o - k * inter;
            const int e = s_ids[k];
            if (e < 0 || e >= num_experts) continue;  // warp-uniform
            const uint4* wg = reinterpret_cast<const uint4*>(w13 + ((size_t)e * 2 * inter + j) * hidden);
            const uint4* wu = wg + (size_t)inter * hc;
            float g = 0.f, up = 0.f;
            for (int base = 0; base < hc; base += 32 * GV_UNROLL) {
                uint4 wa[GV_UNROLL], wb[GV_UNROLL];
#pragma unroll
                for (int u = 0; u < GV_UNROLL; ++u) {
                    const int cc = base + lane + 32 * u;
                    if (cc < hc) {
                        wa[u] = mb1_ld_w<EF>(wg + cc, pol);
                        wb[u] = mb1_ld_w<EF>(wu + cc, pol);
                    }
                }
#pragma unroll
                for (int u = 0; u < GV_UNROLL; ++u) {
                    const int cc = base + lane + 32 * u;
                    if (cc < hc) {
                        float wf[8], wq[8];
                        gv_unpack(wa[u], wf);
                        gv_unpack(wb[u], wq);
                        const uint4 xv = xb[cc];
                        g += gv_dot8(xv, wf);
                        up += gv_dot8(xv, wq);
                    }
                }
            }
            for (int s = 16; s > 0; s >>= 1) g += __shfl_xor_sync(0xffffffffu, g, s);
            for (int s = 16; s > 0; s >>= 1) up += __shfl_xor_sync(0xffffffffu, up, s);
            if (lane == 0) act[(size_t)k * inter + j] = f2bf(g / (1.0f + expf(-g)) * up);
        }
    }
    MB1_STAMP(5);
    mb1_cp_wait_all();
    MB1_STAMP(6);
    grid_sync(bar, (unsigned)G);
    MB1_STAMP(7);

    // Phase 3. act (written by every CTA) past L1 into shared memory, over xs.
    if (rows == 0) {
        MB1_STAMP(8);
        return;
    }
    {
        const uint4* src = reinterpret_cast<const uint4*>(act);
        for (int i = tid; i < K * ci; i += MB1_THREADS) s_act[i] = __ldcg(src + i);
    }
    __syncthreads();
    for (int r = wid; r < rows; r += warps) {
        const int n = n0 + r;
        float sum = 0.f;
        for (int k = 0; k < K; ++k) {
            const int e = s_ids[k];
            if (e < 0 || e >= num_experts) continue;  // warp-uniform
            const uint4* wr = s_w2 + (size_t)(r * K + k) * ci;
            const uint4* ar = s_act + (size_t)k * ci;
            float acc = 0.f;
            for (int cc = lane; cc < ci; cc += 32) {
                float wf[8];
                gv_unpack(wr[cc], wf);
                acc += gv_dot8(ar[cc], wf);
            }
            for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
            sum += s_wts[k] * bf2f(f2bf(acc));
        }
        if (lane == 0) {
            float x = residual[n];
            if (delta) x += delta[n];
            residual[n] = x + bf2f(f2bf(sum));
        }
    }
    MB1_STAMP(8);
}

extern "C" __global__ void __launch_bounds__(MB1_THREADS, 1) moe_block1(MB1_PARAMS) {
    mb1_block<false>(MB1_ARGS);
}
extern "C" __global__ void __launch_bounds__(MB1_THREADS, 1) moe_block1_ef(MB1_PARAMS) {
    mb1_block<true>(MB1_ARGS);
}
