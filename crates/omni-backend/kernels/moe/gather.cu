// The cuBLAS prefill path's own kernels: per-expert counts and the gather of token rows into
// expert order (src/cuda/moe/cublas.rs).
// Prepended by the Rust side: bf16.cuh, moe/ptx.cuh, moe/common.cuh (src/cuda/moe/source.rs).

// ---- pairs per expert (one CTA, blockDim a multiple of 32, at most 1024): counts[e] = number
// of pairs p < pairs with topk_ids[p] == e; ids outside [0, E) are not counted. Dynamic shared
// memory: E ints.
extern "C" __global__ void __launch_bounds__(1024) moe_count(
        const int* __restrict__ topk_ids, int pairs, int num_experts, int* __restrict__ counts) {
    int* cnt = reinterpret_cast<int*>(moe_smem);
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = topk_ids[p];
        if (e >= 0 && e < num_experts) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = cnt[e];
}

// ---- gather into expert order: one warp per pair p (grid-stride over warps). A pair of a
// valid expert e takes the next row r of that expert (`cursor[e]` starts at the expert's first
// row, set by the host from the counts, so rows of one expert are contiguous and the experts'
// ranges never overlap), copies x[p / top_k, :] into xg[r, :] and records inv[p] = r. The order
// of rows inside an expert depends on the atomics; each row's result does not. Pairs of other
// ids write nothing (the reduction skips them). hidden is a multiple of 8, x / xg 16-byte
// aligned.
extern "C" __global__ void moe_gather(
        const unsigned short* __restrict__ x, const int* __restrict__ topk_ids, int pairs,
        int num_experts, int top_k, int hidden, int* __restrict__ cursor,
        unsigned short* __restrict__ xg, int* __restrict__ inv) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const int vpr = hidden >> 3;
    for (long long p = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; p < pairs; p += warps) {
        const int e = topk_ids[p];
        if (e < 0 || e >= num_experts) continue;
        int r = 0;
        if (lane == 0) r = atomicAdd(&cursor[e], 1);
        r = __shfl_sync(0xffffffffu, r, 0);
        if (lane == 0) inv[p] = r;
        const uint4* src = reinterpret_cast<const uint4*>(x + (p / top_k) * (long long)hidden);
        uint4* dst = reinterpret_cast<uint4*>(xg + (long long)r * hidden);
        for (int c = lane; c < vpr; c += 32) dst[c] = src[c];
    }
}
