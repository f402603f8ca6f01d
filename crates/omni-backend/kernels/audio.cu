// Qwen3-Omni Code2Wav (codec decoder) kernels. Activations are time-major bf16
// `[batch, len, channels]` (row r = b * len + t), math in f32; small per-channel vectors
// (biases, norms, SnakeBeta parameters, LayerScale) are f32. Every convolution is causal and
// per sequence: a tap reaching before t = 0 of its own sequence reads zero. Launchers and the
// host mirrors of the indexing: src/cuda/audio/.
// `_v8` entry points move 8 channels (16 bytes) per thread and need channels % 8 == 0 and
// 16-byte aligned buffers; `_v1` ones take any channel count.

__device__ __forceinline__ float c2w_snake(float x, float a, float ib) {
    float s = sinf(a * x);
    return x + ib * (s * s);
}

template <int V>
__device__ __forceinline__ void c2w_load(const unsigned short* p, float* f) {
    if constexpr (V == 8) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            f[2 * k] = __uint_as_float(w[k] << 16);
            f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e) f[e] = bf2f(p[e]);
    }
}

template <int V>
__device__ __forceinline__ void c2w_store(unsigned short* p, const float* f) {
    if constexpr (V == 8) {
        unsigned int w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            w[k] = (unsigned int)f2bf(f[2 * k]) | ((unsigned int)f2bf(f[2 * k + 1]) << 16);
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
        for (int e = 0; e < V; ++e) p[e] = f2bf(f[e]);
    }
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ float c2w_block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    __syncthreads();  // an earlier call's readers are done with `total`
    if (lane == 0) part[wid] = v;
    __syncthreads();
    if (wid == 0) {
        int nw = (blockDim.x + 31) >> 5;
        float s = lane < nw ? part[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// h[b * T + t, c] = mean over q of table[codes[b, q, t] + cb * q, c] (summed in q order, then
// divided). One block per row.
extern "C" __global__ void c2w_embed(const int* codes, const unsigned short* table, float* h,
                                     int T, int nq, int cb, int hidden) {
    long long row = blockIdx.x;
    long long b = row / T;
    int t = (int)(row - b * T);
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float s = 0.f;
        for (int q = 0; q < nq; ++q) {
            long long r = (long long)codes[(b * nq + q) * T + t] + (long long)cb * q;
            s += bf2f(table[r * hidden + c]);
        }
        h[row * hidden + c] = s / (float)nq;
    }
}

// With t != nullptr first h += scale * t (the LayerScale residual add, f32); then
// out = bf16(h / sqrt(mean(h^2) + eps) * w). One block per row.
extern "C" __global__ void c2w_scale_add_rms_norm(float* h, const float* t, const float* scale,
                                                  const float* w, unsigned short* out, int dim,
                                                  float eps) {
    long long row = blockIdx.x;
    float* hr = h + row * dim;
    float ss = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float v = hr[c];
        if (t != nullptr) {
            v += scale[c] * t[row * dim + c];
            hr[c] = v;
        }
        ss += v * v;
    }
    ss = c2w_block_sum(ss);
    float inv = rsqrtf(ss / (float)dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) out[row * dim + c] = f2bf(hr[c] * inv * w[c]);
}

// RoPE (rotate-half) in place on the q and k heads of qkv rows `[(nh + 2 nkv) * hd]`
// (q heads, then k heads, then v heads), row b * T + t at position t; cos_sin rows `[cos | sin]`
// of width hd per position.
extern "C" __global__ void c2w_rope(unsigned short* qkv, const float* cos_sin, int T, int nh,
                                    int nkv, int hd) {
    long long row = blockIdx.x;
    int t = (int)(row % T);
    int half = hd / 2;
    int width = (nh + 2 * nkv) * hd;
    for (int i = threadIdx.x; i < (nh + nkv) * half; i += blockDim.x) {
        int hh = i / half, d = i - hh * half;
        unsigned short* x = qkv + row * width + hh * hd;
        float a = bf2f(x[d]), b = bf2f(x[d + half]);
        float c = cos_sin[t * hd + d], s = cos_sin[t * hd + half + d];
        x[d] = f2bf(a * c - b * s);
        x[d + half] = f2bf(b * c + a * s);
    }
}

// Causal sliding-window attention: query i of a sequence sees keys max(0, i - window + 1) ..= i
// of the same sequence. One warp per (row, head), blockDim.x / 32 heads per block (grid.y
// covers the rest); hd <= 128. Online softmax in f32; out rows `[nh * hd]`.
extern "C" __global__ void c2w_window_attention(const unsigned short* qkv, unsigned short* out,
                                                int T, int nh, int nkv, int hd, int window,
                                                float scale) {
    int lane = threadIdx.x & 31;
    int h = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (h >= nh) return;
    long long row = blockIdx.x;
    int i = (int)(row % T);
    long long base = row - i;
    int width = (nh + 2 * nkv) * hd;
    int g = h / (nh / nkv);
    float q[4], acc[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        int d = lane + 32 * e;
        q[e] = d < hd ? bf2f(qkv[row * width + h * hd + d]) : 0.f;
        acc[e] = 0.f;
    }
    float m = -__int_as_float(0x7f800000), l = 0.f;
    int j0 = i - window + 1;
    if (j0 < 0) j0 = 0;
    for (int j = j0; j <= i; ++j) {
        const unsigned short* kr = qkv + (base + j) * width + (nh + g) * hd;
        const unsigned short* vr = qkv + (base + j) * width + (nh + nkv + g) * hd;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int d = lane + 32 * e;
            if (d < hd) s += q[e] * bf2f(kr[d]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        s *= scale;
        float mn = fmaxf(m, s);
        float corr = expf(m - mn);
        float p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int d = lane + 32 * e;
            if (d < hd) acc[e] = acc[e] * corr + p * bf2f(vr[d]);
        }
        m = mn;
    }
    float inv = 1.f / l;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        int d = lane + 32 * e;
        if (d < hd) out[row * nh * hd + h * hd + d] = f2bf(acc[e] * inv);
    }
}

// x = gelu(x + bias) with the exact erf, x `[n / C, C]`.
extern "C" __global__ void c2w_bias_gelu(unsigned short* x, const float* bias, long long n, int C) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = bf2f(x[i]) + bias[i % C];
        x[i] = f2bf(0.5f * v * (1.f + erff(v * 0.70710678118654752f)));
    }
}

// x += gamma * (y + bias) (gamma == nullptr: x += y + bias; y == nullptr: x += bias).
extern "C" __global__ void c2w_bias_residual(unsigned short* x, const unsigned short* y,
                                             const float* bias, const float* gamma, long long n,
                                             int C) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int c = (int)(i % C);
        float v = (y != nullptr ? bf2f(y[i]) : 0.f) + bias[c];
        if (gamma != nullptr) v *= gamma[c];
        x[i] = f2bf(bf2f(x[i]) + v);
    }
}

// ConvNeXt's depthwise causal conv (k taps, dilation dil, weights `[C, k]`, bias) then
// LayerNorm over the C channels (f32, no rounding in between). One block per row, C floats of
// dynamic shared memory.
extern "C" __global__ void c2w_dwconv_ln(const unsigned short* x, unsigned short* out,
                                         const float* w, const float* b, const float* lw,
                                         const float* lb, int T, int C, int k, int dil,
                                         float eps) {
    extern __shared__ float vals[];
    long long row = blockIdx.x;
    int t = (int)(row % T);
    long long base = row - t;
    float sum = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float v = b[c];
        for (int j = 0; j < k; ++j) {
            int src = t - (k - 1 - j) * dil;
            if (src >= 0) v += w[c * k + j] * bf2f(x[(base + src) * C + c]);
        }
        vals[c] = v;
        sum += v;
    }
    float mean = c2w_block_sum(sum) / (float)C;
    float sq = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float d = vals[c] - mean;
        sq += d * d;
    }
    float inv = rsqrtf(c2w_block_sum(sq) / (float)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        out[row * C + c] = f2bf((vals[c] - mean) * inv * lw[c] + lb[c]);
}

// im2col of a causal conv (k taps, dilation dil, stride 1) as a scatter: the thread of source
// element (r, c..c+V) computes f(x) once (f = SnakeBeta when a != nullptr, else identity) and
// writes it to column block j of every row r + (k - 1 - j) * dil of its sequence; it also
// zeroes the column blocks of row r whose tap reaches before the sequence start.
// cols `[rows, k * C]`, column j * C + c = f(x[r - (k - 1 - j) * dil, c]).
template <int V>
__device__ void c2w_im2col(const unsigned short* x, unsigned short* cols, const float* a,
                           const float* ib, int T, int C, int k, int dil, long long rows) {
    int chunks = C / V;
    long long n = rows * chunks;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / chunks;
        int c = (int)(i - r * chunks) * V;
        int t = (int)(r % T);
        float f[V];
        c2w_load<V>(x + r * C + c, f);
        if (a != nullptr) {
#pragma unroll
            for (int e = 0; e < V; ++e) f[e] = c2w_snake(f[e], a[c + e], ib[c + e]);
        }
        float z[V];
#pragma unroll
        for (int e = 0; e < V; ++e) z[e] = 0.f;
        long long width = (long long)k * C;
        for (int j = 0; j < k; ++j) {
            int shift = (k - 1 - j) * dil;
            if (t + shift < T) c2w_store<V>(cols + (r + shift) * width + j * C + c, f);
            if (t - shift < 0) c2w_store<V>(cols + r * width + j * C + c, z);
        }
    }
}
extern "C" __global__ void c2w_im2col_v1(const unsigned short* x, unsigned short* cols,
                                         const float* a, const float* ib, int T, int C, int k,
                                         int dil, long long rows) {
    c2w_im2col<1>(x, cols, a, ib, T, C, k, dil, rows);
}
extern "C" __global__ void c2w_im2col_v8(const unsigned short* x, unsigned short* cols,
                                         const float* a, const float* ib, int T, int C, int k,
                                         int dil, long long rows) {
    c2w_im2col<8>(x, cols, a, ib, T, C, k, dil, rows);
}

// y = SnakeBeta(x + b1) (b1 == nullptr: no bias), x and y `[n / C, C]`; may alias. With
// res != nullptr also res += b2 (the residual unit's 1x1-conv bias, added before its GEMM
// accumulates into res).
template <int V>
__device__ void c2w_bias_snake(const unsigned short* x, unsigned short* y, const float* b1,
                               const float* a, const float* ib, unsigned short* res,
                               const float* b2, long long n, int C) {
    long long nv = n / V;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nv;
         i += (long long)gridDim.x * blockDim.x) {
        int c = (int)((i * V) % C);
        float f[V];
        c2w_load<V>(x + i * V, f);
#pragma unroll
        for (int e = 0; e < V; ++e) f[e] = c2w_snake(f[e] + (b1 != nullptr ? b1[c + e] : 0.f), a[c + e], ib[c + e]);
        c2w_store<V>(y + i * V, f);
        if (res != nullptr) {
            c2w_load<V>(res + i * V, f);
#pragma unroll
            for (int e = 0; e < V; ++e) f[e] += b2[c + e];
            c2w_store<V>(res + i * V, f);
        }
    }
}
extern "C" __global__ void c2w_bias_snake_v1(const unsigned short* x, unsigned short* y,
                                             const float* b1, const float* a, const float* ib,
                                             unsigned short* res, const float* b2, long long n,
                                             int C) {
    c2w_bias_snake<1>(x, y, b1, a, ib, res, b2, n, C);
}
extern "C" __global__ void c2w_bias_snake_v8(const unsigned short* x, unsigned short* y,
                                             const float* b1, const float* a, const float* ib,
                                             unsigned short* res, const float* b2, long long n,
                                             int C) {
    c2w_bias_snake<8>(x, y, b1, a, ib, res, b2, n, C);
}

// col2im of a transposed conv (kernel k, stride s) computed as z = x @ W^T with z rows
// `[k * Cout]` (tap j, channel co): output u of a sequence is full index u + trim, fed by every
// (t, j) with t * s + j = u + trim, 0 <= t < Lin, 0 <= j < k; plus bias. y `[B, Lout, Cout]`.
template <int V>
__device__ void c2w_col2im(const unsigned short* z, unsigned short* y, const float* bias, int Lin,
                           int Lout, int Cout, int k, int s, int trim, long long n) {
    long long nv = n / V;
    int chunks = Cout / V;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nv;
         i += (long long)gridDim.x * blockDim.x) {
        long long ro = i / chunks;
        int co = (int)(i - ro * chunks) * V;
        long long b = ro / Lout;
        int u = (int)(ro - b * Lout);
        int full = u + trim;
        int t = full / s, j = full - t * s;
        float acc[V], f[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = bias[co + e];
        for (; j < k && t >= 0; --t, j += s) {
            if (t < Lin) {
                c2w_load<V>(z + ((b * Lin + t) * k + j) * Cout + co, f);
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] += f[e];
            }
        }
        c2w_store<V>(y + i * V, acc);
    }
}
extern "C" __global__ void c2w_col2im_v1(const unsigned short* z, unsigned short* y,
                                         const float* bias, int Lin, int Lout, int Cout, int k,
                                         int s, int trim, long long n) {
    c2w_col2im<1>(z, y, bias, Lin, Lout, Cout, k, s, trim, n);
}
extern "C" __global__ void c2w_col2im_v8(const unsigned short* z, unsigned short* y,
                                         const float* bias, int Lin, int Lout, int Cout, int k,
                                         int s, int trim, long long n) {
    c2w_col2im<8>(z, y, bias, Lin, Lout, Cout, k, s, trim, n);
}

// The last conv (C -> 1 channel, k taps, dilation dil) and the clamp to [-1, 1], f32 out: one
// warp per output sample; the taps of a row are contiguous `k * C` elements of x (times the
// weights `[k * C]`, tap-major) except before the sequence start.
extern "C" __global__ void c2w_conv_out_clamp(const unsigned short* x, float* wav, const float* w,
                                              float bias, int T, int C, int k, int dil,
                                              long long rows) {
    int lane = threadIdx.x & 31;
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    int t = (int)(r % T);
    long long base = r - t;
    float acc = 0.f;
    for (int e = lane; e < k * C; e += 32) {
        int j = e / C, c = e - j * C;
        int src = t - (k - 1 - j) * dil;
        if (src >= 0) acc += w[e] * bf2f(x[(base + src) * C + c]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) wav[r] = fminf(fmaxf(acc + bias, -1.f), 1.f);
}
