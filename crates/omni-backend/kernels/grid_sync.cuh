// The grid-wide barrier of the one-launch kernels (moe/block1.cu, attention/block1.cu): every
// CTA of the grid resident at once (one per SM), meeting at a word in global memory; a barrier
// that waits longer than GRID_TIMEOUT_NS traps (a launch error) instead of hanging.
// Prepended by the Rust side after bf16.cuh.

#define GRID_TIMEOUT_NS 2000000000ull

__device__ __forceinline__ unsigned grid_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long grid_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

#ifdef GRID_COUNT_BARRIER
// The first form, kept behind OMNI_CUDA_MOE_BLOCK1_BARRIER=count (the one-launch MoE block only).
// Grid-wide barrier over `blocks` resident CTAs; bar[0] counts arrivals (left at 0), bar[1] is
// the generation. Memory order: the CTA's writes precede thread 0's arrival (bar.sync, then
// __threadfence: a gpu-scope fence, cumulative over the writes the barrier ordered before it);
// the last arrival resets the count and then bumps the generation (fence, then the atomic: a
// release); a waiter reads the generation with ld.acquire and fences before its CTA's
// bar.sync, so every write made before any CTA's arrival is visible to every thread after the
// barrier. The generation is read (acquire) before the arrival: it can only change after this
// CTA's own arrival, so the wait cannot miss it. The count is touched again only after the
// generation changed, i.e. after the reset.
__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned blocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned gen = grid_ld_acquire(bar + 1);
        __threadfence();
        if (atomicAdd(bar, 1u) == blocks - 1u) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            const unsigned long long t0 = grid_now();
            while (grid_ld_acquire(bar + 1) == gen) {
                if (grid_now() - t0 > GRID_TIMEOUT_NS) __trap();
                __nanosleep(32);
            }
        }
        __threadfence();
    }
    __syncthreads();
}
#else
// The same barrier with one atomic per CTA and nothing after the last arrival (the default
// since measured; OMNI_CUDA_MOE_BLOCK1_BARRIER=count selects the form above): CTA 0 adds 2^31 - (blocks - 1), every
// other CTA 1, so the word's top bit flips exactly when all `blocks` arrivals have landed and
// its low bits are back where they were (0 between barriers: bar[1] is not used). A CTA waits
// until the top bit differs from the one its own arrival returned. Before all arrivals the bit
// cannot flip: the low bits stay in (0, 2^31) after CTA 0's addend and below `blocks` without
// it. A CTA already arrived at the next barrier cannot flip it back either: that takes every
// CTA's arrival, including the one still waiting here. Memory order: the CTA's writes, its
// bar.sync, thread 0's __threadfence (gpu scope, cumulative) and then its atomicAdd on the word
// (the release); a waiter's ld.acquire that reads the flipped value has read from the chain of
// read-modify-writes that includes every arrival, then it fences before its CTA's bar.sync:
// every write made before any CTA's arrival is visible to every thread after the barrier.
__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned blocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned add = blockIdx.x == 0 ? 0x80000000u - (blocks - 1u) : 1u;
        __threadfence();
        const unsigned old = atomicAdd(bar, add);
        const unsigned long long t0 = grid_now();
        while (((grid_ld_acquire(bar) ^ old) & 0x80000000u) == 0u)
            if (grid_now() - t0 > GRID_TIMEOUT_NS) __trap();
        __threadfence();
    }
    __syncthreads();
}
#endif
