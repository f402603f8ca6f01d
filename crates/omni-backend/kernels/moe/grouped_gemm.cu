// The grouped expert GEMM template; its `extern "C"` entry points (one per tile configuration
// and direction) are instantiated by the Rust side (src/cuda/moe/source.rs).
// Prepended by the Rust side: bf16.cuh, moe/ptx.cuh, moe/common.cuh (src/cuda/moe/source.rs).

// ---- grouped GEMM over the sorted rows of one BM-row block (grid: x = N tile, y = block).
// GATE_UP: A = x [T, H] gathered by token (p / top_k), B = w13[e] [2I, H], the CTA's B tile is
//   BN/2 gate rows then the matching BN/2 up rows; epilogue silu(gate) * up -> act [rows, I].
// else:    A = act [rows, I] (row = sorted position), B = w2[e] [H, I]; epilogue -> y [P, H]
//   at row p. Rows with p < 0 (padding) are zero-filled and not stored.
// Shared memory (dynamic): STAGES x (BM + BN) x (BK + 8) bf16, then BM ints.
template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool GATE_UP>
__device__ __forceinline__ void moe_gemm(
        const unsigned short* __restrict__ a_src, const unsigned short* __restrict__ w,
        const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
        unsigned short* __restrict__ dst, int hidden, int inter, int top_k) {
    constexpr int NT = WM * WN * 32;
    constexpr int WTM = BM / WM;
    constexpr int WTN = BN / WN;
    constexpr int MF = WTM / 16;
    constexpr int NF = WTN / 8;
    constexpr int LDS = BK + 8;
    constexpr int CPR = BK / 8;
    constexpr int RSTEP = NT / CPR;
    constexpr int A_IT = BM / RSTEP;
    constexpr int B_IT = BN / RSTEP;
    static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile: whole m16 and pairs of n8 fragments");
    static_assert(BK % 16 == 0 && NT % CPR == 0, "k tiling");
    static_assert(BM % RSTEP == 0 && BN % RSTEP == 0 && (BN / 2) % RSTEP == 0, "load mapping");

    pdl_enter();
    const int expert = block_expert[blockIdx.y];
    if (expert < 0) return;  // CTA-uniform, before any barrier
    const int K = GATE_UP ? hidden : inter;
    const long long m0 = (long long)blockIdx.y * BM;

    unsigned short* sA = reinterpret_cast<unsigned short*>(moe_smem);
    unsigned short* sB = sA + STAGES * BM * LDS;
    int* s_pair = reinterpret_cast<int*>(sB + STAGES * BN * LDS);
    const int tid = threadIdx.x;
    for (int r = tid; r < BM; r += NT) s_pair[r] = sorted_ids[m0 + r];
    __syncthreads();

    // Each thread copies the same 16-byte chunk column of rows row0 + i * RSTEP every stage.
    const int chunk = tid % CPR;
    const int row0 = tid / CPR;
    const unsigned short* a_ptr[A_IT];
    bool a_ok[A_IT];
    const unsigned short* b_ptr[B_IT];
    bool b_ok[B_IT];
    moe_tile_sources<A_IT, B_IT, RSTEP, BN, GATE_UP>(a_src, w, s_pair, expert, m0, row0, chunk, hidden,
                                                    inter, top_k, a_ptr, a_ok, b_ptr, b_ok);

    const int KT = (K + BK - 1) / BK;
    auto load_stage = [&](int slot, int kt) {
        const bool kin = kt * BK + chunk * 8 < K;
        unsigned short* da = sA + slot * (BM * LDS) + row0 * LDS + chunk * 8;
#pragma unroll
        for (int i = 0; i < A_IT; ++i) {
            const bool ok = a_ok[i] && kin;
            cp_async16(da + i * RSTEP * LDS, ok ? (const void*)(a_ptr[i] + kt * BK) : (const void*)a_src, ok);
        }
        unsigned short* db = sB + slot * (BN * LDS) + row0 * LDS + chunk * 8;
#pragma unroll
        for (int i = 0; i < B_IT; ++i) {
            const bool ok = b_ok[i] && kin;
            cp_async16(db + i * RSTEP * LDS, ok ? (const void*)(b_ptr[i] + kt * BK) : (const void*)w, ok);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }

    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    // ldmatrix row addresses: A x4 = rows 0-15 at k 0 / k 8; B x4 = fragments nf (lanes 0-15)
    // and nf + 1 (lanes 16-31), each at k 0 (lanes 0-7) / k 8 (lanes 8-15).
    const int a_off = (wm * WTM + (lane & 15)) * LDS + (lane >> 4) * 8;
    int b_off[NF / 2];
#pragma unroll
    for (int np = 0; np < NF / 2; ++np) {
        const int nf = 2 * np + (lane >> 4);
        int brow;
        if (GATE_UP) brow = (nf / (NF / 2)) * (BN / 2) + wn * (WTN / 2) + (nf % (NF / 2)) * 8;
        else brow = wn * WTN + nf * 8;
        b_off[np] = (brow + (lane & 7)) * LDS + ((lane >> 3) & 1) * 8;
    }

    float acc[MF][NF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mf][nf][q] = 0.f;

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();  // stage kt has landed (this thread's copies)
        __syncthreads();              // ... everyone's; and stage kt - 1 is free to overwrite
        {
            const int nk = kt + STAGES - 1;
            if (nk < KT) load_stage(nk % STAGES, nk);
            cp_async_commit();
        }
        const unsigned short* tA = sA + (kt % STAGES) * (BM * LDS);
        const unsigned short* tB = sB + (kt % STAGES) * (BN * LDS);
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            unsigned af[MF][4];
#pragma unroll
            for (int mf = 0; mf < MF; ++mf)
                ldsm_x4(tA + a_off + mf * 16 * LDS + ks * 16, af[mf][0], af[mf][1], af[mf][2], af[mf][3]);
            unsigned bfr[NF][2];
#pragma unroll
            for (int np = 0; np < NF / 2; ++np)
                ldsm_x4(tB + b_off[np] + ks * 16, bfr[2 * np][0], bfr[2 * np][1], bfr[2 * np + 1][0], bfr[2 * np + 1][1]);
#pragma unroll
            for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                for (int nf = 0; nf < NF; ++nf) mma_16816(acc[mf][nf], af[mf], bfr[nf][0], bfr[nf][1]);
        }
    }
    cp_async_wait<0>();

    // Epilogue: accumulator (mf, nf) holds rows g / g + 8 and columns 2 * t4, 2 * t4 + 1.
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * WTM + mf * 16 + g + h * 8;
            const int p = s_pair[r];
            if (p < 0) continue;
            if constexpr (GATE_UP) {
                unsigned short* orow = dst + (size_t)(m0 + r) * inter;
#pragma unroll
                for (int nf = 0; nf < NF / 2; ++nf) {
                    const int j = blockIdx.x * (BN / 2) + wn * (WTN / 2) + nf * 8 + 2 * t4;
                    if (j < inter) {
                        const float g0 = acc[mf][nf][2 * h], g1 = acc[mf][nf][2 * h + 1];
                        const float u0 = acc[mf][nf + NF / 2][2 * h], u1 = acc[mf][nf + NF / 2][2 * h + 1];
                        const float v0 = g0 / (1.0f + expf(-g0)) * u0;
                        const float v1 = g1 / (1.0f + expf(-g1)) * u1;
                        *reinterpret_cast<unsigned*>(orow + j) = pack_bf16x2(v0, v1);
                    }
                }
            } else {
                unsigned short* orow = dst + (size_t)p * hidden;
#pragma unroll
                for (int nf = 0; nf < NF; ++nf) {
                    const int n = blockIdx.x * BN + wn * WTN + nf * 8 + 2 * t4;
                    if (n < hidden)
                        *reinterpret_cast<unsigned*>(orow + n) = pack_bf16x2(acc[mf][nf][2 * h], acc[mf][nf][2 * h + 1]);
                }
            }
        }
    }
}
