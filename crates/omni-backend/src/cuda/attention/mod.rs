//! Paged attention on the GPU: the CUDA twin of [`crate::attention::paged_attention`] (bf16 in
//! and out, f32 math) with the same semantics: a flat batch split by `query_start_loc`,
//! `seq_lens` counting the new tokens, causal masking inside a chunk, query head `h` reading KV
//! head `h / (num_heads / num_kv_heads)`, and the cache laid out `[num_blocks, block_size,
//! num_kv_heads, head_dim]`. The cache write is fused into
//! [`CudaContext::qkv_rope_cache_bf16`].
//!
//! Two paths, picked from the host scalars in [`AttnShape`] only:
//!
//! * **decode** (`max_query_len == 1`): flash-decoding. The grid is (KV head x group-of-query-heads
//!   chunk, sequence, KV partition); one CTA reads a partition of one sequence's K/V once with
//!   16-byte loads and serves every query head of the GQA group from it. With more than one
//!   partition the partial results (in a caller-provided f32 workspace,
//!   [`paged_attention_workspace_len`]) are merged by the last CTA of the sequence's group to
//!   finish (an arrival counter per group in the module's own memory, left at zero); only a
//!   grid with more groups than [`ATTN_COUNTERS`] falls back to a second merge kernel (vLLM's
//!   `paged_attention_v2`). Small grids (batch 1) get partitions down to 32 tokens, each read
//!   in one round trip ([`decode_plan`]). Large grids of GQA groups of 4 or more query heads
//!   take a tensor-core variant (`decode_tc.cu`): the group's heads are the rows of an
//!   `mma.sync` tile, K/V chunks stream through per-warp `cp.async` rings, same partitions,
//!   workspace and merge.
//! * **prefill / mixed** (`max_query_len > 1`): flash-attention 2 on tensor cores
//!   (`mma.sync.m16n8k16` bf16 with `ldmatrix`, f32 accumulation, online softmax), K/V tiles
//!   gathered from the paged cache through the block table with `cp.async`. Decode rows of a
//!   mixed batch go through it too. On an sm_90 device at head_dim 128 (unless
//!   [`PREFILL_WGMMA_ENV`] is `0`), a Hopper kernel instead (`prefill_wg.cu`, sm_90a):
//!   warpgroup MMAs (`wgmma`) of 64 query rows per warpgroup, Q and double-buffered K/V tiles
//!   in 128-byte-swizzled shared memory, P from registers.
//!
//! The launch grid depends only on host scalars; every per-sequence value (query range, context
//! length, blocks) is read on the device and CTAs with nothing to do exit at once. So
//! `max_query_len` / `max_seq_len` may be upper bounds, and a decode step can be captured in a
//! CUDA graph with bounds and replayed with other lengths. Neither call allocates, synchronizes
//! or reads device memory on the host.
//!
//! Device-side metadata is trusted for the computed values but clamped for memory safety: block
//! ids are clamped into the cache, block-table indices into the row, token indices into
//! `num_tokens`.
//!
//! Here: the shape and the host-side heuristics (partitions, GQA tiling, prefill tiling); in
//! `source.rs` the kernels' source per head dimension (`kernels/attention/*`), in `launch.rs`
//! the launcher [`CudaContext::paged_attention_bf16`].

pub(super) mod block1;
#[cfg(test)]
mod block1_emu;
#[cfg(test)]
mod block1_tests;
#[cfg(test)]
mod emu;
#[cfg(test)]
mod emu_tc;
#[cfg(test)]
mod emu_wg;
mod launch;
mod rope;
#[cfg(test)]
mod rope_tests;
pub(super) mod source;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod timing;

#[cfg(doc)]
use super::CudaContext;
pub use block1::{
    ATTN_ONE_LAUNCH_ENV, ATTN_ONE_LAUNCH_KEYS_ENV, AttnBlock1Buffers, AttnBlock1Shape,
    AttnBlock1Weights, DEFAULT_MIN_KEYS, attn_one_launch_enabled,
};
pub use rope::DECODE_ROPE_ENV;

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
/// Smallest decode partition: one round of loads of a CTA (4 warps x 2 tokens x 4 loads in
/// flight at head_dim 128 and 8 query heads; more tokens per round for the other instances).
const MIN_PARTITION: usize = 32;
/// Query heads of one GQA group served by one decode CTA, by template instance.
const GROUP_TILES: [usize; 4] = [1, 2, 4, 8];
/// Query heads of a GQA group served by one tensor-core decode CTA (rows of its MMA tile).
const TC_TILE: usize = 8;
/// Smallest GQA group the tensor-core decode kernel serves: below it the CUDA-core kernel's
/// arithmetic per K/V byte is low enough to stream at the memory's rate.
const TC_MIN_GROUP: usize = 4;
/// Threads of a decode CTA (the kernel assumes 4 warps).
const DECODE_THREADS: u32 = 128;
/// Threads of the decode reduce kernel.
const REDUCE_THREADS: u32 = 128;
/// Decode CTAs below which partitions are halved (down to [`MIN_PARTITION`]) for parallelism.
const DECODE_MIN_CTAS: usize = 1600;
/// The same for the tensor-core kernel: its CTAs stream more bytes at once (three of them fill
/// an SM) and a partition costs it a fixed prologue and merge, so it keeps longer partitions
/// (on an H200: 30B-A3B at batch 64 54.7 us with 256 tokens against 67.3 with 128).
const TC_MIN_CTAS: usize = 1024;
/// Arrival counters of the fused merge in each decode module (`attn_cnt` in `decode.cu`): one
/// per (sequence, grid x) group, so a fused launch has at most this many groups.
const ATTN_COUNTERS: usize = 1 << 15;
/// Most partitions a fused merge takes (its weights and sums share the kernel's score buffer,
/// `ATTN_MAXPART` floats per query head).
const MAX_FUSED_PARTS: usize = MAX_PARTITION / 2;

/// Set to `0`, every decode stays on the CUDA-core kernel (to measure the tensor-core one
/// against it in one build: `scripts/gpu-check.sh ab-tc`). Read once per process.
pub const DECODE_TC_ENV: &str = "OMNI_CUDA_DECODE_TC";

/// Whether [`DECODE_TC_ENV`] leaves the tensor-core decode kernel on (the default).
fn tc_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::cuda::switch_on(DECODE_TC_ENV))
}

/// How one decode call is launched: a pure function of the host scalars ([`decode_plan`]), so a
/// CUDA graph captured for a shape replays the same grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DecodePlan {
    /// Query heads of a GQA group per CTA (one of [`GROUP_TILES`]).
    tile: usize,
    /// Tokens per partition (one CTA's share of a sequence).
    part: usize,
    /// Partitions (grid z), enough for `max_seq_len`.
    parts: usize,
    /// The last CTA of a group merges the partials (else the reduce kernel does, when
    /// `parts > 1`).
    fused: bool,
    /// Launched with programmatic dependent launch (on compute capability 9.0 and later): the
    /// CTAs read their metadata while the predecessor drains.
    pdl: bool,
    /// The tensor-core kernel (`decode_tc.cu`, tile [`TC_TILE`]) instead of the CUDA-core one.
    tc: bool,
    /// Each sequence's partitions are equal (`attn_part_len`: as many as `part` tokens need,
    /// of at most `part` tokens each, multiples of 16) instead of `part` tokens and a tail.
    balanced: bool,
}

/// Tokens per decode partition for `shape`: 512, halved while the grid would have fewer than
/// [`DECODE_MIN_CTAS`] CTAs ([`TC_MIN_CTAS`] on tensor cores; down to [`MIN_PARTITION`]), and
/// whether the merge is fused (the grid's groups fit [`ATTN_COUNTERS`] and it has at most
/// [`MAX_FUSED_PARTS`] partitions).
///
/// With [`DECODE_BALANCED_ENV`], grids that are not small split each sequence into equal
/// partitions of at most that many tokens ([`DecodePlan::balanced`]): 1,056 tokens in 512-token
/// partitions are three of 352, not two of 512 and a tail of 32.
///
/// A grid that stays small even at the smallest partitions (batch 1: a few KV heads) serves
/// at most 4 query heads per CTA: twice the CTAs (each K/V row is read twice, the second time
/// from L2) and half the merge per CTA, which is what bounds the latency there. A larger grid
/// of GQA groups of at least [`TC_MIN_GROUP`] heads goes to the tensor-core kernel: the
/// CUDA-core one spends a group's dot products and shuffles on every K/V byte and falls below
/// the memory's rate at 8 heads per KV head (Qwen3-30B-A3B at batch 64).
fn decode_plan(shape: &AttnShape) -> DecodePlan {
    let (mut tile, _) = group_tiling(shape);
    let small = shape.num_kv_heads * shape.num_seqs * shape.max_seq_len.div_ceil(MIN_PARTITION)
        < DECODE_MIN_CTAS;
    if tile > 4 && small {
        tile = 4;
    }
    let tc = !small && group_size(shape) >= TC_MIN_GROUP && tc_enabled();
    if tc {
        tile = TC_TILE;
    }
    let chunks = group_size(shape).div_ceil(tile);
    let groups = shape.num_kv_heads * chunks * shape.num_seqs;
    let min_ctas = if tc { TC_MIN_CTAS } else { DECODE_MIN_CTAS };
    let mut part = MAX_PARTITION;
    while part > MIN_PARTITION && groups * shape.max_seq_len.div_ceil(part) < min_ctas {
        part /= 2;
    }
    let parts = shape.max_seq_len.div_ceil(part).max(1);
    DecodePlan {
        tile,
        part,
        parts,
        fused: groups <= ATTN_COUNTERS && parts <= MAX_FUSED_PARTS,
        pdl: true,
        tc,
        balanced: !small && balanced_enabled(),
    }
}

/// Set to `1`, grids that are not small split sequences into balanced partitions (off by
/// default: on an H200 the 30B-A3B attention kernel at batch 64 and 1,056 tokens took 49.6
/// instead of 57.8 µs, but `bench latency` at batch 64 moved -1.6% / -1.8% for the 8B / 30B
/// shapes, within what two runs differ by; `scripts/gpu-check.sh ab-bal` measures both).
/// Read once per process.
pub const DECODE_BALANCED_ENV: &str = "OMNI_CUDA_DECODE_BALANCED";

/// Whether [`DECODE_BALANCED_ENV`] turns balanced partitions on.
fn balanced_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::cuda::switch_opt_in(DECODE_BALANCED_ENV))
}

/// [`DecodePlan::balanced`]'s partition length for a sequence of `seq_len` tokens (the
/// kernels' `attn_part_len`; the emulator's copy).
#[cfg(test)]
fn part_len(plan: &DecodePlan, seq_len: usize) -> usize {
    if !plan.balanced || seq_len == 0 {
        return plan.part;
    }
    let np = seq_len.div_ceil(plan.part).min(plan.parts);
    seq_len
        .div_ceil(np)
        .div_ceil(16)
        .saturating_mul(16)
        .min(plan.part)
}

/// Dynamic shared memory of the tensor-core decode kernel at `head_dim`, in bytes: four warps'
/// two-stage rings of 16-key K and V chunks (bf16), or the fused merge's weights and sums
/// (2 x [`TC_TILE`] x [`MAX_FUSED_PARTS`] f32) where that is more.
fn tc_smem_bytes(head_dim: usize) -> usize {
    (4 * 2 * 2 * 16 * head_dim * 2).max(2 * TC_TILE * MAX_FUSED_PARTS * 4)
}

/// Query heads per KV head (at least 1).
fn group_size(shape: &AttnShape) -> usize {
    shape
        .num_heads
        .checked_div(shape.num_kv_heads)
        .unwrap_or(1)
        .max(1)
}

/// (query heads per decode CTA, CTAs per KV head) for the GQA group size of `shape`.
fn group_tiling(shape: &AttnShape) -> (usize, usize) {
    let group = group_size(shape);
    let tile = GROUP_TILES
        .iter()
        .copied()
        .find(|&t| t >= group)
        .unwrap_or(GROUP_TILES[GROUP_TILES.len() - 1]);
    (tile, group.div_ceil(tile))
}

/// The f32 workspace [`CudaContext::paged_attention_bf16`] needs for every decode of at most
/// `shape.num_seqs` sequences of at most `shape.max_seq_len` tokens, in elements: 0 on the
/// prefill path and where every such decode has one partition, else room for the partial
/// output, max and sum of each (sequence, head, partition) of the largest of them. A buffer
/// sized with upper bounds (`max_num_seqs`, `max_model_len`) serves every step.
///
/// The bound, not the plan of `shape` itself: [`decode_plan`]'s partitions are not monotone in
/// the shape (64 sequences of 3,000 tokens over 4 KV heads take 12 partitions of 256 tokens on
/// the CUDA-core kernel; of 4,096, 8 of 512). Over (sequences n, partitions p) of any plan:
/// with the largest partition, n * p is at most `num_seqs * ceil(max_seq_len / 512)`; with a
/// smaller one, the halving before it left fewer than [`DECODE_MIN_CTAS`] CTAs (fewer than
/// [`TC_MIN_CTAS`] < [`DECODE_MIN_CTAS`] on tensor cores), so the grid's `num_kv_heads *
/// chunks * n * p` is below twice that; and never above `num_seqs * ceil(max_seq_len / 32)`.
pub fn paged_attention_workspace_len(shape: &AttnShape) -> usize {
    if shape.max_query_len != 1 || shape.max_seq_len <= MIN_PARTITION {
        return 0;
    }
    let finest = shape.num_seqs * shape.max_seq_len.div_ceil(MIN_PARTITION);
    let coarsest = shape.num_seqs * shape.max_seq_len.div_ceil(MAX_PARTITION);
    let halved = (2 * DECODE_MIN_CTAS).div_ceil(shape.num_kv_heads.max(1));
    let seq_parts = finest.min(coarsest.max(halved));
    seq_parts * shape.num_heads * (shape.head_dim + 2)
}

/// The decode workspace for `parts` partitions: 0 for one, else every (sequence, head,
/// partition)'s partial output, max and sum.
fn decode_workspace_len(shape: &AttnShape, parts: usize) -> usize {
    if parts <= 1 {
        return 0;
    }
    shape.num_seqs * shape.num_heads * parts * (shape.head_dim + 2)
}

/// One tiling of the flash prefill kernel (the template arguments of an `attn_prefill_*`
/// entry point).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefillTile {
    /// Warps per CTA; each owns 16 query rows.
    pub(super) warps: usize,
    /// Keys per tile.
    pub(super) bn: usize,
    /// Q fragments held in registers for the whole key loop.
    pub(super) qreg: bool,
    /// `__launch_bounds__` minimum CTAs per SM (0: none; the compiler picks the registers).
    pub(super) min_ctas: usize,
    /// The Hopper kernel (`prefill_wg.cu`, sm_90a, head_dim [`WGMMA_HEAD_DIM`] only): `warps /
    /// 4` warpgroups of 64 query rows on `wgmma`, two stages of K and V tiles (`qreg` unused).
    pub(super) wgmma: bool,
    /// The wgmma kernel's ping-pong variant (two warpgroups only): the warpgroups take turns
    /// issuing their MMAs (named barriers), K / V copied by warpgroup 0 into three stages each,
    /// handed over with mbarriers instead of a CTA-wide barrier per key tile.
    pub(super) pingpong: bool,
}

impl PrefillTile {
    /// Dynamic shared memory: the Q tile and one K and one V tile; for the wgmma kernel, room
    /// to align to 1024 bytes, the Q tile, two stages of K and V tiles (three in the ping-pong
    /// variant, with its 12 mbarriers) and three tiles' cache slots (i32).
    pub(super) fn smem_bytes(&self, head_dim: usize) -> usize {
        if self.wgmma {
            let (stages, bars) = if self.pingpong { (3, 12 * 8) } else { (2, 0) };
            1024 + (16 * self.warps + 2 * stages * self.bn) * head_dim * 2 + bars + 3 * self.bn * 4
        } else {
            (16 * self.warps + 2 * self.bn) * head_dim * 2
        }
    }
}

/// The only head dimension of the wgmma prefill kernel.
pub(super) const WGMMA_HEAD_DIM: usize = 128;

/// An `mma.sync` prefill tiling (`prefill.cu`): `warps` warps of 16 query rows, `bn`-key
/// tiles, Q in registers when `qreg`, `__launch_bounds__` minimum `min_ctas` CTAs per SM.
const fn mma_tile(warps: usize, bn: usize, qreg: bool, min_ctas: usize) -> PrefillTile {
    PrefillTile {
        warps,
        bn,
        qreg,
        min_ctas,
        wgmma: false,
        pingpong: false,
    }
}

/// A wgmma prefill tiling of `wgs` warpgroups (64 query rows each) and `bn`-key tiles.
const fn wg_tile(wgs: usize, bn: usize, min_ctas: usize) -> PrefillTile {
    PrefillTile {
        wgmma: true,
        ..mma_tile(4 * wgs, bn, false, min_ctas)
    }
}

/// The ping-pong variant of the two-warpgroup tiling over `bn`-key tiles (one CTA per SM):
/// warpgroup 0 copies K/V into 3 stages handed over by mbarriers, the warpgroups alternate their
/// MMAs through named barriers. Correct on an H200 but slower than the lockstep kernel (2048
/// tokens, 32/4 heads: 201.6 against 157.7 µs at 128 keys, 230.9 against 184.5 at 64; a
/// 2048-token prefill of Qwen3-30B-A3B 42.5 against 40.3 ms), so not the default: one
/// warpgroup issuing every copy is likely its limit.
const fn wg_pingpong(bn: usize) -> PrefillTile {
    PrefillTile {
        pingpong: true,
        ..wg_tile(2, bn, 1)
    }
}

/// The wgmma prefill tilings with their entry points (`source::attn_wgmma_source`; test builds
/// compile all of them for the timing, others only the one [`PREFILL_WGMMA_ENV`] selects). The
/// minimum CTAs per SM are what the shared memory allows (228 KiB per SM).
pub(super) const WGMMA_PREFILL: [(PrefillTile, &str); 6] = [
    (wg_tile(1, 64, 2), "attn_prefill_wg_hd128_w1_n64"),
    (wg_tile(2, 64, 1), "attn_prefill_wg_hd128_w2_n64"),
    (wg_tile(1, 128, 1), "attn_prefill_wg_hd128_w1_n128"),
    (wg_tile(2, 128, 1), "attn_prefill_wg_hd128_w2_n128"),
    (wg_pingpong(64), "attn_prefill_wg_hd128_w2_n64_pp"),
    (wg_pingpong(128), "attn_prefill_wg_hd128_w2_n128_pp"),
];

/// The tiling of [`WGMMA_PREFILL`] prefills run by default: two warpgroups over 128-key tiles.
/// On an H200 (2048 tokens, 32/4 heads) 159.5 µs against 274.9 for the `mma.sync` kernel
/// (w2_n64 184.7, w1_n64 201.1, w1_n128 266.1, the ping-pong variants 201.6 / 230.9); a
/// 2048-token prefill of Qwen3-30B-A3B 45.8 -> 41.7 ms to the first token, 4000 tokens 101.3 ->
/// 83.5 ms (`bench/results/gpu-prefill-wgmma-h200-2026-12-04.md`).
pub(super) const WGMMA_PREFILL_PICK: usize = 3;

/// Prefill attention (`max_query_len > 1`) at head_dim 128 on an sm_90 device runs on the
/// warpgroup-MMA kernel (`prefill_wg.cu`) tiled as [`WGMMA_PREFILL_PICK`] unless this is `0`
/// (the `mma.sync` kernel, as on other GPUs); set to a tiling's name (`w1_n64`, `w2_n64`,
/// `w1_n128`, `w2_n128`: warpgroups per CTA, keys per tile; `w2_n64_pp`, `w2_n128_pp`: their
/// ping-pong variants), on that tiling. Decode steps are unchanged. Read once per process.
pub const PREFILL_WGMMA_ENV: &str = "OMNI_CUDA_ATTN_WGMMA";

/// The index into [`WGMMA_PREFILL`] a value of [`PREFILL_WGMMA_ENV`] selects (unset, `1` or
/// anything unknown: the default), or `None` for `0`.
fn wgmma_prefill_choice(v: Option<&str>) -> Option<usize> {
    match v.map(str::trim) {
        Some("0") => None,
        Some(v) => Some(
            WGMMA_PREFILL
                .iter()
                .position(|(_, name)| name.strip_prefix("attn_prefill_wg_hd128_") == Some(v))
                .unwrap_or(WGMMA_PREFILL_PICK),
        ),
        None => Some(WGMMA_PREFILL_PICK),
    }
}

/// The tiling [`PREFILL_WGMMA_ENV`] selects, if any.
pub(super) fn wgmma_prefill_enabled() -> Option<usize> {
    static ON: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *ON.get_or_init(|| wgmma_prefill_choice(std::env::var(PREFILL_WGMMA_ENV).ok().as_deref()))
}

/// The wgmma prefill tiling and entry point for `head_dim` on a device of compute capability
/// `cc` when `enabled` (an index into [`WGMMA_PREFILL`], from [`PREFILL_WGMMA_ENV`]), or `None`
/// (the `mma.sync` kernel).
fn wgmma_prefill_for(
    head_dim: usize,
    cc: (i32, i32),
    enabled: Option<usize>,
) -> Option<(PrefillTile, &'static str)> {
    let i = enabled?;
    (cc == (9, 0) && head_dim == WGMMA_HEAD_DIM).then_some(WGMMA_PREFILL[i])
}

/// Prefill kernel tiling for `head_dim` (the `attn_prefill_hd{HD}` entry point).
fn prefill_cfg(head_dim: usize) -> PrefillTile {
    if head_dim <= 128 {
        mma_tile(4, 64, true, 0)
    } else {
        mma_tile(2, 32, false, 0)
    }
}

/// Tilings the prefill timing measures against [`prefill_cfg`] at head_dim 128 (test builds
/// only), with their entry points.
#[cfg(test)]
pub(super) const PREFILL_CANDIDATES: [(PrefillTile, &str); 6] = [
    // The default held to 168 registers (3 CTAs per SM), with Q in registers or re-read.
    (mma_tile(4, 64, true, 3), "attn_prefill_hd128_w4_n64_b3"),
    (mma_tile(4, 64, false, 3), "attn_prefill_hd128_w4_n64_qs_b3"),
    (mma_tile(4, 32, false, 4), "attn_prefill_hd128_w4_n32_qs_b4"),
    (mma_tile(8, 64, true, 0), "attn_prefill_hd128_w8_n64"),
    (mma_tile(8, 32, true, 0), "attn_prefill_hd128_w8_n32"),
    (mma_tile(4, 32, true, 0), "attn_prefill_hd128_w4_n32"),
];
