// Router top-k softmax.
// Prepended by the Rust side: bf16.cuh, moe/ptx.cuh, moe/common.cuh, moe/topk_warp.cuh
// (src/cuda/moe/source.rs).

// ---- routing: `moe_topk_warp` (topk_warp.cuh) for each token, one warp per token.
extern "C" __global__ void __launch_bounds__(128) moe_topk_softmax(
        const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ wts,
        int tokens, int num_experts, int top_k, int renorm) {
    float* probs = reinterpret_cast<float*>(moe_smem) + (threadIdx.x >> 5) * num_experts;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= tokens) return;  // warp-uniform; only warp-level synchronisation below
    moe_topk_warp(logits + (size_t)t * num_experts, probs, ids + (size_t)t * top_k,
                  wts + (size_t)t * top_k, num_experts, top_k, renorm, lane);
}
