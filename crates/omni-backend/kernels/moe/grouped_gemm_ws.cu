// The grouped expert GEMM on warpgroup MMA, warp-specialized (sm_90a): the problem, arguments,
// 128-row blocks and epilogue of `moe_gemm_wg<BN, 64, STAGES, 2, GATE_UP>` (grouped_gemm_wg.cu,
// whose descriptor and wgmma helpers precede this file in the module), but the CTA's roles are
// split: PW producer warps fill the stages and never compute; two consumer warpgroups (rows
// 0-63 and 64-127 of the block) only wait for stages and issue MMAs, keeping one stage's MMAs
// in flight while they wait for the next. The producers copy the A rows (gathered tokens, or
// the sorted act rows) with `cp.async`; the weight tile too, or, with TMA, producer thread 0
// has the Tensor Memory Accelerator bring it in as BN / 64 boxes of 64 rows x 64 columns
// (`wmap`: the expert weights as one 2-D tensor [rows, K] with the 128-byte swizzle, the
// layout the descriptors read; elements past the tensor are zero-filled, rows past N within
// it are other weight rows, whose outputs the epilogue drops). Stages are handed over with
// mbarriers, not CTA-wide barriers:
//
// * full[s] (count 32 PW, + 1 with TMA): each producer thread's `cp.async.mbarrier.arrive.noinc`
//   arrives once its copies of the stage in slot s have landed; with TMA, thread 0 also arrives
//   announcing the weight tile's bytes (`expect_tx`), which the tensor copies complete. The
//   phase completes when all of them have. A consumer waits for it (acquire), then
//   `fence.proxy.async` makes the cp.async (generic-proxy) writes visible to its wgmma reads
//   (async proxy).
// * empty[s] (count 8, one lane per consumer warp): a consumer warp arrives once its MMAs on
//   the stage in slot s have completed (`wgmma.wait_group 1` after committing the next stage's
//   group); the producer waits for it before refilling slot s.
//
// Phases: the stage kt uses slot kt % STAGES; full[s] completes for the (kt / STAGES)-th time
// when stage kt has landed (parity (kt / STAGES) & 1), empty[s] for the (kt / STAGES)-th time
// when stage kt's MMAs are done, which the producer's refill with stage kt + STAGES waits for.
//
// Shared memory (dynamic, rounded up to 1024 bytes): STAGES A tiles [128][64] bf16, STAGES B
// tiles [BN][64] bf16 (the 128-byte swizzle of grouped_gemm_wg.cu), then 128 A-row offsets
// (long long, -1 for padding), 128 sorted pair ids, 2 * STAGES mbarriers. The mbarrier helpers are
// moe/mbarrier.cuh's.

template <int BN, int STAGES, int PW, bool TMA, bool GATE_UP>
__device__ __forceinline__ void moe_gemm_ws(
        const unsigned short* __restrict__ a_src, const unsigned short* __restrict__ w,
        const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
        unsigned short* __restrict__ dst, int hidden, int inter, int top_k,
        const MoeTensorMap* wmap) {
    constexpr int BM = 128, BK = 64, NC = 256, NP = 32 * PW, NT = NC + NP;
    constexpr int RS = NP / 8;  // rows per producer pass: 8 threads per 128-byte row
    constexpr int A_BYTES = BM * BK * 2;
    constexpr int B_BYTES = BN * BK * 2;
    static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "wgmma N: a multiple of 16 up to 256");
    static_assert(BM % RS == 0 && BN % RS == 0 && (BN / 2) % RS == 0, "producer rows per pass");
    static_assert(!TMA || BN % 128 == 0, "TMA: whole 64-row boxes of gate and of up rows");

    pdl_enter();
    const int expert = block_expert[blockIdx.y];
    if (expert < 0) return;  // CTA-uniform, before any barrier
    const int K = GATE_UP ? hidden : inter;
    const long long m0 = (long long)blockIdx.y * BM;

    const unsigned raw = wg_smem_u32(moe_smem);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* sA = reinterpret_cast<unsigned char*>(moe_smem) + (base - raw);
    unsigned char* sB = sA + STAGES * A_BYTES;
    long long* s_aoff = reinterpret_cast<long long*>(sB + STAGES * B_BYTES);
    int* s_pair = reinterpret_cast<int*>(s_aoff + BM);
    const unsigned bar0 = wg_smem_u32(s_pair + BM);  // full[s] at bar0 + 8 s, empty[s] after
    const unsigned full0 = bar0, empty0 = bar0 + 8 * STAGES;
    const int tid = threadIdx.x;
    for (int r = tid; r < BM; r += NT) {
        const int p = sorted_ids[m0 + r];
        s_pair[r] = p;
        s_aoff[r] = p < 0 ? -1ll : (GATE_UP ? (long long)(p / top_k) : m0 + r) * K;
    }
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, NP + (TMA ? 1 : 0));
            mbar_init(empty0 + 8 * s, NC / 32);
        }
        mbar_init_fence();
    }
    __syncthreads();  // row tables and initialized barriers; the last CTA-wide barrier
    const int KT = (K + BK - 1) / BK;

    if (tid >= NC) {
        // Producers: thread pt copies 16-byte chunk `chunk` of rows rsub + RS i of both tiles.
        const int pt = tid - NC, chunk = pt & 7, rsub = pt >> 3;
        const unsigned short* w_e =
            w + (size_t)expert * (size_t)(GATE_UP ? 2 * inter : hidden) * (size_t)K;
        for (int kt = 0; kt < KT; ++kt) {
            const int s = kt % STAGES;
            if (kt >= STAGES) mbar_wait(empty0 + 8 * s, ((kt / STAGES) - 1) & 1);
            const int kcol = kt * BK + chunk * 8;
            const bool kin = kcol < K;
            unsigned char* da = sA + s * A_BYTES;
#pragma unroll 8
            for (int i = 0; i < BM / RS; ++i) {
                const int r = rsub + RS * i;
                const long long off = s_aoff[r];
                const bool ok = off >= 0 && kin;
                cp_async16(da + r * 128 + ((chunk ^ (r & 7)) * 16), ok ? (const void*)(a_src + off + kcol) : (const void*)a_src, ok);
            }
            unsigned char* db = sB + s * B_BYTES;
            if (TMA) {
                if (pt == 0) {
                    // Box j holds tile rows 64 j .. 64 j + 63: gate_up's first BN / 128 boxes
                    // are gate rows, the rest the matching up rows.
                    mbar_arrive_expect_tx(full0 + 8 * s, B_BYTES);
#pragma unroll
                    for (int j = 0; j < BN / 64; ++j) {
                        const int row = GATE_UP
                            ? expert * 2 * inter + (64 * j < BN / 2 ? 0 : inter - BN / 2)
                                  + blockIdx.x * (BN / 2) + 64 * j
                            : expert * hidden + blockIdx.x * BN + 64 * j;
                        tma_load_2d(wg_smem_u32(db + j * 64 * 128), wmap, kt * BK, row,
                                    full0 + 8 * s);
                    }
                }
            } else {
#pragma unroll 8
                for (int i = 0; i < BN / RS; ++i) {
                    const int r = rsub + RS * i;
                    const int grow = moe_weight_row<BN, GATE_UP>(r, hidden, inter);
                    const bool ok = grow >= 0 && kin;
                    cp_async16(db + r * 128 + ((chunk ^ (r & 7)) * 16), ok ? (const void*)(w_e + (size_t)grow * K + kcol) : (const void*)w, ok);
                }
            }
            cp_async_mbar_arrive(full0 + 8 * s);
        }
        cp_async_wait<0>();  // leave no copy of this thread in flight at exit
        return;
    }

    // Consumers. Warpgroup wg's rows are all padding when its first is (see moe_gemm_wg); the
    // vote makes the flag visibly warp-uniform to ptxas.
    const int wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
    const bool wg_rows = __all_sync(0xffffffffu, s_pair[wg * 64] >= 0);
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % STAGES;
        mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
        fence_proxy_async();
        if (wg_rows) {
            const unsigned a_addr = base + s * A_BYTES + wg * 64 * 128;
            const unsigned b_addr = base + STAGES * A_BYTES + s * B_BYTES;
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks)
                wgmma_bf16<BN>(acc, wg_desc(a_addr + ks * 32), wg_desc(b_addr + ks * 32));
            wg_commit();
            wg_wait<1>();  // this warpgroup's MMAs of stage kt - 1 are done
        }
        if (kt > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((kt - 1) % STAGES));
    }
    if (wg_rows) wg_wait<0>();
    if (!wg_rows) return;
    moe_wg_store<BN, GATE_UP>(acc, s_pair, dst, m0, wg * 64, warp, lane, hidden, inter);
}
