// Sampling on the device (src/cuda/sampling/mod.rs has the semantics and the algorithm).
// The Rust side prepends `#define NT` and `#define CAP`; no bf16 helpers.

typedef unsigned int u32;
typedef unsigned long long u64;
// NT (threads per block, a multiple of 32) and CAP (shared-memory candidates, a power of two
// >= NT) are defined before this body.
#define NW (NT / 32)
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
#define GOLDEN 0x9e3779b97f4a7c15ULL

// Order-preserving key of a float (larger float, larger key; -0 and +0 are one value).
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float kfloat(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// A candidate in shared memory: key in the high half, ~index in the low half, so a descending
// sort orders by logit descending, then token id ascending. Valid keys are > 0x007fffff, so a
// real entry is never 0 (0 pads the sort).
__device__ __forceinline__ u64 pack(u32 key, int idx) { return ((u64)key << 32) | (u64)(~(u32)idx); }
__device__ __forceinline__ u32 pkey(u64 c) { return (u32)(c >> 32); }
__device__ __forceinline__ int pidx(u64 c) { return (int)(~(u32)c); }

// Probability mass in 2^-40 fixed point: exact, order-independent sums (w <= 1, so a row of
// 2^24 entries still fits in 64 bits).
__device__ __forceinline__ u64 fixp(float w) { return __float2ull_rz(__fmul_rn(w, 1099511627776.0f)); }

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
// Gumbel noise for token `idx` of the stream `rk`: -log(-log(1 - v)), v uniform in (0, 1].
__device__ __forceinline__ float gumbel(u64 rk, int idx) {
    u64 h = mix64(rk + (u64)((u32)idx + 1u) * GOLDEN);
    float v = __fmul_rn(__fadd_rn(__uint2float_rn((u32)(h >> 32)), 0.5f), 2.3283064365386963e-10f);
    return -logf(-log1pf(-v));
}

// Upper bound of gumbel(): v >= 2^-33, so -log(-log1p(-v)) <= 22.9.
#define GUMBEL_MAX 23.0f

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    return v > bv || (v == bv && i < bi);
}

// ---- block-wide helpers (every thread of the block must call them; results broadcast) ----
__device__ void block_best(float& v, int& i) {
    __shared__ float sv[NW];
    __shared__ int si[NW];
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL, v, o);
        int oi = __shfl_xor_sync(FULL, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) { sv[wid] = v; si[wid] = i; }
    __syncthreads();
    v = sv[0]; i = si[0];
    for (int w = 1; w < NW; ++w) if (better(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
    __syncthreads();
}

struct SumOp { template <class T> __device__ T operator()(T a, T b) const { return a + b; } };
struct MinOp { template <class T> __device__ T operator()(T a, T b) const { return b < a ? b : a; } };
struct MaxOp { template <class T> __device__ T operator()(T a, T b) const { return b > a ? b : a; } };

template <class T, class Op> __device__ T block_reduce(T v, Op op) {
    __shared__ T sh[NW];
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL, v, o));
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[0];
    for (int w = 1; w < NW; ++w) v = op(v, sh[w]);
    __syncthreads();
    return v;
}

// One binary-search step's aggregate: sum (count or fixed-point mass) of the candidates >= mid,
// the smallest candidate key >= mid and the largest candidate key < mid.
struct Agg { u64 sum; u32 ge; u32 lt; };
__device__ Agg block_agg(Agg a) {
    __shared__ u64 ss[NW];
    __shared__ u32 sg[NW], sl[NW];
    for (int o = 16; o > 0; o >>= 1) {
        a.sum += __shfl_xor_sync(FULL, a.sum, o);
        a.ge = min(a.ge, __shfl_xor_sync(FULL, a.ge, o));
        a.lt = max(a.lt, __shfl_xor_sync(FULL, a.lt, o));
    }
    int wid = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) { ss[wid] = a.sum; sg[wid] = a.ge; sl[wid] = a.lt; }
    __syncthreads();
    Agg r = {ss[0], sg[0], sl[0]};
    for (int w = 1; w < NW; ++w) { r.sum += ss[w]; r.ge = min(r.ge, sg[w]); r.lt = max(r.lt, sl[w]); }
    __syncthreads();
    return r;
}

// Inclusive prefix sum over the threads of the block (thread order); `total` gets the block sum.
template <class T> __device__ T block_incl_scan(T v, T* total) {
    __shared__ T sh[NW];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    T x = v;
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_up_sync(FULL, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sh[wid] = x;
    __syncthreads();
    T pre = 0, tot = 0;
    for (int w = 0; w < NW; ++w) { T s = sh[w]; if (w < wid) pre += s; tot += s; }
    __syncthreads();
    *total = tot;
    return pre + x;
}

// Sorts a[0..n) descending; n a power of two (0 pads).
__device__ void bitonic_sort_desc(u64* a, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += NT) {
                int p = i ^ j;
                if (p > i) {
                    u64 x = a[i], y = a[p];
                    bool desc = (i & k) == 0;
                    if (desc ? (x < y) : (x > y)) { a[i] = y; a[p] = x; }
                }
            }
            __syncthreads();
        }
    }
}

// One row's transformed values and its candidate set: valid (> -inf, not NaN), passing min-p,
// and with key >= lb.
struct Row {
    const float* row;
    int n;
    float m, inv_t, lminp;
    u32 lb;
    // Scaled log-weight (l - m) / T: 0 for the max (also when it is +inf), <= 0 otherwise.
    __device__ __forceinline__ float x(float l) const {
        return l == m ? 0.f : __fmul_rn(__fsub_rn(l, m), inv_t);
    }
    __device__ __forceinline__ bool cand(float l) const {
        return l > NEG_INF && x(l) >= lminp && fkey(l) >= lb;
    }
};

// Candidates with key >= floor: sum of (count or mass) of those >= mid, nearest keys around mid.
__device__ Agg agg_pass(const Row& r, u32 floor_key, u32 mid, bool mass) {
    Agg a = {0ull, 0xffffffffu, 0u};
    for (int i = threadIdx.x; i < r.n; i += NT) {
        float l = r.row[i];
        if (!r.cand(l)) continue;
        u32 k = fkey(l);
        if (k < floor_key) continue;
        if (k >= mid) {
            a.sum += mass ? fixp(expf(r.x(l))) : 1ull;
            a.ge = min(a.ge, k);
        } else {
            a.lt = max(a.lt, k);
        }
    }
    return block_agg(a);
}

// Largest candidate key t (>= floor) with sum(>= t) >= need. `lo` is a candidate key known to
// satisfy it and `hi` an upper bound that is a candidate key. The bracket snaps to keys present
// in the row, so every step strictly shrinks it: at most 32 steps.
__device__ u32 bisect(const Row& r, u32 floor_key, u32 lo, u32 hi, bool mass, u64 need) {
    while (lo < hi) {
        u32 mid = lo + (u32)(((u64)hi - (u64)lo + 1ull) >> 1);
        Agg a = agg_pass(r, floor_key, mid, mass);
        if (a.sum >= need) lo = a.ge; else hi = a.lt;
    }
    return lo;
}

__device__ __forceinline__ u64 topp_target(float top_p, u64 total) {
    return (u64)ceil((double)fmaxf(top_p, 0.f) * (double)total);
}

// Gumbel-max over the candidates with key >= floor; writes the winner (or -1).
__device__ void gumbel_pass(const Row& r, u32 floor_key, u64 rk, int* out) {
    float bv = 0.f;
    int bi = -1;
    for (int i = threadIdx.x; i < r.n; i += NT) {
        float l = r.row[i];
        if (!r.cand(l) || fkey(l) < floor_key) continue;
        float x = r.x(l);
        // The noise is at most ~22.9: an entry that cannot beat the best so far skips the hash
        // and the logarithms (most of a peaked LLM row). It could not have won, so the result
        // does not change.
        if (bi >= 0 && __fadd_rn(x, GUMBEL_MAX) < bv) continue;
        float s = __fadd_rn(x, gumbel(rk, i));
        if (better(s, i, bv, bi)) { bv = s; bi = i; }
    }
    block_best(bv, bi);
    if (threadIdx.x == 0) *out = bi;
}

extern "C" __global__ void __launch_bounds__(NT, 1)
sample_rows_f32(const float* __restrict__ logits, const u32* __restrict__ params,
                int* __restrict__ out, int vocab, int flags) {
    extern __shared__ u64 buf[];  // CAP candidates
    __shared__ u32 s_count, s_pos;
    const int tid = threadIdx.x, lane = tid & 31;
    const float* row = logits + (size_t)blockIdx.x * vocab;
    int* dst = out + blockIdx.x;

    const u32* pw = params + 8 * (size_t)blockIdx.x;
    const float temp = __uint_as_float(pw[0]);
    const int top_k = (int)pw[1];
    const float top_p = __uint_as_float(pw[2]);
    const float min_p = __uint_as_float(pw[3]);
    const u64 seed = (u64)pw[4] | ((u64)pw[5] << 32);
    const u64 offset = (u64)pw[6] | ((u64)pw[7] << 32);

    const bool greedy = !(temp >= 1e-5f);
    const bool has_topk = top_k > 0 && top_k < vocab;
    const bool has_topp = top_p < 1.f;
    const bool has_minp = min_p > 0.f;
    const float inv_t = greedy ? 1.f : __fdiv_rn(1.f, temp);
    // top-p's total is the mass of the min-p survivors when there is no top-k (pass 2 sums it).
    const bool want_s1 = !greedy && has_topp && !has_topk;
    const bool want_z = want_s1 && !(flags & 2);

    // ---- pass 1: max / argmax, per-thread maxima, online softmax normaliser ----
    float tmax = NEG_INF, tz = 0.f;
    int targ = -1;
    for (int i = tid; i < vocab; i += NT) {
        float l = row[i];
        if (!(l > NEG_INF)) continue;
        if (targ < 0 || l > tmax) {
            if (want_z) tz = targ < 0 ? 1.f : __fadd_rn(__fmul_rn(tz, expf(__fmul_rn(__fsub_rn(tmax, l), inv_t))), 1.f);
            tmax = l;
            targ = i;
        } else if (want_z) {
            tz = __fadd_rn(tz, expf(__fmul_rn(__fsub_rn(l, tmax), inv_t)));
        }
    }
    float m = tmax;
    int am = targ;
    block_best(m, am);
    if (greedy || am < 0) {
        if (tid == 0) *dst = am;
        return;
    }

    Row r;
    r.row = row; r.n = vocab; r.m = m; r.inv_t = inv_t; r.lb = 0u;
    r.lminp = has_minp ? logf(fminf(min_p, 1.f)) : NEG_INF;
    const u64 rk = mix64(seed ^ mix64(offset + GOLDEN));

    if (!has_topk && !has_topp) {  // min-p alone is a direct threshold
        gumbel_pass(r, 0u, rk, dst);
        return;
    }

    // ---- lower bounds on the cut-off from the per-thread maxima ----
    u32 lb = 0u;
    bool lb_from_p = false;
    const bool use_lbk = has_topk && top_k <= NT && !(flags & 2);
    if (use_lbk || want_z) {
        float z = block_reduce(targ >= 0 ? __fmul_rn(tz, expf(r.x(tmax))) : 0.f, SumOp());
        buf[tid] = targ >= 0 ? pack(fkey(tmax), targ) : 0ull;
        __syncthreads();
        bitonic_sort_desc(buf, NT);
        // At least k entries (the k largest maxima) are >= the k-th largest maximum.
        if (use_lbk) lb = pkey(buf[top_k - 1]);
        if (want_z) {
            // The largest maxima alone holding top_p of the mass (with a margin for rounding:
            // pass 2 verifies the bound and drops it if it fails) bound the top-p cut-off.
            u64 c = buf[tid];
            float l = kfloat(pkey(c));
            float w = (c != 0ull && r.x(l) >= r.lminp) ? expf(r.x(l)) : 0.f;
            float tot;
            float cum = block_incl_scan(w, &tot);
            float goal = __fmul_rn(__fmul_rn(fmaxf(top_p, 0.f), z), 1.001f);
            int first = block_reduce(cum >= goal && w > 0.f ? tid : NT, MinOp());
            if (first < NT) { lb = pkey(buf[first]); lb_from_p = true; }
        }
        __syncthreads();
    }

    // ---- pass 2: gather the candidates into shared memory (count all of them) ----
    u32 count = 0, kmin = 0xffffffffu;
    u64 z_s1 = 0;
    for (;;) {
        r.lb = lb;
        if (tid == 0) s_count = 0;
        __syncthreads();
        u32 tk_min = 0xffffffffu;
        u64 zs = 0, zc = 0;
        for (int base = 0; base < vocab; base += NT) {
            int i = base + tid;
            bool c = false;
            u32 k = 0;
            if (i < vocab) {
                float l = row[i];
                if (l > NEG_INF) {
                    float x = r.x(l);
                    if (x >= r.lminp) {
                        k = fkey(l);
                        c = k >= lb;
                        if (want_s1) {
                            u64 f = fixp(expf(x));
                            zs += f;
                            if (c) zc += f;
                        }
                    }
                }
            }
            u32 b = __ballot_sync(FULL, c);
            if (b) {
                u32 wbase = 0;
                if (lane == 0) wbase = atomicAdd(&s_count, (u32)__popc(b));
                wbase = __shfl_sync(FULL, wbase, 0);
                if (c) {
                    u32 slot = wbase + (u32)__popc(b & ((1u << lane) - 1u));
                    if (slot < CAP) buf[slot] = pack(k, i);
                    tk_min = min(tk_min, k);
                }
            }
        }
        __syncthreads();
        count = s_count;
        kmin = block_reduce(tk_min, MinOp());
        if (want_s1) {
            z_s1 = block_reduce(zs, SumOp());
            u64 zcand = block_reduce(zc, SumOp());
            if (lb_from_p && zcand < topp_target(top_p, z_s1)) {  // the bound failed: retry without
                lb = 0u;
                lb_from_p = false;
                continue;
            }
        }
        break;
    }

    if (count <= CAP && !(flags & 1)) {
        // ---- shared-memory path: sort the candidates, read the cut-offs off ----
        int n = 1;
        while (n < (int)count) n <<= 1;
        for (int j = (int)count + tid; j < n; j += NT) buf[j] = 0ull;
        __syncthreads();
        bitonic_sort_desc(buf, n);
        int n2 = (int)count;
        if (has_topk && top_k < (int)count) {
            u32 kk = pkey(buf[top_k - 1]);
            if (tid == 0) s_pos = count;
            __syncthreads();
            for (int j = top_k + tid; j < (int)count; j += NT)
                if (pkey(buf[j]) < kk && pkey(buf[j - 1]) >= kk) s_pos = (u32)j;
            __syncthreads();
            n2 = (int)s_pos;
            __syncthreads();
        }
        int n3 = n2;
        if (has_topp) {
            int per = (n2 + NT - 1) / NT;
            int j0 = min(tid * per, n2), j1 = min(j0 + per, n2);
            u64 loc = 0;
            for (int j = j0; j < j1; ++j) loc += fixp(expf(r.x(kfloat(pkey(buf[j])))));
            u64 tot;
            u64 cum = block_incl_scan(loc, &tot) - loc;
            u64 target = topp_target(top_p, want_s1 ? z_s1 : tot);
            int first = n2;
            for (int j = j0; j < j1; ++j) {
                cum += fixp(expf(r.x(kfloat(pkey(buf[j])))));
                if (cum >= target) { first = j; break; }
            }
            first = block_reduce(first, MinOp());
            if (first < n2) {
                u32 kp = pkey(buf[first]);
                if (tid == 0) s_pos = n2;
                __syncthreads();
                for (int j = first + 1 + tid; j < n2; j += NT)
                    if (pkey(buf[j]) < kp && pkey(buf[j - 1]) >= kp) s_pos = (u32)j;
                __syncthreads();
                n3 = (int)s_pos;
            }
        }
        float bv = 0.f;
        int bi = -1;
        for (int j = tid; j < n3; j += NT) {
            u64 c = buf[j];
            int i = pidx(c);
            float s = __fadd_rn(r.x(kfloat(pkey(c))), gumbel(rk, i));
            if (better(s, i, bv, bi)) { bv = s; bi = i; }
        }
        block_best(bv, bi);
        if (tid == 0) *dst = bi;
        return;
    }

    // ---- global path: binary search for each cut-off over the row ----
    const u32 kmax = fkey(m);
    u32 tk = 0u, tp = 0u;
    if (has_topk && top_k < (int)count) tk = bisect(r, 0u, kmin, kmax, false, (u64)top_k);
    if (has_topp) {
        u64 total = want_s1 ? z_s1 : agg_pass(r, tk, tk, true).sum;
        u32 lo = max(kmin, tk);
        tp = bisect(r, tk, lo, kmax, true, topp_target(top_p, total));
    }
    gumbel_pass(r, max(tk, tp), rk, dst);
}
