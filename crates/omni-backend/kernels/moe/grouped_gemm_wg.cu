// The grouped expert GEMM on Hopper's warpgroup MMA (sm_90a): the same problem, arguments and
// epilogue as `moe_gemm` (grouped_gemm.cu). A CTA of WGS warpgroups (4 warps each) computes a
// 64 * WGS-row block against BN weight rows: warpgroup wg issues `wgmma.mma_async` m64nBNk16 on
// rows 64 wg .. 64 wg + 63 against the one weight tile they share (both operands read from
// shared memory through matrix descriptors), fed by a STAGES-deep `cp.async` pipeline of
// BK-wide K stages (one or two 64-wide sub-tiles) that all the CTA's threads fill. Two (four)
// warpgroups halve (quarter) the weight traffic per row (the weight tile is read once for 128
// or 256 rows); a warpgroup whose rows are all padding skips its MMAs. Its `extern "C"` entry points are instantiated by the Rust side
// (src/cuda/moe/source.rs), which also prepends bf16.cuh, moe/ptx.cuh, moe/common.cuh and the
// generated `wgmma_m64n<BN>k16` wrappers.
//
// Shared memory (dynamic, rounded up to a 1024-byte boundary): STAGES A tiles of BK / 64
// sub-tiles [64 WGS][64] bf16, STAGES B tiles of BK / 64 sub-tiles [BN][64] bf16, then 64 WGS
// ints. Every tile row is 128 bytes, stored with
// the 128-byte swizzle the descriptors name: 16-byte chunk c of row r sits at chunk c ^ (r % 8),
// so an 8-row group is one 1024-byte swizzle atom (the descriptor's stride byte offset), the K
// step ks of 16 elements starts 32 * ks bytes into the tile, and warpgroup wg's rows start
// 8192 wg bytes into an A tile (a whole number of atoms).

__device__ __forceinline__ unsigned wg_smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
// Matrix descriptor of a K-major tile with 128-byte rows and the 128-byte swizzle: start address
// >> 4 in bits 0-13, leading byte offset 0 (unused by swizzled K-major layouts), stride byte
// offset 1024 >> 4 in bits 32-45, base offset 0 (atoms are 1024-aligned), layout 1 (128-byte
// swizzle) in bits 62-63.
__device__ __forceinline__ unsigned long long wg_desc(unsigned smem_addr) {
    return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Makes this thread's completed generic-proxy writes to shared memory (cp.async) visible to the
// async proxy, through which wgmma reads its operands.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The epilogue of the warpgroup-MMA GEMMs: warp `warp` (lane `lane`) of the warpgroup owning
// block rows r_base .. r_base + 63 writes its accumulators (the m16n8 layout moe_gemm_wg
// describes) for the rows that hold a pair (`s_pair`: the block's sorted pair ids, in shared or
// global memory) into N tile nt: gate_up applies SiLU(gate) * up into act row m0 + r, down
// writes y row p.
template <int BN, bool GATE_UP>
__device__ __forceinline__ void moe_wg_store(
        const float (&acc)[BN / 2], const int* s_pair, unsigned short* __restrict__ dst,
        long long m0, int nt, int r_base, int warp, int lane, int hidden, int inter) {
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r_base + warp * 16 + g + h * 8;
        const int p = s_pair[r];
        if (p < 0) continue;
        if constexpr (GATE_UP) {
            unsigned short* orow = dst + (size_t)(m0 + r) * inter;
#pragma unroll
            for (int nb = 0; nb < BN / 16; ++nb) {
                const int j = nt * (BN / 2) + nb * 8 + 2 * t4;
                if (j < inter) {
                    const float g0 = acc[4 * nb + 2 * h], g1 = acc[4 * nb + 2 * h + 1];
                    const int u = 4 * (nb + BN / 16) + 2 * h;
                    const float v0 = g0 / (1.0f + expf(-g0)) * acc[u];
                    const float v1 = g1 / (1.0f + expf(-g1)) * acc[u + 1];
                    *reinterpret_cast<unsigned*>(orow + j) = pack_bf16x2(v0, v1);
                }
            }
        } else {
            unsigned short* orow = dst + (size_t)p * hidden;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
                const int n = nt * BN + nb * 8 + 2 * t4;
                if (n < hidden)
                    *reinterpret_cast<unsigned*>(orow + n) = pack_bf16x2(acc[4 * nb + 2 * h], acc[4 * nb + 2 * h + 1]);
            }
        }
    }
}

template <int BN, int BK, int STAGES, int WGS, bool GATE_UP>
__device__ __forceinline__ void moe_gemm_wg(
        const unsigned short* __restrict__ a_src, const unsigned short* __restrict__ w,
        const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
        unsigned short* __restrict__ dst, int hidden, int inter, int top_k) {
    constexpr int BM = 64 * WGS, NT = 128 * WGS;
    constexpr int KS = BK / 64;    // 64-wide swizzled sub-tiles per stage
    constexpr int RSTEP = NT / 8;  // rows per pass: 8 chunks of 16 bytes per 128-byte row
    constexpr int A_IT = BM / RSTEP;
    constexpr int B_IT = BN / RSTEP;
    constexpr int SUB_A = BM * 128, SUB_B = BN * 128;  // whole swizzle atoms
    constexpr int A_BYTES = KS * SUB_A;
    constexpr int B_BYTES = KS * SUB_B;
    static_assert(BK == 64 || BK == 128, "one or two 64-wide sub-tiles per stage");
    static_assert(BN % 16 == 0 && BN >= 16 && BN <= 256, "wgmma N: a multiple of 16 up to 256");
    static_assert((BN / 2) % RSTEP == 0, "gate and up halves load whole passes");
    static_assert(WGS == 1 || WGS == 2 || WGS == 4, "one, two or four warpgroups");

    pdl_enter();
    const int expert = block_expert[blockIdx.y];
    if (expert < 0) return;  // CTA-uniform, before any barrier
    const int K = GATE_UP ? hidden : inter;
    const long long m0 = (long long)blockIdx.y * BM;

    const unsigned raw = wg_smem_u32(moe_smem);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* sA = reinterpret_cast<unsigned char*>(moe_smem) + (base - raw);
    unsigned char* sB = sA + STAGES * A_BYTES;
    int* s_pair = reinterpret_cast<int*>(sB + STAGES * B_BYTES);
    const int tid = threadIdx.x;
    for (int r = tid; r < BM; r += NT) s_pair[r] = sorted_ids[m0 + r];
    __syncthreads();

    // Each thread copies chunk `chunk` of rows row0 + i * RSTEP; those rows share row0 % 8
    // (RSTEP is a multiple of 8), so the swizzled byte offset within a row is the same for all.
    const int chunk = tid % 8;
    const int row0 = tid / 8;
    const int swz = ((chunk ^ (row0 & 7)) * 16);
    const unsigned short* a_ptr[A_IT];
    bool a_ok[A_IT];
    const unsigned short* b_ptr[B_IT];
    bool b_ok[B_IT];
    moe_tile_sources<A_IT, B_IT, RSTEP, BN, GATE_UP>(a_src, w, s_pair, expert, m0, row0, chunk, hidden,
                                                    inter, top_k, a_ptr, a_ok, b_ptr, b_ok);

    const int KT = (K + BK - 1) / BK;
    // Sub-tile j of stage kt holds K columns kt * BK + 64 j .. + 63.
    auto load_stage = [&](int slot, int kt) {
#pragma unroll
        for (int j = 0; j < KS; ++j) {
            const int k0 = kt * BK + j * 64;
            const bool kin = k0 + chunk * 8 < K;
            unsigned char* da = sA + slot * A_BYTES + j * SUB_A + row0 * 128 + swz;
#pragma unroll
            for (int i = 0; i < A_IT; ++i) {
                const bool ok = a_ok[i] && kin;
                cp_async16(da + i * RSTEP * 128, ok ? (const void*)(a_ptr[i] + k0) : (const void*)a_src, ok);
            }
            unsigned char* db = sB + slot * B_BYTES + j * SUB_B + row0 * 128 + swz;
#pragma unroll
            for (int i = 0; i < B_IT; ++i) {
                const bool ok = b_ok[i] && kin;
                cp_async16(db + i * RSTEP * 128, ok ? (const void*)(b_ptr[i] + k0) : (const void*)w, ok);
            }
        }
    };

    // Copies run STAGES - 1 stages ahead of the MMAs. Every stage's MMAs complete before the
    // next barrier, so stage kt refills the slot of stage kt - 1. (Leaving one stage's MMAs in
    // flight, copies STAGES - 2 ahead, took 1.01-1.09x the time on an H200.)
    constexpr int AHEAD = STAGES - 1;
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }

    // Warpgroup wg's rows; the alignment pads an expert's last block at its end, so when the
    // first of them is padding they all are: the flag is uniform over the warpgroup, as wgmma
    // requires. Taken through a vote so that ptxas sees it warp-uniform (read from shared memory
    // it would count as divergent, and ptxas then serializes the wgmma instructions).
    const int wg = tid >> 7;
    const bool wg_rows = __all_sync(0xffffffffu, s_pair[wg * 64] >= 0);
    // Accumulator element 4 * nb + q of thread (warp w of warpgroup wg, lane): row 64 wg + 16 w +
    // lane / 4 + 8 * (q / 2), column nb * 8 + 2 * (lane % 4) + q % 2 (the m16n8 layout, one m16
    // slab per warp).
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<AHEAD - 1>();  // stage kt has landed (this thread's copies)
        fence_proxy_async();         // ... and is visible to wgmma's proxy
        __syncthreads();             // everyone's; the MMAs of stage kt - 1 (its slot) are done
        {
            const int nk = kt + AHEAD;
            if (nk < KT) load_stage(nk % STAGES, nk);
            cp_async_commit();
        }
        if (wg_rows) {
            const unsigned a_addr = base + (kt % STAGES) * A_BYTES + wg * 64 * 128;
            const unsigned b_addr = base + STAGES * A_BYTES + (kt % STAGES) * B_BYTES;
            wg_fence();
#pragma unroll
            for (int j = 0; j < KS; ++j)
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)
                    wgmma_bf16<BN>(acc, wg_desc(a_addr + j * SUB_A + ks * 32),
                                   wg_desc(b_addr + j * SUB_B + ks * 32));
            wg_commit();
            wg_wait<0>();  // this warpgroup's MMAs of stage kt are done
        }
    }
    cp_async_wait<0>();

    if (!wg_rows) return;
    moe_wg_store<BN, GATE_UP>(acc, s_pair, dst, m0, blockIdx.x, wg * 64, (tid >> 5) & 3, tid & 31,
                              hidden, inter);
}
