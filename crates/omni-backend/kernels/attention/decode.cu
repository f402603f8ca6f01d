// Flash-decoding kernel template (one query token per sequence). The `extern "C"` entry points
// `attn_decode_hd{HD}_g{GM}` are instantiated per head dimension by the Rust side.
// Prepended by the Rust side: bf16.cuh, rope.cuh, attention/common.cuh, attention/decode_rope.cuh.

// One CTA: KV head `blockIdx.x / head_chunks`, query heads `g0 .. g0 + GM` of its group,
// sequence `blockIdx.y`, context partition `blockIdx.z` (`part_size` tokens). 4 warps; a token's
// K/V head row (HD bf16) is read by L = HD / 8 lanes with one 16-byte load each.
// Phase 1: scores (log2 domain) into shared memory; phase 2: softmax numerators; phase 3: P V.
// The metadata and the first round's block-table entries are loaded together up front, before
// `griddepcontrol.wait` (programmatic dependent launch: that part overlaps the predecessor).
// When the sequence has one partition (device-side: seq_len <= part_size) the CTA writes `out`
// directly; else normalized partials + (max, sum) go to ws, and with `fused` the last of the
// sequence's partitions to finish (a counter per (sequence, grid x) in `attn_cnt`, left at 0)
// merges them into `out` (`attn_merge_partials`), else the reduce kernel does (reduce.cu).

// Arrival counters of the fused merge, one per (sequence, grid x) group: zero when the module
// loads (PTX zero-initialises .global variables) and reset to zero by each group's last CTA, so
// every launch finds them at zero (launches of one function are ordered on the context's one
// stream). The Rust side defines ATTN_COUNTERS and keeps the groups of a fused launch below it.
__device__ unsigned int attn_cnt[ATTN_COUNTERS];

// The last CTA of a group: out rows of heads hbase .. hbase + GM (below G) of token qs from the
// np (<= ATTN_FUSED_PARTS) partials of each, merged with weights sum_p * exp2(max_p - max) (the
// reduce kernel's arithmetic). Latency matters more than bytes here: one warp per head loads
// the (max, sum) pairs of every partition at once into shared memory (`sw`: GM *
// ATTN_FUSED_PARTS weights, then as many sums) and turns them into weights, then every thread
// sums its 4-dim slices with MP partitions' loads in flight. Partials are read past L1
// (__ldcg): other CTAs of this launch wrote them, and L1 is not coherent.
template <int HD, int GM>
__device__ __forceinline__ void attn_merge_partials(
    const float* __restrict__ ws, u16* __restrict__ out, float* sw, float* sden, size_t nrows,
    int s, int hbase, int G, int g0, int qs, int num_heads, int max_parts, int np)
{
    constexpr int NW = 4, NT = 128, Q = HD / 4, IT = (GM * Q + NT - 1) / NT, MP = 8;
    constexpr int FP = ATTN_FUSED_PARTS;
    float* sl = sw + GM * FP;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < GM; g += NW) {
        if (g0 + g >= G) continue;
        const size_t row0 = ((size_t)s * num_heads + hbase + g) * max_parts;
        const float* wm = ws + nrows * HD + row0;
        const float* wl = wm + nrows;
        float mx = ATTN_NEG_INF;
#pragma unroll 4
        for (int p = lane; p < np; p += 32) {
            const float m = __ldcg(wm + p);
            sl[g * FP + p] = __ldcg(wl + p);
            sw[g * FP + p] = m;
            mx = fmaxf(mx, m);
        }
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float den = 0.f;
        for (int p = lane; p < np; p += 32) {
            const float w = sl[g * FP + p] * exp2f(sw[g * FP + p] - mx);
            sw[g * FP + p] = w;
            den += w;
        }
        for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
        if (lane == 0) sden[g] = den;
    }
    __syncthreads();
    float4 acc[IT];
#pragma unroll
    for (int it = 0; it < IT; ++it) acc[it] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int p0 = 0; p0 < np; p0 += MP) {
        float4 o[IT][MP];
#pragma unroll
        for (int it = 0; it < IT; ++it) {
            const int idx = threadIdx.x + it * NT, g = idx / Q, d4 = idx - g * Q;
            const size_t row0 = ((size_t)s * num_heads + hbase + g) * max_parts;
#pragma unroll
            for (int j = 0; j < MP; ++j) {
                o[it][j] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (idx < GM * Q && g0 + g < G && p0 + j < np) {
                    o[it][j] = __ldcg(reinterpret_cast<const float4*>(ws + (row0 + p0 + j) * HD) + d4);
                }
            }
        }
#pragma unroll
        for (int it = 0; it < IT; ++it) {
            const int idx = threadIdx.x + it * NT, g = min(idx / Q, GM - 1);
#pragma unroll
            for (int j = 0; j < MP; ++j) {
                if (p0 + j < np) {
                    const float w = sw[g * FP + p0 + j];
                    acc[it].x += w * o[it][j].x;
                    acc[it].y += w * o[it][j].y;
                    acc[it].z += w * o[it][j].z;
                    acc[it].w += w * o[it][j].w;
                }
            }
        }
    }
#pragma unroll
    for (int it = 0; it < IT; ++it) {
        const int idx = threadIdx.x + it * NT, g = idx / Q, d4 = idx - g * Q;
        if (idx >= GM * Q || g0 + g >= G) continue;
        const float den = sden[g];
        const float inv = den > 0.f ? 1.f / den : 0.f;
        uint2 packed;
        packed.x = pack_bf16x2(acc[it].x * inv, acc[it].y * inv);
        packed.y = pack_bf16x2(acc[it].z * inv, acc[it].w * inv);
        *reinterpret_cast<uint2*>(out + ((size_t)qs * num_heads + hbase + g) * HD + d4 * 4) = packed;
    }
}

// Element d of query head h's result: bf16 into `out` (`direct`: one partition), else the
// normalized partial into row (s, h, part) of ws, with its max (log2 domain) and sum.
template <int HD>
__device__ __forceinline__ void attn_store(float* __restrict__ ws, u16* __restrict__ out,
    bool direct, size_t nrows, int s, int h, int qs, int num_heads, int max_parts, int part,
    int d, float o, float m, float l)
{
    if (direct) {
        out[((size_t)qs * num_heads + h) * HD + d] = f2bf(o);
    } else {
        const size_t row = ((size_t)s * num_heads + h) * max_parts + part;
        ws[row * HD + d] = o;
        if (d == 0) {
            ws[nrows * HD + row] = m;
            ws[nrows * HD + nrows + row] = l;
        }
    }
}

// The fused merge after a CTA has written its partials (every thread of the CTA calls it).
// Ordering (the pattern of cooperative groups' grid barrier): the barrier orders every
// thread's partial stores before thread 0's __threadfence() and atomicAdd, so the CTA that
// draws ticket np - 1 (every other partition has counted itself the same way) sees all np
// partitions' stores once it has fenced too; its barrier then orders that before every
// thread's reads, which go past L1 (__ldcg, L2 is coherent). The last CTA resets the counter:
// no other CTA of this launch touches it again, and the next launch is stream-ordered after
// this one (its CTAs touch counters only after their griddepcontrol.wait, i.e. after this grid
// has completed). `sw` is shared memory for 2 * GM * ATTN_FUSED_PARTS floats that nothing else
// reads after the first barrier.
template <int HD, int GM>
__device__ __forceinline__ void attn_fused_tail(
    const float* __restrict__ ws, u16* __restrict__ out, float* sw, float* sden, int* s_last,
    size_t nrows, int s, int hbase, int G, int g0, int qs, int num_heads, int max_parts, int np)
{
    unsigned int* cnt = attn_cnt + (size_t)blockIdx.y * gridDim.x + blockIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        *s_last = atomicAdd(cnt, 1u) == (unsigned int)(np - 1);
        if (*s_last) *cnt = 0u;
        __threadfence();
    }
    __syncthreads();
    if (!*s_last) return;
    attn_merge_partials<HD, GM>(ws, out, sw, sden, nrows, s, hbase, G, g0, qs, num_heads,
                                max_parts, np);
}

// The metadata step of a decode CTA (`attn_decode`, `attn_decode_tc`): first it lets the next
// kernel launch; false when the CTA has nothing to do (its sequence has not exactly one query
// token, or the partition starting at `start` lies past the context); else it waits for the
// predecessor grid and sets the query row `qs`, the partition's tokens `n` and the sequence's
// partitions with work `np` (the same in every CTA of the sequence). Launched with
// programmatic dependent launch, the CTA may have started while its predecessor (the kernel
// writing q and this step's K/V rows) drains: the metadata and block tables are written only
// by host copies before the step's first kernel, so they are safe to read before the wait; q,
// the caches, ws, out and the counters only after it.
__device__ __forceinline__ bool attn_decode_begin(const int* __restrict__ qsl,
    const int* __restrict__ seq_lens, int s, int start, int num_tokens, int part_size,
    int max_parts, int& qs, int& n, int& np)
{
    // The next kernel may launch at once: every programmatic successor waits for this grid
    // before it touches what it writes (and the reduce kernel is launched without the attribute).
    pdl_launch_dependents();
    qs = qsl[s];
    const int qe = qsl[s + 1];
    const int seq_len = seq_lens[s];
    if (qe - qs != 1 || qs < 0 || qs >= num_tokens) return false;
    if (start >= seq_len) return false;
    pdl_wait();
    n = min(part_size, seq_len - start);
    np = min((seq_len + part_size - 1) / part_size, max_parts);
    return true;
}

// ROPE: the `DecodeRope` form (q is then unused: the query rows come from rope.qkv).
template <int HD, int GM, bool ROPE>
__device__ __forceinline__ void attn_decode(
    const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    u16* __restrict__ out, const int* __restrict__ qsl, const int* __restrict__ seq_lens,
    const int* __restrict__ bt, float* __restrict__ ws, int num_tokens, int num_heads, int nkv,
    int bs, int num_blocks, int mbps, int part_size, int max_parts, int head_chunks,
    int fused, int balanced, float scale_log2, const DecodeRope& rope)
{
    // U: tokens per lane per iteration (U independent 16-byte loads in flight per lane).
    constexpr int NW = 4, NT = 128, L = HD / 8, TPW = 32 / L, TPS = NW * TPW, U = GM >= 8 ? 4 : 8;
    constexpr int SMF = (GM * ATTN_MAXPART > NW * GM * HD) ? GM * ATTN_MAXPART : NW * GM * HD;
    __shared__ __align__(16) float sm[SMF];
    __shared__ int sslot[ATTN_MAXPART];
    __shared__ float red_m[NW][GM];
    __shared__ float red_l[NW][GM];

    static_assert(2 * GM * ATTN_FUSED_PARTS <= SMF, "the merge's weights and sums fit sm");
    __shared__ int s_last;
    __shared__ float s_den[GM];

    const int s = blockIdx.y, part = blockIdx.z;
    const int kvh = blockIdx.x / head_chunks;
    const int g0 = (blockIdx.x - kvh * head_chunks) * GM;
    const int G = num_heads / nkv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tg = lane / L, lig = lane - tg * L;
    // Balanced partitions need the length first (host-written metadata: legal before the wait).
    const int plen = balanced ? attn_part_len(seq_lens[s], part_size, max_parts, 1) : part_size;
    const int start = part * plen;
    const int* btab = bt + (size_t)s * mbps;
    const size_t head_off = (size_t)kvh * HD + lig * 8;
    const size_t tok_stride = (size_t)nkv * HD;
    // The first round's slots before the metadata is known (kv_slot clamps every index, so
    // these loads are in bounds whatever the lengths), then the metadata in one go.
    int slot0[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        slot0[u] = kv_slot(btab, start + min(warp * TPW + u * TPS + tg, plen - 1), bs, mbps,
                           num_blocks);
    }
    // With ROPE the rotation angles of the token's position, also before the wait.
    float rcs[ROPE ? 8 : 1], rsn[ROPE ? 8 : 1];
    if constexpr (ROPE) {
        const int t = min(max(qsl[s], 0), num_tokens - 1);
        decode_rope_angles<HD>(rope, t, lig, rcs, rsn);
    }
    int qs, n, np;
    if (!attn_decode_begin(qsl, seq_lens, s, start, num_tokens, plen, max_parts, qs, n, np))
        return;
    const int hbase = kvh * G + g0;
    const size_t q_row = ROPE ? (size_t)(num_heads + 2 * nkv) * HD : (size_t)num_heads * HD;
    const u16* qsrc = ROPE ? rope.qkv : q;

    float qr[GM][8];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        if (g0 + g < G) {
            uint4 u = *reinterpret_cast<const uint4*>(
                qsrc + (size_t)qs * q_row + (size_t)(hbase + g) * HD + lig * 8);
            if constexpr (ROPE) u = decode_rope_row<HD>(u, rope.q_norm, rcs, rsn, lig, rope.eps);
            unpack8(u, qr[g]);
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] = 0.f;
        }
    }
    // The new token (context index seq_len - 1 = start + n - 1 when this partition ends the
    // sequence; CTA-uniform) in registers: its key normed and rotated, its value as is.
    int inew = -1;
    uint4 knew = make_uint4(0u, 0u, 0u, 0u), vnew = knew;
    if constexpr (ROPE) {
        if (start + n == seq_lens[s]) {
            inew = n - 1;
            const u16* row = rope.qkv + (size_t)qs * q_row;
            const uint4 kraw = *reinterpret_cast<const uint4*>(
                row + (size_t)(num_heads + kvh) * HD + lig * 8);
            vnew = *reinterpret_cast<const uint4*>(
                row + (size_t)(num_heads + nkv + kvh) * HD + lig * 8);
            knew = decode_rope_row<HD>(kraw, rope.k_norm, rcs, rsn, lig, rope.eps);
            const long long slot = rope.slots[qs];
            if (g0 == 0 && warp == 0 && tg == 0 && slot >= 0) {
                const size_t at = (size_t)slot * tok_stride + head_off;
                *reinterpret_cast<uint4*>(rope.kc_w + at) = knew;
                *reinterpret_cast<uint4*>(rope.vc_w + at) = vnew;
            }
        }
    }

    // Phase 1: scores. The loop bound is warp-uniform (shuffles below need the full warp).
    float mx[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) mx[g] = ATTN_NEG_INF;
    for (int it = warp * TPW; it < n; it += TPS * U) {
        const bool first = it == warp * TPW;
        uint4 kv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            kv[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i < n) {
                const int slot = first ? slot0[u] : kv_slot(btab, start + i, bs, mbps, num_blocks);
                if (lig == 0) sslot[i] = slot;
                kv[u] = i == inew ? knew
                    : __ldg(reinterpret_cast<const uint4*>(kc + (size_t)slot * tok_stride + head_off));
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
                vv[u] = i == inew ? vnew
                    : __ldg(reinterpret_cast<const uint4*>(vc + (size_t)sslot[i] * tok_stride + head_off));
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
    const bool direct = max_parts == 1 || (fused && np == 1);
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
        attn_store<HD>(ws, out, direct, nrows, s, hbase + g, qs, num_heads, max_parts, part, d,
                       o / l, m, l);
    }
    if (direct || !fused) return;
    attn_fused_tail<HD, GM>(ws, out, sm, s_den, &s_last, nrows, s, hbase, G, g0, qs, num_heads,
                            max_parts, np);
}
