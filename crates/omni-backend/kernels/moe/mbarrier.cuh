// Shared-memory mbarriers and the Tensor Memory Accelerator's tiled copy (sm_90), for the
// warp-specialized grouped GEMMs (grouped_gemm_tma.cu, grouped_gemm_ws.cu). Prepended by the
// Rust side to the Hopper MoE module.

__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(addr), "r"(count) : "memory");
}
// Makes the initialized mbarriers visible to the async proxy (the TMA unit completes
// transactions on them) before any copy names them; a CTA barrier follows.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned addr, unsigned parity) {
    unsigned done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity) {
    while (!mbar_try_wait(addr, parity)) {
    }
}
__device__ __forceinline__ void mbar_arrive(unsigned addr) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(addr) : "memory");
}
// Arrives on the mbarrier and adds `bytes` to the transaction count its current phase waits
// for (the bytes of the tensor copies issued next that complete on it).
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned addr, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(addr), "r"(bytes) : "memory");
}
// Arrives on the mbarrier once every cp.async this thread issued before has completed (the
// arrival was counted in the barrier's expected count: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned addr) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(addr) : "memory");
}

// A CUtensorMap (the driver's 128-byte opaque descriptor of a global tensor, made on the host
// by cuTensorMapEncodeTiled), passed by value as a `__grid_constant__` kernel parameter.
struct __align__(64) MoeTensorMap {
    unsigned long long opaque[16];
};

// The box of `map` at element coordinates (c0 innermost, c1) into shared memory at `dst`
// (CTA-local address, aligned as the map's swizzle requires), completing `bytes` of the
// transaction count of the mbarrier at `mbar`. Elements outside the tensor are zero-filled.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const MoeTensorMap* map, int c0, int c1,
                                            unsigned mbar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(mbar)
        : "memory");
}
