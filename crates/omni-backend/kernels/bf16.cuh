// bf16 <-> f32 helpers shared by every kernel module (NVRTC 13 ships no built-in
// `cuda_bf16.h`, so bf16 is moved as `unsigned short`; round to nearest even, quiet NaN), and
// the programmatic dependent launch instructions. The Rust side (src/cuda/kernels.rs) prepends
// this file to every module that uses it.

__device__ __forceinline__ float bf2f(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u); // quiet NaN
    u += 0x7FFFu + ((u >> 16) & 1u);   // round to nearest even
    return (unsigned short)(u >> 16);
}

// Programmatic dependent launch (kernels launched with programmatic stream serialization, on
// sm_90 and later; no-ops below it, and harmless when launched without the attribute):
// `pdl_launch_dependents` lets the next kernel's CTAs launch (they wait in turn);
// `pdl_wait` waits for the predecessor grid to complete with its writes visible, and comes
// before the kernel reads or writes anything a predecessor writes or reads.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// First statement of a kernel that touches no memory before its wait: dependents may launch,
// and the order of memory accesses is the stream order's.
__device__ __forceinline__ void pdl_enter() {
    pdl_launch_dependents();
    pdl_wait();
}
