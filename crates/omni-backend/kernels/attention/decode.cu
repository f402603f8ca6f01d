// Flash-decoding kernel template (one query token per sequence). The `extern "C"` entry points
// `attn_decode_hd{HD}_g{GM}` are instantiated per head dimension by the Rust side.
// Prepended by the Rust side: bf16.cuh, attention/common.cuh.

// One CTA: KV head `blockIdx.x / head_chunks`, query heads `g0 .. g0 + GM` of its group,
// sequence `blockIdx.y`, context partition `blockIdx.z` (`part_size` tokens). 4 warps; a token's
// K/V head row (HD bf16) is read by L = HD / 8 lanes with one 16-byte load each.
// Phase 1: scores (log2 domain) into shared memory; phase 2: softmax numerators; phase 3: P V.
// With one partition the CTA writes `out` directly, else normalized partials + (max, sum) to ws.
template <int HD, int GM>
__device__ __forceinline__ void attn_decode(
    const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    u16* __restrict__ out, const int* __restrict__ qsl, const int* __restrict__ seq_lens,
    const int* __restrict__ bt, float* __restrict__ ws, int num_tokens, int num_heads, int nkv,
    int bs, int num_blocks, int mbps, int part_size, int max_parts, int head_chunks,
    float scale_log2)
{
    // U: tokens per lane per iteration (U independent 16-byte loads in flight per lane).
    constexpr int NW = 4, NT = 128, L = HD / 8, TPW = 32 / L, TPS = NW * TPW, U = GM >= 8 ? 4 : 8;
    constexpr int SMF = (GM * ATTN_MAXPART > NW * GM * HD) ? GM * ATTN_MAXPART : NW * GM * HD;
    __shared__ __align__(16) float sm[SMF];
    __shared__ int sslot[ATTN_MAXPART];
    __shared__ float red_m[NW][GM];
    __shared__ float red_l[NW][GM];

    const int s = blockIdx.y, part = blockIdx.z;
    const int kvh = blockIdx.x / head_chunks;
    const int g0 = (blockIdx.x - kvh * head_chunks) * GM;
    const int G = num_heads / nkv;
    const int qs = qsl[s];
    if (qsl[s + 1] - qs != 1 || qs < 0 || qs >= num_tokens) return;
    const int seq_len = seq_lens[s];
    const int start = part * part_size;
    if (start >= seq_len) return;
    const int n = min(part_size, seq_len - start);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tg = lane / L, lig = lane - tg * L;
    const int hbase = kvh * G + g0;
    const int* btab = bt + (size_t)s * mbps;
    const size_t head_off = (size_t)kvh * HD + lig * 8;
    const size_t tok_stride = (size_t)nkv * HD;

    float qr[GM][8];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        if (g0 + g < G) {
            const uint4 u = *reinterpret_cast<const uint4*>(
                q + ((size_t)qs * num_heads + hbase + g) * HD + lig * 8);
            unpack8(u, qr[g]);
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] = 0.f;
        }
    }

    // Phase 1: scores. The loop bound is warp-uniform (shuffles below need the full warp).
    float mx[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) mx[g] = ATTN_NEG_INF;
    for (int it = warp * TPW; it < n; it += TPS * U) {
        uint4 kv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            kv[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i < n) {
                const int slot = kv_slot(btab, start + i, bs, mbps, num_blocks);
                if (lig == 0) sslot[i] = slot;
                kv[u] = __ldg(reinterpret_cast<const uint4*>(kc + (size_t)slot * tok_stride + head_off));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            float kf[8];
            unpack8(kv[u], kf);
            float d[GM];
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                d[g] = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d[g] = fmaf(qr[g][e], kf[e], d[g]);
            }
#pragma unroll
            for (int o = L / 2; o > 0; o >>= 1) {
#pragma unroll
                for (int g = 0; g < GM; ++g) d[g] += __shfl_xor_sync(0xffffffffu, d[g], o);
            }
            if (i < n) {
#pragma unroll
                for (int g = 0; g < GM; ++g) mx[g] = fmaxf(mx[g], d[g]);
                if (lig == 0) {
#pragma unroll
                    for (int g = 0; g < GM; ++g) sm[g * ATTN_MAXPART + i] = d[g];
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], o));
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GM; ++g) red_m[warp][g] = mx[g];
    }
    __syncthreads();

    // Phase 2: exp2(score - max) in place, partial sums.
    float gmx[GM], ls[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        float v = red_m[0][g];
#pragma unroll
        for (int w = 1; w < NW; ++w) v = fmaxf(v, red_m[w][g]);
        gmx[g] = v;
        ls[g] = 0.f;
    }
    for (int i = tid; i < n; i += NT) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
            const float e = exp2f(sm[g * ATTN_MAXPART + i] - gmx[g]);
            sm[g * ATTN_MAXPART + i] = e;
            ls[g] += e;
        }
    }
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ls[g] += __shfl_xor_sync(0xffffffffu, ls[g], o);
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GM; ++g) red_l[warp][g] = ls[g];
    }
    __syncthreads();

    // Phase 3: P V with the slots cached in phase 1.
    float acc[GM][8];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }
    for (int it = warp * TPW; it < n; it += TPS * U) {
        uint4 vv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            vv[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i < n) {
                vv[u] = __ldg(reinterpret_cast<const uint4*>(vc + (size_t)sslot[i] * tok_stride + head_off));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            if (i < n) {
                float vf[8];
                unpack8(vv[u], vf);
#pragma unroll
                for (int g = 0; g < GM; ++g) {
                    const float p = sm[g * ATTN_MAXPART + i];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
                }
            }
        }
    }
    // Sum the token groups of a warp (lanes lig, lig + L, ...), then the warps via smem.
#pragma unroll
    for (int o = L; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
        }
    }
    __syncthreads();
    if (tg == 0) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sm[(warp * GM + g) * HD + lig * 8 + e] = acc[g][e];
        }
    }
    __syncthreads();
    const size_t nrows = (size_t)gridDim.y * num_heads * max_parts;
    for (int idx = tid; idx < GM * HD; idx += NT) {
        const int g = idx / HD, d = idx - g * HD;
        if (g0 + g >= G) continue;
        float o = 0.f, m = red_m[0][g], l = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            o += sm[(w * GM + g) * HD + d];
            m = fmaxf(m, red_m[w][g]);
            l += red_l[w][g];
        }
        const int h = hbase + g;
        if (max_parts == 1) {
            out[((size_t)qs * num_heads + h) * HD + d] = f2bf(o / l);
        } else {
            const size_t row = ((size_t)s * num_heads + h) * max_parts + part;
            ws[row * HD + d] = o / l;
            if (d == 0) {
                ws[nrows * HD + row] = m;
                ws[nrows * HD + nrows + row] = l;
            }
        }
    }
}
