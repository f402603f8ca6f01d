// The attention block of a one-token decode step in one launch (src/cuda/attention/block1.rs):
// what the staged QKV GEMV with the input norm folded in (`gemv_staged_r1`, GV_IN_NORM), the q/k
// norm + RoPE + cache write, the decode attention and the staged o_proj GEMV (f32 out) do for one
// token, on a grid of one CTA per SM that meets at two grid barriers:
//
//   start    thread 0 has the copy engine bring this CTA's QKV weight rows into shared memory
//            (`cp.async.bulk`, one mbarrier per 16 rows) before the dependency wait: weights
//            are never written by a step, so they stream while the previous kernel drains; the
//            other threads prefetch the K and V rows of the CTA's phase-2 partition into L2;
//   phase 1  every CTA normalises the residual row itself (gv_norm_row: the staged GEMV's
//            bits; with `set` the row is first the bf16 embedding, which CTA 0 writes back) and
//            warp w computes QKV rows w, w + 16, .. of its share (the staged GEMV's sum order:
//            the same bits); once every warp is done with them, thread 0 has the o_proj rows of
//            its share copied over the QKV rows (they stream during the barrier and the
//            attention); barrier 1;
//   phase 2  CTA c = kvh * parts + part takes KV head kvh's partition `part` of the context
//            (ab1_plen: ceil(seq_len / parts) keys, at least min_keys): it norms and rotates
//            its query heads' rows (decode_rope_row), the partition that ends the sequence also
//            the new key, which it writes into the caches with the value; scores, softmax and
//            P V of up to AB1_GM query heads in tiles of AB1_PLEN_MAX keys (online softmax);
//            the partial (normalised output, max, sum) goes to `ws`, and the last partition of
//            the KV head to finish (a counter per KV head, left at 0) merges them into `attn`
//            (bf16, the decode kernel's merge weights sum_p * 2^(max_p - max)); barrier 2;
//   phase 3  every CTA copies `attn` into shared memory and warp w computes o_proj rows w,
//            w + 16, .. of its share from the staged rows into the f32 `proj` (the staged GEMV's
//            sum order: the same bits as `gemv_staged_r1` on the same `attn`).
//
// Four launches become one, the QKV weights land before the residual is known, and the o_proj
// weights land under the attention. Needs every CTA resident at once (the grid is the SM count,
// one CTA per SM by its shared memory; dependents are triggered only after barrier 1, when all are
// resident). The attention partials differ from the decode kernel's partitions, so `attn` is
// equal to the separate kernels' up to f32 rounding, not bit for bit, and the new key to
// qkv_rope_cache_bf16's up to a bf16 rounding (decode_rope_row adds the q/k norm's sum of
// squares in another order). `stamps` (null but in a test) takes each CTA's %globaltimer at
// AB1_STAMPS points.
// Prepended by the Rust side: bf16.cuh, grid_sync.cuh, gemv_common.cuh, rope.cuh,
// attention/common.cuh, attention/decode_rope.cuh.

#define AB1_THREADS 512
#define AB1_WARPS 16
#define AB1_HD 128
#define AB1_GM 8
#define AB1_PLEN_MAX 512
#define AB1_GROUP_ROWS 16
#define AB1_MAX_GROUPS 8
#define AB1_COPY_BYTES 32768u
#define AB1_STAMPS 8
#define AB1_STAMP(i) \
    if (a.stamps != nullptr && tid == 0) a.stamps[(size_t)c * AB1_STAMPS + (i)] = grid_now()

// The kernel's arguments, by value (`Ab1Args` in block1.rs repeats the layout). `rope.qkv` is
// the QKV output row (written in phase 1, read in phase 2), `rope.kc_w` / `rope.vc_w` the caches.
struct Ab1Args {
    DecodeRope rope;
    float* residual;             // [hidden] f32: read (set: written by CTA 0)
    const u16* init;             // [hidden] bf16 embedding row when `set`
    const u16* norm_w;           // input norm weight [hidden]
    const u16* w_qkv;            // [(nh + 2 nkv) * HD, hidden]
    u16* qkv;                    // out [(nh + 2 nkv) * HD]
    const int* seq_lens;         // [1]
    const int* block_table;      // [mbps]
    float* ws;                   // partials: nh * parts * HD, then nh * parts maxima and sums
    unsigned* bar;               // [0]: grid barrier word, [1 + kvh]: merge counters; zero
    u16* attn;                   // out [nh * HD]
    const u16* w_o;              // [hidden, nh * HD]
    float* proj;                 // out [hidden]
    unsigned long long* stamps;  // null, or gridDim.x * AB1_STAMPS
    int hidden, num_heads, nkv, bs, num_blocks, mbps, rows_qkv, rows_o, parts, min_keys, set;
    float scale_log2;
};

// The layout `Ab1Args` in block1.rs repeats (its test checks the same offsets on the host).
static_assert(sizeof(DecodeRope) == 88, "DecodeRope: 88 bytes");
static_assert(sizeof(Ab1Args) == 240, "Ab1Args: 240 bytes");

extern __shared__ __align__(128) unsigned char ab1_smem[];

// Keys of a partition of a `seq_len`-key context split over `parts` (a KV head's CTAs): the
// context in equal parts, but at least `min_keys` (>= 1) keys each, so a short context takes
// fewer CTAs and the merge fewer partials (block1.rs `partitions` is the same rule).
__device__ __forceinline__ int ab1_plen(int seq_len, int parts, int min_keys) {
    return max((seq_len + parts - 1) / parts, min_keys);
}

// Warp `wid`'s rows of a staged GEMV: y[j] = sum_k x[k] * w_j[k] for j = wid, wid + 16, .. <
// rows, row j waiting for its group's mbarrier; gemv_staged_body's loop and reduction for one
// input row (the same bits). `k` a multiple of 8.
template <bool F32>
__device__ __forceinline__ void ab1_gemv(const uint4* xin, const unsigned char* ws, int rows,
                                         int k, unsigned bar0, void* y, int wid, int lane) {
    const int chunks = k >> 3;
    const size_t row_bytes = (size_t)k * 2;
    for (int j = wid; j < rows; j += AB1_WARPS) {
        gv_stage_wait(bar0 + 8u * (unsigned)(j / AB1_GROUP_ROWS));
        const uint4* wr = reinterpret_cast<const uint4*>(ws + (size_t)j * row_bytes);
        float acc = 0.f;
        for (int base = 0; base < chunks; base += 32 * GV_UNROLL) {
            uint4 wa[GV_UNROLL];
#pragma unroll
            for (int u = 0; u < GV_UNROLL; ++u) {
                const int cc = base + lane + 32 * u;
                if (cc < chunks) wa[u] = wr[cc];
            }
#pragma unroll
            for (int u = 0; u < GV_UNROLL; ++u) {
                const int cc = base + lane + 32 * u;
                if (cc < chunks) {
                    float wf[8];
                    gv_unpack(wa[u], wf);
                    acc += gv_dot8(xin[cc], wf);
                }
            }
        }
        for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
        if (lane == 0) {
            if (F32) reinterpret_cast<float*>(y)[j] = acc;
            else reinterpret_cast<u16*>(y)[j] = f2bf(acc);
        }
    }
}

// Phase 2 of CTA (kvh, part) of a `seq_len`-key context in partitions of `plen` keys
// (ab1_plen): the partition's partial, and the merge when it is the KV head's last to finish.
// `sc`: AB1_GM * AB1_PLEN_MAX floats, `sslot`: AB1_PLEN_MAX ints (one tile).
__device__ __forceinline__ void ab1_attention(const Ab1Args& a, int kvh, int part, int seq_len,
                                              int plen, float* sc, int* sslot) {
    constexpr int HD = AB1_HD, L = HD / 8, TPS = AB1_WARPS * (32 / L), U = 2;
    __shared__ float s_m[AB1_GM], s_l[AB1_GM], s_alpha[AB1_GM];
    __shared__ __align__(16) float s_q[AB1_GM][HD];
    __shared__ __align__(16) u16 s_knew[HD];
    __shared__ __align__(16) u16 s_vnew[HD];
    __shared__ int s_last;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int tg = lane / L, lig = lane - tg * L;
    const int P = a.parts, Gq = a.num_heads / a.nkv, nh = a.num_heads, nkv = a.nkv;
    const int np = (seq_len + plen - 1) / plen;
    const int start = part * plen, n = min(plen, seq_len - start);
    const int hbase = kvh * Gq;
    const size_t tok_stride = (size_t)nkv * HD, head_off = (size_t)kvh * HD + lig * 8;

    float rcs[8], rsn[8];
    decode_rope_angles<HD>(a.rope, 0, lig, rcs, rsn);
    // The new token (context index seq_len - 1) when this partition ends the sequence: its key
    // normed and rotated and its value into shared memory (read once every warp has passed
    // the barrier below) and the caches; one writer per KV head.
    const int inew = start + n == seq_len ? n - 1 : -1;
    if (inew >= 0) {
        const uint4 kraw = __ldcg(reinterpret_cast<const uint4*>(a.qkv + (size_t)(nh + kvh) * HD + lig * 8));
        const uint4 vnew = __ldcg(reinterpret_cast<const uint4*>(a.qkv + (size_t)(nh + nkv + kvh) * HD + lig * 8));
        const uint4 knew = decode_rope_row<HD>(kraw, a.rope.k_norm, rcs, rsn, lig, a.rope.eps);
        if (wid == 0 && tg == 0) {
            *reinterpret_cast<uint4*>(s_knew + lig * 8) = knew;
            *reinterpret_cast<uint4*>(s_vnew + lig * 8) = vnew;
            const long long slot = a.rope.slots[0];
            if (slot >= 0) {
                const size_t at = (size_t)slot * tok_stride + head_off;
                *reinterpret_cast<uint4*>(a.rope.kc_w + at) = knew;
                *reinterpret_cast<uint4*>(a.rope.vc_w + at) = vnew;
            }
        }
    }

    // Query rows (other CTAs wrote them: past L1), normed, rotated, scaled to the log2 domain,
    // into s_q: warp h < Gq takes head h.
    if (wid < Gq) {
        uint4 u = __ldcg(reinterpret_cast<const uint4*>(a.qkv + (size_t)(hbase + wid) * HD + lig * 8));
        u = decode_rope_row<HD>(u, a.rope.q_norm, rcs, rsn, lig, a.rope.eps);
        float qf[8];
        unpack8(u, qf);
        if (tg == 0) {
#pragma unroll
            for (int e = 0; e < 8; ++e) s_q[wid][lig * 8 + e] = qf[e] * a.scale_log2;
        }
    } else if (wid < AB1_GM && tg == 0) {
#pragma unroll
        for (int e = 0; e < 8; ++e) s_q[wid][lig * 8 + e] = 0.f;
    }
    __syncthreads();  // s_q, s_knew, s_vnew written
    // The partition in tiles of up to AB1_PLEN_MAX keys, with the online softmax: per head the
    // running max s_m and sum s_l; a tile whose max is larger scales what came before by
    // s_alpha = 2^(old max - new max) (0 before the first tile).
    if (tid < AB1_GM) {
        s_m[tid] = ATTN_NEG_INF;
        s_l[tid] = 0.f;
    }
    // P V: thread (sub, g, ch) sums keys sub, sub + 4, .. of head g's dims ch * 8 .. + 7.
    const int unit = tid & 127, sub = tid >> 7, g = unit >> 4, ch = unit & 15;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int t0 = 0; t0 < n; t0 += AB1_PLEN_MAX) {
        const int tn = min(AB1_PLEN_MAX, n - t0), tnew = inew - t0;
        // Scores (log2 domain) into sc: warp w's lanes tg take keys w * 2 + tg, + TPS, ..; U
        // loads a lane in flight. The new key comes from s_knew (no CTA reads its slot).
        for (int it = wid * (32 / L); it < tn; it += TPS * U) {
            uint4 kv[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = it + u * TPS + tg;
                kv[u] = make_uint4(0u, 0u, 0u, 0u);
                if (i < tn) {
                    const int slot = kv_slot(a.block_table, start + t0 + i, a.bs, a.mbps, a.num_blocks);
                    if (lig == 0) sslot[i] = slot;
                    kv[u] = i == tnew ? *reinterpret_cast<const uint4*>(s_knew + lig * 8)
                        : __ldg(reinterpret_cast<const uint4*>(a.rope.kc_w + (size_t)slot * tok_stride + head_off));
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = it + u * TPS + tg;
                float kf[8];
                unpack8(kv[u], kf);
                float d[AB1_GM];
#pragma unroll
                for (int gg = 0; gg < AB1_GM; ++gg) {
                    const float4 qa = *reinterpret_cast<const float4*>(&s_q[gg][lig * 8]);
                    const float4 qb = *reinterpret_cast<const float4*>(&s_q[gg][lig * 8 + 4]);
                    const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
                    d[gg] = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) d[gg] = fmaf(qv[e], kf[e], d[gg]);
                }
#pragma unroll
                for (int o = L / 2; o > 0; o >>= 1) {
#pragma unroll
                    for (int gg = 0; gg < AB1_GM; ++gg) d[gg] += __shfl_xor_sync(0xffffffffu, d[gg], o);
                }
                if (i < tn && lig == 0) {
#pragma unroll
                    for (int gg = 0; gg < AB1_GM; ++gg) sc[gg * AB1_PLEN_MAX + i] = d[gg];
                }
            }
        }
        __syncthreads();
        // Softmax: warp h takes head h's scores (the tile's max, the new running max, the
        // numerators in place and the running sum).
        if (wid < Gq) {
            float* row = sc + wid * AB1_PLEN_MAX;
            float m = ATTN_NEG_INF;
            for (int i = lane; i < tn; i += 32) m = fmaxf(m, row[i]);
            for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            const float m_old = s_m[wid];
            m = fmaxf(m, m_old);
            float l = 0.f;
            for (int i = lane; i < tn; i += 32) {
                const float e = exp2f(row[i] - m);
                row[i] = e;
                l += e;
            }
            for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
            __syncwarp();
            if (lane == 0) {
                const float alpha = exp2f(m_old - m);
                s_alpha[wid] = alpha;
                s_l[wid] = s_l[wid] * alpha + l;
                s_m[wid] = m;
            }
        }
        __syncthreads();
        if (g < Gq) {
            const float alpha = s_alpha[g];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] *= alpha;
            const size_t voff = (size_t)kvh * HD + ch * 8;
#pragma unroll 4
            for (int i = sub; i < tn; i += 4) {
                const float p = sc[g * AB1_PLEN_MAX + i];
                const uint4 vv = i == tnew ? *reinterpret_cast<const uint4*>(s_vnew + ch * 8)
                    : __ldg(reinterpret_cast<const uint4*>(a.rope.vc_w + (size_t)sslot[i] * tok_stride + voff));
                float vf[8];
                unpack8(vv, vf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, vf[e], acc[e]);
            }
        }
        __syncthreads();  // the tile's sc and sslot are read: the next tile or the sums take them
    }
    float* red = sc;  // [4][AB1_GM][HD]
#pragma unroll
    for (int e = 0; e < 8; ++e) red[((size_t)sub * AB1_GM + g) * HD + ch * 8 + e] = acc[e];
    __syncthreads();
    const bool direct = np == 1;
    const size_t rows = (size_t)nh * P;
    float* wm = a.ws + rows * HD;
    float* wl = wm + rows;
    for (int idx = tid; idx < Gq * HD; idx += AB1_THREADS) {
        const int gg = idx / HD, d = idx - gg * HD;
        float o = 0.f;
#pragma unroll
        for (int s = 0; s < 4; ++s) o += red[((size_t)s * AB1_GM + gg) * HD + d];
        o = o / s_l[gg];
        if (direct) {
            a.attn[(size_t)(hbase + gg) * HD + d] = f2bf(o);
        } else {
            const size_t row = (size_t)(hbase + gg) * P + part;
            a.ws[row * HD + d] = o;
            if (d == 0) {
                wm[row] = s_m[gg];
                wl[row] = s_l[gg];
            }
        }
    }
    if (direct) return;
    // The last partition of this KV head to finish merges (attn_fused_tail's ordering: the
    // CTA's stores, bar.sync, fence + ticket; the last fences again and reads past L1).
    __syncthreads();
    if (tid == 0) {
        unsigned* cnt = a.bar + 1 + kvh;
        __threadfence();
        s_last = atomicAdd(cnt, 1u) == (unsigned)(np - 1);
        if (s_last) *cnt = 0u;
        __threadfence();
    }
    __syncthreads();
    if (!s_last) return;
    // Merge weights sum_p * 2^(max_p - max) of each head into sc[g * parts + p], then the rows.
    float* sw = sc;
    __shared__ float s_den[AB1_GM];
    if (wid < Gq) {
        const size_t row0 = (size_t)(hbase + wid) * P;
        float m = ATTN_NEG_INF;
        for (int p = lane; p < np; p += 32) m = fmaxf(m, __ldcg(wm + row0 + p));
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float den = 0.f;
        for (int p = lane; p < np; p += 32) {
            const float w = __ldcg(wl + row0 + p) * exp2f(__ldcg(wm + row0 + p) - m);
            sw[wid * P + p] = w;
            den += w;
        }
        for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
        if (lane == 0) s_den[wid] = den;
    }
    __syncthreads();
    // Thread (half, head, 4 dims) (2 * Gq * HD / 4 <= AB1_THREADS of them): half 0 sums
    // partials 0 .. ceil(np / 2), half 1 the rest, whose sums reach half 0 through shared
    // memory past the weights.
    const int units = Gq * (HD / 4), hp = (np + 1) / 2;
    float4* sums = reinterpret_cast<float4*>(sw + AB1_GM * P);
    const int half = tid / units, u = tid - half * units;
    const int gg = u / (HD / 4), d4 = u - gg * (HD / 4);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (half < 2) {
        const size_t row0 = (size_t)(hbase + gg) * P;
        const int p0 = half * hp, p1 = half ? np : hp;
#pragma unroll 8
        for (int p = p0; p < p1; ++p) {
            const float w = sw[gg * P + p];
            const float4 v = __ldcg(reinterpret_cast<const float4*>(a.ws + (row0 + p) * HD) + d4);
            o.x += w * v.x;
            o.y += w * v.y;
            o.z += w * v.z;
            o.w += w * v.w;
        }
        if (half == 1) sums[u] = o;
    }
    __syncthreads();
    if (half == 0) {
        const float4 r = sums[u];
        const float inv = s_den[gg] > 0.f ? 1.f / s_den[gg] : 0.f;
        uint2 packed;
        packed.x = pack_bf16x2((o.x + r.x) * inv, (o.y + r.y) * inv);
        packed.y = pack_bf16x2((o.z + r.z) * inv, (o.w + r.w) * inv);
        *reinterpret_cast<uint2*>(a.attn + (size_t)(hbase + gg) * HD + d4 * 4) = packed;
    }
}

// Dynamic shared memory (block1.rs `block1_plan` computes the same): 2 * AB1_MAX_GROUPS
// mbarriers (128 bytes), the input row (max(hidden, nh * HD) bf16, rounded up to 128 bytes),
// the scores (AB1_GM * AB1_PLEN_MAX f32), the slots (AB1_PLEN_MAX i32), then the weight rows
// (max(rows_qkv * hidden, rows_o * nh * HD) bf16).
extern "C" __global__ void __launch_bounds__(AB1_THREADS, 1) attn_block1(const Ab1Args a) {
    __shared__ float sh[32];
    const int G = gridDim.x, c = blockIdx.x, tid = threadIdx.x;
    const int lane = tid & 31, wid = tid >> 5;
    const int H = a.hidden, ko = a.num_heads * AB1_HD;
    const int nq = (a.num_heads + 2 * a.nkv) * AB1_HD;
    const int q0 = c * a.rows_qkv, nrq = max(0, min(a.rows_qkv, nq - q0));
    const int o0 = c * a.rows_o, nro = max(0, min(a.rows_o, H - o0));
    const size_t xin_bytes = ((size_t)max(H, ko) * 2 + 127) / 128 * 128;
    const unsigned bars = (unsigned)__cvta_generic_to_shared(ab1_smem);
    const unsigned bar_q = bars, bar_o = bars + 8u * AB1_MAX_GROUPS;
    u16* xin = reinterpret_cast<u16*>(ab1_smem + 16 * AB1_MAX_GROUPS);
    float* sc = reinterpret_cast<float*>(ab1_smem + 16 * AB1_MAX_GROUPS + xin_bytes);
    int* sslot = reinterpret_cast<int*>(sc + AB1_GM * AB1_PLEN_MAX);
    unsigned char* wsm = reinterpret_cast<unsigned char*>(sslot + AB1_PLEN_MAX);
    const unsigned wdst = (unsigned)__cvta_generic_to_shared(wsm);
    AB1_STAMP(0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 0) {
        for (int g = 0; g < 2 * AB1_MAX_GROUPS; ++g)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" :: "r"(bars + 8u * g) : "memory");
        // The initialised barriers visible to the copy engine before a copy names them.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        gv_stage_rows(wdst, reinterpret_cast<const char*>(a.w_qkv + (size_t)q0 * H), nrq,
                      (size_t)H * 2, bar_q, AB1_GROUP_ROWS, AB1_COPY_BYTES);
    }
#endif
    // This CTA's phase-2 partition (the context length is host-written: readable before the
    // wait), if it has one.
    const int seq_len = a.seq_lens[0];
    const int kvh = c / a.parts, part = c - kvh * a.parts;
    const int plen = seq_len > 0 ? ab1_plen(seq_len, a.parts, a.min_keys) : 0;
    const bool attends = kvh < a.nkv && seq_len > 0 && part * plen < seq_len;
    // Its K and V rows into L2 (phase 2 then reads them from there): the block table is
    // host-written and the rows were written by earlier steps, so they are readable before the
    // wait; the new token's slot is skipped (this launch writes it).
    if (attends) {
        const int start = part * plen, n = min(plen, seq_len - start);
        const size_t head = (size_t)kvh * AB1_HD;
        for (int j = tid; j < 4 * min(n, AB1_PLEN_MAX); j += AB1_THREADS) {
            const int i = j >> 2;
            if (start + i == seq_len - 1) continue;
            const int slot = kv_slot(a.block_table, start + i, a.bs, a.mbps, a.num_blocks);
            const u16* cache = (j & 2) ? a.rope.vc_w : a.rope.kc_w;
            const u16* p = cache + (size_t)slot * a.nkv * AB1_HD + head + (j & 1) * 64;
            asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
        }
    }
    __syncthreads();  // the barriers are initialised before any thread waits on them
    pdl_wait();
    AB1_STAMP(1);

    // Phase 1: the input norm and this CTA's QKV rows.
    gv_norm_row(a.residual, a.init, a.set != 0, a.set != 0 && c == 0, a.residual, a.norm_w, xin,
                H, a.rope.eps, sh);
    __syncthreads();
    ab1_gemv<false>(reinterpret_cast<const uint4*>(xin), wsm, nrq, H, bar_q, a.qkv + q0, wid, lane);
    __syncthreads();  // every warp is done with the QKV rows: the o_proj rows may overwrite them
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 0) {
        // The generic-proxy reads of those rows ordered before the copy engine's writes.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        gv_stage_rows(wdst, reinterpret_cast<const char*>(a.w_o + (size_t)o0 * ko), nro,
                      (size_t)ko * 2, bar_o, AB1_GROUP_ROWS, AB1_COPY_BYTES);
    }
#endif
    AB1_STAMP(2);
    grid_sync(a.bar, (unsigned)G);
    AB1_STAMP(3);
    // Every CTA is resident: dependents may launch now (they wait for this grid to complete).
    pdl_launch_dependents();

    // Phase 2: attention of this CTA's (KV head, partition), if it has one.
    if (attends) ab1_attention(a, kvh, part, seq_len, plen, sc, sslot);
    AB1_STAMP(4);
    grid_sync(a.bar, (unsigned)G);
    AB1_STAMP(5);

    // Phase 3: o_proj rows of this CTA from the merged attention row (past L1).
    if (nro == 0) {
        AB1_STAMP(6);
        AB1_STAMP(7);
        return;
    }
    {
        const uint4* src = reinterpret_cast<const uint4*>(a.attn);
        uint4* dst = reinterpret_cast<uint4*>(xin);
        for (int i = tid; i < (ko >> 3); i += AB1_THREADS) dst[i] = __ldcg(src + i);
    }
    __syncthreads();
    AB1_STAMP(6);
    ab1_gemv<true>(reinterpret_cast<const uint4*>(xin), wsm, nro, ko, bar_o, a.proj + o0, wid, lane);
    AB1_STAMP(7);
}
