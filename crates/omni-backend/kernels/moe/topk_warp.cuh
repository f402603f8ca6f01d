// Routing of one token by one warp: softmax over E in f32, top-k by probability (ties: lower
// expert id first), optional renormalisation of the k weights (sum taken in selection order).
// Shared by `moe_topk_softmax` (topk_softmax.cu) and the small-batch router (small.cu), so both
// pick the same experts with the same weights from the same logits. `row` (the E logits) may be
// `probs` itself (each lane reads an entry before it writes it); `probs` is E floats of shared
// memory. Only warp-level synchronisation. Prepended by the Rust side after bf16.cuh.

__device__ __forceinline__ void moe_topk_warp(const float* row, float* probs, int* out_ids,
        float* out_w, int num_experts, int top_k, int renorm, int lane) {
    const float neg_inf = __int_as_float(0xff800000);
    float mx = neg_inf;
    for (int i = lane; i < num_experts; i += 32) {
        const float v = row[i];
        probs[i] = v;
        mx = fmaxf(mx, v);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int i = lane; i < num_experts; i += 32) {
        const float e = mx == neg_inf ? 0.f : expf(probs[i] - mx);
        probs[i] = e;
        sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = mx == neg_inf ? 0.f : 1.f / sum;
    for (int i = lane; i < num_experts; i += 32) probs[i] *= inv;
    __syncwarp();
    float sel_sum = 0.f;
    for (int j = 0; j < top_k; ++j) {
        float bv = -1.f;
        int bi = num_experts;
        for (int i = lane; i < num_experts; i += 32) {
            const float v = probs[i];
            if (v > bv) { bv = v; bi = i; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        sel_sum += bv;
        if (lane == 0) { out_ids[j] = bi; out_w[j] = bv; }
        if (bi < num_experts && lane == (bi & 31)) probs[bi] = -2.f;  // the owning lane
        __syncwarp();
    }
    if (renorm && lane == 0)
        for (int j = 0; j < top_k; ++j) out_w[j] = out_w[j] / sel_sum;
}
