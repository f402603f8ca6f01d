// Weighted sum of each token's expert outputs.
// Prepended by the Rust side: bf16.cuh, moe/ptx.cuh, moe/common.cuh (src/cuda/moe/source.rs).

// ---- weighted reduction: out[t, :] = sum over slots (in order) of w[t, s] * y[row(p), :] for
// the pair p = t * k + s, where row(p) = p, or inv[p] when `inv` is not null (the cuBLAS path
// keeps y in expert order); slots with an expert id outside [0, E) contribute nothing. 8 columns
// per thread. The sum is rounded to bf16 and stored in `out`, or widened back to f32 into `out32`
// when that is not null (the residual stream's type: no separate widening pass).
extern "C" __global__ void moe_reduce(
        const unsigned short* __restrict__ y, const int* __restrict__ ids, const float* __restrict__ wts,
        const int* __restrict__ inv, unsigned short* __restrict__ out, float* __restrict__ out32,
        int tokens, int hidden, int top_k, int num_experts) {
    pdl_enter();
    const int vpr = hidden >> 3;
    const long long n = (long long)tokens * vpr;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / vpr;
        const int c = (int)(i - t * vpr) * 8;
        float acc[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = 0.f;
        for (int s = 0; s < top_k; ++s) {
            const long long p = t * top_k + s;
            const int e = ids[p];
            if (e < 0 || e >= num_experts) continue;
            const float wv = wts[p];
            const long long row = inv ? (long long)inv[p] : p;
            const uint4 v = *reinterpret_cast<const uint4*>(y + row * hidden + c);
            const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                acc[2 * q] += wv * bf2f((unsigned short)(u[q] & 0xffffu));
                acc[2 * q + 1] += wv * bf2f((unsigned short)(u[q] >> 16));
            }
        }
        if (out32) {
            float4* o = reinterpret_cast<float4*>(out32 + t * hidden + c);
            o[0] = make_float4(bf2f(f2bf(acc[0])), bf2f(f2bf(acc[1])), bf2f(f2bf(acc[2])),
                               bf2f(f2bf(acc[3])));
            o[1] = make_float4(bf2f(f2bf(acc[4])), bf2f(f2bf(acc[5])), bf2f(f2bf(acc[6])),
                               bf2f(f2bf(acc[7])));
            continue;
        }
        uint4 o;
        o.x = pack_bf16x2(acc[0], acc[1]);
        o.y = pack_bf16x2(acc[2], acc[3]);
        o.z = pack_bf16x2(acc[4], acc[5]);
        o.w = pack_bf16x2(acc[6], acc[7]);
        *reinterpret_cast<uint4*>(out + t * hidden + c) = o;
    }
}
