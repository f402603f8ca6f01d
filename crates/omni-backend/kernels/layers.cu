// The fused per-layer kernels of the decoder (src/cuda/layers.rs): residual add + RMSNorm,
// QKV split + per-head norm + RoPE + cache write, embedding gather, bias, widening, device fill.
// Prepended by the Rust side: bf16.cuh.

// Block reduction of a float sum over up to 1024 threads (`blockDim.x` a multiple of 32).
__device__ __forceinline__ float block_sum(float v, float* sh) {
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

// The residual stream is f32. mode 1: residual = bf16 `init` (the embedding); 2: residual +=
// f32 `delta`; 0: as it is. Then out = residual * rsqrt(mean(residual^2) + eps) * w.
// Launched with programmatic dependent launch: lets dependents launch, issues the L2 prefetch of
// a later kernel's weights (`l2_prefetch`, before the wait: weights only; blocks past the rows
// only prefetch), then waits.
extern "C" __global__ void fused_add_rmsnorm_f32res(float* __restrict__ residual,
        const unsigned short* __restrict__ init, const float* __restrict__ delta, int mode,
        const unsigned short* __restrict__ w, unsigned short* __restrict__ out,
        float* __restrict__ out32, int dim, float eps, L2_PREFETCH_ARGS) {
    __shared__ float sh[32];
    pdl_launch_dependents();
    if (l2_prefetch(pf0, pf0_bytes, pf1, pf1_bytes, pf_work_blocks)) return;
    pdl_wait();
    const size_t base = (size_t)blockIdx.x * dim;
    float* x = residual + base;
    unsigned short* y = out + base;
    float ss = 0.f;
    if ((dim & 3) == 0) {
        for (int i = threadIdx.x * 4; i < dim; i += blockDim.x * 4) {
            float4 v;
            if (mode == 1) {
                const unsigned short* s = init + base + i;
                v = make_float4(bf2f(s[0]), bf2f(s[1]), bf2f(s[2]), bf2f(s[3]));
            } else {
                v = *reinterpret_cast<const float4*>(x + i);
                if (mode == 2) {
                    float4 d = *reinterpret_cast<const float4*>(delta + base + i);
                    v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
                }
            }
            *reinterpret_cast<float4*>(x + i) = v;
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float v = mode == 1 ? bf2f(init[base + i]) : mode == 2 ? x[i] + delta[base + i] : x[i];
            x[i] = v;
            ss += v * v;
        }
    }
    float inv = rsqrtf(block_sum(ss, sh) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = bf2f(w[i]) * (x[i] * inv);
        y[i] = f2bf(v);
        if (out32) out32[base + i] = v;
    }
}

extern "C" __global__ void add_bias_f32(float* __restrict__ x, const unsigned short* __restrict__ b,
        long long cols, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += bf2f(b[i % cols]);
}

// One warp per (token, head) over q heads then kv heads of this rank, QKR_WARPS heads per
// block. Lane l owns the rotary pairs (i, i + hd/2) for i = l, l + 32, ... < hd/2 (hd <= 256).
// qkv row = [q heads | k heads | v heads] * hd. Launched with programmatic dependent launch; the
// L2 prefetch of a later kernel's weights is issued before the wait, as in the norm above.
#define QKR_WARPS 4
#define QKR_MAX_PAIRS 4
extern "C" __global__ void __launch_bounds__(32 * QKR_WARPS) qkv_rope_cache_bf16(
        const unsigned short* __restrict__ qkv, unsigned short* __restrict__ q_out,
        unsigned short* __restrict__ k_cache, unsigned short* __restrict__ v_cache,
        const int* __restrict__ positions, const long long* __restrict__ slot_mapping,
        const float* __restrict__ inv_freq, const unsigned short* __restrict__ q_norm,
        const unsigned short* __restrict__ k_norm, const unsigned char* __restrict__ mrope_axes,
        long long pos_stride, int tokens, int lq, int lkv, int hd, float eps, L2_PREFETCH_ARGS) {
    pdl_launch_dependents();
    if (l2_prefetch(pf0, pf0_bytes, pf1, pf1_bytes, pf_work_blocks)) return;
    pdl_wait();
    const int heads = lq + lkv;
    const long long w = (long long)blockIdx.x * QKR_WARPS + (threadIdx.x >> 5);
    if (w >= (long long)tokens * heads) return;  // whole warps
    const long long t = w / heads;
    const int hh = (int)(w - t * heads);
    const int half = hd >> 1, lane = threadIdx.x & 31;
    const size_t row = (size_t)(lq + 2 * lkv) * hd;
    const unsigned short* src = qkv + t * row + (size_t)hh * hd;
    const unsigned short* nw = hh < lq ? q_norm : k_norm;
    float a[QKR_MAX_PAIRS], b[QKR_MAX_PAIRS];
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < QKR_MAX_PAIRS; ++u) {
        const int i = lane + 32 * u;
        a[u] = 0.f;
        b[u] = 0.f;
        if (i < half) {
            a[u] = bf2f(src[i]);
            b[u] = bf2f(src[i + half]);
            ss += a[u] * a[u] + b[u] * b[u];
        }
    }
    if (nw) {
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float inv = rsqrtf(ss / (float)hd + eps);
#pragma unroll
        for (int u = 0; u < QKR_MAX_PAIRS; ++u) {
            const int i = lane + 32 * u;
            if (i < half) {
                a[u] = a[u] * inv * bf2f(nw[i]);
                b[u] = b[u] * inv * bf2f(nw[i + half]);
            }
        }
    }
    long long slot = -1;
    if (hh >= lq) {
        slot = slot_mapping[t];
        if (slot < 0) return;  // whole warps
    }
    const int j = hh - lq;
    unsigned short* dst = hh < lq ? q_out + ((size_t)t * lq + hh) * hd
                                  : k_cache + ((size_t)slot * lkv + j) * hd;
#pragma unroll
    for (int u = 0; u < QKR_MAX_PAIRS; ++u) {
        const int i = lane + 32 * u;
        if (i >= half) continue;
        // M-RoPE: frequency i turns by the temporal, height or width row of the positions.
        const long long axis = mrope_axes ? (long long)mrope_axes[i] : 0;
        const float p = (float)positions[axis * pos_stride + t];
        float sn, cs;
        sincosf(p * inv_freq[i], &sn, &cs);
        dst[i] = f2bf(a[u] * cs - b[u] * sn);
        dst[i + half] = f2bf(b[u] * cs + a[u] * sn);
    }
    if (hh < lq) return;
    unsigned short* vd = v_cache + ((size_t)slot * lkv + j) * hd;
    const unsigned short* vs = qkv + t * row + (size_t)(lq + lkv + j) * hd;
    for (int i = lane; i < hd; i += 32) vd[i] = vs[i];
}

// dst[rows[r], :] += src[r, :] for r < m (rows distinct): the deepstack residual additions.
extern "C" __global__ void add_rows_f32(float* __restrict__ dst, const float* __restrict__ src,
        const int* __restrict__ rows, long long hidden, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / hidden, j = i - r * hidden;
        dst[(long long)rows[r] * hidden + j] += src[i];
    }
}

extern "C" __global__ void embedding_ids_bf16(const unsigned short* __restrict__ table, const int* __restrict__ ids,
        unsigned short* __restrict__ out, long long hidden, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long t = i / hidden, j = i - t * hidden;
        out[i] = table[(long long)ids[t] * hidden + j];
    }
}

extern "C" __global__ void add_bias_bf16(unsigned short* __restrict__ x, const unsigned short* __restrict__ b,
        long long cols, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(b[i % cols]));
}

extern "C" __global__ void bf16_to_f32(const unsigned short* __restrict__ x, float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf2f(x[i]);
}

// Uniform in [lo, hi) from a stateless hash of (seed, index): the same buffer for the same seed on
// every run and every device.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
extern "C" __global__ void fill_uniform_bf16(unsigned short* __restrict__ x, long long n,
        unsigned long long seed, float lo, float hi) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned long long r = mix64(seed ^ mix64((unsigned long long)i));
        float u = (float)(r >> 40) * (1.0f / 16777216.0f);
        x[i] = f2bf(lo + (hi - lo) * u);
    }
}
