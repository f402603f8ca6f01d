// The helpers of the weight-streaming GEMV kernels (gemv.cu, moe/small.cu): programmatic
// dependent launch, the block sum of `fused_add_rmsnorm_f32res`, the 8-wide bf16 dot product and
// unpacking. Prepended by the Rust side after bf16.cuh.

#define GV_UNROLL 8
#define GV_MAX_ROWS 8

__device__ __forceinline__ void gv_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void gv_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// `block_sum` of layers.cu (the same shuffles in the same order).
__device__ __forceinline__ float gv_block_sum(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? sh[lane] : 0.f;
    if (wid == 0) for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}

// Chunk c (8 values) of x row r dotted with the 8 weights wf: the plain GEMV's inner sum.
__device__ __forceinline__ float gv_dot8(const uint4 xv, const float* wf) {
    const unsigned int xx[4] = {xv.x, xv.y, xv.z, xv.w};
    float s = 0.f;
    for (int j = 0; j < 4; ++j) {
        s += __uint_as_float(xx[j] << 16) * wf[2 * j];
        s += __uint_as_float(xx[j] & 0xffff0000u) * wf[2 * j + 1];
    }
    return s;
}

__device__ __forceinline__ void gv_unpack(const uint4 wv, float* wf) {
    const unsigned int ww[4] = {wv.x, wv.y, wv.z, wv.w};
    for (int j = 0; j < 4; ++j) {
        wf[2 * j] = __uint_as_float(ww[j] << 16);
        wf[2 * j + 1] = __uint_as_float(ww[j] & 0xffff0000u);
    }
}
