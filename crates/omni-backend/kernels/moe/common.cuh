// Shared by the MoE kernels: the dynamic shared memory they all use and bf16x2 packing.
// Prepended by the Rust side after bf16.cuh and moe/ptx.cuh. bf16 is `unsigned short`; all
// math in f32.

extern __shared__ uint4 moe_smem[];

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

// The row, in expert weights of `GATE_UP` (w13: 2 inter rows, gate then up) or down (w2: hidden
// rows), of row r (0 <= r < BN) of the weight tile for N tile nt: gate_up tiles hold BN / 2
// gate rows, then the matching BN / 2 up rows. -1 past N (inter or hidden).
template <int BN, bool GATE_UP>
__device__ __forceinline__ int moe_weight_row(int r, int nt, int hidden, int inter) {
    if (GATE_UP) {
        const int up = r >= BN / 2 ? 1 : 0;
        const int j = nt * (BN / 2) + r - up * (BN / 2);
        return j < inter ? up * inter + j : -1;
    }
    const int j = nt * BN + r;
    return j < hidden ? j : -1;
}

// The global sources of one thread's cp.async copies in a tile of the grouped GEMMs (both
// `moe_gemm` and `moe_gemm_wg`): A rows row0 + i * RSTEP of the BM-row block starting at sorted
// row m0 (gate_up: the token p / top_k of the pair p in s_pair; down: the sorted row itself);
// B rows row0 + i * RSTEP of expert `expert`'s weights for N tile blockIdx.x (gate_up: BN / 2
// gate rows, then the matching BN / 2 up rows). A row of padding (p < 0) or past N gets ok =
// false (its copies zero-fill) and a pointer inside the tensor. Pointers are at the thread's
// 16-byte chunk `chunk` of the row.
template <int A_IT, int B_IT, int RSTEP, int BN, bool GATE_UP>
__device__ __forceinline__ void moe_tile_sources(
        const unsigned short* a_src, const unsigned short* w, const int* s_pair, int expert,
        long long m0, int row0, int chunk, int hidden, int inter, int top_k,
        const unsigned short* (&a_ptr)[A_IT], bool (&a_ok)[A_IT],
        const unsigned short* (&b_ptr)[B_IT], bool (&b_ok)[B_IT]) {
    const int K = GATE_UP ? hidden : inter;
#pragma unroll
    for (int i = 0; i < A_IT; ++i) {
        const int r = row0 + i * RSTEP;
        const int p = s_pair[r];
        a_ok[i] = p >= 0;
        long long arow = 0;
        if (a_ok[i]) arow = GATE_UP ? (long long)(p / top_k) : m0 + r;
        a_ptr[i] = a_src + arow * K + chunk * 8;
    }
    const unsigned short* w_e = w + (size_t)expert * (size_t)(GATE_UP ? 2 * inter : hidden) * (size_t)K;
#pragma unroll
    for (int i = 0; i < B_IT; ++i) {
        const int grow = moe_weight_row<BN, GATE_UP>(row0 + i * RSTEP, blockIdx.x, hidden, inter);
        b_ok[i] = grow >= 0;
        b_ptr[i] = w_e + (size_t)(b_ok[i] ? grow : 0) * K + chunk * 8;
    }
}
