// Shared by the MoE kernels: the dynamic shared memory they all use and bf16x2 packing.
// Prepended by the Rust side after bf16.cuh and moe/ptx.cuh. bf16 is `unsigned short`; all
// math in f32.

extern __shared__ uint4 moe_smem[];

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}
