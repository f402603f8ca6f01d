// The grouped expert GEMM on warpgroup MMA, warp-specialized and persistent (sm_90a): the
// problem, arguments, 64 WGS-row blocks and epilogue of `moe_gemm_wg<BN, 64, STAGES, WGS,
// GATE_UP>` (grouped_gemm_wg.cu, whose descriptor and wgmma helpers precede this file), but
// each CTA loops over tiles (tile t = M block t / n_tiles, N tile t % n_tiles, for t =
// blockIdx.x, + gridDim.x, ...; blocks the alignment left unused are skipped by every role
// alike) and its roles are split: PW producer warps fill the stages and never compute; WGS
// consumer warpgroups (rows 0-63, and 64-127 with two) only wait for stages and issue MMAs,
// keeping one stage's MMAs in flight while they wait for the next. The producers run ahead
// across tile boundaries, so the next tile's first stages load while the consumers finish and
// store the current one. They copy the A rows (gathered tokens, or the sorted act rows) with
// `cp.async`; the weight tile too, or, with TMA, producer thread 0 has the Tensor Memory
// Accelerator bring it in as BN / 64 boxes of 64 rows x 64 columns (`wmap`: the expert weights
// as one 2-D tensor [rows, K] with the 128-byte swizzle, the layout the descriptors read;
// elements past the tensor are zero-filled, rows past N within it are other weight rows, whose
// outputs the epilogue drops). Stages are handed over with mbarriers, never CTA-wide barriers:
//
// * full[s] (count 32 PW, + 1 with TMA): each producer thread's `cp.async.mbarrier.arrive.noinc`
//   arrives once its copies of the stage in slot s have landed; with TMA, thread 0 also arrives
//   announcing the weight tile's bytes (`expect_tx`), which the tensor copies complete. The
//   phase completes when all of them have. A consumer waits for it (acquire), then
//   `fence.proxy.async` makes the cp.async (generic-proxy) writes visible to its wgmma reads
//   (async proxy).
// * empty[s] (count 4 WGS, one lane per consumer warp): a consumer warp arrives once its MMAs on
//   the stage in slot s have completed (`wgmma.wait_group 1` after committing the next stage's
//   group, `wait_group 0` after a tile's last); the producer waits for it before refilling.
//
// Phases: both roles count the stages g = 0, 1, ... of every tile they take, in the same order;
// stage g uses slot g % STAGES; full[s] completes for the (g / STAGES)-th time when stage g has
// landed (parity (g / STAGES) & 1), empty[s] when stage g's MMAs are done, which the refill
// with stage g + STAGES waits for (parity (g / STAGES - 1) & 1). Row tables come from global
// memory (sorted_ids, L2-resident), so no role waits for another outside the mbarriers.
//
// Shared memory (dynamic, rounded up to 1024 bytes): STAGES A tiles [BM][64] bf16, STAGES B
// tiles [BN][64] bf16 (the 128-byte swizzle of grouped_gemm_wg.cu), then 2 * STAGES mbarriers
// (moe/mbarrier.cuh).

template <int BN, int STAGES, int PW, int WGS, bool TMA, bool GATE_UP>
__device__ __forceinline__ void moe_gemm_ws(
        const unsigned short* __restrict__ a_src, const unsigned short* __restrict__ w,
        const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
        unsigned short* __restrict__ dst, int hidden, int inter, int top_k, int max_blocks,
        const MoeTensorMap* wmap) {
    constexpr int BM = 64 * WGS, BK = 64, NC = 128 * WGS, NP = 32 * PW;
    constexpr int RS = NP / 8;  // rows per producer pass: 8 threads per 128-byte row
    constexpr int A_IT = BM / RS;
    constexpr int A_BYTES = BM * BK * 2;
    constexpr int B_BYTES = BN * BK * 2;
    static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "wgmma N: a multiple of 16 up to 256");
    static_assert(BM % RS == 0 && BN % RS == 0 && (BN / 2) % RS == 0, "producer rows per pass");
    static_assert(!TMA || BN % 128 == 0, "TMA: whole 64-row boxes of gate and of up rows");
    static_assert(WGS == 1 || WGS == 2, "one or two consumer warpgroups");

    pdl_enter();
    const int K = GATE_UP ? hidden : inter;
    const int KT = (K + BK - 1) / BK;
    const int n_tiles = GATE_UP ? (inter + BN / 2 - 1) / (BN / 2) : (hidden + BN - 1) / BN;
    const int tiles = n_tiles * max_blocks;

    const unsigned raw = wg_smem_u32(moe_smem);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* sA = reinterpret_cast<unsigned char*>(moe_smem) + (base - raw);
    unsigned char* sB = sA + STAGES * A_BYTES;
    const unsigned full0 = base + STAGES * (A_BYTES + B_BYTES);  // full[s] at + 8 s
    const unsigned empty0 = full0 + 8 * STAGES;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, NP + (TMA ? 1 : 0));
            mbar_init(empty0 + 8 * s, NC / 32);
        }
        mbar_init_fence();
    }
    __syncthreads();  // initialized barriers; the only CTA-wide barrier

    if (tid >= NC) {
        // Producers: thread pt copies 16-byte chunk `chunk` of rows rsub + RS i of both tiles.
        const int pt = tid - NC, chunk = pt & 7, rsub = pt >> 3;
        int g = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            const int mb = t / n_tiles, nt = t - mb * n_tiles;
            const int expert = __ldg(block_expert + mb);
            if (expert < 0) continue;  // the consumers skip it too
            const long long m0 = (long long)mb * BM;
            long long aoff[A_IT];  // element offset of A row rsub + RS i, -1 for padding
#pragma unroll
            for (int i = 0; i < A_IT; ++i) {
                const int p = __ldg(sorted_ids + m0 + rsub + RS * i);
                aoff[i] = p < 0 ? -1ll : (GATE_UP ? (long long)(p / top_k) : m0 + rsub + RS * i) * K;
            }
            const unsigned short* w_e =
                w + (size_t)expert * (size_t)(GATE_UP ? 2 * inter : hidden) * (size_t)K;
            for (int kt = 0; kt < KT; ++kt, ++g) {
                const int s = g % STAGES;
                if (g >= STAGES) mbar_wait(empty0 + 8 * s, ((g / STAGES) - 1) & 1);
                const int kcol = kt * BK + chunk * 8;
                const bool kin = kcol < K;
                unsigned char* da = sA + s * A_BYTES;
#pragma unroll
                for (int i = 0; i < A_IT; ++i) {
                    const int r = rsub + RS * i;
                    const bool ok = aoff[i] >= 0 && kin;
                    cp_async16(da + r * 128 + ((chunk ^ (r & 7)) * 16), ok ? (const void*)(a_src + aoff[i] + kcol) : (const void*)a_src, ok);
                }
                unsigned char* db = sB + s * B_BYTES;
                if (TMA) {
                    if (pt == 0) {
                        // Box j holds tile rows 64 j .. 64 j + 63: gate_up's first BN / 128
                        // boxes are gate rows, the rest the matching up rows.
                        mbar_arrive_expect_tx(full0 + 8 * s, B_BYTES);
#pragma unroll
                        for (int j = 0; j < BN / 64; ++j) {
                            const int row = GATE_UP
                                ? expert * 2 * inter + (64 * j < BN / 2 ? 0 : inter - BN / 2)
                                      + nt * (BN / 2) + 64 * j
                                : expert * hidden + nt * BN + 64 * j;
                            tma_load_2d(wg_smem_u32(db + j * 64 * 128), wmap, kt * BK, row,
                                        full0 + 8 * s);
                        }
                    }
                } else {
#pragma unroll 8
                    for (int i = 0; i < BN / RS; ++i) {
                        const int r = rsub + RS * i;
                        const int grow = moe_weight_row<BN, GATE_UP>(r, nt, hidden, inter);
                        const bool ok = grow >= 0 && kin;
                        cp_async16(db + r * 128 + ((chunk ^ (r & 7)) * 16), ok ? (const void*)(w_e + (size_t)grow * K + kcol) : (const void*)w, ok);
                    }
                }
                cp_async_mbar_arrive(full0 + 8 * s);
            }
        }
        cp_async_wait<0>();  // leave no copy of this thread in flight at exit
        return;
    }

    // Consumers. Warpgroup wg's rows are all padding when its first is (see moe_gemm_wg); the
    // vote makes the flag visibly warp-uniform to ptxas.
    const int wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
    int g = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int mb = t / n_tiles, nt = t - mb * n_tiles;
        // As the producers; through a vote, so that ptxas sees the branch warp-uniform (else it
        // serializes the wgmma instructions after it).
        if (__all_sync(0xffffffffu, __ldg(block_expert + mb) < 0)) continue;
        const long long m0 = (long long)mb * BM;
        const int* pairs = sorted_ids + m0;
        const bool wg_rows = __all_sync(0xffffffffu, __ldg(pairs + wg * 64) >= 0);
        // The tile's first MMA overwrites the accumulators (no zeroing writes before it).
        float acc[BN / 2];
        for (int kt = 0; kt < KT; ++kt, ++g) {
            const int s = g % STAGES;
            mbar_wait(full0 + 8 * s, (g / STAGES) & 1);
            fence_proxy_async();
            if (wg_rows) {
                const unsigned a_addr = base + s * A_BYTES + wg * 64 * 128;
                const unsigned b_addr = base + STAGES * A_BYTES + s * B_BYTES;
                wg_fence();
                if (kt == 0)
                    wgmma_bf16_first<BN>(acc, wg_desc(a_addr), wg_desc(b_addr));
                else
                    wgmma_bf16<BN>(acc, wg_desc(a_addr), wg_desc(b_addr));
#pragma unroll
                for (int ks = 1; ks < BK / 16; ++ks)
                    wgmma_bf16<BN>(acc, wg_desc(a_addr + ks * 32), wg_desc(b_addr + ks * 32));
                wg_commit();
                wg_wait<1>();  // this warpgroup's MMAs of stage g - 1 are done
            }
            if (kt > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((g - 1) % STAGES));
        }
        if (wg_rows) wg_wait<0>();
        if (lane == 0) mbar_arrive(empty0 + 8 * ((g - 1) % STAGES));  // the tile's last stage
        if (wg_rows)
            moe_wg_store<BN, GATE_UP>(acc, pairs, dst, m0, nt, wg * 64, warp, lane, hidden, inter);
    }
}
