// bf16 <-> f32 helpers shared by every kernel module (NVRTC 13 ships no built-in
// `cuda_bf16.h`, so bf16 is moved as `unsigned short`; round to nearest even, quiet NaN).
// The Rust side (src/cuda/kernels.rs) prepends this file to every module that uses it.

__device__ __forceinline__ float bf2f(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u); // quiet NaN
    u += 0x7FFFu + ((u >> 16) & 1u);   // round to nearest even
    return (unsigned short)(u >> 16);
}
