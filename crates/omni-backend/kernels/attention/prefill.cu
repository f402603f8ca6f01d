// Flash-attention 2 prefill kernel template (tensor cores). The `extern "C"` entry point
// `attn_prefill_hd{HD}` is instantiated per head dimension by the Rust side.
// Prepended by the Rust side: bf16.cuh, attention/common.cuh (decode.cu precedes it in the same
// module).

__device__ __forceinline__ void ldsm_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// c += a (16x16, row) * b (16x8, col), bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Physical 16-byte chunk of logical chunk `ch` in row `r` of a [rows][C chunks] tile: XOR
// swizzle (conflict-free ldmatrix) when a row spans at least 128 bytes.
template <int C>
__device__ __forceinline__ int swz(int r, int ch) {
    return C >= 8 ? (ch ^ (r & 7)) : ch;
}

// One CTA: query rows q0 .. q0 + BM of sequence blockIdx.z (tiles in reverse order: the longest
// causal tiles start first), query head blockIdx.y. Warp w owns rows 16w .. 16w + 16.
// Loop over key tiles of BN: S = Q K^T (mma), causal/length mask, online softmax in the log2
// domain, O += P V (P rounded to bf16 in registers). K tile j+1 loads during P V of tile j, V
// tile j during S of tile j.
template <int HD, int NWARPS, int BN, bool QREG>
__device__ __forceinline__ void attn_prefill(
    const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    u16* __restrict__ out, const int* __restrict__ qsl, const int* __restrict__ seq_lens,
    const int* __restrict__ bt, int num_tokens, int num_heads, int nkv, int bs, int num_blocks,
    int mbps, float scale_log2)
{
    constexpr int BM = 16 * NWARPS, NT = 32 * NWARPS, C = HD / 8;
    constexpr int QPT = BM * C / NT, KPT = BN * C / NT, RSTEP = NT / C;
    static_assert(NT % C == 0 && (BM * C) % NT == 0 && (BN * C) % NT == 0, "tile shape");
    static_assert(BN % 16 == 0 && HD % 16 == 0, "mma shape");
    // Dynamic shared memory, (BM + 2 BN) * HD bf16: the Q tile, then one K and one V tile.
    extern __shared__ __align__(128) u16 apf_smem[];
    u16* sQ = apf_smem;
    u16* sK = sQ + BM * HD;
    u16* sV = sK + BN * HD;

    const int s = blockIdx.z, h = blockIdx.y;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int qs = qsl[s], qlen = qsl[s + 1] - qs;
    const int q0 = qt * BM;
    if (q0 >= qlen) return;
    const int seq_len = seq_lens[s];
    const int ctx0 = seq_len - qlen;
    const int kvh = h / (num_heads / nkv);
    const int kv_end = min(seq_len, ctx0 + min(q0 + BM, qlen));
    const int n_tiles = kv_end > 0 ? (kv_end + BN - 1) / BN : 0;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ch = tid % C, r0 = tid / C;
    const int* btab = bt + (size_t)s * mbps;
    const size_t tok_stride = (size_t)nkv * HD;
    const size_t head_off = (size_t)kvh * HD + ch * 8;

    // Q tile (rows past the chunk or the batch are zero-filled).
#pragma unroll
    for (int k = 0; k < QPT; ++k) {
        const int r = r0 + k * RSTEP;
        const int tok = qs + q0 + r;
        const bool ok = (q0 + r < qlen) && tok >= 0 && tok < num_tokens;
        const u16* src = ok ? q + ((size_t)tok * num_heads + h) * HD + ch * 8 : q;
        cp_async16(smem_u32(sQ + r * HD + swz<C>(r, ch) * 8), src, ok ? 16 : 0);
    }
    int slot[KPT];
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
        const int key = r0 + k * RSTEP;
        slot[k] = key < kv_end ? kv_slot(btab, key, bs, mbps, num_blocks) : -1;
        const u16* src = slot[k] >= 0 ? kc + (size_t)slot[k] * tok_stride + head_off : kc;
        cp_async16(smem_u32(sK + key * HD + swz<C>(key, ch) * 8), src, slot[k] >= 0 ? 16 : 0);
    }
    cp_async_commit();

    const int g = lane >> 2, c = lane & 3;
    const int lrow = lane & 7, lsel1 = (lane >> 3) & 1, lsel2 = lane >> 4;
    const int pos_a = ctx0 + q0 + warp * 16 + g, pos_b = pos_a + 8;
    u32 qf[QREG ? HD / 16 : 1][4];
    float o[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
        o[dt][0] = 0.f; o[dt][1] = 0.f; o[dt][2] = 0.f; o[dt][3] = 0.f;
    }
    float m_run[2] = {ATTN_NEG_INF, ATTN_NEG_INF}, l_run[2] = {0.f, 0.f};

    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<0>();
        __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1}
        if (QREG && j == 0) {
#pragma unroll
            for (int kk = 0; kk < (QREG ? HD / 16 : 1); ++kk) {
                const int r = warp * 16 + lrow + 8 * lsel1, cq = 2 * kk + lsel2;
                ldsm_x4(smem_u32(sQ + r * HD + swz<C>(r, cq) * 8), qf[kk]);
            }
        }
#pragma unroll
        for (int k = 0; k < KPT; ++k) {
            const int r = r0 + k * RSTEP;
            const u16* src = slot[k] >= 0 ? vc + (size_t)slot[k] * tok_stride + head_off : vc;
            cp_async16(smem_u32(sV + r * HD + swz<C>(r, ch) * 8), src, slot[k] >= 0 ? 16 : 0);
        }
        cp_async_commit();

        float sacc[BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            sacc[nt][0] = 0.f; sacc[nt][1] = 0.f; sacc[nt][2] = 0.f; sacc[nt][3] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 a[4];
            if (QREG) {
                a[0] = qf[QREG ? kk : 0][0]; a[1] = qf[QREG ? kk : 0][1];
                a[2] = qf[QREG ? kk : 0][2]; a[3] = qf[QREG ? kk : 0][3];
            } else {
                const int r = warp * 16 + lrow + 8 * lsel1, cq = 2 * kk + lsel2;
                ldsm_x4(smem_u32(sQ + r * HD + swz<C>(r, cq) * 8), a);
            }
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                const int r = nn * 16 + lrow + 8 * lsel2, ck = 2 * kk + lsel1;
                u32 b[4];
                ldsm_x4(smem_u32(sK + r * HD + swz<C>(r, ck) * 8), b);
                mma_bf16(sacc[2 * nn], a, b[0], b[1]);
                mma_bf16(sacc[2 * nn + 1], a, b[2], b[3]);
            }
        }

        // Scale into the log2 domain; mask keys past the row's position or the context.
        const int kbase = j * BN;
        const bool need_mask = (kbase + BN - 1 > ctx0 + q0) || (kbase + BN > kv_end);
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = sacc[nt][e] * scale_log2;
                if (need_mask) {
                    const int key = kbase + nt * 8 + 2 * c + (e & 1);
                    const int pos = e < 2 ? pos_a : pos_b;
                    if (key > pos || key >= kv_end) v = ATTN_NEG_INF;
                }
                sacc[nt][e] = v;
            }
        }
        // Online softmax; a row lives in the 4 lanes of a quad.
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            float tmax = ATTN_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
                tmax = fmaxf(tmax, fmaxf(sacc[nt][2 * rh], sacc[nt][2 * rh + 1]));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
            const float m_new = fmaxf(m_run[rh], tmax);
            const float m_base = m_new == ATTN_NEG_INF ? 0.f : m_new;
            const float alpha = exp2f(m_run[rh] - m_base);
            m_run[rh] = m_new;
            float rs = 0.f;
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                const float p0 = exp2f(sacc[nt][2 * rh] - m_base);
                const float p1 = exp2f(sacc[nt][2 * rh + 1] - m_base);
                sacc[nt][2 * rh] = p0;
                sacc[nt][2 * rh + 1] = p1;
                rs += p0 + p1;
            }
            l_run[rh] = l_run[rh] * alpha + rs;
#pragma unroll
            for (int dt = 0; dt < HD / 8; ++dt) {
                o[dt][2 * rh] *= alpha;
                o[dt][2 * rh + 1] *= alpha;
            }
        }

        cp_async_wait<0>();
        __syncthreads();  // V_j landed; every warp is done with K_j
        if (j + 1 < n_tiles) {
#pragma unroll
            for (int k = 0; k < KPT; ++k) {
                const int r = r0 + k * RSTEP;
                const int key = (j + 1) * BN + r;
                slot[k] = key < kv_end ? kv_slot(btab, key, bs, mbps, num_blocks) : -1;
                const u16* src = slot[k] >= 0 ? kc + (size_t)slot[k] * tok_stride + head_off : kc;
                cp_async16(smem_u32(sK + r * HD + swz<C>(r, ch) * 8), src, slot[k] >= 0 ? 16 : 0);
            }
            cp_async_commit();
        }

#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[4];
            a[0] = pack_bf16x2(sacc[2 * kk][0], sacc[2 * kk][1]);
            a[1] = pack_bf16x2(sacc[2 * kk][2], sacc[2 * kk][3]);
            a[2] = pack_bf16x2(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
            a[3] = pack_bf16x2(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
#pragma unroll
            for (int dd = 0; dd < HD / 16; ++dd) {
                const int r = kk * 16 + lrow + 8 * lsel1, cv = 2 * dd + lsel2;
                u32 b[4];
                ldsm_x4_t(smem_u32(sV + r * HD + swz<C>(r, cv) * 8), b);
                mma_bf16(o[2 * dd], a, b[0], b[1]);
                mma_bf16(o[2 * dd + 1], a, b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        float l = l_run[rh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = q0 + warp * 16 + g + 8 * rh;
        const int tok = qs + row;
        if (row < qlen && tok >= 0 && tok < num_tokens) {
            u16* dst = out + ((size_t)tok * num_heads + h) * HD + 2 * c;
#pragma unroll
            for (int dt = 0; dt < HD / 8; ++dt) {
                *reinterpret_cast<u32*>(dst + dt * 8) =
                    pack_bf16x2(o[dt][2 * rh] * inv, o[dt][2 * rh + 1] * inv);
            }
        }
    }
}
