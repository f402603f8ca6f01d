// The router of long steps on tensor cores with its top-k in the same launch (src/cuda/moe/
// route_mma.rs; opt-in OMNI_CUDA_MOE_ROUTE_MMA=1). The inputs are the split-bf16 router's
// (router.rs): the norm's output as x = hi + mid + lo (`h`, and `h_lo` rows [mid | lo]), the
// router as w = w_hi (+ w_lo): logits[t, e] = hi.w_hi + mid.w_hi + lo.w_hi (+ hi.w_lo), every
// product exact in f32 (bf16 x bf16) and summed in f32 by `mma.sync` m16n8k16.
// Prepended by the Rust side: bf16.cuh, moe/ptx.cuh, moe/common.cuh, moe/topk_warp.cuh.
//
// Grid: x = block mb of MR_BM tokens, y = split s of the hidden dimension (MR_KC columns each:
// the split, and so the order of every sum, depends on the hidden size alone, never on the
// token count: a token's logits have the same bits in any batch). 8 warps: warp w multiplies
// tokens 16 (w % 4) .. + 15 of the block by experts 64 (w / 4) .. + 63 (8 n8 fragments; experts
// past E are zero rows). Stages of MR_BK columns (hi, mid, lo: [MR_BM][MR_LDS], w_hi (and w_lo):
// [128][MR_LDS] bf16, rows padded by 8 elements so that ldmatrix's 8 row addresses hit 8
// different 16-byte bank groups), MR_STAGES deep, filled with cp.async as in moe_gemm.
//
// Split-K fix-up: each CTA stores its partial sums ([tokens of the block][E] f32) into part[s]
// and counts itself in cnt[mb]; the CTA that counts last adds the splits' partials of each logit
// in split order (0, 1, ..: the same bits whichever CTA is last), writes the logits (when
// `logits` is not null), resets cnt[mb] to 0 for the next launch, and routes its tokens
// (`moe_topk_regs`, a warp per token: the experts and weights of `moe_topk_softmax`). No CTA
// waits for another.
// Memory order (the CUDA programming guide's last-block pattern): every thread's partial stores,
// then its __threadfence (fence.sc.gpu), then the CTA barrier, then thread 0's atomicAdd on
// cnt[mb]: the stores are ordered before the count at GPU scope. The last CTA's thread 0 reads
// the count of all the others (one chain of read-modify-writes on cnt[mb]), then its CTA meets
// at a barrier and every thread fences again before reading the partials through L2 (__ldcg;
// L1 is not coherent), so the reads come after every split's stores. cnt[mb] is reset by a
// plain store; the next launch reads it after this grid completed (stream order; dependents
// launched early wait in pdl_enter for this grid's completion).

#define MR_BM 64
#define MR_BK 32
#define MR_LDS (MR_BK + 8)
#define MR_STAGES 4
#define MR_KC 512
#define MR_THREADS 256

template <bool LO>
__device__ __forceinline__ void moe_route_mma_body(
        const unsigned short* __restrict__ h, const unsigned short* __restrict__ h_lo,
        const unsigned short* __restrict__ w_hi2, const unsigned short* __restrict__ w_lo,
        float* __restrict__ part, int* __restrict__ cnt, float* __restrict__ logits,
        int* __restrict__ ids, float* __restrict__ wts, int tokens, int hidden, int num_experts,
        int top_k, int renorm) {
    constexpr int NA = 3, NB = LO ? 2 : 1;   // A tiles (hi, mid, lo), B tiles (w_hi, w_lo)
    constexpr int A_TILE = MR_BM * MR_LDS, B_TILE = 128 * MR_LDS;
    constexpr int STAGE = NA * A_TILE + NB * B_TILE;
    constexpr int KTS = MR_KC / MR_BK;       // k tiles of a whole split
    __shared__ int s_last;
    pdl_enter();
    const int mb = blockIdx.x, s = blockIdx.y, splits = gridDim.y;
    const int m0 = mb * MR_BM;
    const int kt0 = s * KTS;
    const int KT = min(KTS, (hidden + MR_BK - 1) / MR_BK - kt0);
    unsigned short* sm = reinterpret_cast<unsigned short*>(moe_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // Thread tid copies 16-byte chunk `chunk` (columns 8 chunk ..) of A row row0 of each A
    // tile and of B rows row0 and row0 + 64; rows past the tokens or the experts zero-fill.
    const int chunk = tid & 3, row0 = tid >> 2;
    const bool a_ok = m0 + row0 < tokens;
    const size_t tok = a_ok ? (size_t)(m0 + row0) : 0;
    const unsigned short* a_src[NA] = {h + tok * hidden + chunk * 8,
                                       h_lo + tok * 2 * hidden + chunk * 8,
                                       h_lo + tok * 2 * hidden + hidden + chunk * 8};
    bool b_ok[2];
    const unsigned short* b_src[NB][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int e = row0 + 64 * i;
        b_ok[i] = e < num_experts;
        const size_t er = b_ok[i] ? (size_t)e : 0;
        b_src[0][i] = w_hi2 + er * 2 * hidden + chunk * 8;
        if constexpr (LO) b_src[NB - 1][i] = w_lo + er * hidden + chunk * 8;
    }
    auto load_stage = [&](int slot, int kt) {
        const int k0 = (kt0 + kt) * MR_BK;
        const bool kin = k0 + chunk * 8 < hidden;
        unsigned short* d = sm + slot * STAGE + row0 * MR_LDS + chunk * 8;
#pragma unroll
        for (int m = 0; m < NA; ++m) {
            const bool ok = a_ok && kin;
            cp_async16(d + m * A_TILE, ok ? (const void*)(a_src[m] + k0) : (const void*)h, ok);
        }
#pragma unroll
        for (int m = 0; m < NB; ++m)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const bool ok = b_ok[i] && kin;
                cp_async16(d + NA * A_TILE + m * B_TILE + i * 64 * MR_LDS,
                           ok ? (const void*)(b_src[m][i] + k0) : (const void*)w_hi2, ok);
            }
    };
#pragma unroll
    for (int st = 0; st < MR_STAGES - 1; ++st) {
        if (st < KT) load_stage(st, st);
        cp_async_commit();
    }

    const int wm = warp & 3, wn = warp >> 2;
    // ldmatrix row addresses (as moe_gemm's): A x4 = rows 0-15 at k 0 / k 8; B x4 = fragments
    // 2 np (lanes 0-15) and 2 np + 1 (lanes 16-31), each at k 0 (lanes 0-7) / k 8 (lanes 8-15).
    const int a_off = (16 * wm + (lane & 15)) * MR_LDS + (lane >> 4) * 8;
    const int b_off = (64 * wn + (lane >> 4) * 8 + (lane & 7)) * MR_LDS + ((lane >> 3) & 1) * 8;
    float acc[8][4];
#pragma unroll
    for (int nf = 0; nf < 8; ++nf)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[nf][q] = 0.f;

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<MR_STAGES - 2>();  // stage kt has landed (this thread's copies)
        __syncthreads();                 // ... everyone's; stage kt - 1 is free to overwrite
        {
            const int nk = kt + MR_STAGES - 1;
            if (nk < KT) load_stage(nk % MR_STAGES, nk);
            cp_async_commit();
        }
        const unsigned short* t = sm + (kt % MR_STAGES) * STAGE;
#pragma unroll
        for (int ks = 0; ks < MR_BK / 16; ++ks) {
            unsigned a[NA][4];
#pragma unroll
            for (int m = 0; m < NA; ++m)
                ldsm_x4(t + m * A_TILE + a_off + ks * 16, a[m][0], a[m][1], a[m][2], a[m][3]);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                unsigned b[4];
                ldsm_x4(t + NA * A_TILE + b_off + np * 16 * MR_LDS + ks * 16, b[0], b[1], b[2], b[3]);
#pragma unroll
                for (int m = 0; m < NA; ++m) {
                    mma_16816(acc[2 * np], a[m], b[0], b[1]);
                    mma_16816(acc[2 * np + 1], a[m], b[2], b[3]);
                }
                if constexpr (LO) {
                    ldsm_x4(t + NA * A_TILE + B_TILE + b_off + np * 16 * MR_LDS + ks * 16, b[0], b[1],
                            b[2], b[3]);
                    mma_16816(acc[2 * np], a[0], b[0], b[1]);
                    mma_16816(acc[2 * np + 1], a[0], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // This split's partial sums: fragment nf holds rows g / g + 8 and columns 2 t4, 2 t4 + 1.
    const int g = lane >> 2, t4 = lane & 3;
    const size_t mpad = (size_t)gridDim.x * MR_BM;
    float* ps = part + ((size_t)s * mpad + m0) * num_experts;
#pragma unroll
    for (int nf = 0; nf < 8; ++nf)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = 16 * wm + g + 8 * hh, c = 64 * wn + 8 * nf + 2 * t4;
            if (m0 + r >= tokens) continue;
            if (c < num_experts) ps[(size_t)r * num_experts + c] = acc[nf][2 * hh];
            if (c + 1 < num_experts) ps[(size_t)r * num_experts + c + 1] = acc[nf][2 * hh + 1];
        }
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(cnt + mb, 1) == splits - 1;
    __syncthreads();
    if (!s_last) return;  // CTA-uniform
    __threadfence();

    // The last CTA: logits = the splits' partials in split order, into shared memory (the
    // stages are done: every copy waited for, every thread past the barrier), then routing.
    float* rows = reinterpret_cast<float*>(moe_smem);
    const int nrows = min(MR_BM, tokens - m0);
    // The block's rows are one run of nrows * E floats in each split, 16-byte aligned (m0 and
    // mpad are multiples of 64): float4s, then the tail element by element.
    const float* p0 = part + (size_t)m0 * num_experts;
    const size_t split_stride = mpad * num_experts;
    float* lg = logits ? logits + (size_t)m0 * num_experts : nullptr;
    const int n = nrows * num_experts, n4 = n >> 2;
    for (int i = tid; i < n4; i += MR_THREADS) {
        float4 v = __ldcg(reinterpret_cast<const float4*>(p0) + i);
#pragma unroll 4
        for (int q = 1; q < splits; ++q) {
            const float4 w = __ldcg(reinterpret_cast<const float4*>(p0 + q * split_stride) + i);
            v.x += w.x; v.y += w.y; v.z += w.z; v.w += w.w;
        }
        reinterpret_cast<float4*>(rows)[i] = v;
        if (lg) reinterpret_cast<float4*>(lg)[i] = v;
    }
    for (int i = 4 * n4 + tid; i < n; i += MR_THREADS) {
        float v = __ldcg(p0 + i);
        for (int q = 1; q < splits; ++q) v += __ldcg(p0 + q * split_stride + i);
        rows[i] = v;
        if (lg) lg[i] = v;
    }
    if (tid == 0) cnt[mb] = 0;
    __syncthreads();
    // 8 tokens a warp: the register form of the warp's top-k (E <= 128 <= 32 MOE_TOPK_REG;
    // the same experts and weights as the shared-memory form, topk_emu.rs), two redux.sync a
    // pick instead of a shuffle tree over shared memory.
    for (int r = warp; r < nrows; r += MR_THREADS / 32)
        moe_topk_regs(rows + r * num_experts, ids + (size_t)(m0 + r) * top_k,
                      wts + (size_t)(m0 + r) * top_k, num_experts, top_k, renorm, lane);
}

#define MR_ARGS const unsigned short* __restrict__ h, const unsigned short* __restrict__ h_lo, \
        const unsigned short* __restrict__ w_hi2, const unsigned short* __restrict__ w_lo,     \
        float* __restrict__ part, int* __restrict__ cnt, float* __restrict__ logits,           \
        int* __restrict__ ids, float* __restrict__ wts, int tokens, int hidden,                \
        int num_experts, int top_k, int renorm
#define MR_PASS h, h_lo, w_hi2, w_lo, part, cnt, logits, ids, wts, tokens, hidden, num_experts, \
        top_k, renorm
// A router of bf16 values (no w_lo; 100 KiB of shared memory: two CTAs fit an SM), and one
// with w_lo (140 KiB).
extern "C" __global__ void __launch_bounds__(MR_THREADS, 2) moe_route_mma(MR_ARGS) {
    moe_route_mma_body<false>(MR_PASS);
}
extern "C" __global__ void __launch_bounds__(MR_THREADS, 1) moe_route_mma_lo(MR_ARGS) {
    moe_route_mma_body<true>(MR_PASS);
}
