// Routing of one token by one warp: softmax over E in f32, top-k by probability (ties: lower
// expert id first), optional renormalisation of the k weights (sum taken in selection order).
// Shared by `moe_topk_softmax` (topk_softmax.cu) and the small-batch router (small.cu), so both
// pick the same experts with the same weights from the same logits. `row` (the E logits) may be
// `probs` itself (each lane reads an entry before it writes it); `probs` is E floats of shared
// memory. Only warp-level synchronisation. Prepended by the Rust side after bf16.cuh.

// Experts a lane keeps in registers: up to 32 * MOE_TOPK_REG experts are routed from registers
// (`moe_topk_regs`), more (or every count, with MOE_TOPK_FROM_SMEM) through `probs`
// (`moe_topk_smem`); the same experts and weights.
#define MOE_TOPK_REG 8

// Warp-wide max (MAX) or min of an unsigned (`redux.sync` from sm_80, else a shuffle tree).
// Every lane of the warp calls it.
template <bool MAX>
__device__ __forceinline__ unsigned moe_warp_redux_u32(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned r;
    if (MAX)
        asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    else
        asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
#else
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned w = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? max(v, w) : min(v, w);
    }
    return v;
#endif
}

// The register form (num_experts <= 32 * MOE_TOPK_REG): lane l holds experts l, l + 32, ...
// The softmax is the shared-memory form's arithmetic in its order. A pick ranks the remaining
// probabilities by key = bits + 1 (probabilities are >= +0, whose bits order as unsigned
// integers like the values; 0 for a picked expert, a NaN or a lane's empty slot): the warp's
// largest key is the largest probability, and among the lanes holding it the smallest expert
// id wins (each lane's candidate is its lowest id of that key, as its ascending scan with a
// strict > leaves it): the shared-memory form's order, ties to the lower id. No key left: id
// num_experts and weight -1, as there.
// Statement X(m) for each register slot m (spelled out: the slots stay registers however the
// surrounding kernel is unrolled and inlined).
#define MOE_TOPK_EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
__device__ __forceinline__ void moe_topk_regs(const float* row, int* out_ids, float* out_w,
        int num_experts, int top_k, int renorm, int lane) {
    static_assert(MOE_TOPK_REG == 8, "MOE_TOPK_EACH spells out 8 slots");
    const float neg_inf = __int_as_float(0xff800000);
    float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f, p4 = 0.f, p5 = 0.f, p6 = 0.f, p7 = 0.f;
    float mx = neg_inf;
#define MOE_TK_LOAD(m)                                 \
    if (lane + 32 * (m) < num_experts) {                \
        p##m = row[lane + 32 * (m)];                    \
        mx = fmaxf(mx, p##m);                           \
    }
    MOE_TOPK_EACH(MOE_TK_LOAD)
#undef MOE_TK_LOAD
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
#define MOE_TK_EXP(m)                                                 \
    if (lane + 32 * (m) < num_experts) {                               \
        p##m = mx == neg_inf ? 0.f : expf(p##m - mx);                  \
        sum += p##m;                                                   \
    }
    MOE_TOPK_EACH(MOE_TK_EXP)
#undef MOE_TK_EXP
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = mx == neg_inf ? 0.f : 1.f / sum;
    unsigned k0, k1, k2, k3, k4, k5, k6, k7;
#define MOE_TK_KEY(m)                                                                    \
    {                                                                                     \
        const float v = p##m * inv;                                                       \
        k##m = lane + 32 * (m) < num_experts && v >= 0.f ? __float_as_uint(v) + 1u : 0u; \
    }
    MOE_TOPK_EACH(MOE_TK_KEY)
#undef MOE_TK_KEY
    float sel_sum = 0.f;
    for (int j = 0; j < top_k; ++j) {
        unsigned bk = 0u;
        int bm = 0;
#define MOE_TK_BEST(m)   \
    if (k##m > bk) {     \
        bk = k##m;       \
        bm = (m);        \
    }
        MOE_TOPK_EACH(MOE_TK_BEST)
#undef MOE_TK_BEST
        const unsigned kmax = moe_warp_redux_u32<true>(bk);
        const unsigned mine = bk == kmax && kmax != 0u ? (unsigned)(lane + 32 * bm) : 0xffffffffu;
        const unsigned bi = moe_warp_redux_u32<false>(mine);
        const float bv = kmax != 0u ? __uint_as_float(kmax - 1u) : -1.f;
        sel_sum += bv;
        if (lane == 0) {
            out_ids[j] = kmax != 0u ? (int)bi : num_experts;
            out_w[j] = bv;
        }
        const bool owner = kmax != 0u && lane == (int)(bi & 31u);
        const int slot = (int)(bi >> 5);
#define MOE_TK_TAKE(m) \
    if (owner && slot == (m)) k##m = 0u;
        MOE_TOPK_EACH(MOE_TK_TAKE)
#undef MOE_TK_TAKE
    }
    __syncwarp();
    if (renorm && lane == 0)
        for (int j = 0; j < top_k; ++j) out_w[j] = out_w[j] / sel_sum;
}

__device__ __forceinline__ void moe_topk_smem(const float* row, float* probs, int* out_ids,
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

// The register form unless the module is built with MOE_TOPK_FROM_SMEM (the Rust side's
// OMNI_CUDA_MOE_TOPK_REGS=0).
__device__ __forceinline__ void moe_topk_warp(const float* row, float* probs, int* out_ids,
        float* out_w, int num_experts, int top_k, int renorm, int lane) {
#ifndef MOE_TOPK_FROM_SMEM
    if (num_experts <= 32 * MOE_TOPK_REG) {
        moe_topk_regs(row, out_ids, out_w, num_experts, top_k, renorm, lane);
        return;
    }
#endif
    moe_topk_smem(row, probs, out_ids, out_w, num_experts, top_k, renorm, lane);
}
