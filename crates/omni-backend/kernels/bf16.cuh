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

// L2 prefetch hint for read-only data (weights) a later kernel of the step reads. The bulk L2
// prefetch (`cp.async.bulk.prefetch.L2`, sm_90; nothing below it) goes through each SM's copy
// engine, a few hundred GB/s per SM: a 20 MB region needs most of the GPU's SMs to arrive in
// microseconds, so the region is split into 32 KiB chunks spread over every block of the grid
// (chunk c to block c % gridDim.x, then across its threads), and a kernel that has only a few
// blocks of work is launched with extra blocks (`pf_work_blocks` is the count of working ones)
// that only prefetch and exit: `if (l2_prefetch(...)) return;` before `pdl_wait`. Fire and
// forget: nothing waits for the prefetches, a CTA may exit with them in flight, and a line a
// reader asks for while its prefetch is in flight merges with it in L2. A null pointer or zero
// bytes issues nothing. The Rust side (`L2Prefetch`) passes 16-byte aligned regions whose
// length is a multiple of 16. Only data no kernel of the step writes may be named: callers
// issue it before `pdl_wait`. One-dimensional grids only.
#define L2_PREFETCH_ARGS const void* __restrict__ pf0, unsigned long long pf0_bytes, \
                         const void* __restrict__ pf1, unsigned long long pf1_bytes, \
                         int pf_work_blocks
#define L2_PREFETCH_CHUNK 32768ull
// One bulk prefetch: bytes off .. min(off + L2_PREFETCH_CHUNK, end) of the region at b (off <
// end; start and lengths multiples of 16).
__device__ __forceinline__ void l2_prefetch_chunk(const char* b, unsigned long long off,
                                                  unsigned long long end) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned long long left = end - off;
    const unsigned int sz = (unsigned int)(left < L2_PREFETCH_CHUNK ? left : L2_PREFETCH_CHUNK);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(b + off), "r"(sz) : "memory");
#endif
}
__device__ __forceinline__ void l2_prefetch_region(const void* p, unsigned long long bytes) {
    if (p == nullptr || bytes == 0) return;
    const unsigned long long chunks = (bytes + L2_PREFETCH_CHUNK - 1) / L2_PREFETCH_CHUNK;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    const char* b = static_cast<const char*>(p);
    for (unsigned long long c = blockIdx.x + (unsigned long long)gridDim.x * threadIdx.x; c < chunks;
         c += step)
        l2_prefetch_chunk(b, c * L2_PREFETCH_CHUNK, bytes);
}
// Issues this block's share of both regions; true for a prefetch-only block (past the
// `pf_work_blocks` working ones), which then returns.
__device__ __forceinline__ bool l2_prefetch(L2_PREFETCH_ARGS) {
    l2_prefetch_region(pf0, pf0_bytes);
    l2_prefetch_region(pf1, pf1_bytes);
    return (int)blockIdx.x >= pf_work_blocks;
}
