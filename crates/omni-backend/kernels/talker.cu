// Qwen3-Omni's Talker and code predictor on the device (src/cuda/talker.rs): the gated shared
// expert's add, the code predictor's frame set-up and per-group choice (argmax or top-k / top-p
// with a counter-based draw), the Talker's layer-0 choice under its constraints, and the next
// Talker input. Every launch reads only device buffers and host scalars, so a whole frame of the
// code predictor is one CUDA graph. Prepended by the Rust side: bf16.cuh.

#define CHOOSE_THREADS 1024
#define CHOOSE_MAX_VOCAB 4096
#define TK_NEG_INF (__int_as_float(0xff800000))

// Block reduction of a float sum (`blockDim.x` a multiple of 32, at most 1024).
__device__ __forceinline__ float tk_block_sum(float v, float* sh) {
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

// proj[r, :] += sigmoid(x32[r, :] . gate) * shared_out[r, :]: the shared expert scaled by its
// gate (one block per row; x32 is the unrounded normed input the router also reads).
extern "C" __global__ void gated_shared_add_f32(float* __restrict__ proj,
        const float* __restrict__ x32, const float* __restrict__ gate,
        const float* __restrict__ shared_out, int dim) {
    __shared__ float sh[32];
    const size_t base = (size_t)blockIdx.x * dim;
    float d = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) d += x32[base + i] * gate[i];
    const float g = 1.f / (1.f + expf(-tk_block_sum(d, sh)));
    for (int i = threadIdx.x; i < dim; i += blockDim.x) proj[base + i] += g * shared_out[base + i];
}

// out = bf16(codec_sum + text), `n` elements: the next Talker input.
extern "C" __global__ void codec_input_bf16(unsigned short* __restrict__ out,
        const float* __restrict__ codec_sum, const float* __restrict__ text, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f2bf(codec_sum[i] + text[i]);
}

// The code predictor's step metadata for row r at group step g (1-based; g = 1 is the 2-token
// prefill of [h, E(c0)], later steps one token at position g). Row r owns KV block r.
__device__ __forceinline__ void cp_meta(int r, int g, int block_size, int mbps,
        int* positions, long long* slots, int* qsl, int* seq_lens, int* tables, int* rows) {
    if (g == 1) {
        positions[2 * r] = 0; positions[2 * r + 1] = 1;
        slots[2 * r] = (long long)r * block_size;
        slots[2 * r + 1] = (long long)r * block_size + 1;
        qsl[r + 1] = 2 * (r + 1);
        seq_lens[r] = 2;
        rows[r] = 2 * r + 1;
    } else {
        positions[r] = g;
        slots[r] = (long long)r * block_size + g;
        qsl[r + 1] = r + 1;
        seq_lens[r] = g + 1;
        rows[r] = r;
    }
    if (r == 0) qsl[0] = 0;
    tables[(size_t)r * mbps] = r;
}

// One block per row r: the code predictor's first step. in rows 2r, 2r+1 = the Talker's
// final-norm state h[r] and its codec embedding of c0[r]; codec_sum[r] = E(c0[r]) (f32);
// codes[r * groups_total] = c0; the step-1 metadata.
extern "C" __global__ void cp_begin(const unsigned short* __restrict__ hidden,
        const int* __restrict__ c0, const unsigned short* __restrict__ talker_embed,
        unsigned short* __restrict__ cp_in, float* __restrict__ codec_sum, int* __restrict__ codes,
        int* positions, long long* slots, int* qsl, int* seq_lens, int* tables, int* rows,
        int dim, int groups_total, int block_size, int mbps) {
    const int r = blockIdx.x;
    const int c = c0[r];
    const unsigned short* e = talker_embed + (size_t)c * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const unsigned short x = e[i];
        cp_in[(size_t)(2 * r) * dim + i] = hidden[(size_t)r * dim + i];
        cp_in[(size_t)(2 * r + 1) * dim + i] = x;
        codec_sum[(size_t)r * dim + i] = bf2f(x);
    }
    if (threadIdx.x == 0) {
        codes[(size_t)r * groups_total] = c;
        cp_meta(r, 1, block_size, mbps, positions, slots, qsl, seq_lens, tables, rows);
    }
}

// SplitMix64's finaliser; uniform draws are a hash of (seed, offset), mirrored on the host.
__device__ __forceinline__ unsigned long long tk_mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float tk_uniform(unsigned long long seed, unsigned long long offset) {
    return (float)(tk_mix64(seed ^ tk_mix64(offset)) >> 40) * (1.0f / 16777216.0f);
}

// Order-preserving key of a float (NaN counts as -inf); candidates sort as (key desc, id asc).
__device__ __forceinline__ unsigned int tk_key(float f) {
    if (f != f) f = TK_NEG_INF;
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float tk_unkey(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// A candidate: the value's key in the high half, ~id in the low half, so the larger of two
// packed keys is the larger value, then the lower id (`torch.argmax`'s tie rule).
__device__ __forceinline__ unsigned long long tk_pack(float x, int i) {
    return (((unsigned long long)tk_key(x)) << 32) | (unsigned long long)(0xffffffffu - (unsigned int)i);
}
__device__ __forceinline__ int tk_id(unsigned long long k) {
    return (int)(0xffffffffu - (unsigned int)(k & 0xffffffffull));
}
__device__ __forceinline__ float tk_val(unsigned long long k) { return tk_unkey((unsigned int)(k >> 32)); }

// Per-row sampling parameters: 6 words [temperature, top_k, top_p, unused, seed lo, seed hi].
// temperature <= 0: argmax (lowest id among equals). Otherwise the CPU's `top_k_top_p` on the
// logits divided by the temperature: the top_k largest, then the smallest prefix whose mass
// reaches top_p, one draw u in [0, 1) (a hash of (seed, offset)) over the kept weights in order.
//
// `keys[0..v)` holds the row packed with tk_pack (already penalised / suppressed); every thread
// of the block calls this; the code is returned to all.
__device__ int tk_choose(unsigned long long* keys, int* out_code, int v,
        const unsigned int* params, unsigned long long offset) {
    __shared__ unsigned long long wbest[32];
    const float temperature = __uint_as_float(params[0]);
    const int tid = threadIdx.x;
    if (!(temperature > 0.f)) {
        unsigned long long best = 0ull;
        for (int i = tid; i < v; i += blockDim.x) best = keys[i] > best ? keys[i] : best;
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long ob = __shfl_xor_sync(0xffffffffu, best, o);
            best = ob > best ? ob : best;
        }
        if ((tid & 31) == 0) wbest[tid >> 5] = best;
        __syncthreads();
        if (tid == 0) {
            unsigned long long b = wbest[0];
            for (int w = 1; w < (int)(blockDim.x >> 5); ++w) b = wbest[w] > b ? wbest[w] : b;
            *out_code = b == 0ull ? 0 : tk_id(b);
        }
        __syncthreads();
        return *out_code;
    }
    int n = 1;
    while (n < v) n <<= 1;
    for (int i = v + tid; i < n; i += blockDim.x) keys[i] = 0ull;
    __syncthreads();
    // Bitonic sort, descending.
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = tid; i < n; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const unsigned long long a = keys[i], b = keys[l];
                    const bool desc = (i & k) == 0;
                    if (desc ? (a < b) : (a > b)) { keys[i] = b; keys[l] = a; }
                }
            }
            __syncthreads();
        }
    }
    if (tid == 0) {
        const float inv_t = 1.f / temperature;
        const int top_k = (int)params[1];
        const float top_p = __uint_as_float(params[2]);
        const unsigned long long seed = (unsigned long long)params[4] | ((unsigned long long)params[5] << 32);
        const int k = (top_k <= 0 || top_k > v) ? v : top_k;
        const float m = tk_val(keys[0]) * inv_t;
        float total = 0.f;
        for (int i = 0; i < k; ++i) total += expf(tk_val(keys[i]) * inv_t - m);
        int kept = 0;
        float mass = 0.f;
        for (int i = 0; i < k; ++i) {
            kept += 1;
            mass += expf(tk_val(keys[i]) * inv_t - m) / total;
            if (mass >= top_p) break;
        }
        float kept_total = 0.f;
        for (int i = 0; i < kept; ++i) kept_total += expf(tk_val(keys[i]) * inv_t - m);
        float target = tk_uniform(seed, offset) * kept_total;
        int pick = kept - 1;
        for (int i = 0; i < kept; ++i) {
            const float x = expf(tk_val(keys[i]) * inv_t - m);
            if (target < x) { pick = i; break; }
            target -= x;
        }
        *out_code = tk_id(keys[pick]);
    }
    __syncthreads();
    return *out_code;
}

// Teacher forcing: with `forced` ([rows, groups_total], or null), the kernel records its own
// choice in `chosen` (same layout) and continues with the forced code (clamped into the
// vocabulary), so a frame follows a given trajectory.
__device__ __forceinline__ int tk_forced(const int* forced, int* chosen, size_t at, int c, int v) {
    if (!forced) return c;
    if (threadIdx.x == 0) chosen[at] = c;
    const int f = forced[at];
    return f < 0 ? 0 : (f >= v ? v - 1 : f);
}

// One block per row r: the Talker's layer-0 code from its logits [rows, v]: the repetition
// penalty over the codes this row chose before (`seen` [rows, v] bytes), the control range
// [suppress_from, v) suppressed except `eos` (Qwen3-Omni: v - 1024), then tk_choose (or the
// forced code, see tk_forced). Writes c0[r], codes[r * groups_total], marks it seen.
extern "C" __global__ void __launch_bounds__(CHOOSE_THREADS) talker_choose_c0(
        const float* __restrict__ logits, unsigned char* __restrict__ seen,
        const unsigned int* __restrict__ params, long long* __restrict__ frame,
        int* __restrict__ c0, int* __restrict__ codes, const int* __restrict__ forced,
        int* __restrict__ chosen, int v, float penalty, int eos, int suppress_from,
        int groups_total) {
    __shared__ unsigned long long keys[CHOOSE_MAX_VOCAB];
    __shared__ int code;
    const int r = blockIdx.x;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        float x = logits[(size_t)r * v + i];
        if (seen[(size_t)r * v + i]) x = x > 0.f ? x / penalty : x * penalty;
        if (i >= suppress_from && i != eos) x = TK_NEG_INF;
        keys[i] = tk_pack(x, i);
    }
    __syncthreads();
    const int own = tk_choose(keys, &code, v, params + 6 * r,
                              (unsigned long long)frame[r] * (unsigned long long)groups_total);
    const int c = tk_forced(forced, chosen, (size_t)r * groups_total, own, v);
    if (threadIdx.x == 0) {
        c0[r] = c;
        codes[(size_t)r * groups_total] = c;
        seen[(size_t)r * v + c] = 1;
        frame[r] += 1;
    }
}

// One block per row r after code-predictor group step g (1-based): chooses code g from the
// head's logits [rows, v]; adds its embedding (table g - 1 of `embed`, [groups, v, dim]) to
// codec_sum[r], writes it as the next step's input row r and that step's metadata. After the
// last group the row's frame counter advances. `forced` / `chosen`: see tk_forced.
extern "C" __global__ void __launch_bounds__(CHOOSE_THREADS) cp_choose(
        const float* __restrict__ logits, const unsigned int* __restrict__ params,
        long long* __restrict__ frame, const unsigned short* __restrict__ embed,
        unsigned short* __restrict__ cp_in, float* __restrict__ codec_sum, int* __restrict__ codes,
        int* positions, long long* slots, int* qsl, int* seq_lens, int* tables, int* rows,
        const int* __restrict__ forced, int* __restrict__ chosen,
        int v, int dim, int g, int groups_total, int block_size, int mbps) {
    __shared__ unsigned long long keys[CHOOSE_MAX_VOCAB];
    __shared__ int code;
    const int r = blockIdx.x;
    for (int i = threadIdx.x; i < v; i += blockDim.x) keys[i] = tk_pack(logits[(size_t)r * v + i], i);
    __syncthreads();
    const int own = tk_choose(keys, &code, v, params + 6 * r,
                              (unsigned long long)frame[r] * (unsigned long long)groups_total + g);
    const int c = tk_forced(forced, chosen, (size_t)r * groups_total + g, own, v);
    const unsigned short* e = embed + ((size_t)(g - 1) * v + c) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const unsigned short x = e[i];
        codec_sum[(size_t)r * dim + i] += bf2f(x);
        cp_in[(size_t)r * dim + i] = x;
    }
    if (threadIdx.x == 0) {
        codes[(size_t)r * groups_total + g] = c;
        if (g + 1 < groups_total)
            cp_meta(r, g + 1, block_size, mbps, positions, slots, qsl, seq_lens, tables, rows);
        else
            frame[r] += 1;
    }
}
