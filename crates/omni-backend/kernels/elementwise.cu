// Element-wise kernels with grid-stride loops (any grid covers `n`).
// Prepended by the Rust side: bf16.cuh.

// SiLU-and-mul on fused rows `[gate | up]` of width `2 * inter` into `[tokens, inter]`.
extern "C" __global__ void silu_mul_bf16(const unsigned short* __restrict__ gu, unsigned short* __restrict__ out,
                                         long long inter, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long t = i / inter, j = i - t * inter;
        float g = bf2f(gu[t * 2 * inter + j]), u = bf2f(gu[t * 2 * inter + inter + j]);
        out[i] = f2bf(g / (1.0f + expf(-g)) * u);
    }
}
