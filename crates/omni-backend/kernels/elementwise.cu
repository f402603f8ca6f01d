// Element-wise kernels with grid-stride loops (any grid covers `n`).
// Prepended by the Rust side: bf16.cuh.

// SiLU-and-mul on fused rows `[gate | up]` of width `2 * inter` into `[tokens, inter]`. Rows
// of a multiple of 8 with 16-byte aligned buffers move 8 values per thread (the same math per
// element).
__device__ __forceinline__ float silu_mul1(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}
extern "C" __global__ void silu_mul_bf16(const unsigned short* __restrict__ gu, unsigned short* __restrict__ out,
                                         long long inter, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vec = (inter & 7) == 0 && ((reinterpret_cast<unsigned long long>(gu) |
                                           reinterpret_cast<unsigned long long>(out)) & 15) == 0;
    if (vec) {
        const long long vpr = inter >> 3;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n >> 3); i += stride) {
            const long long t = i / vpr, c = (i - t * vpr) * 8;
            const uint4 gv = *reinterpret_cast<const uint4*>(gu + t * 2 * inter + c);
            const uint4 uv = *reinterpret_cast<const uint4*>(gu + t * 2 * inter + inter + c);
            const unsigned g4[4] = {gv.x, gv.y, gv.z, gv.w}, u4[4] = {uv.x, uv.y, uv.z, uv.w};
            unsigned o4[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float lo = silu_mul1(bf2f((unsigned short)(g4[q] & 0xffffu)), bf2f((unsigned short)(u4[q] & 0xffffu)));
                const float hi = silu_mul1(bf2f((unsigned short)(g4[q] >> 16)), bf2f((unsigned short)(u4[q] >> 16)));
                o4[q] = (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
            }
            *reinterpret_cast<uint4*>(out + t * inter + c) = make_uint4(o4[0], o4[1], o4[2], o4[3]);
        }
        return;
    }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        long long t = i / inter, j = i - t * inter;
        float g = bf2f(gu[t * 2 * inter + j]), u = bf2f(gu[t * 2 * inter + inter + j]);
        out[i] = f2bf(silu_mul1(g, u));
    }
}
