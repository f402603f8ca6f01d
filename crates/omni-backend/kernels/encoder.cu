// Qwen3-Omni's encoder towers (vision and audio, src/cuda/encoder/): the element-wise and row
// kernels around the cuBLAS GEMMs. The residual stream and GEMM outputs are f32; what feeds a
// GEMM is bf16. Element-wise kernels use grid-stride loops over `long long` indices.

// Sum (op 0) or max (op 1) over the block; blockDim.x a multiple of 32, at most 1024.
__device__ __forceinline__ float enc_block_reduce(float v, float* sh, int op) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = op ? fmaxf(v, w) : v + w;
    }
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    const float id = op ? __int_as_float(0xff800000) : 0.f;
    v = (threadIdx.x < (blockDim.x >> 5)) ? sh[lane] : id;
    if (wid == 0) {
        for (int o = 16; o > 0; o >>= 1) {
            float w = __shfl_xor_sync(0xffffffffu, v, o);
            v = op ? fmaxf(v, w) : v + w;
        }
    }
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}

// act 0: identity, 1: exact (erf) GELU, 2: tanh GELU.
__device__ __forceinline__ float enc_act(float x, int act) {
    if (act == 1) return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    if (act == 2) {
        const float inner = 0.79788456080286536f * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.f + tanhf(inner));
    }
    return x;
}

// nn.LayerNorm over rows of `dim` f32 values (one block per row, two passes, biased variance):
// out (bf16) = (x - mean) / sqrt(var + eps) * w + b.
extern "C" __global__ void enc_layer_norm(const float* __restrict__ x, const float* __restrict__ w,
        const float* __restrict__ b, unsigned short* __restrict__ out, int dim, float eps) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * dim;
    const float* row = x + base;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += row[i];
    const float mean = enc_block_reduce(s, sh, 0) / (float)dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = row[i] - mean;
        ss += d * d;
    }
    const float inv = rsqrtf(enc_block_reduce(ss, sh, 0) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        out[base + i] = f2bf((row[i] - mean) * inv * w[i] + b[i]);
}

// out (bf16) = act(y + bias[col]) over `n` elements of rows of `cols`.
extern "C" __global__ void enc_bias_act(const float* __restrict__ y, const float* __restrict__ bias,
        unsigned short* __restrict__ out, long long n, int cols, int act) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = f2bf(enc_act(y[i] + bias[i % cols], act));
}

// x[r, c] += (y ? y[r, c] : 0) + add[(r % period) * cols + c]: a residual update with the
// bias (period 1), or a per-row table (the audio positions, period = frames per chunk).
extern "C" __global__ void enc_add_rows(float* __restrict__ x, const float* __restrict__ y,
        const float* __restrict__ add, long long n, int cols, int period) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / cols;
        const int c = (int)(i - r * cols);
        x[i] += (y ? y[i] : 0.f) + add[(r % period) * cols + c];
    }
}

// The fused qkv projection's epilogue: y (f32 `[tokens, 3 * dim]`, q | k | v, heads outermost
// in each) + bias, with the rotate_half rotary on q and k from `cos_sin` (`[tokens, head_dim]`,
// cos then sin of the `head_dim / 2` frequencies; null = no rotary), to bf16. Element d of a
// head pairs with d + half (d < half) or d - half: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
extern "C" __global__ void enc_qkv_rope(const float* __restrict__ y, const float* __restrict__ bias,
        const float* __restrict__ cos_sin, unsigned short* __restrict__ out, long long n,
        int dim, int head_dim) {
    const int row = 3 * dim, half = head_dim / 2;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / row;
        const int j = (int)(i - t * row);
        float v = y[i] + bias[j];
        if (cos_sin && j < 2 * dim) {
            const int d = j % head_dim;
            const int f = d < half ? d : d - half;
            const int pj = d < half ? j + half : j - half;
            const float p = y[t * row + pj] + bias[pj];
            const float c = cos_sin[t * head_dim + f], s = cos_sin[t * head_dim + half + f];
            v = d < half ? v * c - p * s : v * c + p * s;
        }
        out[i] = f2bf(v);
    }
}

// Softmax of each row of `cols` f32 scores (already scaled) to bf16 probabilities; one block
// per row.
extern "C" __global__ void enc_softmax_rows(const float* __restrict__ s,
        unsigned short* __restrict__ p, int cols) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * cols;
    const float* row = s + base;
    float m = __int_as_float(0xff800000);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, row[i]);
    m = enc_block_reduce(m, sh, 1);
    float sum = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) sum += expf(row[i] - m);
    const float inv = 1.f / enc_block_reduce(sum, sh, 0);
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        p[base + i] = f2bf(expf(row[i] - m) * inv);
}

// The vision tower's input: x[p, c] = y[p, c] + bias[c] + sum_k tap_w[p, k] * table[tap_idx[p, k],
// c] over the 4 bilinear taps of patch p in the learned position table (`[rows, hidden]`).
extern "C" __global__ void enc_vision_pos(const float* __restrict__ y,
        const float* __restrict__ bias, const float* __restrict__ table,
        const int* __restrict__ tap_idx, const float* __restrict__ tap_w, float* __restrict__ x,
        long long n, int hidden) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / hidden;
        const int c = (int)(i - p * hidden);
        float pos = 0.f;
        for (int k = 0; k < 4; ++k) pos += tap_w[p * 4 + k] * table[(long long)tap_idx[p * 4 + k] * hidden + c];
        x[i] = y[i] + bias[c] + pos;
    }
}

// The vision rotary table: row t (`head_dim = 4 * quarter` values) holds cos then sin of the
// angles `row_t * inv_freq[j]` (j < quarter) then `col_t * inv_freq[j]`; rc = (row, col) per
// token.
extern "C" __global__ void enc_rope_table(const int* __restrict__ rc,
        const float* __restrict__ inv_freq, float* __restrict__ out, long long n, int quarter) {
    const int half = 2 * quarter;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / half;
        const int j = (int)(i - t * half);
        const float pos = (float)(j < quarter ? rc[2 * t] : rc[2 * t + 1]);
        const float a = pos * inv_freq[j < quarter ? j : j - quarter];
        out[t * 2 * half + j] = cosf(a);
        out[t * 2 * half + half + j] = sinf(a);
    }
}

// im2col of a 3x3, stride 2, padding 1 Conv2d over `n` images stored `[n, W, H, C]` (the time
// axis W outside the frequency axis H, channels innermost): col[p, (ky * 3 + kx) * C + c] with
// output pixel p = (b * OW + ox) * OH + oy reads x[b, 2 ox + kx - 1, 2 oy + ky - 1, c] (zero
// outside). The GEMM's output `[p, out_channels]` is then `[n, OW, OH, out]`, the next layer's
// input as is.
extern "C" __global__ void enc_im2col_s2(const unsigned short* __restrict__ x,
        unsigned short* __restrict__ col, long long total, int w, int h, int c, int ow, int oh) {
    const int depth = 9 * c;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / depth;
        const int d = (int)(i - p * depth);
        const int tap = d / c, ch = d - tap * c;
        const int ky = tap / 3, kx = tap - ky * 3;
        const int oy = (int)(p % oh);
        const long long q = p / oh;
        const int ox = (int)(q % ow);
        const long long b = q / ow;
        const int iy = 2 * oy + ky - 1, ix = 2 * ox + kx - 1;
        unsigned short v = 0;
        if (iy >= 0 && iy < h && ix >= 0 && ix < w) v = x[((b * w + ix) * h + iy) * c + ch];
        col[i] = v;
    }
}
