// The helpers of the weight-streaming GEMV kernels (gemv.cu, moe/small.cu): the block sum of
// `fused_add_rmsnorm_f32res` (at any block size), the 8-wide bf16 dot product and unpacking. Prepended by the Rust side after bf16.cuh.

#define GV_UNROLL 8
#define GV_MAX_ROWS 8

// The block sum of `fused_add_rmsnorm_f32res` (layers.cu) launched with `vt` threads (a
// multiple of 32, at most 1024), computed by this block's threads whatever their number: thread
// t plays virtual threads t, t + blockDim.x, ... < vt. `part(v)` is virtual thread v's partial
// sum; each virtual warp's xor-shuffle reduction and the final one over the virtual warps are
// the unfused kernel's, in its order (the same bits). `sh` holds 32 floats.
template <typename Part>
__device__ __forceinline__ float gv_virtual_block_sum(int vt, float* sh, Part part) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    __syncthreads();  // the previous use of sh is over
    for (int v0 = 0; v0 < vt; v0 += blockDim.x) {
        const int v = v0 + threadIdx.x;  // v < vt is warp-uniform (vt, v0: multiples of 32)
        if (v < vt) {
            float s = part(v);
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) sh[v >> 5] = s;
        }
    }
    __syncthreads();
    if (wid == 0) {
        float s = lane < (vt >> 5) ? sh[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) sh[0] = s;
    }
    __syncthreads();
    return sh[0];
}

// The threads `fused_add_rmsnorm_f32res` runs with for rows of `dim` (the host's
// `block_threads(dim / 4, 1024)`).
__device__ __forceinline__ int gv_norm_threads(int dim) {
    return min(max(((dim >> 2) + 31) >> 5, 1), 32) << 5;
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

// Row r of `residual` (or of bf16 `init` when set) normalised into xs[r * dim ..]: the loops of
// `fused_add_rmsnorm_f32res` (mode 1 / the add already done) and its block sum over its own
// thread count (`gv_virtual_block_sum`), so any block size gives its bits; dim a multiple of 4.
__device__ __forceinline__ void gv_norm_row(const float* __restrict__ x,
        const unsigned short* __restrict__ init, bool set, bool write_back, float* residual,
        const unsigned short* __restrict__ w, unsigned short* xs, int dim, float eps, float* sh) {
    const int vt = gv_norm_threads(dim);
    const float total = gv_virtual_block_sum(vt, sh, [&](int v) {
        float ss = 0.f;
        for (int i = v * 4; i < dim; i += vt * 4) {
            float4 e;
            if (set) {
                const unsigned short* s = init + i;
                e = make_float4(bf2f(s[0]), bf2f(s[1]), bf2f(s[2]), bf2f(s[3]));
                if (write_back) *reinterpret_cast<float4*>(residual + i) = e;
            } else {
                e = *reinterpret_cast<const float4*>(x + i);
            }
            ss += e.x * e.x + e.y * e.y + e.z * e.z + e.w * e.w;
        }
        return ss;
    });
    const float inv = rsqrtf(total / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float xi = set ? bf2f(init[i]) : x[i];
        xs[i] = f2bf(bf2f(w[i]) * (xi * inv));
    }
}

// Weight rows into shared memory by the copy engine (sm_90; nothing below it), for the staged
// GEMV (gemv.cu) and the one-launch attention block (attention/block1.cu). Thread 0 of a block:
// `rows` rows of `row_bytes` from `src` to the shared address `dst`, in groups of `group_rows`
// rows; group g completes the mbarrier at `bar + 8 g` (initialised with count 1) when its bytes
// have landed, in copies of at most `chunk` bytes (row bytes multiples of 16).
__device__ __forceinline__ void gv_stage_rows(unsigned dst, const char* src, int rows,
                                              size_t row_bytes, unsigned bar, int group_rows,
                                              unsigned chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int groups = (rows + group_rows - 1) / group_rows;
    for (int g = 0; g < groups; ++g) {
        const unsigned b = bar + 8u * g;
        const size_t begin = (size_t)g * group_rows * row_bytes;
        const size_t end = (size_t)min(rows, (g + 1) * group_rows) * row_bytes;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                     :: "r"(b), "r"((unsigned)(end - begin)) : "memory");
        for (size_t off = begin; off < end; off += chunk) {
            const unsigned sz = (unsigned)min((size_t)chunk, end - off);
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                :: "r"(dst + (unsigned)off), "l"(src + off), "r"(sz), "r"(b) : "memory");
        }
    }
#endif
}

// Waits for the first phase of the mbarrier at shared address `bar` (a group of
// gv_stage_rows landed).
__device__ __forceinline__ void gv_stage_wait(unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar) : "memory");
    }
#endif
}
