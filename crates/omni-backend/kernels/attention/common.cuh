// Device helpers shared by the attention modules (src/cuda/attention/source.rs).
// Prepended by the Rust side: bf16.cuh; this file comes next.

typedef unsigned short u16;
typedef unsigned int u32;
#define ATTN_NEG_INF __int_as_float(0xff800000)
#define ATTN_MAXPART 512

// 2^x by the SFU alone (`ex2.approx.ftz`: subnormal results flush to 0, which a softmax
// weight below 2^-126 of its row's largest is as good as); exp2f outside fast-math wraps the
// same instruction in a range fix-up of three more.
__device__ __forceinline__ float attn_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// 8 bf16 (one 16-byte load, element 0 in the low half of .x) to f32.
__device__ __forceinline__ void unpack8(uint4 u, float* f) {
    f[0] = __uint_as_float(u.x << 16); f[1] = __uint_as_float(u.x & 0xffff0000u);
    f[2] = __uint_as_float(u.y << 16); f[3] = __uint_as_float(u.y & 0xffff0000u);
    f[4] = __uint_as_float(u.z << 16); f[5] = __uint_as_float(u.z & 0xffff0000u);
    f[6] = __uint_as_float(u.w << 16); f[7] = __uint_as_float(u.w & 0xffff0000u);
}

// Two f32 to a bf16x2 register (round to nearest even), `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Cache slot (block * block_size + offset) of context position `key`; indices clamped into the
// block-table row and the cache so bad metadata cannot fault.
__device__ __forceinline__ int kv_slot(const int* __restrict__ btab, int key, int bs, int mbps,
                                       int num_blocks) {
    int bi = key / bs;
    const int off = key - bi * bs;
    bi = min(bi, mbps - 1);
    int blk = __ldg(btab + bi);
    blk = min(max(blk, 0), num_blocks - 1);
    return blk * bs + off;
}

// Keys per partition of a sequence of `seq_len` keys: `part_size`, or, `balanced`, the
// sequence split into as many equal partitions (multiples of 16 keys, at most `part_size`) as
// `part_size` alone would give, so no partition is a short tail.
__device__ __forceinline__ int attn_part_len(int seq_len, int part_size, int max_parts,
                                             int balanced) {
    if (!balanced || seq_len <= 0) return part_size;
    const int np = min((seq_len + part_size - 1) / part_size, max_parts);
    const int per = (seq_len + np - 1) / np;
    return min((per + 15) / 16 * 16, part_size);
}

// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
// 16-byte cp.async (L2 only) of `bytes` (16, or 0: the destination is zero-filled, nothing read).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's commit groups are pending.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
