// Sorts the (token, slot) pairs by expert into tile-padded row blocks.
// Prepended by the Rust side: bf16.cuh, moe/ptx.cuh, moe/common.cuh (src/cuda/moe/source.rs).

#define MOE_ALIGN_ILP 8
// ev[j] = the expert of pair p0 + j nt, or -1 past the pairs.
__device__ __forceinline__ void moe_align_ids(const int* __restrict__ topk_ids, int pairs, int p0,
                                              int nt, int (&ev)[MOE_ALIGN_ILP]) {
#pragma unroll
    for (int j = 0; j < MOE_ALIGN_ILP; ++j) {
        const int p = p0 + j * nt;
        ev[j] = p < pairs ? topk_ids[p] : -1;
    }
}

// ---- alignment (one CTA, blockDim a multiple of 32, at most 1024). Pairs whose expert id is
// outside [0, E) are dropped. Dynamic shared memory: (32 + 3 E) ints.
extern "C" __global__ void __launch_bounds__(1024) moe_align(
        const int* __restrict__ topk_ids, int pairs, int num_experts, int bm, int max_blocks,
        int* __restrict__ sorted_ids, int* __restrict__ block_expert) {
    pdl_enter();
    int* warp_tot = reinterpret_cast<int*>(moe_smem);
    int* cnt = warp_tot + 32;
    int* boff = cnt + num_experts;
    int* cur = boff + num_experts;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
    for (int e = tid; e < num_experts; e += nt) { cnt[e] = 0; cur[e] = 0; }
    __syncthreads();
    // A thread's pairs p = tid + j nt are read MOE_ALIGN_ILP at a time before their atomics:
    // that many independent loads in flight instead of one L2 round trip per pair.
    for (int p0 = tid; p0 < pairs; p0 += MOE_ALIGN_ILP * nt) {
        int ev[MOE_ALIGN_ILP];
        moe_align_ids(topk_ids, pairs, p0, nt, ev);
#pragma unroll
        for (int j = 0; j < MOE_ALIGN_ILP; ++j)
            if (ev[j] >= 0 && ev[j] < num_experts) atomicAdd(&cnt[ev[j]], 1);
    }
    __syncthreads();
    // Exclusive prefix sum of the per-expert block counts, nt experts at a time.
    int carry = 0;
    for (int base = 0; base < num_experts; base += nt) {
        const int e = base + tid;
        const int v = e < num_experts ? (cnt[e] + bm - 1) / bm : 0;
        int x = v;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) warp_tot[warp] = x;
        __syncthreads();
        if (warp == 0) {
            int s = lane < nwarps ? warp_tot[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, s, o);
                if (lane >= o) s += y;
            }
            warp_tot[lane] = s;
        }
        __syncthreads();
        if (e < num_experts) boff[e] = carry + (warp > 0 ? warp_tot[warp - 1] : 0) + x - v;
        carry += warp_tot[31];
        __syncthreads();
    }
    const int total = carry;
    for (int e = tid; e < num_experts; e += nt) {
        const int c = cnt[e];
        const int nb = (c + bm - 1) / bm;
        const int b0 = boff[e];
        for (int b = 0; b < nb; ++b)
            if (b0 + b < max_blocks) block_expert[b0 + b] = e;
        for (int q = c; q < nb * bm; ++q)
            if (b0 + q / bm < max_blocks) sorted_ids[(long long)b0 * bm + q] = -1;
    }
    for (int b = total + tid; b < max_blocks; b += nt) block_expert[b] = -1;
    for (int p0 = tid; p0 < pairs; p0 += MOE_ALIGN_ILP * nt) {
        int ev[MOE_ALIGN_ILP];
        moe_align_ids(topk_ids, pairs, p0, nt, ev);
#pragma unroll
        for (int j = 0; j < MOE_ALIGN_ILP; ++j) {
            const int e = ev[j];
            if (e >= 0 && e < num_experts) {
                const int slot = atomicAdd(&cur[e], 1);
                if (boff[e] + slot / bm < max_blocks)
                    sorted_ids[(long long)boff[e] * bm + slot] = p0 + j * nt;
            }
        }
    }
}
