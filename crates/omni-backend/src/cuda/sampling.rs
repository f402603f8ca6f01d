//! Sampling on the device: temperature, min-p, top-k, top-p and one seeded draw per row, in one
//! kernel launch with one CTA (1024 threads) per row and no sort of the vocabulary.
//!
//! The semantics follow the CPU sampler (`omni_models::sampler`): NaN logits count as `-inf`;
//! temperature below `1e-5` is greedy (argmax, lowest index on ties, other parameters ignored);
//! otherwise logits are divided by the temperature, then **min-p**, then **top-k**, then **top-p**
//! are applied, each on the distribution left by the previous one, and one token is drawn from
//! what is left. Two deliberate differences:
//!
//! * **Ties at a cut-off are all kept.** Every filter is a threshold on the logit: top-k keeps
//!   every entry whose logit is `>=` the k-th largest (so more than `k` survive when the k-th
//!   largest value is repeated), and top-p keeps every entry equal to the value at which the
//!   cumulative mass first reaches `top_p` (the CPU keeps the lowest token ids among equal
//!   values instead). `-0.0` and `0.0` are the same value.
//! * **The random stream is a different one.** The draw is a Gumbel-max over the kept entries
//!   with noise from a counter-based hash of `(seed, offset, token id)` (SplitMix64's mixer), so a
//!   row's token depends only on its logits, its parameters, `seed` and `offset`: not on its
//!   position in the batch, other rows, or the path the kernel took. It does not reproduce the
//!   CPU sampler's tokens for the same seed.
//!
//! How the cut-offs are found without sorting 150k entries:
//!
//! 1. Pass 1 over the row: max logit `m` (and argmax: greedy rows stop here), each thread's
//!    maximum, and (top-p without top-k) the softmax normaliser.
//! 2. Lower bounds on the final cut-off from the 1024 per-thread maxima (sorted in shared memory):
//!    the k-th largest thread maximum bounds the top-k cut-off from below, and the smallest set
//!    of largest maxima that already holds `top_p` of the mass bounds the top-p cut-off. min-p is
//!    a direct threshold: keep `(l - m) / T >= ln(min_p)`, i.e. `p >= min_p * p_max`.
//! 3. Pass 2 gathers the candidates above the bounds into shared memory (up to 16384). On a
//!    typical LLM distribution this is a few hundred entries, which are sorted there, and the
//!    top-k and top-p cut-offs read off directly.
//! 4. Otherwise (flat distributions, `top_k > 1024`) each cut-off is found by **binary search
//!    over the logit value range** on the global row: the search runs on the order-preserving
//!    32-bit key of the f32 logit; each step counts (top-k) or sums the probability mass of
//!    (top-p) the candidates `>= mid` and also finds the nearest candidate values on either
//!    side of `mid`, so the bracket always snaps to values present in the row: at most 32 steps,
//!    exact.
//!
//! Probability mass is summed in 2^-40 fixed point (integers; a weight below 2^-40 of the most
//! likely token's counts as zero for top-p), so sums are exact and independent of the summation
//! order: both paths find the same cut-offs bit for bit, and a seeded row is reproducible. The
//! Gumbel noise comes from 32 random bits (at most ~22.9), so probabilities below ~1e-9 are not
//! reproduced faithfully; everything else is drawn from the exactly filtered, renormalized
//! distribution.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{CudaContext, CudaError, CudaResult, to_i32};

/// Threads per CTA (one CTA per row); the kernel's block reductions assume exactly this.
const THREADS: u32 = 1024;
/// Candidates gathered into shared memory (8 bytes each): 128 KiB of dynamic shared memory.
const SMEM_CANDIDATES: usize = 16384;

/// The sampling kernel's entry point.
const SAMPLE_FN: &str = "sample_rows_f32";

/// Per-row sampling parameters for [`CudaContext::sample_rows_f32`].
///
/// `#[repr(C)]`: 32 bytes, the layout the kernel reads (uploaded as eight `u32` words).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSamplingParams {
    /// Softmax temperature; below `1e-5` (or NaN) the row is greedy (argmax) and every other
    /// field is ignored.
    pub temperature: f32,
    /// Keep the `top_k` largest logits (ties at the cut-off kept); `<= 0` or `>= vocab` is off.
    pub top_k: i32,
    /// Keep the smallest most-likely set holding at least `top_p` of the probability mass
    /// (ties at the cut-off kept); `>= 1.0` (or NaN) is off, `<= 0` keeps only the most likely
    /// value.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p * p_max`; `<= 0` (or NaN) is off, values above 1
    /// act as 1 (keep the most likely value only).
    pub min_p: f32,
    /// The random stream: rows with the same seed, offset and logits draw the same token.
    /// Callers give unseeded requests distinct seeds (e.g. from a host RNG).
    pub seed: u64,
    /// Which draw of that seed's stream, e.g. the number of tokens generated so far.
    pub offset: u64,
}

impl DeviceSamplingParams {
    /// Greedy decoding (argmax, lowest token id on ties).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            offset: 0,
        }
    }

    /// Plain sampling at `temperature` (all filters off) from stream `seed` at draw `offset`.
    pub fn random(temperature: f32, seed: u64, offset: u64) -> Self {
        Self {
            temperature,
            seed,
            offset,
            ..Self::greedy()
        }
    }

    /// The eight `u32` words the kernel reads, in field order (little-endian halves for the
    /// 64-bit fields).
    fn words(&self) -> [u32; 8] {
        [
            self.temperature.to_bits(),
            self.top_k as u32,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.offset as u32,
            (self.offset >> 32) as u32,
        ]
    }
}

#[cfg(test)]
/// Kernel flag: take the global binary-search path even when the candidates fit in shared
/// memory (tests compare both paths).
const FLAG_FORCE_GLOBAL: i32 = 1;
#[cfg(test)]
/// Kernel flag: skip the lower bounds from the per-thread maxima (tests check they never change
/// the result).
const FLAG_NO_BOUNDS: i32 = 2;

/// The sampling kernel (header-free CUDA C++; [`sampling_source`] defines `NT` and `CAP` from
/// [`THREADS`] and [`SMEM_CANDIDATES`]).
const SAMPLE_BODY: &str = r#"
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
"#;

/// Full source of the sampling module (f32 only; no bf16 helpers needed).
fn sampling_source() -> String {
    format!("#define NT {THREADS}\n#define CAP {SMEM_CANDIDATES}\n{SAMPLE_BODY}")
}

impl CudaContext {
    /// Samples one token per row of `logits` (`[params.len(), vocab]` f32, row-major) with that
    /// row's [`DeviceSamplingParams`], on the device: one kernel launch, one CTA per row (see the
    /// [module docs](self) for the semantics and how the cut-offs are found). The tokens are
    /// written to `out` (`[params.len()]` i32, `-1` for a row with no logit above `-inf`) and
    /// also returned (this synchronizes the stream); `None` marks such a row, as
    /// [`CudaContext::argmax_f32_rows`] does.
    pub fn sample_rows_f32<O>(
        &self,
        logits: &impl DevicePtr<f32>,
        params: &[DeviceSamplingParams],
        vocab: usize,
        out: &mut O,
    ) -> CudaResult<Vec<Option<u32>>>
    where
        O: DevicePtr<i32> + DevicePtrMut<i32>,
    {
        self.sample_rows_f32_flags(logits, params, vocab, out, 0)
    }

    /// [`CudaContext::sample_rows_f32`] with kernel flags (`FLAG_*`, for tests).
    fn sample_rows_f32_flags<O>(
        &self,
        logits: &impl DevicePtr<f32>,
        params: &[DeviceSamplingParams],
        vocab: usize,
        out: &mut O,
        flags: i32,
    ) -> CudaResult<Vec<Option<u32>>>
    where
        O: DevicePtr<i32> + DevicePtrMut<i32>,
    {
        let rows = params.len();
        if vocab == 0 {
            return Err(crate::Error::Shape {
                what: "cuda sampling vocab (non-zero)",
                expected: 1,
                got: 0,
            }
            .into());
        }
        let total = rows.checked_mul(vocab).ok_or(CudaError::TooLarge {
            what: "rows * vocab",
            value: usize::MAX,
        })?;
        crate::check_len("cuda sampling logits", logits.len(), total)?;
        crate::check_len("cuda sampling out", out.len(), rows)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let rows_u32 = u32::try_from(rows)
            .ok()
            .filter(|&r| r <= i32::MAX as u32)
            .ok_or(CudaError::TooLarge {
                what: "rows",
                value: rows,
            })?;
        let vocab_i = to_i32("vocab", vocab)?;
        let words: Vec<u32> = params.iter().flat_map(|p| p.words()).collect();
        let dparams = self.stream.clone_htod(&words)?;

        let f = self.function(sampling_source, SAMPLE_FN)?;
        let smem = SMEM_CANDIDATES * std::mem::size_of::<u64>();
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            to_i32("sampling shared memory", smem)?,
        )?;
        let cfg = LaunchConfig {
            grid_dim: (rows_u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        {
            let (lp, _lg) = logits.device_ptr(&self.stream);
            let (op, _og) = out.device_ptr_mut(&self.stream);
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(&lp)
                .arg(&dparams)
                .arg(&op)
                .arg(&vocab_i)
                .arg(&flags);
            // SAFETY: the arguments match `sample_rows_f32(const float*, const u32*, int*, int,
            // int)` (device pointers passed as 64-bit values); logits holds rows * vocab f32,
            // dparams 8 words per row and out rows i32 (checked above), one CTA per row; the
            // block has exactly 1024 threads and 128 KiB of dynamic shared memory (the attribute
            // set above), as the kernel's reductions and candidate buffer require. The pointer
            // guards live until after the launch is queued.
            unsafe { launch.launch(cfg) }?;
        }
        let mut host = vec![0i32; rows];
        self.stream.memcpy_dtoh(out, &mut host)?;
        Ok(host.into_iter().map(|t| u32::try_from(t).ok()).collect())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::cuda::kernels::check_compiles;
    use crate::cuda::tests::ctx_or_skip;

    #[test]
    fn sampling_kernel_compiles_for_sm90() {
        check_compiles("sampling", &sampling_source());
    }

    #[test]
    fn params_pack_into_eight_words_in_field_order() {
        let p = DeviceSamplingParams {
            temperature: 0.5,
            top_k: -1,
            top_p: 0.9,
            min_p: 0.0,
            seed: 0x1122_3344_5566_7788,
            offset: 42,
        };
        assert_eq!(std::mem::size_of::<DeviceSamplingParams>(), 32);
        assert_eq!(
            p.words(),
            [
                0.5f32.to_bits(),
                u32::MAX,
                0.9f32.to_bits(),
                0,
                0x5566_7788,
                0x1122_3344,
                42,
                0
            ]
        );
    }

    /// Deterministic pseudo-random f32 in [0, 1).
    fn rng(state: &mut u64) -> f64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*state >> 11) as f64) / (1u64 << 53) as f64
    }

    /// LLM-like logits: a Gaussian-ish bulk plus a few large ones.
    fn llm_row(vocab: usize, seed: u64) -> Vec<f32> {
        let mut s = seed ^ 0x5eed;
        (0..vocab)
            .map(|_| {
                let g: f64 = (0..4).map(|_| rng(&mut s)).sum::<f64>() - 2.0;
                let spike = if rng(&mut s) < 2e-4 { 12.0 } else { 0.0 };
                (3.0 * g + spike) as f32
            })
            .collect()
    }

    fn cpu_argmax(row: &[f32]) -> Option<u32> {
        let mut best: Option<(usize, f32)> = None;
        for (i, &l) in row.iter().enumerate() {
            if l > f32::NEG_INFINITY && best.is_none_or(|(_, b)| l > b) {
                best = Some((i, l));
            }
        }
        best.map(|(i, _)| i as u32)
    }

    /// The exactly filtered and renormalized distribution, in f64: the CPU sampler's
    /// `candidates` (temperature, min-p, top-k, top-p, in that order), with this kernel's tie
    /// rule (entries equal to a cut-off value are kept). Also returns the smallest relative
    /// distance of a top-p / min-p decision to its boundary, so tests can insist on
    /// well-conditioned inputs.
    fn reference(row: &[f32], p: &DeviceSamplingParams) -> (Vec<f64>, f64) {
        let max = row
            .iter()
            .copied()
            .filter(|l| !l.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / f64::from(p.temperature);
        let mut w: Vec<f64> = row
            .iter()
            .map(|&l| {
                if l > f32::NEG_INFINITY {
                    (f64::from(l - max) * inv_t).exp()
                } else {
                    0.0
                }
            })
            .collect();
        let mut margin = f64::INFINITY;
        if p.min_p > 0.0 {
            let t = f64::from(p.min_p.min(1.0));
            for x in &mut w {
                if *x > 0.0 {
                    margin = margin.min(((*x - t) / t).abs());
                }
                if *x < t {
                    *x = 0.0;
                }
            }
        }
        let mut order: Vec<usize> = (0..row.len()).filter(|&i| w[i] > 0.0).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
        if p.top_k > 0 && (p.top_k as usize) < order.len() {
            let cut = w[order[p.top_k as usize - 1]];
            for &i in &order[p.top_k as usize..] {
                if w[i] < cut {
                    w[i] = 0.0;
                }
            }
            order.retain(|&i| w[i] > 0.0);
        }
        if p.top_p < 1.0 {
            let total: f64 = order.iter().map(|&i| w[i]).sum();
            let target = f64::from(p.top_p.max(0.0)) * total;
            let mut cum = 0.0;
            let mut cut = None;
            for &i in &order {
                let before = cum;
                cum += w[i];
                if cut.is_none() {
                    margin = margin.min((cum - target).abs() / total);
                    if before > 0.0 {
                        margin = margin.min((before - target).abs() / total);
                    }
                    if cum >= target {
                        cut = Some(w[i]);
                    }
                }
            }
            if let Some(c) = cut {
                for x in &mut w {
                    if *x < c {
                        *x = 0.0;
                    }
                }
            }
        }
        let total: f64 = w.iter().sum();
        (w.iter().map(|x| x / total).collect(), margin)
    }

    /// Whether `token` survives the filters of `p` (tie-inclusive reference).
    fn kept(row: &[f32], p: &DeviceSamplingParams, token: u32) -> bool {
        reference(row, p).0[token as usize] > 0.0
    }

    fn sample(
        cx: &CudaContext,
        logits: &[f32],
        params: &[DeviceSamplingParams],
        vocab: usize,
        flags: i32,
    ) -> Vec<Option<u32>> {
        let d = cx.stream().clone_htod(logits).unwrap();
        let mut out = cx.stream().alloc_zeros::<i32>(params.len()).unwrap();
        cx.sample_rows_f32_flags(&d, params, vocab, &mut out, flags)
            .unwrap()
    }

    fn filtered(temperature: f32, top_k: i32, top_p: f32, min_p: f32) -> DeviceSamplingParams {
        DeviceSamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: 7,
            offset: 0,
        }
    }

    #[test]
    fn greedy_matches_cpu_argmax() {
        let Some(cx) = ctx_or_skip("greedy_matches_cpu_argmax") else {
            return;
        };
        for &vocab in &[1usize, 5, 1000, 151_936] {
            let rows = 6;
            let mut logits: Vec<f32> = (0..rows)
                .flat_map(|r| llm_row(vocab, 100 + r as u64))
                .collect();
            // Row 1: a tie for the max (lowest index wins); row 2: NaN and +-inf noise.
            if vocab > 3 {
                let r1 = &mut logits[vocab..2 * vocab];
                let mx = r1.iter().copied().fold(f32::NEG_INFINITY, f32::max) + 1.0;
                r1[vocab - 1] = mx;
                r1[vocab / 2] = mx;
                let r2 = &mut logits[2 * vocab..3 * vocab];
                r2[0] = f32::NAN;
                r2[1] = f32::NEG_INFINITY;
            }
            // Row 3: nothing to sample; row 4: everything NaN but one.
            logits[3 * vocab..4 * vocab].fill(f32::NEG_INFINITY);
            logits[4 * vocab..5 * vocab].fill(f32::NAN);
            logits[4 * vocab + vocab / 3] = -5.0;
            let mut params = vec![DeviceSamplingParams::greedy(); rows];
            // Greedy ignores the filters and the seed.
            params[5] = DeviceSamplingParams {
                temperature: 0.0,
                top_k: 3,
                top_p: 0.1,
                min_p: 0.5,
                seed: 99,
                offset: 3,
            };
            let got = sample(&cx, &logits, &params, vocab, 0);
            let want: Vec<Option<u32>> = logits.chunks(vocab).map(cpu_argmax).collect();
            println!("sampling greedy vocab={vocab}: {got:?}");
            assert_eq!(got, want, "vocab {vocab}");
            assert_eq!(got[3], None);
        }
    }

    #[test]
    fn seeded_rows_are_reproducible_and_offsets_vary() {
        let Some(cx) = ctx_or_skip("seeded_rows_are_reproducible_and_offsets_vary") else {
            return;
        };
        let vocab = 32_000;
        let row = llm_row(vocab, 5);
        let base = DeviceSamplingParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
            seed: 1234,
            offset: 0,
        };
        // 64 offsets of one seed, then the same 64 again in reverse batch order.
        let params: Vec<_> = (0..64u64)
            .chain((0..64u64).rev())
            .map(|o| DeviceSamplingParams { offset: o, ..base })
            .collect();
        let logits: Vec<f32> = (0..params.len()).flat_map(|_| row.clone()).collect();
        let a = sample(&cx, &logits, &params, vocab, 0);
        let b = sample(&cx, &logits, &params, vocab, 0);
        assert_eq!(a, b, "same inputs, same tokens");
        for i in 0..64 {
            assert_eq!(a[i], a[127 - i], "offset {i} depends on its batch position");
        }
        let distinct: std::collections::HashSet<_> = a[..64].iter().collect();
        println!(
            "sampling seeded: {} distinct tokens over 64 offsets",
            distinct.len()
        );
        assert!(distinct.len() > 16, "offsets must draw differently: {a:?}");
        // Another seed gives another sequence.
        let other: Vec<_> = params
            .iter()
            .map(|p| DeviceSamplingParams { seed: 4321, ..*p })
            .collect();
        let c = sample(&cx, &logits, &other, vocab, 0);
        assert_ne!(a, c);
        for (t, p) in a.iter().zip(&params) {
            assert!(kept(&row, p, t.unwrap()));
        }
    }

    /// Logits whose temperature-1 softmax is proportional to `(i + 1.3)^-1.1`, shuffled.
    fn small_logits() -> Vec<f32> {
        let perm = [5usize, 12, 0, 9, 3, 14, 7, 1, 10, 15, 2, 8, 13, 4, 11, 6];
        let mut l = vec![0f32; 16];
        for (rank, &i) in perm.iter().enumerate() {
            l[i] = (-1.1 * (rank as f64 + 1.3).ln()) as f32 + 2.0;
        }
        l
    }

    fn combos() -> Vec<DeviceSamplingParams> {
        vec![
            filtered(1.0, 0, 1.0, 0.0),
            filtered(0.6, 0, 1.0, 0.0),
            filtered(1.7, 0, 1.0, 0.0),
            filtered(1.0, 5, 1.0, 0.0),
            filtered(0.8, 1, 1.0, 0.0),
            filtered(1.0, 0, 0.7, 0.0),
            filtered(1.3, 0, 0.9, 0.0),
            filtered(1.0, 0, 1.0, 0.14),
            filtered(2.0, 0, 1.0, 0.3),
            filtered(1.0, 10, 0.8, 0.0),
            filtered(1.2, 12, 0.9, 0.06),
            filtered(0.9, 0, 0.75, 0.1),
            filtered(1.0, 3, 0.0, 0.0),
        ]
    }

    #[test]
    fn reference_inputs_are_well_conditioned() {
        // Runs everywhere: the distribution test's boundaries are far from the decision points.
        let l = small_logits();
        for p in combos() {
            let (probs, margin) = reference(&l, &p);
            assert!(margin > 2e-3, "{p:?}: margin {margin}");
            assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        }
    }

    #[test]
    fn draws_follow_the_filtered_distribution() {
        let Some(cx) = ctx_or_skip("draws_follow_the_filtered_distribution") else {
            return;
        };
        let vocab = 16;
        let row = small_logits();
        let draws = 20_000usize;
        for p in combos() {
            let (probs, _) = reference(&row, &p);
            let params: Vec<_> = (0..draws as u64)
                .map(|o| DeviceSamplingParams { offset: o, ..p })
                .collect();
            let logits: Vec<f32> = (0..draws).flat_map(|_| row.iter().copied()).collect();
            for flags in [0, FLAG_FORCE_GLOBAL] {
                let got = sample(&cx, &logits, &params, vocab, flags);
                let mut counts = [0usize; 16];
                for t in &got {
                    counts[t.expect("a token") as usize] += 1;
                }
                let mut chi2 = 0.0;
                let mut df = 0i32;
                for (i, (&c, &q)) in counts.iter().zip(&probs).enumerate() {
                    if q == 0.0 {
                        assert_eq!(c, 0, "{p:?}: filtered token {i} sampled {c} times");
                    } else {
                        let e = q * draws as f64;
                        chi2 += (c as f64 - e).powi(2) / e;
                        df += 1;
                    }
                }
                let df = f64::from((df - 1).max(1));
                // ~p < 1e-5 for these degrees of freedom.
                let bound = df + 6.0 * (2.0 * df).sqrt() + 8.0;
                println!(
                    "sampling distribution {p:?} flags={flags}: chi2 {chi2:.1} (df {df}, bound {bound:.1})"
                );
                assert!(chi2 < bound, "{p:?} flags {flags}: chi2 {chi2} >= {bound}");
            }
        }
    }

    /// Rows that exercise every path: peaked (shared memory), flat with top-p (global search),
    /// top-k above 1024 (no bound), ties at the cut-offs, NaN / -inf entries.
    fn mixed_batch(vocab: usize) -> (Vec<f32>, Vec<DeviceSamplingParams>) {
        let mut logits = Vec::new();
        let mut params = Vec::new();
        let cases = [
            filtered(0.7, 50, 0.9, 0.0),
            filtered(1.0, 20, 1.0, 0.0),
            filtered(1.0, 0, 0.95, 0.0),
            filtered(1.0, 0, 0.5, 0.02),
            filtered(0.8, 2000, 0.99, 0.0),
            filtered(1.0, 1, 1.0, 0.0),
            filtered(1.0, 0, 1.0, 0.05),
            filtered(1.0, 0, 1.0, 0.0),
        ];
        for (r, p) in cases.iter().enumerate() {
            for flat in [false, true] {
                let mut row = llm_row(vocab, 1000 + r as u64);
                if flat {
                    for x in &mut row {
                        *x *= 0.05;
                    }
                }
                // Ties: repeat some values, sprinkle NaN / -inf.
                for j in (0..vocab).step_by(97) {
                    row[j] = row[(j * 7 + 3) % vocab];
                }
                if vocab > 10 {
                    row[1] = f32::NAN;
                    row[2] = f32::NEG_INFINITY;
                }
                logits.extend_from_slice(&row);
                for o in 0..3u64 {
                    if o > 0 {
                        logits.extend_from_slice(&row);
                    }
                    params.push(DeviceSamplingParams {
                        seed: 77 + r as u64,
                        offset: o,
                        ..*p
                    });
                }
            }
        }
        (logits, params)
    }

    #[test]
    fn every_path_picks_the_same_kept_token() {
        let Some(cx) = ctx_or_skip("every_path_picks_the_same_kept_token") else {
            return;
        };
        for &vocab in &[16usize, 1000, 151_936] {
            let (logits, params) = mixed_batch(vocab);
            let base = sample(&cx, &logits, &params, vocab, 0);
            for flags in [
                FLAG_FORCE_GLOBAL,
                FLAG_NO_BOUNDS,
                FLAG_FORCE_GLOBAL | FLAG_NO_BOUNDS,
            ] {
                let other = sample(&cx, &logits, &params, vocab, flags);
                assert_eq!(
                    base, other,
                    "vocab {vocab}: flags {flags} changed the tokens"
                );
            }
            for ((row, p), t) in logits.chunks(vocab).zip(&params).zip(&base) {
                let t = t.expect("a token");
                assert!(
                    kept(row, p, t),
                    "vocab {vocab} {p:?}: token {t} was filtered out"
                );
            }
            println!(
                "sampling paths agree on {} rows of vocab {vocab}",
                params.len()
            );
        }
    }

    #[test]
    fn edge_rows_keep_ties_and_handle_inf_and_nan() {
        let Some(cx) = ctx_or_skip("edge_rows_keep_ties_and_handle_inf_and_nan") else {
            return;
        };
        let inf = f32::INFINITY;
        let f = filtered;
        let cases: Vec<(Vec<f32>, DeviceSamplingParams, Vec<i64>)> = vec![
            // Ties at the cut-off are all kept.
            (vec![1.5; 50], f(1.0, 3, 1.0, 0.0), (0..50).collect()),
            (vec![1.5; 50], f(1.0, 0, 0.5, 0.0), (0..50).collect()),
            (
                [0.0, -0.0].repeat(10),
                f(1.0, 1, 1.0, 0.0),
                (0..20).collect(),
            ),
            // +inf logits share all the mass.
            (
                vec![1.0, inf, 3.0, inf, -2.0],
                f(1.0, 0, 1.0, 0.0),
                vec![1, 3],
            ),
            (
                vec![1.0, inf, 3.0, inf, -2.0],
                f(1.0, 1, 0.9, 0.1),
                vec![1, 3],
            ),
            (vec![0.3], f(1.0, 0, 0.9, 0.1), vec![0]),
            // min_p > 1 and top_p <= 0 keep the most likely value; NaN switches a filter off.
            (
                vec![0.1, 2.0, 1.9, -1.0, 2.0],
                f(1.0, 0, 1.0, 5.0),
                vec![1, 4],
            ),
            (
                vec![0.1, 2.0, 1.9, -1.0, 2.0],
                f(1.0, 0, -1.0, 0.0),
                vec![1, 4],
            ),
            (
                vec![0.1, 2.0, 1.9, -1.0, 2.0],
                f(1.0, -5, f32::NAN, f32::NAN),
                (0..5).collect(),
            ),
            // NaN or tiny temperature is greedy.
            (
                vec![0.1, 2.0, 1.9, -1.0, 2.0],
                f(f32::NAN, 0, 1.0, 0.0),
                vec![1],
            ),
            (
                vec![0.1, 2.0, 1.9, -1.0, 2.0],
                f(1e-6, 0, 1.0, 0.0),
                vec![1],
            ),
            (
                vec![f32::NAN, f32::NEG_INFINITY, 4.0, f32::NAN],
                f(1.0, 2, 0.9, 0.0),
                vec![2],
            ),
            (
                vec![f32::NAN, f32::NEG_INFINITY, f32::NAN],
                f(1.0, 2, 0.9, 0.0),
                vec![-1],
            ),
        ];
        for (row, p, allowed) in cases {
            let n = 200;
            let params: Vec<_> = (0..n as u64)
                .map(|o| DeviceSamplingParams { offset: o, ..p })
                .collect();
            let logits: Vec<f32> = (0..n).flat_map(|_| row.iter().copied()).collect();
            let base = sample(&cx, &logits, &params, row.len(), 0);
            let mut seen = std::collections::BTreeSet::new();
            for flags in [0, FLAG_FORCE_GLOBAL, FLAG_NO_BOUNDS] {
                let got = sample(&cx, &logits, &params, row.len(), flags);
                assert_eq!(got, base, "{row:?} {p:?}: flags {flags} changed the tokens");
                seen.extend(got.iter().map(|t| t.map_or(-1, i64::from)));
            }
            println!("sampling edge {row:?} {p:?}: drew {seen:?}");
            assert!(
                seen.iter().all(|t| allowed.contains(t)),
                "{row:?} {p:?}: {seen:?}"
            );
            if allowed.len() <= 2 {
                assert_eq!(seen.len(), allowed.len(), "{row:?} {p:?}: {seen:?}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let Some(cx) = ctx_or_skip("sampling bad_shapes_are_errors") else {
            return;
        };
        let d = cx.stream().clone_htod(&[0f32; 10]).unwrap();
        let mut out = cx.stream().alloc_zeros::<i32>(2).unwrap();
        let p = [DeviceSamplingParams::greedy(); 2];
        assert!(matches!(
            cx.sample_rows_f32(&d, &p, 4, &mut out),
            Err(CudaError::Shape(_))
        ));
        assert!(matches!(
            cx.sample_rows_f32(&d, &p[..1], 10, &mut out),
            Err(CudaError::Shape(_))
        ));
        assert_eq!(cx.sample_rows_f32(&d, &p, 5, &mut out).unwrap().len(), 2);
    }

    #[test]
    fn sampling_timing_64_rows_151936() {
        let Some(cx) = ctx_or_skip("sampling_timing_64_rows_151936") else {
            return;
        };
        let (rows, vocab) = (64usize, 151_936usize);
        let logits: Vec<f32> = (0..rows)
            .flat_map(|r| llm_row(vocab, 7000 + r as u64))
            .collect();
        let flat: Vec<f32> = logits.iter().map(|x| x * 0.05).collect();
        let d = cx.stream().clone_htod(&logits).unwrap();
        let dflat = cx.stream().clone_htod(&flat).unwrap();
        let mut out = cx.stream().alloc_zeros::<i32>(rows).unwrap();
        let cases = [
            ("greedy", DeviceSamplingParams::greedy(), false),
            ("temperature 0.8", filtered(0.8, 0, 1.0, 0.0), false),
            ("min_p 0.05", filtered(1.0, 0, 1.0, 0.05), false),
            (
                "top_k 50 top_p 0.9 T 0.7",
                filtered(0.7, 50, 0.9, 0.0),
                false,
            ),
            ("top_k 20", filtered(1.0, 20, 1.0, 0.0), false),
            ("top_p 0.95", filtered(1.0, 0, 0.95, 0.0), false),
            ("top_k 4096", filtered(1.0, 4096, 1.0, 0.0), false),
            (
                "flat top_p 0.95 (global search)",
                filtered(1.0, 0, 0.95, 0.0),
                true,
            ),
        ];
        for (name, p, use_flat) in cases {
            let params: Vec<_> = (0..rows as u64)
                .map(|o| DeviceSamplingParams { offset: o, ..p })
                .collect();
            let src = if use_flat { &dflat } else { &d };
            cx.sample_rows_f32(src, &params, vocab, &mut out).unwrap();
            let iters = 20;
            let t = std::time::Instant::now();
            for _ in 0..iters {
                cx.sample_rows_f32(src, &params, vocab, &mut out).unwrap();
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
            println!(
                "sampling {rows}x{vocab} {name}: {us:.0} us per call (upload + kernel + sync)"
            );
        }
    }
}
