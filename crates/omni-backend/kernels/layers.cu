// The fused per-layer kernels of the decoder (src/cuda/layers.rs): residual add + RMSNorm,
// QKV split + per-head norm + RoPE + cache write, embedding gather, bias, widening, device fill.
// Prepended by the Rust side: bf16.cuh, rope.cuh.

// Block reduction of a float sum over up to 1024 threads (`blockDim.x` a multiple of 32).
__device__ __forceinline__ float block_sum(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? sh[lane] : 0.f;
    if (wid == 0) for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}

// The residual stream is f32. mode 1: residual = bf16 `init` (the embedding); 2: residual +=
// f32 `delta`; 0: as it is. Then out = residual * rsqrt(mean(residual^2) + eps) * w, and, where
// not null, the unrounded normed rows v into `out32` (f32) and/or the rest of v past its bf16
// `out` into `out_lo` as two more bf16 terms: row r of out_lo is [mid | lo] (2 dim) with
// mid = bf16(v - out), lo = bf16(v - out - mid). Both differences are exact in f32 and the
// three terms hold v's 24-bit significand, so out + mid + lo == v (the MoE router's split bf16
// GEMM takes them for f32 products on tensor cores).
// Launched with programmatic dependent launch: lets dependents launch, issues the L2 prefetch of
// a later kernel's weights (`l2_prefetch`, before the wait: weights only; blocks past the rows
// only prefetch), then waits.
// float4s a thread keeps in registers (rows of up to 4 FAN_REG blockDim elements).
#define FAN_REG 4
// Elements i .. i + 3 of the row at x (row offset `base`) after the update of `mode` (1: from
// bf16 `init`; 2: + f32 `delta`; 0: as they are), written back and returned.
__device__ __forceinline__ float4 fan_update4(float* x, const unsigned short* __restrict__ init,
                                              const float* __restrict__ delta, size_t base, int i,
                                              int mode) {
    float4 v;
    if (mode == 1) {
        const unsigned short* s = init + base + i;
        v = make_float4(bf2f(s[0]), bf2f(s[1]), bf2f(s[2]), bf2f(s[3]));
    } else {
        v = *reinterpret_cast<const float4*>(x + i);
        if (mode == 2) {
            const float4 d = *reinterpret_cast<const float4*>(delta + base + i);
            v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
        }
    }
    *reinterpret_cast<float4*>(x + i) = v;
    return v;
}
extern "C" __global__ void fused_add_rmsnorm_f32res(float* __restrict__ residual,
        const unsigned short* __restrict__ init, const float* __restrict__ delta, int mode,
        const unsigned short* __restrict__ w, unsigned short* __restrict__ out,
        float* __restrict__ out32, unsigned short* __restrict__ out_lo, int dim, float eps,
        int vec, L2_PREFETCH_ARGS) {
    __shared__ float sh[32];
    pdl_launch_dependents();
    if (l2_prefetch(pf0, pf0_bytes, pf1, pf1_bytes, pf_work_blocks)) return;
    pdl_wait();
    const size_t base = (size_t)blockIdx.x * dim;
    float* x = residual + base;
    unsigned short* y = out + base;
    float ss = 0.f;
    if (vec && (dim & 3) == 0 && dim <= 4 * FAN_REG * (int)blockDim.x) {
        // The row in registers (FAN_REG float4 a thread at most), stored 4 elements at a time
        // (`vec`: w, out, out_lo 8-byte and out32 16-byte aligned): the same values, sums and
        // bits as the loops below, without reading the row back.
        float4 vr[FAN_REG];
#pragma unroll
        for (int k = 0; k < FAN_REG; ++k) {
            const int i = (threadIdx.x + k * blockDim.x) * 4;
            if (i >= dim) break;
            const float4 v = fan_update4(x, init, delta, base, i, mode);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            vr[k] = v;
        }
        const float inv = rsqrtf(block_sum(ss, sh) / (float)dim + eps);
#pragma unroll
        for (int k = 0; k < FAN_REG; ++k) {
            const int i = (threadIdx.x + k * blockDim.x) * 4;
            if (i >= dim) break;
            const float xv[4] = {vr[k].x, vr[k].y, vr[k].z, vr[k].w};
            const uint2 wv = *reinterpret_cast<const uint2*>(w + i);
            const unsigned short ws[4] = {(unsigned short)(wv.x & 0xffffu), (unsigned short)(wv.x >> 16),
                                          (unsigned short)(wv.y & 0xffffu), (unsigned short)(wv.y >> 16)};
            float v[4];
            unsigned short hi[4], mid[4], lo[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                v[j] = bf2f(ws[j]) * (xv[j] * inv);
                hi[j] = f2bf(v[j]);
                const float r = v[j] - bf2f(hi[j]);
                mid[j] = f2bf(r);
                lo[j] = f2bf(r - bf2f(mid[j]));
            }
            auto pack4 = [](const unsigned short* q) {
                return make_uint2((unsigned)q[0] | ((unsigned)q[1] << 16),
                                  (unsigned)q[2] | ((unsigned)q[3] << 16));
            };
            *reinterpret_cast<uint2*>(y + i) = pack4(hi);
            if (out32) *reinterpret_cast<float4*>(out32 + base + i) = make_float4(v[0], v[1], v[2], v[3]);
            if (out_lo) {
                *reinterpret_cast<uint2*>(out_lo + 2 * base + i) = pack4(mid);
                *reinterpret_cast<uint2*>(out_lo + 2 * base + dim + i) = pack4(lo);
            }
        }
        return;
    }
    if ((dim & 3) == 0) {
        for (int i = threadIdx.x * 4; i < dim; i += blockDim.x * 4) {
            const float4 v = fan_update4(x, init, delta, base, i, mode);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float v = mode == 1 ? bf2f(init[base + i]) : mode == 2 ? x[i] + delta[base + i] : x[i];
            x[i] = v;
            ss += v * v;
        }
    }
    float inv = rsqrtf(block_sum(ss, sh) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = bf2f(w[i]) * (x[i] * inv);
        const unsigned short hi = f2bf(v);
        y[i] = hi;
        if (out32) out32[base + i] = v;
        if (out_lo) {
            const float r = v - bf2f(hi);
            const unsigned short mid = f2bf(r);
            out_lo[2 * base + i] = mid;
            out_lo[2 * base + dim + i] = f2bf(r - bf2f(mid));
        }
    }
}

extern "C" __global__ void add_bias_f32(float* __restrict__ x, const unsigned short* __restrict__ b,
        long long cols, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += bf2f(b[i % cols]);
}

// One warp per (token, group of `hpw` heads) over q heads then kv heads of this rank,
// QKR_WARPS warps per block (the Rust side groups heads only for long prefills: a warp does its
// heads one after another, which costs a decode step its parallelism). A lane owns E consecutive rotary indices i, i + 1 (E = 2 when
// hd / 2 is even: bf16x2 loads and stores; else E = 1) at i = E * lane + 32 E u, and their
// partners i + hd/2 (hd <= 256). The angles depend on the token and i only, so the warp turns
// them into (cos, sin) once and applies them to each of its heads. qkv row = [q heads | k heads
// | v heads] * hd. Launched with programmatic dependent launch: the positions, the M-RoPE axes
// and the slot mapping are written only by host copies before the step's first kernel, and
// inv_freq by none, so they are read (and the angles computed) before the wait, overlapping the
// predecessor (the QKV projection); qkv, the norm weights and every output after it. The L2
// prefetch of a later kernel's weights is issued before the wait, as in the norm above.
#define QKR_WARPS 4
#define QKR_MAX_PAIRS 4
// Most heads a warp takes (the Rust side's QKV_ROPE_HEADS); their q/k words are all loaded
// before the first is normed, so a warp has every head's loads in flight at once.
#define QKR_MAX_HEADS 8
template <int E, bool GROUPED>
__device__ __forceinline__ void qkr_heads(
        const unsigned short* __restrict__ qkv, unsigned short* __restrict__ q_out,
        unsigned short* __restrict__ k_cache, unsigned short* __restrict__ v_cache,
        const int* __restrict__ positions, const long long* __restrict__ slot_mapping,
        const float* __restrict__ inv_freq, const unsigned short* __restrict__ q_norm,
        const unsigned short* __restrict__ k_norm, const unsigned char* __restrict__ mrope_axes,
        long long pos_stride, long long t, int h0, int h1, int lq, int lkv, int hd, float eps) {
    constexpr int NU = QKR_MAX_PAIRS / E;
    const int half = hd >> 1, lane = threadIdx.x & 31;
    float cs[NU][E], sn[NU][E];
#pragma unroll
    for (int u = 0; u < NU; ++u) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int i = E * lane + 32 * E * u + e;
            cs[u][e] = 1.f;
            sn[u][e] = 0.f;
            if (i < half)
                rope_sincos(positions, inv_freq, mrope_axes, pos_stride, t, i, &sn[u][e],
                            &cs[u][e]);
        }
    }
    const long long slot = h1 > lq ? slot_mapping[t] : -1;
    pdl_wait();
    const size_t row = (size_t)(lq + 2 * lkv) * hd;
    const unsigned short* src_row = qkv + t * row;
    // GROUPED (a warp may have several heads), E = 2: every head's words first (E bf16 of i and of
    // i + hd/2 per lane and u; a padding token's keys are never read), then head by head. A warp
    // of one head, and the scalar path (E = 1, odd hd / 2), load each head's words as they come
    // to it: on an H100 the up-front form took a batch-1 decode step's kernels 0.34 -> 0.58 ms
    // (eager, Qwen3-30B-A3B) for nothing to overlap.
    constexpr int PH = E == 2 && GROUPED ? QKR_MAX_HEADS : 1;
    unsigned wva[PH][NU], wvb[PH][NU];
    auto load = [&](int s, int hh) {
        const bool live = hh < h1 && (hh < lq || slot >= 0);
        const unsigned short* src = src_row + (size_t)hh * hd;
#pragma unroll
        for (int u = 0; u < NU; ++u) {
            const int i = E * lane + 32 * E * u;
            wva[s][u] = wvb[s][u] = 0u;
            if (live && i < half) {
                if constexpr (E == 2) {
                    wva[s][u] = *reinterpret_cast<const unsigned*>(src + i);
                    wvb[s][u] = *reinterpret_cast<const unsigned*>(src + i + half);
                } else {
                    wva[s][u] = src[i];
                    wvb[s][u] = src[i + half];
                }
            }
        }
    };
    if constexpr (PH > 1) {
#pragma unroll
        for (int g = 0; g < PH; ++g) load(g, h0 + g);
    }
    // The norm weights of the current kind of head (q or k), reloaded when it changes.
    const unsigned short* nw_cur = nullptr;
    float wa[NU][E], wb[NU][E];
    // A warp of one head (not GROUPED) takes one pass: no unrolled copies for heads it lacks.
    constexpr int NH = GROUPED ? QKR_MAX_HEADS : 1;
#pragma unroll
    for (int g = 0; g < NH; ++g) {
        const int hh = h0 + g;
        if (hh >= h1) break;
        if (hh >= lq && slot < 0) return;  // a padding token's keys and values: whole warps
        if constexpr (PH == 1) load(0, hh);
        const int sg = PH == 1 ? 0 : g;
        const unsigned short* nw = hh < lq ? q_norm : k_norm;
        float a[NU][E] = {}, b[NU][E] = {};
        float ss = 0.f;
#pragma unroll
        for (int u = 0; u < NU; ++u) {
            const int i = E * lane + 32 * E * u;
            if (i < half) {
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    a[u][e] = bf2f((unsigned short)(wva[sg][u] >> (16 * e)));
                    b[u][e] = bf2f((unsigned short)(wvb[sg][u] >> (16 * e)));
                    ss += a[u][e] * a[u][e] + b[u][e] * b[u][e];
                }
            }
        }
        if (nw) {
            if (nw != nw_cur) {
                nw_cur = nw;
#pragma unroll
                for (int u = 0; u < NU; ++u)
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        const int i = E * lane + 32 * E * u + e;
                        wa[u][e] = i < half ? bf2f(nw[i]) : 0.f;
                        wb[u][e] = i < half ? bf2f(nw[i + half]) : 0.f;
                    }
            }
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            const float inv = rsqrtf(ss / (float)hd + eps);
#pragma unroll
            for (int u = 0; u < NU; ++u)
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    a[u][e] = a[u][e] * inv * wa[u][e];
                    b[u][e] = b[u][e] * inv * wb[u][e];
                }
        }
        const int j = hh - lq;
        unsigned short* dst = hh < lq ? q_out + ((size_t)t * lq + hh) * hd
                                      : k_cache + ((size_t)slot * lkv + j) * hd;
#pragma unroll
        for (int u = 0; u < NU; ++u) {
            const int i = E * lane + 32 * E * u;
            if (i >= half) continue;
            float ra[E], rb[E];
#pragma unroll
            for (int e = 0; e < E; ++e) {
                ra[e] = a[u][e] * cs[u][e] - b[u][e] * sn[u][e];
                rb[e] = b[u][e] * cs[u][e] + a[u][e] * sn[u][e];
            }
            if constexpr (E == 2) {
                *reinterpret_cast<unsigned*>(dst + i) = (unsigned)f2bf(ra[0]) | ((unsigned)f2bf(ra[1]) << 16);
                *reinterpret_cast<unsigned*>(dst + i + half) = (unsigned)f2bf(rb[0]) | ((unsigned)f2bf(rb[1]) << 16);
            } else {
                dst[i] = f2bf(ra[0]);
                dst[i + half] = f2bf(rb[0]);
            }
        }
        if (hh < lq) continue;
        // hd is even and every row offset a multiple of hd: 4-byte words.
        unsigned* vd = reinterpret_cast<unsigned*>(v_cache + ((size_t)slot * lkv + j) * hd);
        const unsigned* vs = reinterpret_cast<const unsigned*>(src_row + (size_t)(lq + lkv + j) * hd);
        for (int i = lane; i < half; i += 32) vd[i] = vs[i];
    }
}

// The kernel body: warp w of the grid takes token w / groups and heads h0 .. h1 of its group.
#define QKR_ARGS const unsigned short* __restrict__ qkv, unsigned short* __restrict__ q_out, \
        unsigned short* __restrict__ k_cache, unsigned short* __restrict__ v_cache, \
        const int* __restrict__ positions, const long long* __restrict__ slot_mapping, \
        const float* __restrict__ inv_freq, const unsigned short* __restrict__ q_norm, \
        const unsigned short* __restrict__ k_norm, const unsigned char* __restrict__ mrope_axes, \
        long long pos_stride, int tokens, int lq, int lkv, int hd, float eps, int hpw, \
        L2_PREFETCH_ARGS
template <bool GROUPED>
__device__ __forceinline__ void qkr_kernel(QKR_ARGS) {
    pdl_launch_dependents();
    if (l2_prefetch(pf0, pf0_bytes, pf1, pf1_bytes, pf_work_blocks)) return;
    const int heads = lq + lkv, groups = (heads + hpw - 1) / hpw;
    const long long w = (long long)blockIdx.x * QKR_WARPS + (threadIdx.x >> 5);
    if (w >= (long long)tokens * groups) return;  // whole warps
    const long long t = w / groups;
    const int h0 = (int)(w - t * groups) * hpw, h1 = min(h0 + hpw, heads);
    if (((hd >> 1) & 1) == 0)
        qkr_heads<2, GROUPED>(qkv, q_out, k_cache, v_cache, positions, slot_mapping, inv_freq,
                              q_norm, k_norm, mrope_axes, pos_stride, t, h0, h1, lq, lkv, hd, eps);
    else
        qkr_heads<1, GROUPED>(qkv, q_out, k_cache, v_cache, positions, slot_mapping, inv_freq,
                              q_norm, k_norm, mrope_axes, pos_stride, t, h0, h1, lq, lkv, hd, eps);
}
#define QKR_PASS qkv, q_out, k_cache, v_cache, positions, slot_mapping, inv_freq, q_norm, \
        k_norm, mrope_axes, pos_stride, tokens, lq, lkv, hd, eps, hpw, pf0, pf0_bytes, pf1, \
        pf1_bytes, pf_work_blocks
// One head a warp (hpw 1: decode and short prefills). Its own entry, so the grouped form's
// registers (126 in one kernel with it) do not weigh on it: on an H100 the one-kernel form
// took decode at batch 1 / 4 from ~207 / ~433 to ~190 / ~406 tok/s (Qwen3-30B-A3B).
extern "C" __global__ void __launch_bounds__(32 * QKR_WARPS) qkv_rope_cache_bf16(QKR_ARGS) {
    qkr_kernel<false>(QKR_PASS);
}
// Several heads a warp (hpw > 1: long prefills).
extern "C" __global__ void __launch_bounds__(32 * QKR_WARPS) qkv_rope_cache_grouped_bf16(QKR_ARGS) {
    qkr_kernel<true>(QKR_PASS);
}

// The wide form for long prefills at head_dim 128 (the default since measured;
// OMNI_CUDA_QKV_ROPE_WIDE=0 turns it off): the token's heads as one list, q heads, then k heads, then v heads (copied), in
// rounds of 4, 8 lanes a head; lane l of a round holds 16-byte words of dims 8 (l % 8) .. + 7
// and of their rotation partners 64 + 8 (l % 8) .. (rotate-half), so a round is two 16-byte
// loads and stores a lane and the head's sum of squares three shuffles inside its 8 lanes. A
// warp takes QKW_ROUNDS rounds of one token (`hpw` of the launch: rounds a warp), loads all
// its words before the first round's arithmetic, and turns the (cos, sin) of its 8 frequencies
// once (before the wait, as the other entries). The arithmetic is qkr_heads' per element (x *
// inv * w, then a cos - b sin, b cos + a sin); the sum of squares adds the same squares in
// another order (the inverse norm may differ in its last bit). Padding tokens (slot < 0) write
// their query heads only.
#define QKW_ROUNDS 5
extern "C" __global__ void __launch_bounds__(32 * QKR_WARPS) qkv_rope_cache_wide_bf16(QKR_ARGS) {
    pdl_launch_dependents();
    if (l2_prefetch(pf0, pf0_bytes, pf1, pf1_bytes, pf_work_blocks)) return;
    const int lane = threadIdx.x & 31, grp = lane & 7, sub = lane >> 3;
    const int all = lq + 2 * lkv, rounds = (all + 3) >> 2, wpt = (rounds + hpw - 1) / hpw;
    const long long w = (long long)blockIdx.x * QKR_WARPS + (threadIdx.x >> 5);
    if (w >= (long long)tokens * wpt) return;  // whole warps
    const long long t = w / wpt;
    const int r0 = (int)(w - t * wpt) * hpw, r1 = min(r0 + hpw, rounds);
    // (cos, sin) of frequencies 8 grp .. 8 grp + 7 (hd 128: 64 frequencies).
    float cs[8], sn[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
        rope_sincos(positions, inv_freq, mrope_axes, pos_stride, t, 8 * grp + e, &sn[e], &cs[e]);
    const long long slot = slot_mapping[t];
    pdl_wait();
    const unsigned short* src_row = qkv + t * (long long)all * 128;
    uint4 va[QKW_ROUNDS], vb[QKW_ROUNDS];
#pragma unroll
    for (int k = 0; k < QKW_ROUNDS; ++k) {
        const int hh = 4 * (r0 + k) + sub;
        const bool live = r0 + k < r1 && hh < all && (hh < lq || slot >= 0);
        va[k] = vb[k] = make_uint4(0u, 0u, 0u, 0u);
        if (live) {
            const uint4* src = reinterpret_cast<const uint4*>(src_row + (size_t)hh * 128 + 8 * grp);
            va[k] = src[0];
            vb[k] = src[8];  // dims + 64
        }
    }
#pragma unroll
    for (int k = 0; k < QKW_ROUNDS; ++k) {
        if (r0 + k >= r1) break;  // warp-uniform
        const int hh = 4 * (r0 + k) + sub;
        const bool live = hh < all && (hh < lq || slot >= 0);
        const unsigned aw[4] = {va[k].x, va[k].y, va[k].z, va[k].w};
        const unsigned bw[4] = {vb[k].x, vb[k].y, vb[k].z, vb[k].w};
        float a[8], b[8], ss = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            a[e] = bf2f((unsigned short)(aw[e >> 1] >> (16 * (e & 1))));
            b[e] = bf2f((unsigned short)(bw[e >> 1] >> (16 * (e & 1))));
            ss += a[e] * a[e] + b[e] * b[e];
        }
        // Every lane takes part (a v head's or a dead lane's sum goes unused).
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        ss += __shfl_xor_sync(0xffffffffu, ss, 2);
        ss += __shfl_xor_sync(0xffffffffu, ss, 4);
        if (!live) continue;
        const int kv = hh - lq - lkv;  // >= 0: a value head
        if (kv >= 0) {
            uint4* vd = reinterpret_cast<uint4*>(v_cache + ((size_t)slot * lkv + kv) * 128 + 8 * grp);
            vd[0] = va[k];
            vd[8] = vb[k];
            continue;
        }
        const unsigned short* nw = hh < lq ? q_norm : k_norm;
        if (nw) {
            const float inv = rsqrtf(ss / 128.f + eps);
            const uint4 wa4 = *reinterpret_cast<const uint4*>(nw + 8 * grp);
            const uint4 wb4 = *reinterpret_cast<const uint4*>(nw + 64 + 8 * grp);
            const unsigned wa[4] = {wa4.x, wa4.y, wa4.z, wa4.w}, wb[4] = {wb4.x, wb4.y, wb4.z, wb4.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                a[e] = a[e] * inv * bf2f((unsigned short)(wa[e >> 1] >> (16 * (e & 1))));
                b[e] = b[e] * inv * bf2f((unsigned short)(wb[e >> 1] >> (16 * (e & 1))));
            }
        }
        unsigned ro[4], rp[4];
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            const float a0 = a[e] * cs[e] - b[e] * sn[e], a1 = a[e + 1] * cs[e + 1] - b[e + 1] * sn[e + 1];
            const float b0 = b[e] * cs[e] + a[e] * sn[e], b1 = b[e + 1] * cs[e + 1] + a[e + 1] * sn[e + 1];
            ro[e >> 1] = (unsigned)f2bf(a0) | ((unsigned)f2bf(a1) << 16);
            rp[e >> 1] = (unsigned)f2bf(b0) | ((unsigned)f2bf(b1) << 16);
        }
        unsigned short* dst = hh < lq ? q_out + ((size_t)t * lq + hh) * 128
                                      : k_cache + ((size_t)slot * lkv + (hh - lq)) * 128;
        uint4* d = reinterpret_cast<uint4*>(dst + 8 * grp);
        d[0] = make_uint4(ro[0], ro[1], ro[2], ro[3]);
        d[8] = make_uint4(rp[0], rp[1], rp[2], rp[3]);
    }
}

// dst[rows[r], :] += src[r, :] for r < m (rows distinct): the deepstack residual additions.
extern "C" __global__ void add_rows_f32(float* __restrict__ dst, const float* __restrict__ src,
        const int* __restrict__ rows, long long hidden, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / hidden, j = i - r * hidden;
        dst[(long long)rows[r] * hidden + j] += src[i];
    }
}

extern "C" __global__ void embedding_ids_bf16(const unsigned short* __restrict__ table, const int* __restrict__ ids,
        unsigned short* __restrict__ out, long long hidden, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long t = i / hidden, j = i - t * hidden;
        out[i] = table[(long long)ids[t] * hidden + j];
    }
}

extern "C" __global__ void add_bias_bf16(unsigned short* __restrict__ x, const unsigned short* __restrict__ b,
        long long cols, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(b[i % cols]));
}

extern "C" __global__ void bf16_to_f32(const unsigned short* __restrict__ x, float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf2f(x[i]);
}

// Uniform in [lo, hi) from a stateless hash of (seed, index): the same buffer for the same seed on
// every run and every device.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
extern "C" __global__ void fill_uniform_bf16(unsigned short* __restrict__ x, long long n,
        unsigned long long seed, float lo, float hi) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned long long r = mix64(seed ^ mix64((unsigned long long)i));
        float u = (float)(r >> 40) * (1.0f / 16777216.0f);
        x[i] = f2bf(lo + (hi - lo) * u);
    }
}
