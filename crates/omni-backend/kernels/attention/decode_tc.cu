// Flash-decoding on tensor cores for GQA groups (one query token per sequence; the group's
// query heads are the rows of the MMA): template `attn_decode_tc<HD, GM>`, entry points
// `attn_decode_tc_hd{HD}_g{GM}` instantiated by the Rust side. The grid, the arguments, the
// workspace and the merge are `attn_decode`'s (decode.cu); the mma / ldmatrix / cp.async
// helpers are prefill.cu's. Both precede this file in the module.
//
// One CTA: KV head blockIdx.x / head_chunks, query heads g0 .. g0 + GM of its group as rows
// 0 .. GM of a 16-row A tile (rows past the group are zero), sequence blockIdx.y, partition
// blockIdx.z. The partition is cut into ATC_CHUNK-token chunks; warp w takes chunks w, w + 4,
// .. through a private two-stage cp.async ring of K and V chunks in dynamic shared memory, so
// the loop has no CTA barrier and the next chunk loads while this one is computed. Per chunk:
// S = Q K^T (two 8-key n-tiles x HD / 16 k-steps), keys past the partition masked, online
// softmax in the log2 domain, O += P V with P rounded to bf16 (the prefill kernel's
// arithmetic). Then the warps' (max, sum, O) meet in shared memory (each warp writes into its
// own ring) and the CTA stores the partition's result like `attn_decode` does.
//
// Dynamic shared memory: max(4 warps x ATC_STAGES x (K + V) x ATC_CHUNK x HD bf16, the fused
// merge's 2 x GM x ATTN_FUSED_PARTS floats) bytes (the Rust side's `tc_smem_bytes`).

#define ATC_CHUNK 16
#define ATC_STAGES 2

template <int N>
__device__ __forceinline__ void cp_async_wait_pending() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

template <int HD, int GM>
__device__ __forceinline__ void attn_decode_tc(
    const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    u16* __restrict__ out, const int* __restrict__ qsl, const int* __restrict__ seq_lens,
    const int* __restrict__ bt, float* __restrict__ ws, int num_tokens, int num_heads, int nkv,
    int bs, int num_blocks, int mbps, int part_size, int max_parts, int head_chunks,
    int fused, int balanced, float scale_log2)
{
    constexpr int NW = 4, NT = 128, C = HD / 8;
    // Elements of one K (or V) chunk; floats of one warp's ring; cp.async per lane per chunk.
    constexpr int TILE = ATC_CHUNK * HD, WREG = ATC_STAGES * TILE, CPL = ATC_CHUNK * C / 32;
    static_assert(HD % 16 == 0 && CPL >= 1 && (ATC_CHUNK * C) % 32 == 0, "tile shape");
    static_assert(GM <= 8 && WREG >= 8 * HD + 16, "rows g of the A tile; a warp's result fits its ring");
    extern __shared__ __align__(128) unsigned char atc_smem[];
    __shared__ int s_last;
    __shared__ float s_den[GM];

    const int s = blockIdx.y, part = blockIdx.z;
    const int kvh = blockIdx.x / head_chunks;
    const int g0 = (blockIdx.x - kvh * head_chunks) * GM;
    const int G = num_heads / nkv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int plen = balanced ? attn_part_len(seq_lens[s], part_size, max_parts, 1) : part_size;
    const int start = part * plen;
    const int* btab = bt + (size_t)s * mbps;
    int qs, n, np;
    if (!attn_decode_begin(qsl, seq_lens, s, start, num_tokens, plen, max_parts, qs, n, np))
        return;
    const int hbase = kvh * G + g0;
    const int rows = min(GM, G - g0);
    const size_t tok_stride = (size_t)nkv * HD;
    const size_t head_off = (size_t)kvh * HD;
    const int nchunks = (n + ATC_CHUNK - 1) / ATC_CHUNK;
    // This warp's ring: stage st holds K at ring + 2 * st * TILE and V right after it.
    u16* ring = reinterpret_cast<u16*>(atc_smem) + (size_t)warp * 2 * WREG;

    // Chunk `chunk`'s K and V rows into stage `st`, one commit group; keys past the partition
    // are zero-filled (masked below). Lane l moves 16-byte pieces idx = l + 32 k: key idx / C,
    // piece idx % C (swizzled as in the prefill kernel).
    auto load = [&](int chunk, int st) {
        u16* dk = ring + 2 * st * TILE;
#pragma unroll
        for (int k = 0; k < CPL; ++k) {
            const int idx = lane + 32 * k, r = idx / C, ch = idx - r * C;
            const int i = chunk * ATC_CHUNK + r;
            const bool ok = i < n;
            const size_t off = ok ? (size_t)kv_slot(btab, start + i, bs, mbps, num_blocks) * tok_stride + head_off + ch * 8 : 0;
            const int at = r * HD + swz<C>(r, ch) * 8;
            cp_async16(smem_u32(dk + at), kc + off, ok ? 16 : 0);
            cp_async16(smem_u32(dk + TILE + at), vc + off, ok ? 16 : 0);
        }
        cp_async_commit();
    };
    if (warp < nchunks) load(warp, 0);

    // Q as the A operand: lane (g, c) holds rows g and g + 8, columns 16 kk + 2c (+1, +8, +9).
    const int g = lane >> 2, c = lane & 3;
    const int lrow = lane & 7, lsel1 = (lane >> 3) & 1, lsel2 = lane >> 4;
    u32 qf[HD / 16][4];
    {
        const u32* qa = reinterpret_cast<const u32*>(q + ((size_t)qs * num_heads + hbase + g) * HD);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            qf[kk][0] = g < rows ? qa[kk * 8 + c] : 0u;
            qf[kk][1] = 0u;  // rows g + 8 >= GM: padding
            qf[kk][2] = g < rows ? qa[kk * 8 + 4 + c] : 0u;
            qf[kk][3] = 0u;
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
        o[dt][0] = 0.f; o[dt][1] = 0.f; o[dt][2] = 0.f; o[dt][3] = 0.f;
    }
    float m_run = ATTN_NEG_INF, l_run = 0.f;  // row g (rows g + 8 are padding)

    int st = 0;
    for (int chunk = warp; chunk < nchunks; chunk += NW) {
        if (chunk + NW < nchunks) load(chunk + NW, st ^ 1);
        else cp_async_commit();  // an empty group: "all but the newest" is then this chunk
        cp_async_wait_pending<1>();
        __syncwarp();  // every lane's pieces of this chunk have landed
        const u16* sK = ring + 2 * st * TILE;
        const u16* sV = sK + TILE;

        float sacc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            sacc[nt][0] = 0.f; sacc[nt][1] = 0.f; sacc[nt][2] = 0.f; sacc[nt][3] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const int r = lrow + 8 * lsel2, ck = 2 * kk + lsel1;
            u32 b[4];
            ldsm_x4(smem_u32(sK + r * HD + swz<C>(r, ck) * 8), b);
            mma_bf16(sacc[0], qf[kk], b[0], b[1]);
            mma_bf16(sacc[1], qf[kk], b[2], b[3]);
        }
        // Log2 domain; keys past the partition masked. Row g's scores are sacc[nt][0..2].
        const int kbase = chunk * ATC_CHUNK;
        float tmax = ATTN_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = kbase + nt * 8 + 2 * c + e;
                const float v = key < n ? sacc[nt][e] * scale_log2 : ATTN_NEG_INF;
                sacc[nt][e] = v;
                tmax = fmaxf(tmax, v);
            }
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        // The chunk has a key below n (chunk * ATC_CHUNK < n), so m_new is finite.
        const float m_new = fmaxf(m_run, tmax);
        const float alpha = exp2f(m_run - m_new);
        m_run = m_new;
        float rs = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = exp2f(sacc[nt][e] - m_new);
                sacc[nt][e] = p;
                rs += p;
            }
        }
        l_run = l_run * alpha + rs;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
            o[dt][0] *= alpha;
            o[dt][1] *= alpha;
        }
        // P (rows g; padding rows zero) as the A operand of one 16-key k-step.
        u32 a[4];
        a[0] = pack_bf16x2(sacc[0][0], sacc[0][1]);
        a[1] = 0u;
        a[2] = pack_bf16x2(sacc[1][0], sacc[1][1]);
        a[3] = 0u;
#pragma unroll
        for (int dd = 0; dd < HD / 16; ++dd) {
            const int r = lrow + 8 * lsel1, cv = 2 * dd + lsel2;
            u32 b[4];
            ldsm_x4_t(smem_u32(sV + r * HD + swz<C>(r, cv) * 8), b);
            mma_bf16(o[2 * dd], a, b[0], b[1]);
            mma_bf16(o[2 * dd + 1], a, b[2], b[3]);
        }
        __syncwarp();  // every lane is done reading this stage before it is refilled
        st ^= 1;
    }
    cp_async_wait_pending<0>();

    // Each warp's (max, sum, O) of rows 0..8 into its own ring: O [8][HD] f32, then max[8] and
    // sum[8]. A warp without chunks leaves (-inf, 0, 0).
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    float* wr = reinterpret_cast<float*>(ring);
    __syncwarp();
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
        wr[g * HD + dt * 8 + 2 * c] = o[dt][0];
        wr[g * HD + dt * 8 + 2 * c + 1] = o[dt][1];
    }
    if (c == 0) {
        wr[8 * HD + g] = m_run;
        wr[8 * HD + 8 + g] = l_run;
    }
    __syncthreads();
    const float* all = reinterpret_cast<const float*>(atc_smem);
    constexpr int WF = WREG;  // floats per warp ring (2 * WREG bf16)
    const size_t nrows = (size_t)gridDim.y * num_heads * max_parts;
    const bool direct = max_parts == 1 || (fused && np == 1);
    for (int idx = tid; idx < GM * HD; idx += NT) {
        const int r = idx / HD, d = idx - r * HD;
        if (r >= rows) continue;
        float mx = ATTN_NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) mx = fmaxf(mx, all[w * WF + 8 * HD + r]);
        float ov = 0.f, lv = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float wt = exp2f(all[w * WF + 8 * HD + r] - mx);
            ov += wt * all[w * WF + r * HD + d];
            lv += wt * all[w * WF + 8 * HD + 8 + r];
        }
        attn_store<HD>(ws, out, direct, nrows, s, hbase + r, qs, num_heads, max_parts, part, d,
                       ov / lv, mx, lv);
    }
    if (direct || !fused) return;
    attn_fused_tail<HD, GM>(ws, out, reinterpret_cast<float*>(atc_smem), s_den, &s_last, nrows,
                            s, hbase, G, g0, qs, num_heads, max_parts, np);
}
