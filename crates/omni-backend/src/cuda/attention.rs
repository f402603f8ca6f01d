//! Paged attention on the GPU: the CUDA twins of [`crate::attention::reshape_and_cache`] and
//! [`crate::attention::paged_attention`] (bf16 in and out, f32 math), with the same semantics:
//! a flat batch split by `query_start_loc`, `seq_lens` counting the new tokens, causal masking
//! inside a chunk, query head `h` reading KV head `h / (num_heads / num_kv_heads)`, and the cache
//! laid out `[num_blocks, block_size, num_kv_heads, head_dim]`.
//!
//! Two paths, picked from the host scalars in [`AttnShape`] only:
//!
//! * **decode** (`max_query_len == 1`): flash-decoding. The grid is (KV head x group-of-query-heads
//!   chunk, sequence, KV partition); one CTA reads a partition of one sequence's K/V once with
//!   16-byte loads and serves every query head of the GQA group from it. With more than one
//!   partition a second kernel merges the partial results (vLLM's `paged_attention_v2`); the
//!   partials live in a caller-provided f32 workspace
//!   ([`paged_attention_workspace_len`]).
//! * **prefill / mixed** (`max_query_len > 1`): flash-attention 2 on tensor cores
//!   (`mma.sync.m16n8k16` bf16 with `ldmatrix`, f32 accumulation, online softmax), K/V tiles
//!   gathered from the paged cache through the block table with `cp.async`. Decode rows of a
//!   mixed batch go through it too.
//!
//! The launch grid depends only on host scalars; every per-sequence value (query range, context
//! length, blocks) is read on the device and CTAs with nothing to do exit at once. So
//! `max_query_len` / `max_seq_len` may be upper bounds, and a decode step can be captured in a
//! CUDA graph with bounds and replayed with other lengths. Neither call allocates, synchronizes
//! or reads device memory on the host.
//!
//! Device-side metadata is trusted for the computed values but clamped for memory safety: block
//! ids are clamped into the cache, block-table indices into the row, token indices into
//! `num_tokens`; slots outside the cache are skipped by [`CudaContext::reshape_and_cache_bf16`].

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{CudaContext, CudaError, CudaResult, bf16, kernels, to_i32, to_i64};

/// Host-side scalars of one [`CudaContext::paged_attention_bf16`] call.
///
/// `max_query_len` and `max_seq_len` may be upper bounds of the real per-sequence values (the
/// grid is sized from them; the kernels read the real lengths from device memory). Every
/// sequence must satisfy `query_len <= max_query_len` and `seq_len <= max_seq_len`.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Number of sequences (`seq_lens` entries; `query_start_loc` has one more).
    pub num_seqs: usize,
    /// Number of query tokens in the flat batch (rows of `q` and `out`).
    pub num_tokens: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads (divides `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per head: 16, 32, 64, 128 or 256.
    pub head_dim: usize,
    /// Tokens per cache block (any value >= 1).
    pub block_size: usize,
    /// Row stride of `block_tables` (entries per sequence).
    pub max_blocks_per_seq: usize,
    /// Largest query length of any sequence (or an upper bound); 1 selects the decode path.
    pub max_query_len: usize,
    /// Largest context length of any sequence (or an upper bound).
    pub max_seq_len: usize,
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// Head dimensions the kernels are built for.
pub const SUPPORTED_HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];

/// Largest decode partition (tokens per CTA); sizes the kernel's shared memory.
const MAX_PARTITION: usize = 512;
/// Query heads of one GQA group served by one decode CTA, by template instance.
const GROUP_TILES: [usize; 4] = [1, 2, 4, 8];
/// Threads of a decode CTA (the kernel assumes 4 warps).
const DECODE_THREADS: u32 = 128;
/// Threads of the decode reduce kernel.
const REDUCE_THREADS: u32 = 128;
/// Decode CTAs below which partitions are halved (down to 64 tokens) for parallelism.
const DECODE_MIN_CTAS: usize = 1600;

/// Tokens per decode partition for `shape`: 512, halved while the grid would have fewer than
/// [`DECODE_MIN_CTAS`] CTAs (down to 64). A pure function of the host scalars.
fn decode_partition(shape: &AttnShape) -> usize {
    let (_, chunks) = group_tiling(shape);
    let ctas_per_part = shape.num_kv_heads * chunks * shape.num_seqs;
    let mut part = MAX_PARTITION;
    while part > 64 && ctas_per_part * shape.max_seq_len.div_ceil(part) < DECODE_MIN_CTAS {
        part /= 2;
    }
    part
}

/// Decode partitions (grid z) for `shape`.
fn decode_parts(shape: &AttnShape) -> usize {
    shape.max_seq_len.div_ceil(decode_partition(shape)).max(1)
}

/// (query heads per decode CTA, CTAs per KV head) for the GQA group size of `shape`.
fn group_tiling(shape: &AttnShape) -> (usize, usize) {
    let group = shape
        .num_heads
        .checked_div(shape.num_kv_heads)
        .unwrap_or(1)
        .max(1);
    let tile = GROUP_TILES
        .iter()
        .copied()
        .find(|&t| t >= group)
        .unwrap_or(GROUP_TILES[GROUP_TILES.len() - 1]);
    (tile, group.div_ceil(tile))
}

/// The f32 workspace [`CudaContext::paged_attention_bf16`] needs for `shape`, in elements: 0 on
/// the prefill path and for single-partition decodes, else room for every (sequence, head,
/// partition)'s partial output, max and sum. A pure function of the host scalars, so a buffer
/// sized for upper bounds serves every smaller step.
pub fn paged_attention_workspace_len(shape: &AttnShape) -> usize {
    if shape.max_query_len != 1 {
        return 0;
    }
    let parts = decode_parts(shape);
    if parts <= 1 {
        return 0;
    }
    shape.num_seqs * shape.num_heads * parts * (shape.head_dim + 2)
}

/// Prefill kernel tiling for `head_dim`: (warps, keys per tile, Q held in registers).
fn prefill_cfg(head_dim: usize) -> (usize, usize, bool) {
    if head_dim <= 128 {
        (4, 64, true)
    } else {
        (2, 32, false)
    }
}

/// Kernel entry points of the source built for one head dimension.
struct HdKernels {
    source: fn() -> String,
    decode: [&'static str; 4],
    prefill: &'static str,
}

macro_rules! hd_kernels {
    ($hd:literal, $src:ident) => {
        HdKernels {
            source: $src,
            decode: [
                concat!("attn_decode_hd", $hd, "_g1"),
                concat!("attn_decode_hd", $hd, "_g2"),
                concat!("attn_decode_hd", $hd, "_g4"),
                concat!("attn_decode_hd", $hd, "_g8"),
            ],
            prefill: concat!("attn_prefill_hd", $hd),
        }
    };
}

fn attn_source_hd16() -> String {
    attn_source(16)
}
fn attn_source_hd32() -> String {
    attn_source(32)
}
fn attn_source_hd64() -> String {
    attn_source(64)
}
fn attn_source_hd128() -> String {
    attn_source(128)
}
fn attn_source_hd256() -> String {
    attn_source(256)
}

/// The kernels for `head_dim`, or a metadata error naming the supported sizes.
fn hd_kernels(head_dim: usize) -> CudaResult<HdKernels> {
    Ok(match head_dim {
        16 => hd_kernels!(16, attn_source_hd16),
        32 => hd_kernels!(32, attn_source_hd32),
        64 => hd_kernels!(64, attn_source_hd64),
        128 => hd_kernels!(128, attn_source_hd128),
        256 => hd_kernels!(256, attn_source_hd256),
        _ => {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: head_dim {head_dim} is not supported (one of {SUPPORTED_HEAD_DIMS:?})"
            ))
            .into());
        }
    })
}

const RESHAPE_FN: &str = "attn_reshape_and_cache_bf16";
const REDUCE_FN: &str = "attn_decode_reduce";

/// Device helpers shared by the attention sources (after [`kernels::BF16_HELPERS`]).
const ATTN_COMMON: &str = r#"
typedef unsigned short u16;
typedef unsigned int u32;
#define ATTN_NEG_INF __int_as_float(0xff800000)
#define ATTN_MAXPART 512

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
"#;

/// Flash-decoding kernel template (one query token per sequence).
const DECODE_TEMPLATE: &str = r#"
// One CTA: KV head `blockIdx.x / head_chunks`, query heads `g0 .. g0 + GM` of its group,
// sequence `blockIdx.y`, context partition `blockIdx.z` (`part_size` tokens). 4 warps; a token's
// K/V head row (HD bf16) is read by L = HD / 8 lanes with one 16-byte load each.
// Phase 1: scores (log2 domain) into shared memory; phase 2: softmax numerators; phase 3: P V.
// With one partition the CTA writes `out` directly, else normalized partials + (max, sum) to ws.
template <int HD, int GM>
__device__ __forceinline__ void attn_decode(
    const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    u16* __restrict__ out, const int* __restrict__ qsl, const int* __restrict__ seq_lens,
    const int* __restrict__ bt, float* __restrict__ ws, int num_tokens, int num_heads, int nkv,
    int bs, int num_blocks, int mbps, int part_size, int max_parts, int head_chunks,
    float scale_log2)
{
    // U: tokens per lane per iteration (U independent 16-byte loads in flight per lane).
    constexpr int NW = 4, NT = 128, L = HD / 8, TPW = 32 / L, TPS = NW * TPW, U = GM >= 8 ? 4 : 8;
    constexpr int SMF = (GM * ATTN_MAXPART > NW * GM * HD) ? GM * ATTN_MAXPART : NW * GM * HD;
    __shared__ __align__(16) float sm[SMF];
    __shared__ int sslot[ATTN_MAXPART];
    __shared__ float red_m[NW][GM];
    __shared__ float red_l[NW][GM];

    const int s = blockIdx.y, part = blockIdx.z;
    const int kvh = blockIdx.x / head_chunks;
    const int g0 = (blockIdx.x - kvh * head_chunks) * GM;
    const int G = num_heads / nkv;
    const int qs = qsl[s];
    if (qsl[s + 1] - qs != 1 || qs < 0 || qs >= num_tokens) return;
    const int seq_len = seq_lens[s];
    const int start = part * part_size;
    if (start >= seq_len) return;
    const int n = min(part_size, seq_len - start);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tg = lane / L, lig = lane - tg * L;
    const int hbase = kvh * G + g0;
    const int* btab = bt + (size_t)s * mbps;
    const size_t head_off = (size_t)kvh * HD + lig * 8;
    const size_t tok_stride = (size_t)nkv * HD;

    float qr[GM][8];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        if (g0 + g < G) {
            const uint4 u = *reinterpret_cast<const uint4*>(
                q + ((size_t)qs * num_heads + hbase + g) * HD + lig * 8);
            unpack8(u, qr[g]);
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qr[g][e] = 0.f;
        }
    }

    // Phase 1: scores. The loop bound is warp-uniform (shuffles below need the full warp).
    float mx[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) mx[g] = ATTN_NEG_INF;
    for (int it = warp * TPW; it < n; it += TPS * U) {
        uint4 kv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            kv[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i < n) {
                const int slot = kv_slot(btab, start + i, bs, mbps, num_blocks);
                if (lig == 0) sslot[i] = slot;
                kv[u] = __ldg(reinterpret_cast<const uint4*>(kc + (size_t)slot * tok_stride + head_off));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            float kf[8];
            unpack8(kv[u], kf);
            float d[GM];
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                d[g] = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d[g] = fmaf(qr[g][e], kf[e], d[g]);
            }
#pragma unroll
            for (int o = L / 2; o > 0; o >>= 1) {
#pragma unroll
                for (int g = 0; g < GM; ++g) d[g] += __shfl_xor_sync(0xffffffffu, d[g], o);
            }
            if (i < n) {
#pragma unroll
                for (int g = 0; g < GM; ++g) mx[g] = fmaxf(mx[g], d[g]);
                if (lig == 0) {
#pragma unroll
                    for (int g = 0; g < GM; ++g) sm[g * ATTN_MAXPART + i] = d[g];
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], o));
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GM; ++g) red_m[warp][g] = mx[g];
    }
    __syncthreads();

    // Phase 2: exp2(score - max) in place, partial sums.
    float gmx[GM], ls[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        float v = red_m[0][g];
#pragma unroll
        for (int w = 1; w < NW; ++w) v = fmaxf(v, red_m[w][g]);
        gmx[g] = v;
        ls[g] = 0.f;
    }
    for (int i = tid; i < n; i += NT) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
            const float e = exp2f(sm[g * ATTN_MAXPART + i] - gmx[g]);
            sm[g * ATTN_MAXPART + i] = e;
            ls[g] += e;
        }
    }
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ls[g] += __shfl_xor_sync(0xffffffffu, ls[g], o);
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GM; ++g) red_l[warp][g] = ls[g];
    }
    __syncthreads();

    // Phase 3: P V with the slots cached in phase 1.
    float acc[GM][8];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }
    for (int it = warp * TPW; it < n; it += TPS * U) {
        uint4 vv[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            vv[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i < n) {
                vv[u] = __ldg(reinterpret_cast<const uint4*>(vc + (size_t)sslot[i] * tok_stride + head_off));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = it + u * TPS + tg;
            if (i < n) {
                float vf[8];
                unpack8(vv[u], vf);
#pragma unroll
                for (int g = 0; g < GM; ++g) {
                    const float p = sm[g * ATTN_MAXPART + i];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
                }
            }
        }
    }
    // Sum the token groups of a warp (lanes lig, lig + L, ...), then the warps via smem.
#pragma unroll
    for (int o = L; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
        }
    }
    __syncthreads();
    if (tg == 0) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sm[(warp * GM + g) * HD + lig * 8 + e] = acc[g][e];
        }
    }
    __syncthreads();
    const size_t nrows = (size_t)gridDim.y * num_heads * max_parts;
    for (int idx = tid; idx < GM * HD; idx += NT) {
        const int g = idx / HD, d = idx - g * HD;
        if (g0 + g >= G) continue;
        float o = 0.f, m = red_m[0][g], l = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            o += sm[(w * GM + g) * HD + d];
            m = fmaxf(m, red_m[w][g]);
            l += red_l[w][g];
        }
        const int h = hbase + g;
        if (max_parts == 1) {
            out[((size_t)qs * num_heads + h) * HD + d] = f2bf(o / l);
        } else {
            const size_t row = ((size_t)s * num_heads + h) * max_parts + part;
            ws[row * HD + d] = o / l;
            if (d == 0) {
                ws[nrows * HD + row] = m;
                ws[nrows * HD + nrows + row] = l;
            }
        }
    }
}
"#;

/// Flash-attention 2 prefill kernel template (tensor cores).
const PREFILL_TEMPLATE: &str = r#"
__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void ldsm_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// c += a (16x16, row) * b (16x8, col), bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Physical 16-byte chunk of logical chunk `ch` in row `r` of a [rows][C chunks] tile: XOR
// swizzle (conflict-free ldmatrix) when a row spans at least 128 bytes.
template <int C>
__device__ __forceinline__ int swz(int r, int ch) {
    return C >= 8 ? (ch ^ (r & 7)) : ch;
}

// One CTA: query rows q0 .. q0 + BM of sequence blockIdx.z (tiles in reverse order: the longest
// causal tiles start first), query head blockIdx.y. Warp w owns rows 16w .. 16w + 16.
// Loop over key tiles of BN: S = Q K^T (mma), causal/length mask, online softmax in the log2
// domain, O += P V (P rounded to bf16 in registers). K tile j+1 loads during P V of tile j, V
// tile j during S of tile j.
template <int HD, int NWARPS, int BN, bool QREG>
__device__ __forceinline__ void attn_prefill(
    const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    u16* __restrict__ out, const int* __restrict__ qsl, const int* __restrict__ seq_lens,
    const int* __restrict__ bt, int num_tokens, int num_heads, int nkv, int bs, int num_blocks,
    int mbps, float scale_log2)
{
    constexpr int BM = 16 * NWARPS, NT = 32 * NWARPS, C = HD / 8;
    constexpr int QPT = BM * C / NT, KPT = BN * C / NT, RSTEP = NT / C;
    static_assert(NT % C == 0 && (BM * C) % NT == 0 && (BN * C) % NT == 0, "tile shape");
    static_assert(BN % 16 == 0 && HD % 16 == 0, "mma shape");
    __shared__ __align__(128) u16 sQ[BM * HD];
    __shared__ __align__(128) u16 sK[BN * HD];
    __shared__ __align__(128) u16 sV[BN * HD];

    const int s = blockIdx.z, h = blockIdx.y;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int qs = qsl[s], qlen = qsl[s + 1] - qs;
    const int q0 = qt * BM;
    if (q0 >= qlen) return;
    const int seq_len = seq_lens[s];
    const int ctx0 = seq_len - qlen;
    const int kvh = h / (num_heads / nkv);
    const int kv_end = min(seq_len, ctx0 + min(q0 + BM, qlen));
    const int n_tiles = kv_end > 0 ? (kv_end + BN - 1) / BN : 0;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ch = tid % C, r0 = tid / C;
    const int* btab = bt + (size_t)s * mbps;
    const size_t tok_stride = (size_t)nkv * HD;
    const size_t head_off = (size_t)kvh * HD + ch * 8;

    // Q tile (rows past the chunk or the batch are zero-filled).
#pragma unroll
    for (int k = 0; k < QPT; ++k) {
        const int r = r0 + k * RSTEP;
        const int tok = qs + q0 + r;
        const bool ok = (q0 + r < qlen) && tok >= 0 && tok < num_tokens;
        const u16* src = ok ? q + ((size_t)tok * num_heads + h) * HD + ch * 8 : q;
        cp_async16(smem_u32(sQ + r * HD + swz<C>(r, ch) * 8), src, ok ? 16 : 0);
    }
    int slot[KPT];
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
        const int key = r0 + k * RSTEP;
        slot[k] = key < kv_end ? kv_slot(btab, key, bs, mbps, num_blocks) : -1;
        const u16* src = slot[k] >= 0 ? kc + (size_t)slot[k] * tok_stride + head_off : kc;
        cp_async16(smem_u32(sK + key * HD + swz<C>(key, ch) * 8), src, slot[k] >= 0 ? 16 : 0);
    }
    cp_async_commit();

    const int g = lane >> 2, c = lane & 3;
    const int lrow = lane & 7, lsel1 = (lane >> 3) & 1, lsel2 = lane >> 4;
    const int pos_a = ctx0 + q0 + warp * 16 + g, pos_b = pos_a + 8;
    u32 qf[QREG ? HD / 16 : 1][4];
    float o[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
        o[dt][0] = 0.f; o[dt][1] = 0.f; o[dt][2] = 0.f; o[dt][3] = 0.f;
    }
    float m_run[2] = {ATTN_NEG_INF, ATTN_NEG_INF}, l_run[2] = {0.f, 0.f};

    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait_all();
        __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1}
        if (QREG && j == 0) {
#pragma unroll
            for (int kk = 0; kk < (QREG ? HD / 16 : 1); ++kk) {
                const int r = warp * 16 + lrow + 8 * lsel1, cq = 2 * kk + lsel2;
                ldsm_x4(smem_u32(sQ + r * HD + swz<C>(r, cq) * 8), qf[kk]);
            }
        }
#pragma unroll
        for (int k = 0; k < KPT; ++k) {
            const int r = r0 + k * RSTEP;
            const u16* src = slot[k] >= 0 ? vc + (size_t)slot[k] * tok_stride + head_off : vc;
            cp_async16(smem_u32(sV + r * HD + swz<C>(r, ch) * 8), src, slot[k] >= 0 ? 16 : 0);
        }
        cp_async_commit();

        float sacc[BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            sacc[nt][0] = 0.f; sacc[nt][1] = 0.f; sacc[nt][2] = 0.f; sacc[nt][3] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 a[4];
            if (QREG) {
                a[0] = qf[QREG ? kk : 0][0]; a[1] = qf[QREG ? kk : 0][1];
                a[2] = qf[QREG ? kk : 0][2]; a[3] = qf[QREG ? kk : 0][3];
            } else {
                const int r = warp * 16 + lrow + 8 * lsel1, cq = 2 * kk + lsel2;
                ldsm_x4(smem_u32(sQ + r * HD + swz<C>(r, cq) * 8), a);
            }
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                const int r = nn * 16 + lrow + 8 * lsel2, ck = 2 * kk + lsel1;
                u32 b[4];
                ldsm_x4(smem_u32(sK + r * HD + swz<C>(r, ck) * 8), b);
                mma_bf16(sacc[2 * nn], a, b[0], b[1]);
                mma_bf16(sacc[2 * nn + 1], a, b[2], b[3]);
            }
        }

        // Scale into the log2 domain; mask keys past the row's position or the context.
        const int kbase = j * BN;
        const bool need_mask = (kbase + BN - 1 > ctx0 + q0) || (kbase + BN > kv_end);
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = sacc[nt][e] * scale_log2;
                if (need_mask) {
                    const int key = kbase + nt * 8 + 2 * c + (e & 1);
                    const int pos = e < 2 ? pos_a : pos_b;
                    if (key > pos || key >= kv_end) v = ATTN_NEG_INF;
                }
                sacc[nt][e] = v;
            }
        }
        // Online softmax; a row lives in the 4 lanes of a quad.
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            float tmax = ATTN_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
                tmax = fmaxf(tmax, fmaxf(sacc[nt][2 * rh], sacc[nt][2 * rh + 1]));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
            const float m_new = fmaxf(m_run[rh], tmax);
            const float m_base = m_new == ATTN_NEG_INF ? 0.f : m_new;
            const float alpha = exp2f(m_run[rh] - m_base);
            m_run[rh] = m_new;
            float rs = 0.f;
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                const float p0 = exp2f(sacc[nt][2 * rh] - m_base);
                const float p1 = exp2f(sacc[nt][2 * rh + 1] - m_base);
                sacc[nt][2 * rh] = p0;
                sacc[nt][2 * rh + 1] = p1;
                rs += p0 + p1;
            }
            l_run[rh] = l_run[rh] * alpha + rs;
#pragma unroll
            for (int dt = 0; dt < HD / 8; ++dt) {
                o[dt][2 * rh] *= alpha;
                o[dt][2 * rh + 1] *= alpha;
            }
        }

        cp_async_wait_all();
        __syncthreads();  // V_j landed; every warp is done with K_j
        if (j + 1 < n_tiles) {
#pragma unroll
            for (int k = 0; k < KPT; ++k) {
                const int r = r0 + k * RSTEP;
                const int key = (j + 1) * BN + r;
                slot[k] = key < kv_end ? kv_slot(btab, key, bs, mbps, num_blocks) : -1;
                const u16* src = slot[k] >= 0 ? kc + (size_t)slot[k] * tok_stride + head_off : kc;
                cp_async16(smem_u32(sK + r * HD + swz<C>(r, ch) * 8), src, slot[k] >= 0 ? 16 : 0);
            }
            cp_async_commit();
        }

#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[4];
            a[0] = pack_bf16x2(sacc[2 * kk][0], sacc[2 * kk][1]);
            a[1] = pack_bf16x2(sacc[2 * kk][2], sacc[2 * kk][3]);
            a[2] = pack_bf16x2(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
            a[3] = pack_bf16x2(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
#pragma unroll
            for (int dd = 0; dd < HD / 16; ++dd) {
                const int r = kk * 16 + lrow + 8 * lsel1, cv = 2 * dd + lsel2;
                u32 b[4];
                ldsm_x4_t(smem_u32(sV + r * HD + swz<C>(r, cv) * 8), b);
                mma_bf16(o[2 * dd], a, b[0], b[1]);
                mma_bf16(o[2 * dd + 1], a, b[2], b[3]);
            }
        }
    }
    cp_async_wait_all();

#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        float l = l_run[rh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = q0 + warp * 16 + g + 8 * rh;
        const int tok = qs + row;
        if (row < qlen && tok >= 0 && tok < num_tokens) {
            u16* dst = out + ((size_t)tok * num_heads + h) * HD + 2 * c;
#pragma unroll
            for (int dt = 0; dt < HD / 8; ++dt) {
                *reinterpret_cast<u32*>(dst + dt * 8) =
                    pack_bf16x2(o[dt][2 * rh] * inv, o[dt][2 * rh + 1] * inv);
            }
        }
    }
}
"#;

/// Decode partial merge and the cache write.
const MISC_BODY: &str = r#"
// One CTA per (head, sequence): merges the partitions' normalized partials with weights
// sum_p * exp2(max_p - max) (log2 domain, as written by attn_decode).
extern "C" __global__ void __launch_bounds__(128) attn_decode_reduce(
    const float* __restrict__ ws, u16* __restrict__ out, const int* __restrict__ qsl,
    const int* __restrict__ seq_lens, int num_tokens, int num_heads, int hd, int part_size,
    int max_parts)
{
    const int s = blockIdx.y, h = blockIdx.x;
    const int qs = qsl[s];
    if (qsl[s + 1] - qs != 1 || qs < 0 || qs >= num_tokens) return;
    const int seq_len = seq_lens[s];
    const int np = seq_len > 0 ? min((seq_len + part_size - 1) / part_size, max_parts) : 0;
    const size_t nrows = (size_t)gridDim.y * num_heads * max_parts;
    const size_t row0 = ((size_t)s * num_heads + h) * max_parts;
    const float* wm = ws + nrows * hd + row0;
    const float* wl = ws + nrows * hd + nrows + row0;
    float mx = ATTN_NEG_INF;
    for (int p = 0; p < np; ++p) mx = fmaxf(mx, wm[p]);
    float den = 0.f;
    for (int p = 0; p < np; ++p) den += wl[p] * exp2f(wm[p] - mx);
    const float inv = den > 0.f ? 1.f / den : 0.f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < np; ++p) acc += wl[p] * exp2f(wm[p] - mx) * ws[(row0 + p) * hd + d];
        out[((size_t)qs * num_heads + h) * hd + d] = f2bf(acc * inv);
    }
}

// One CTA per new token: copies its K and V rows (row_vecs 16-byte vectors) to cache slot
// slots[t]; negative or out-of-cache slots are skipped.
extern "C" __global__ void attn_reshape_and_cache_bf16(
    const uint4* __restrict__ k, const uint4* __restrict__ v, uint4* __restrict__ kc,
    uint4* __restrict__ vc, const long long* __restrict__ slots, int row_vecs, long long num_slots)
{
    const long long slot = slots[blockIdx.x];
    if (slot < 0 || slot >= num_slots) return;
    const size_t src = (size_t)blockIdx.x * row_vecs, dst = (size_t)slot * row_vecs;
    for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
        kc[dst + i] = k[src + i];
        vc[dst + i] = v[src + i];
    }
}
"#;

/// The decode and prefill kernels for one head dimension (entry points named as in
/// [`hd_kernels`]).
fn attn_source(hd: usize) -> String {
    let mut src = format!(
        "{}{ATTN_COMMON}{DECODE_TEMPLATE}{PREFILL_TEMPLATE}",
        kernels::BF16_HELPERS
    );
    let decode_args = "const u16* q, const u16* kc, const u16* vc, u16* out, const int* qsl, \
        const int* seq_lens, const int* bt, float* ws, int num_tokens, int num_heads, int nkv, \
        int bs, int num_blocks, int mbps, int part_size, int max_parts, int head_chunks, \
        float scale_log2";
    let decode_call = "q, kc, vc, out, qsl, seq_lens, bt, ws, num_tokens, num_heads, nkv, bs, \
        num_blocks, mbps, part_size, max_parts, head_chunks, scale_log2";
    for gm in GROUP_TILES {
        src.push_str(&format!(
            "extern \"C\" __global__ void __launch_bounds__({DECODE_THREADS}) \
             attn_decode_hd{hd}_g{gm}({decode_args}) {{ attn_decode<{hd}, {gm}>({decode_call}); }}\n"
        ));
    }
    let (warps, bn, qreg) = prefill_cfg(hd);
    let threads = 32 * warps;
    src.push_str(&format!(
        "extern \"C\" __global__ void __launch_bounds__({threads}) attn_prefill_hd{hd}(\
         const u16* q, const u16* kc, const u16* vc, u16* out, const int* qsl, \
         const int* seq_lens, const int* bt, int num_tokens, int num_heads, int nkv, int bs, \
         int num_blocks, int mbps, float scale_log2) {{ \
         attn_prefill<{hd}, {warps}, {bn}, {qreg}>(q, kc, vc, out, qsl, seq_lens, bt, \
         num_tokens, num_heads, nkv, bs, num_blocks, mbps, scale_log2); }}\n"
    ));
    src
}

/// The decode reduce and reshape-and-cache kernels.
fn attn_misc_source() -> String {
    format!("{}{ATTN_COMMON}{MISC_BODY}", kernels::BF16_HELPERS)
}

fn at_least(what: &'static str, got: usize, need: usize) -> CudaResult<()> {
    if got < need {
        return Err(crate::Error::Shape {
            what,
            expected: need,
            got,
        }
        .into());
    }
    Ok(())
}

fn aligned16(what: &str, ptr: u64) -> CudaResult<()> {
    if !ptr.is_multiple_of(16) {
        return Err(crate::Error::Metadata(format!(
            "cuda {what}: device pointer {ptr:#x} is not 16-byte aligned (views must start at a multiple of 8 bf16 elements)"
        ))
        .into());
    }
    Ok(())
}

fn to_u32(what: &'static str, value: usize) -> CudaResult<u32> {
    u32::try_from(value).map_err(|_| CudaError::TooLarge { what, value })
}

/// Grid y/z dimensions are limited to 65535.
fn grid_yz(what: &'static str, value: usize) -> CudaResult<u32> {
    if value > 65_535 {
        return Err(CudaError::TooLarge { what, value });
    }
    to_u32(what, value)
}

impl CudaContext {
    /// Writes new tokens' `k` and `v` (`[num_tokens, num_kv_heads, head_dim]` bf16) into the
    /// caches (`[num_blocks, block_size, num_kv_heads, head_dim]`, any block size) at
    /// `slot_mapping[t]` (`[num_tokens]` i64, `block * block_size + offset`): the GPU twin of
    /// [`crate::attention::reshape_and_cache`]. Negative slots (padding) are skipped, and so are
    /// slots past the cache (which the CPU version reports; here that would need a host sync).
    ///
    /// Buffers may be longer than needed (sized for a maximum); all bf16 buffers must start
    /// 16-byte aligned and `num_kv_heads * head_dim` must be a multiple of 8.
    #[allow(clippy::too_many_arguments)]
    pub fn reshape_and_cache_bf16(
        &self,
        k: &impl DevicePtr<bf16>,
        v: &impl DevicePtr<bf16>,
        k_cache: &mut impl DevicePtrMut<bf16>,
        v_cache: &mut impl DevicePtrMut<bf16>,
        slot_mapping: &impl DevicePtr<i64>,
        num_tokens: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> CudaResult<()> {
        let row = num_kv_heads * head_dim;
        if row == 0 || !row.is_multiple_of(8) {
            return Err(crate::Error::Metadata(format!(
                "cuda reshape_and_cache: num_kv_heads * head_dim = {row} must be a positive multiple of 8"
            ))
            .into());
        }
        at_least("cuda reshape_and_cache keys", k.len(), num_tokens * row)?;
        at_least("cuda reshape_and_cache values", v.len(), num_tokens * row)?;
        at_least(
            "cuda reshape_and_cache slot_mapping",
            slot_mapping.len(),
            num_tokens,
        )?;
        crate::check_len(
            "cuda reshape_and_cache value cache (same as key cache)",
            v_cache.len(),
            k_cache.len(),
        )?;
        if !k_cache.len().is_multiple_of(row) {
            return Err(crate::Error::Shape {
                what: "cuda reshape_and_cache cache (multiple of num_kv_heads * head_dim)",
                expected: row,
                got: k_cache.len(),
            }
            .into());
        }
        if num_tokens == 0 {
            return Ok(());
        }
        let num_slots = to_i64("cache slots", k_cache.len() / row)?;
        let row_vecs = to_i32("num_kv_heads * head_dim / 8", row / 8)?;
        let grid = to_u32("num_tokens", num_tokens)?;
        let f = self.function(attn_misc_source, RESHAPE_FN)?;
        let (kp, _gk) = k.device_ptr(&self.stream);
        let (vp, _gv) = v.device_ptr(&self.stream);
        let (sp, _gs) = slot_mapping.device_ptr(&self.stream);
        let (kcp, _gkc) = k_cache.device_ptr_mut(&self.stream);
        let (vcp, _gvc) = v_cache.device_ptr_mut(&self.stream);
        for (what, p) in [
            ("reshape_and_cache keys", kp),
            ("reshape_and_cache values", vp),
            ("reshape_and_cache key cache", kcp),
            ("reshape_and_cache value cache", vcp),
        ] {
            aligned16(what, p)?;
        }
        let threads = (row / 8).div_ceil(32).clamp(1, 8) as u32 * 32;
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&f);
        launch
            .arg(&kp)
            .arg(&vp)
            .arg(&kcp)
            .arg(&vcp)
            .arg(&sp)
            .arg(&row_vecs)
            .arg(&num_slots);
        // SAFETY: the arguments match `attn_reshape_and_cache_bf16(const uint4*, const uint4*,
        // uint4*, uint4*, const long long*, int, long long)`; the pointers are live device
        // buffers of this context, 16-byte aligned (checked), k/v hold num_tokens rows of
        // row_vecs vectors and slot_mapping num_tokens entries (one CTA per token); the caches
        // hold num_slots rows and the kernel skips slots outside 0..num_slots.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Paged attention of `q` (`[num_tokens, num_heads, head_dim]` bf16) over the caches
    /// (`[num_blocks, block_size, num_kv_heads, head_dim]`) into `out` (same shape as `q`): the
    /// GPU twin of [`crate::attention::paged_attention`], f32 math.
    ///
    /// Metadata lives on the device: `query_start_loc` (`[num_seqs + 1]` i32), `seq_lens`
    /// (`[num_seqs]` i32, context length including the new tokens) and `block_tables`
    /// (`[num_seqs, max_blocks_per_seq]` i32). Host scalars come in `shape`; the decode path runs
    /// when `shape.max_query_len == 1` (then every sequence has 0 or 1 query tokens), else the
    /// tensor-core prefill path. `workspace` must hold [`paged_attention_workspace_len`] f32
    /// (any buffer when that is 0).
    ///
    /// Launch-only: no allocation, no synchronization and no host reads of device memory, so it
    /// can be captured in a CUDA graph (the kernels must have been loaded by an earlier call).
    /// Buffers may be longer than `shape` needs; `q`, `out` and the caches must start 16-byte
    /// aligned. Rows of `out` that belong to no sequence are left untouched.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_bf16(
        &self,
        q: &impl DevicePtr<bf16>,
        k_cache: &impl DevicePtr<bf16>,
        v_cache: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        query_start_loc: &impl DevicePtr<i32>,
        seq_lens: &impl DevicePtr<i32>,
        block_tables: &impl DevicePtr<i32>,
        workspace: &mut impl DevicePtrMut<f32>,
        shape: &AttnShape,
    ) -> CudaResult<()> {
        let sh = *shape;
        let kernels = hd_kernels(sh.head_dim)?;
        if sh.num_kv_heads == 0 || !sh.num_heads.is_multiple_of(sh.num_kv_heads) {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: {} query heads over {} KV heads",
                sh.num_heads, sh.num_kv_heads
            ))
            .into());
        }
        if sh.block_size == 0 || sh.max_blocks_per_seq == 0 {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: block_size {} and max_blocks_per_seq {} must be positive",
                sh.block_size, sh.max_blocks_per_seq
            ))
            .into());
        }
        if !sh.scale.is_finite() {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: softmax scale {} is not finite",
                sh.scale
            ))
            .into());
        }
        let q_len = sh.num_tokens * sh.num_heads * sh.head_dim;
        at_least("cuda paged attention query", q.len(), q_len)?;
        at_least("cuda paged attention out", out.len(), q_len)?;
        at_least(
            "cuda paged attention query_start_loc",
            query_start_loc.len(),
            sh.num_seqs + 1,
        )?;
        at_least("cuda paged attention seq_lens", seq_lens.len(), sh.num_seqs)?;
        at_least(
            "cuda paged attention block_tables",
            block_tables.len(),
            sh.num_seqs * sh.max_blocks_per_seq,
        )?;
        let block_elems = sh.block_size * sh.num_kv_heads * sh.head_dim;
        crate::check_len(
            "cuda paged attention value cache (same as key cache)",
            v_cache.len(),
            k_cache.len(),
        )?;
        if k_cache.len() < block_elems || !k_cache.len().is_multiple_of(block_elems) {
            return Err(crate::Error::Shape {
                what: "cuda paged attention cache (a positive multiple of block_size * num_kv_heads * head_dim)",
                expected: block_elems,
                got: k_cache.len(),
            }
            .into());
        }
        let num_blocks = k_cache.len() / block_elems;
        // Slots are int on the device.
        to_i32("cache slots", num_blocks * sh.block_size)?;
        let ws_need = paged_attention_workspace_len(&sh);
        at_least("cuda paged attention workspace", workspace.len(), ws_need)?;
        if sh.num_seqs == 0 || sh.num_tokens == 0 || sh.max_query_len == 0 {
            return Ok(());
        }

        let num_tokens = to_i32("num_tokens", sh.num_tokens)?;
        let num_heads = to_i32("num_heads", sh.num_heads)?;
        let nkv = to_i32("num_kv_heads", sh.num_kv_heads)?;
        let bs = to_i32("block_size", sh.block_size)?;
        let num_blocks_i = to_i32("num_blocks", num_blocks)?;
        let mbps = to_i32("max_blocks_per_seq", sh.max_blocks_per_seq)?;
        let scale_log2 = sh.scale * std::f32::consts::LOG2_E;
        let seqs = grid_yz("num_seqs", sh.num_seqs)?;

        let (qp, _gq) = q.device_ptr(&self.stream);
        let (kp, _gk) = k_cache.device_ptr(&self.stream);
        let (vp, _gv) = v_cache.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let (qslp, _gqsl) = query_start_loc.device_ptr(&self.stream);
        let (slp, _gsl) = seq_lens.device_ptr(&self.stream);
        let (btp, _gbt) = block_tables.device_ptr(&self.stream);
        let (wsp, _gws) = workspace.device_ptr_mut(&self.stream);
        for (what, p) in [
            ("paged attention query", qp),
            ("paged attention key cache", kp),
            ("paged attention value cache", vp),
            ("paged attention out", op),
        ] {
            aligned16(what, p)?;
        }

        if sh.max_query_len == 1 {
            let (tile, chunks) = group_tiling(&sh);
            let tile_idx = GROUP_TILES.iter().position(|&t| t == tile).unwrap_or(0);
            let part = decode_partition(&sh);
            let parts = decode_parts(&sh);
            let part_i = to_i32("decode partition", part)?;
            let parts_i = to_i32("decode partitions", parts)?;
            let chunks_i = to_i32("head chunks", chunks)?;
            let cfg = LaunchConfig {
                grid_dim: (
                    to_u32("num_kv_heads * head chunks", sh.num_kv_heads * chunks)?,
                    seqs,
                    grid_yz("decode partitions", parts)?,
                ),
                block_dim: (DECODE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let f = self.function(kernels.source, kernels.decode[tile_idx])?;
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(&qp)
                .arg(&kp)
                .arg(&vp)
                .arg(&op)
                .arg(&qslp)
                .arg(&slp)
                .arg(&btp)
                .arg(&wsp)
                .arg(&num_tokens)
                .arg(&num_heads)
                .arg(&nkv)
                .arg(&bs)
                .arg(&num_blocks_i)
                .arg(&mbps)
                .arg(&part_i)
                .arg(&parts_i)
                .arg(&chunks_i)
                .arg(&scale_log2);
            // SAFETY: the arguments match `attn_decode_hd*_g*(const u16* x3, u16*, const int* x3,
            // float*, int x9, float)`. q/out hold num_tokens rows of num_heads * head_dim and
            // the kernel only touches rows qsl[s] < num_tokens; the metadata buffers hold
            // num_seqs (+1) entries and num_seqs * max_blocks_per_seq table entries (grid y =
            // num_seqs); block-table indices are clamped below max_blocks_per_seq and block
            // ids into 0..num_blocks, the size of both caches (checked). The workspace holds
            // num_seqs * num_heads * parts * (head_dim + 2) f32 when parts > 1 (checked) and is
            // not touched otherwise. All bf16 pointers are 16-byte aligned (checked).
            unsafe { launch.launch(cfg) }?;
            if parts > 1 {
                let hd_i = to_i32("head_dim", sh.head_dim)?;
                let cfg = LaunchConfig {
                    grid_dim: (to_u32("num_heads", sh.num_heads)?, seqs, 1),
                    block_dim: (REDUCE_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let f = self.function(attn_misc_source, REDUCE_FN)?;
                let mut launch = self.stream.launch_builder(&f);
                launch
                    .arg(&wsp)
                    .arg(&op)
                    .arg(&qslp)
                    .arg(&slp)
                    .arg(&num_tokens)
                    .arg(&num_heads)
                    .arg(&hd_i)
                    .arg(&part_i)
                    .arg(&parts_i);
                // SAFETY: the arguments match `attn_decode_reduce(const float*, u16*, const
                // int*, const int*, int x5)`; the workspace holds the num_seqs * num_heads *
                // parts rows (and their max / sum) written by the decode launch above on the
                // same stream; out rows are only written for qsl[s] < num_tokens, and the
                // kernel reads at most `parts` partitions per row.
                unsafe { launch.launch(cfg) }?;
            }
        } else {
            let (warps, _, _) = prefill_cfg(sh.head_dim);
            let bm = 16 * warps;
            let cfg = LaunchConfig {
                grid_dim: (
                    to_u32("query tiles", sh.max_query_len.div_ceil(bm))?,
                    grid_yz("num_heads", sh.num_heads)?,
                    seqs,
                ),
                block_dim: (32 * warps as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let f = self.function(kernels.source, kernels.prefill)?;
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(&qp)
                .arg(&kp)
                .arg(&vp)
                .arg(&op)
                .arg(&qslp)
                .arg(&slp)
                .arg(&btp)
                .arg(&num_tokens)
                .arg(&num_heads)
                .arg(&nkv)
                .arg(&bs)
                .arg(&num_blocks_i)
                .arg(&mbps)
                .arg(&scale_log2);
            // SAFETY: the arguments match `attn_prefill_hd*(const u16* x3, u16*, const int* x3,
            // int x6, float)`; the block has 32 * warps threads as the template instance
            // assumes and uses only static shared memory (48 KiB). q/out rows are read and
            // written only below num_tokens, metadata entries only for s < num_seqs (grid z),
            // table indices are clamped below max_blocks_per_seq and block ids into the caches'
            // num_blocks (checked); all bf16 pointers are 16-byte aligned (checked).
            unsafe { launch.launch(cfg) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::attention::{AttentionMetadata, LayerKvCache, paged_attention, reshape_and_cache};
    use crate::cuda::kernels::check_compiles;
    use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
    use cudarc::driver::CudaSlice;

    #[test]
    fn attention_kernels_compile_for_sm90() {
        check_compiles("attention misc", &attn_misc_source());
        for hd in SUPPORTED_HEAD_DIMS {
            let k = hd_kernels(hd).unwrap();
            let src = (k.source)();
            for name in k.decode.iter().chain([&k.prefill]) {
                assert!(src.contains(name), "{name} missing from the hd{hd} source");
            }
            check_compiles(&format!("attention hd{hd}"), &src);
        }
    }

    #[test]
    fn unsupported_head_dim_is_a_clear_error() {
        let e = hd_kernels(96).err().unwrap().to_string();
        assert!(e.contains("head_dim 96 is not supported"), "{e}");
    }

    #[test]
    fn workspace_is_zero_off_the_multi_partition_decode_path() {
        let mut sh = AttnShape {
            num_seqs: 64,
            num_tokens: 64,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            max_blocks_per_seq: 64,
            max_query_len: 1,
            max_seq_len: 1024,
            scale: 0.1,
        };
        assert_eq!(decode_partition(&sh), 256);
        assert_eq!(paged_attention_workspace_len(&sh), 64 * 32 * 4 * 130);
        sh.max_query_len = 2;
        assert_eq!(paged_attention_workspace_len(&sh), 0);
        sh.max_query_len = 1;
        sh.max_seq_len = 60;
        assert_eq!(paged_attention_workspace_len(&sh), 0);
        assert_eq!(group_tiling(&sh), (4, 1));
        sh.num_heads = 8 * 12;
        assert_eq!(group_tiling(&sh), (8, 2));
        sh.num_heads = 8 * 3;
        assert_eq!(group_tiling(&sh), (4, 1));
    }

    /// Small deterministic generator for test layouts.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % n.max(1)
        }
    }

    /// A batch on the device with its CPU reference output.
    struct Fixture {
        nh: usize,
        nkv: usize,
        hd: usize,
        bs: usize,
        num_tokens: usize,
        mbps: usize,
        max_q: usize,
        max_ctx: usize,
        dq: CudaSlice<bf16>,
        dk_cache: CudaSlice<bf16>,
        dv_cache: CudaSlice<bf16>,
        dqsl: CudaSlice<i32>,
        dseq: CudaSlice<i32>,
        dbt: CudaSlice<i32>,
        want: Vec<f32>,
    }

    impl Fixture {
        /// `seqs`: (context length, query length) per sequence. Writes the earlier context and
        /// then the new tokens through both `reshape_and_cache` versions (checking the GPU cache
        /// against the CPU one) and computes the CPU attention.
        #[allow(clippy::too_many_arguments)]
        fn new(
            cx: &CudaContext,
            nh: usize,
            nkv: usize,
            hd: usize,
            bs: usize,
            seqs: &[(usize, usize)],
            seed: u64,
        ) -> Self {
            let mut rng = Lcg(seed);
            let need: Vec<usize> = seqs.iter().map(|&(c, _)| c.div_ceil(bs)).collect();
            let num_blocks = need.iter().sum::<usize>() + 3;
            let mut perm: Vec<usize> = (0..num_blocks).collect();
            for i in (1..num_blocks).rev() {
                let j = rng.next(i + 1);
                perm.swap(i, j);
            }
            let mbps = need.iter().copied().max().unwrap_or(0) + 1;
            let mut tables: Vec<Vec<u32>> = Vec::new();
            let mut flat_bt = vec![0i32; seqs.len() * mbps];
            let mut next = 0;
            for (s, &n) in need.iter().enumerate() {
                let t: Vec<u32> = perm[next..next + n].iter().map(|&b| b as u32).collect();
                next += n;
                for (i, &b) in t.iter().enumerate() {
                    flat_bt[s * mbps + i] = b as i32;
                }
                // Padding entries point at a real block: must never be read.
                flat_bt[s * mbps + n] = perm[num_blocks - 1] as i32;
                tables.push(t);
            }
            let row = nkv * hd;
            let slot = |s: usize, p: usize| (tables[s][p / bs] as usize * bs + p % bs) as i64;
            let (mut old_k, mut old_v, mut old_slots) = (Vec::new(), Vec::new(), Vec::new());
            let (mut new_k, mut new_v, mut new_slots) = (Vec::new(), Vec::new(), Vec::new());
            let mut qsl = vec![0usize];
            for (s, &(ctx, ql)) in seqs.iter().enumerate() {
                assert!(ql <= ctx);
                let k = rand_bf16_f32(ctx * row, seed * 1000 + 2 * s as u64);
                let v = rand_bf16_f32(ctx * row, seed * 1000 + 2 * s as u64 + 1);
                for p in 0..ctx {
                    let (dk, dv, ds) = if p < ctx - ql {
                        (&mut old_k, &mut old_v, &mut old_slots)
                    } else {
                        (&mut new_k, &mut new_v, &mut new_slots)
                    };
                    dk.extend_from_slice(&k[p * row..(p + 1) * row]);
                    dv.extend_from_slice(&v[p * row..(p + 1) * row]);
                    ds.push(slot(s, p));
                }
                qsl.push(qsl[s] + ql);
            }
            let num_tokens = new_slots.len();
            let mut cache = LayerKvCache::new(num_blocks, bs, nkv, hd);
            let mut dk_cache = cx.zeros_bf16(num_blocks * bs * row).unwrap();
            let mut dv_cache = cx.zeros_bf16(num_blocks * bs * row).unwrap();
            // A trailing padding token (slot -1) with the new ones.
            new_k.extend(rand_bf16_f32(row, seed + 77));
            new_v.extend(rand_bf16_f32(row, seed + 78));
            new_slots.push(-1);
            for (k, v, slots) in [(&old_k, &old_v, &old_slots), (&new_k, &new_v, &new_slots)] {
                if slots.is_empty() {
                    continue;
                }
                reshape_and_cache(k, v, slots, &mut cache).unwrap();
                let (dk, dv) = (
                    cx.upload_f32_as_bf16(k).unwrap(),
                    cx.upload_f32_as_bf16(v).unwrap(),
                );
                let ds = cx.stream().clone_htod(slots).unwrap();
                cx.reshape_and_cache_bf16(
                    &dk,
                    &dv,
                    &mut dk_cache,
                    &mut dv_cache,
                    &ds,
                    slots.len(),
                    nkv,
                    hd,
                )
                .unwrap();
            }
            assert_eq!(
                cx.download_f32(&dk_cache).unwrap(),
                cache.k,
                "GPU key cache"
            );
            assert_eq!(
                cx.download_f32(&dv_cache).unwrap(),
                cache.v,
                "GPU value cache"
            );
            new_slots.pop();

            let q = rand_bf16_f32(num_tokens * nh * hd, seed + 99);
            let meta = AttentionMetadata {
                slot_mapping: new_slots,
                block_tables: tables,
                seq_lens: seqs.iter().map(|&(c, _)| c).collect(),
                query_start_loc: qsl.clone(),
            };
            let mut want = vec![0.0; q.len()];
            paged_attention(&q, nh, &cache, &meta, 1.0 / (hd as f32).sqrt(), &mut want).unwrap();
            let to_i32 = |v: &[usize]| v.iter().map(|&x| x as i32).collect::<Vec<i32>>();
            Self {
                nh,
                nkv,
                hd,
                bs,
                num_tokens,
                mbps,
                max_q: seqs.iter().map(|&(_, q)| q).max().unwrap_or(0),
                max_ctx: seqs.iter().map(|&(c, _)| c).max().unwrap_or(0),
                dq: cx.upload_f32_as_bf16(&q).unwrap(),
                dk_cache,
                dv_cache,
                dqsl: cx.stream().clone_htod(&to_i32(&qsl)).unwrap(),
                dseq: cx.stream().clone_htod(&to_i32(&meta.seq_lens)).unwrap(),
                dbt: cx.stream().clone_htod(&flat_bt).unwrap(),
                want,
            }
        }

        fn shape(&self, max_query_len: usize, max_seq_len: usize) -> AttnShape {
            AttnShape {
                num_seqs: self.dseq.len(),
                num_tokens: self.num_tokens,
                num_heads: self.nh,
                num_kv_heads: self.nkv,
                head_dim: self.hd,
                block_size: self.bs,
                max_blocks_per_seq: self.mbps,
                max_query_len,
                max_seq_len,
                scale: 1.0 / (self.hd as f32).sqrt(),
            }
        }

        fn run(&self, cx: &CudaContext, shape: &AttnShape) -> Vec<f32> {
            let mut out = cx.zeros_bf16(self.want.len()).unwrap();
            let mut ws = cx
                .stream()
                .alloc_zeros::<f32>(paged_attention_workspace_len(shape).max(1))
                .unwrap();
            cx.paged_attention_bf16(
                &self.dq,
                &self.dk_cache,
                &self.dv_cache,
                &mut out,
                &self.dqsl,
                &self.dseq,
                &self.dbt,
                &mut ws,
                shape,
            )
            .unwrap();
            cx.download_f32(&out).unwrap()
        }

        fn check(&self, cx: &CudaContext, what: &str, shape: &AttnShape) -> Vec<f32> {
            let got = self.run(cx, shape);
            let err = rel_err(&got, &self.want);
            println!(
                "attention check {what}: nh {} nkv {} hd {} bs {} tokens {} max_q {} max_ctx {} (grid bounds q {} ctx {}): rel_err {err:.3e}",
                self.nh,
                self.nkv,
                self.hd,
                self.bs,
                self.num_tokens,
                self.max_q,
                self.max_ctx,
                shape.max_query_len,
                shape.max_seq_len
            );
            assert!(err <= 2e-2, "{what}: rel_err {err}");
            got
        }
    }

    /// A random mix of full prefills, chunked prefills and decodes.
    fn random_mix(seed: u64, n: usize, max_ctx: usize) -> Vec<(usize, usize)> {
        let mut rng = Lcg(seed);
        (0..n)
            .map(|_| {
                let ctx = 1 + rng.next(max_ctx);
                match rng.next(3) {
                    0 => (ctx, ctx),
                    1 => (ctx, 1 + rng.next(ctx)),
                    _ => (ctx, 1),
                }
            })
            .collect()
    }

    #[test]
    fn paged_attention_mixed_batches_match_cpu() {
        let Some(cx) = ctx_or_skip("paged_attention_mixed_batches_match_cpu") else {
            return;
        };
        let fixed = vec![
            (200, 200),
            (150, 70),
            (1, 1),
            (77, 1),
            (600, 1),
            (513, 64),
            (64, 64),
            (300, 2),
            (129, 65),
        ];
        let configs: [(usize, usize, usize, usize); 7] = [
            (8, 2, 128, 16),
            (4, 4, 128, 4),
            (8, 2, 64, 16),
            (4, 4, 64, 4),
            (8, 2, 16, 4),
            (6, 2, 32, 16),
            (4, 2, 256, 16),
        ];
        for (i, &(nh, nkv, hd, bs)) in configs.iter().enumerate() {
            for (j, seqs) in [fixed.clone(), random_mix(11 + i as u64, 10, 400)]
                .iter()
                .enumerate()
            {
                let fx = Fixture::new(&cx, nh, nkv, hd, bs, seqs, 100 + (10 * i + j) as u64);
                let sh = fx.shape(fx.max_q, fx.max_ctx);
                fx.check(&cx, "mixed", &sh);
            }
        }
    }

    #[test]
    fn paged_attention_decode_batches_match_cpu() {
        let Some(cx) = ctx_or_skip("paged_attention_decode_batches_match_cpu") else {
            return;
        };
        let lens = [1usize, 17, 512, 513, 1100, 2000, 64, 255, 256, 257];
        let seqs: Vec<(usize, usize)> = lens.iter().map(|&c| (c, 1)).collect();
        let short: Vec<(usize, usize)> = [1usize, 3, 16, 40, 61].iter().map(|&c| (c, 1)).collect();
        let configs: [(usize, usize, usize, usize); 7] = [
            (32, 8, 128, 16),
            (4, 4, 128, 4),
            (8, 2, 64, 16),
            (12, 1, 64, 16),
            (8, 2, 16, 4),
            (6, 2, 32, 4),
            (4, 2, 256, 16),
        ];
        for (i, &(nh, nkv, hd, bs)) in configs.iter().enumerate() {
            for (j, s) in [&seqs, &short].into_iter().enumerate() {
                let fx = Fixture::new(&cx, nh, nkv, hd, bs, s, 500 + (10 * i + j) as u64);
                let sh = fx.shape(1, fx.max_ctx);
                fx.check(&cx, "decode", &sh);
                // The same decodes through the tensor-core path (max_query_len an upper bound).
                let sh = fx.shape(2, fx.max_ctx);
                fx.check(&cx, "decode via prefill kernel", &sh);
            }
        }
        // A large batch: partitions of 256 (exact bound) and 512 (bound 2048) tokens.
        let mut rng = Lcg(3);
        let big: Vec<(usize, usize)> = (0..64).map(|_| (1 + rng.next(1500), 1)).collect();
        let fx = Fixture::new(&cx, 32, 8, 128, 16, &big, 700);
        for bound in [fx.max_ctx, 2048] {
            let sh = fx.shape(1, bound);
            println!(
                "attention decode partition {} for max_seq_len {bound}",
                decode_partition(&sh)
            );
            fx.check(&cx, "large decode batch", &sh);
        }
    }

    /// Graph-style launches: grid sized from upper bounds, lengths read on the device.
    #[test]
    fn paged_attention_upper_bounds_give_the_same_answer() {
        let Some(cx) = ctx_or_skip("paged_attention_upper_bounds_give_the_same_answer") else {
            return;
        };
        for (nh, nkv, hd, bs) in [(32, 8, 128, 16), (8, 2, 64, 4), (8, 8, 16, 16)] {
            // Decode: exact bounds vs a much larger max_seq_len (more partitions, reduce path).
            let seqs: Vec<(usize, usize)> =
                [5usize, 700, 1300, 90].iter().map(|&c| (c, 1)).collect();
            let fx = Fixture::new(&cx, nh, nkv, hd, bs, &seqs, 900);
            let exact = fx.check(&cx, "decode exact bounds", &fx.shape(1, fx.max_ctx));
            let loose = fx.check(&cx, "decode loose bounds", &fx.shape(1, 6000));
            let d = rel_err(&loose, &exact);
            println!("attention graph-style decode: loose vs exact rel diff {d:.3e}");
            assert!(d <= 1e-2, "decode loose vs exact {d}");
            // Short decodes: one partition exactly (direct write) vs many (reduce).
            let seqs: Vec<(usize, usize)> = [5usize, 30, 64].iter().map(|&c| (c, 1)).collect();
            let fx = Fixture::new(&cx, nh, nkv, hd, bs, &seqs, 901);
            let exact = fx.check(&cx, "short decode exact", &fx.shape(1, fx.max_ctx));
            let loose = fx.check(&cx, "short decode loose", &fx.shape(1, 4096));
            assert!(rel_err(&loose, &exact) <= 1e-2);
            // Prefill: max_query_len twice the real one must give identical bits.
            let seqs = [(300, 300), (150, 40), (77, 1)];
            let fx = Fixture::new(&cx, nh, nkv, hd, bs, &seqs, 902);
            let exact = fx.check(&cx, "prefill exact bounds", &fx.shape(fx.max_q, fx.max_ctx));
            let loose = fx.check(&cx, "prefill loose bounds", &fx.shape(2 * fx.max_q, 4096));
            assert_eq!(loose, exact, "prefill with an upper-bound grid differs");
        }
    }

    #[test]
    fn attention_timing() {
        let Some(cx) = ctx_or_skip("attention_timing") else {
            return;
        };
        let (nh, nkv, hd, bs) = (32usize, 8usize, 128usize, 16usize);
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let e0 = cx.raw().new_event(flags).unwrap();
        let e1 = cx.raw().new_event(flags).unwrap();
        let time_us = |f: &mut dyn FnMut()| {
            for _ in 0..3 {
                f();
            }
            cx.synchronize().unwrap();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                e0.record(cx.stream()).unwrap();
                for _ in 0..10 {
                    f();
                }
                e1.record(cx.stream()).unwrap();
                e1.synchronize().unwrap();
                best = best.min(e0.elapsed_ms(&e1).unwrap() as f64 * 100.0);
            }
            best
        };

        // Decode: 64 sequences x 1024 context.
        let (seqs, ctx) = (64usize, 1024usize);
        let bps = ctx / bs;
        let num_blocks = seqs * bps;
        let mut rng = Lcg(5);
        let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..num_blocks).rev() {
            perm.swap(i, rng.next(i + 1));
        }
        let kc = cx
            .upload_f32_as_bf16(&rand_bf16_f32(num_blocks * bs * nkv * hd, 1))
            .unwrap();
        let vc = cx
            .upload_f32_as_bf16(&rand_bf16_f32(num_blocks * bs * nkv * hd, 2))
            .unwrap();
        let q = cx
            .upload_f32_as_bf16(&rand_bf16_f32(seqs * nh * hd, 3))
            .unwrap();
        let mut out = cx.zeros_bf16(seqs * nh * hd).unwrap();
        let qsl = cx
            .stream()
            .clone_htod(&(0..=seqs as i32).collect::<Vec<_>>())
            .unwrap();
        let sl = cx.stream().clone_htod(&vec![ctx as i32; seqs]).unwrap();
        let bt = cx.stream().clone_htod(&perm).unwrap();
        let shape = AttnShape {
            num_seqs: seqs,
            num_tokens: seqs,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: bs,
            max_blocks_per_seq: bps,
            max_query_len: 1,
            max_seq_len: ctx,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let mut ws = cx
            .stream()
            .alloc_zeros::<f32>(paged_attention_workspace_len(&shape).max(1))
            .unwrap();
        let us = time_us(&mut || {
            cx.paged_attention_bf16(&q, &kc, &vc, &mut out, &qsl, &sl, &bt, &mut ws, &shape)
                .unwrap()
        });
        let bytes = (seqs * ctx * nkv * hd * 2 * 2) as f64;
        println!(
            "attention decode batch {seqs} x ctx {ctx}, {nh}/{nkv} heads, hd {hd}, block {bs}, partition {}: {us:.1} us/call, KV read {:.0} GB/s",
            decode_partition(&shape),
            bytes / (us * 1e3)
        );
        // Same with the grid sized for 4x the context (graph-style upper bound).
        let loose = AttnShape {
            max_seq_len: 4 * ctx,
            ..shape
        };
        let mut ws2 = cx
            .stream()
            .alloc_zeros::<f32>(paged_attention_workspace_len(&loose).max(1))
            .unwrap();
        let us = time_us(&mut || {
            cx.paged_attention_bf16(&q, &kc, &vc, &mut out, &qsl, &sl, &bt, &mut ws2, &loose)
                .unwrap()
        });
        println!(
            "attention decode (max_seq_len bound {}): {us:.1} us/call, KV read {:.0} GB/s",
            loose.max_seq_len,
            bytes / (us * 1e3)
        );

        // Prefill: one sequence of 2048 tokens.
        let t = 2048usize;
        let bps = t / bs;
        let kc = cx
            .upload_f32_as_bf16(&rand_bf16_f32(bps * bs * nkv * hd, 4))
            .unwrap();
        let vc = cx
            .upload_f32_as_bf16(&rand_bf16_f32(bps * bs * nkv * hd, 5))
            .unwrap();
        let q = cx
            .upload_f32_as_bf16(&rand_bf16_f32(t * nh * hd, 6))
            .unwrap();
        let mut out = cx.zeros_bf16(t * nh * hd).unwrap();
        let qsl = cx.stream().clone_htod(&[0i32, t as i32]).unwrap();
        let sl = cx.stream().clone_htod(&[t as i32]).unwrap();
        let bt = cx
            .stream()
            .clone_htod(&(0..bps as i32).rev().collect::<Vec<_>>())
            .unwrap();
        let shape = AttnShape {
            num_seqs: 1,
            num_tokens: t,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: bs,
            max_blocks_per_seq: bps,
            max_query_len: t,
            max_seq_len: t,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let mut ws = cx.stream().alloc_zeros::<f32>(1).unwrap();
        let us = time_us(&mut || {
            cx.paged_attention_bf16(&q, &kc, &vc, &mut out, &qsl, &sl, &bt, &mut ws, &shape)
                .unwrap()
        });
        let flops = 4.0 * (t * t) as f64 / 2.0 * (nh * hd) as f64;
        println!(
            "attention prefill {t} tokens, {nh}/{nkv} heads, hd {hd}, block {bs}: {us:.1} us/call, {:.1} TFLOP/s (x36 layers: {:.2} ms)",
            flops / (us * 1e6),
            36.0 * us / 1e3
        );
    }
}
