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
// f32 `delta`. Then out = residual * rsqrt(mean(residual^2) + eps) * w.
extern "C" __global__ void fused_add_rmsnorm_f32res(float* __restrict__ residual,
        const unsigned short* __restrict__ init, const float* __restrict__ delta, int mode,
        const unsigned short* __restrict__ w, unsigned short* __restrict__ out,
        float* __restrict__ out32, int dim, float eps) {
    __shared__ float sh[32];
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
                float4 d = *reinterpret_cast<const float4*>(delta + base + i);
                v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
            }
            *reinterpret_cast<float4*>(x + i) = v;
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float v = mode == 1 ? bf2f(init[base + i]) : x[i] + delta[base + i];
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

// One block per (token, head) over q heads then kv heads of this rank. Thread i < hd/2 owns the
// rotary pair (i, i + hd/2). qkv row = [q heads | k heads | v heads] * hd.
extern "C" __global__ void qkv_rope_cache_bf16(const unsigned short* __restrict__ qkv,
        unsigned short* __restrict__ q_out, unsigned short* __restrict__ k_cache,
        unsigned short* __restrict__ v_cache, const int* __restrict__ positions,
        const long long* __restrict__ slot_mapping, const float* __restrict__ inv_freq,
        const unsigned short* __restrict__ q_norm, const unsigned short* __restrict__ k_norm,
        const unsigned char* __restrict__ mrope_axes, long long pos_stride,
        int lq, int lkv, int hd, float eps) {
    __shared__ float sh[32];
    const int heads = lq + lkv;
    const int t = blockIdx.x / heads, hh = blockIdx.x - t * heads;
    const int half = hd >> 1, i = threadIdx.x;
    const size_t row = (size_t)(lq + 2 * lkv) * hd;
    const unsigned short* src;
    const unsigned short* nw;
    if (hh < lq) { src = qkv + t * row + (size_t)hh * hd; nw = q_norm; }
    else { src = qkv + t * row + (size_t)(lq + (hh - lq)) * hd; nw = k_norm; }
    float a = 0.f, b = 0.f;
    if (i < half) { a = bf2f(src[i]); b = bf2f(src[i + half]); }
    if (nw) {
        float inv = rsqrtf(block_sum(a * a + b * b, sh) / (float)hd + eps);
        if (i < half) { a = a * inv * bf2f(nw[i]); b = b * inv * bf2f(nw[i + half]); }
    }
    float ra = 0.f, rb = 0.f;
    if (i < half) {
        // M-RoPE: frequency i turns by the temporal, height or width row of the positions.
        const long long axis = mrope_axes ? (long long)mrope_axes[i] : 0;
        const float p = (float)positions[axis * pos_stride + t];
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        ra = a * c - b * s;
        rb = b * c + a * s;
    }
    if (hh < lq) {
        unsigned short* dst = q_out + ((size_t)t * lq + hh) * hd;
        if (i < half) { dst[i] = f2bf(ra); dst[i + half] = f2bf(rb); }
        return;
    }
    const long long slot = slot_mapping[t];
    if (slot < 0) return;
    const int j = hh - lq;
    unsigned short* kd = k_cache + ((size_t)slot * lkv + j) * hd;
    unsigned short* vd = v_cache + ((size_t)slot * lkv + j) * hd;
    const unsigned short* vs = qkv + t * row + (size_t)(lq + lkv + j) * hd;
    if (i < half) {
        kd[i] = f2bf(ra); kd[i + half] = f2bf(rb);
        vd[i] = vs[i]; vd[i + half] = vs[i + half];
    }
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
