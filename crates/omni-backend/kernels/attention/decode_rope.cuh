// The q/k norm + RoPE of one decode token's head rows, 16 bytes a lane (`DecodeRope`): shared by
// the decode attention that does the q/k norm + RoPE + cache write inside (attention/decode.cu)
// and the one-launch attention block (attention/block1.cu).
// Prepended by the Rust side after bf16.cuh, rope.cuh and attention/common.cuh.

// The q/k norm + RoPE + cache write of a decode step, fused into the decode kernel (the
// `attn_decode_rope_*` entries; src/cuda/attention/rope.rs). `qkv` holds the QKV projection's
// rows ([tokens, (num_heads + 2 nkv) * HD] bf16) in place of q; each CTA norms and rotates its
// own query heads' rows; the CTA whose partition ends the sequence also norms and rotates the new
// token's key (its value is copied as is) and reads both from registers instead of the cache,
// and, when it serves the group's first query heads (g0 == 0), writes them into the cache at
// the token's slot (`kc_w`, `vc_w`: the caches the kernel reads; no CTA of the launch reads that
// slot from memory, and each (sequence, KV head) has exactly one writer). The arithmetic is
// qkv_rope_cache_bf16's (kernels/layers.cu): x * rsqrt(mean(x^2) + eps) * w, rotate-half with
// (cos, sin)(position * inv_freq[i]), bf16 rounding before the scores use q.
struct DecodeRope {
    const u16* qkv;
    u16* kc_w;
    u16* vc_w;
    const int* positions;
    const long long* slots;
    const float* inv_freq;
    const u16* q_norm;  // null: no q/k norm
    const u16* k_norm;
    const unsigned char* mrope_axes;  // null: one row of positions
    long long pos_stride;
    float eps;
};

// (cos, sin) of this lane's 8 dims d = lig * 8 + e (frequency d mod HD / 2) at token t's
// position (host-written: readable before the dependency wait).
template <int HD>
__device__ __forceinline__ void decode_rope_angles(const DecodeRope& r, int t, int lig,
                                                   float* cs, float* sn) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int d = lig * 8 + e, i = d < HD / 2 ? d : d - HD / 2;
        rope_sincos(r.positions, r.inv_freq, r.mrope_axes, r.pos_stride, t, i, &sn[e], &cs[e]);
    }
}

// One head row normed (when `nw`) and rotated, as bf16: lane lig of a token group of L = HD / 8
// lanes holds dims lig * 8 .. + 7 (`raw`); the row's sum of squares is reduced over the group and
// dim d's rotation partner d +- HD / 2 is lane lig ^ L / 2's. Every lane of the warp calls it.
template <int HD>
__device__ __forceinline__ uint4 decode_rope_row(uint4 raw, const u16* __restrict__ nw,
                                                 const float* cs, const float* sn, int lig,
                                                 float eps) {
    constexpr int L = HD / 8;
    float x[8];
    unpack8(raw, x);
    if (nw) {
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
#pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float inv = rsqrtf(ss / (float)HD + eps);
        float w[8];
        unpack8(*reinterpret_cast<const uint4*>(nw + lig * 8), w);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = x[e] * inv * w[e];
    }
    const bool lo = lig < L / 2;
    float y[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float p = __shfl_xor_sync(0xffffffffu, x[e], L / 2);
        y[e] = lo ? x[e] * cs[e] - p * sn[e] : x[e] * cs[e] + p * sn[e];
    }
    return make_uint4(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]),
                      pack_bf16x2(y[4], y[5]), pack_bf16x2(y[6], y[7]));
}
