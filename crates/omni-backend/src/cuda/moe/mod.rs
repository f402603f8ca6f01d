//! Mixture-of-experts on the GPU (Qwen3-MoE): top-k softmax routing and a fused,
//! CUDA-graph-capturable expert MLP.
//!
//! [`CudaContext::fused_moe_bf16`] queues four kernels, none of which reads routing on the host:
//!
//! 1. `moe_align` (one CTA): counts the `(token, slot)` pairs per expert, pads every expert's
//!    count to a multiple of the tile height `BM`, prefix-sums the padded counts and scatters the
//!    pair indices `t * top_k + slot` into `sorted_ids` (padding rows are `-1`), with the expert of
//!    each `BM`-row block in `block_expert` (`-1` for blocks past the used ones). Like vLLM's
//!    `moe_align_block_size`.
//! 2. A grouped GEMM `gate_up = x[token] @ w13[e]^T` over the sorted rows, gathering token rows of
//!    `x`, with SiLU-and-mul fused in the epilogue (each CTA owns matching gate and up columns),
//!    into `act` (`[sorted rows, inter]`).
//! 3. A grouped GEMM `y[pair] = act @ w2[e]^T`, scattering rows back to pair order.
//! 4. `moe_reduce`: `out[t] = sum_slot w[t, slot] * y[t * top_k + slot]` in f32, slots in order
//!    (deterministic, no float atomics), rounded to bf16 (widened back to f32 by
//!    [`CudaContext::fused_moe_bf16`] into an f32 output, the residual stream's type).
//!
//! Both GEMMs run on tensor cores (`mma.sync.m16n8k16` bf16 -> f32, `ldmatrix`, a multi-stage
//! `cp.async` pipeline). Launch grids depend only on host scalars: the number of `BM`-row blocks
//! is bounded by `min(P, ceil((P + min(E, P) * (BM - 1)) / BM))` for `P = tokens * top_k`
//! pairs, and unused blocks exit at once. Two tile shapes exist: a decode tile (`BM = 16`, narrow
//! `N` tiles so a handful of experts still spreads over every SM and streams its weights once)
//! and a prefill tile (`BM = 64`, `BN = 128`, 32 x 64 warp tiles); the choice depends only on the
//! average number of pairs per expert.
//!
//! On sm_90 (Hopper) the prefill steps, from 8 pairs per expert, run warpgroup-MMA tiles
//! instead (`wgmma.mma_async` m64n128k16 reading both operands from 128-byte-swizzled shared
//! memory; `kernels/moe/grouped_gemm_wg.cu`, its own module compiled for `sm_90a`): the same
//! 64-row blocks with one warpgroup per CTA, and from 64 pairs per expert 128-row blocks with two
//! warpgroups sharing each weight tile, from 192 pairs per expert a persistent warp-specialized
//! tile of 128 rows x 256 weight rows whose weight tiles the Tensor Memory Accelerator copies
//! (`kernels/moe/grouped_gemm_ws.cu`, its own module; tensor maps in `tma.rs`).
//! `OMNI_CUDA_MOE_WGMMA` (`0` off, `64` / `128` one tile only, `tma` the TMA tile from 64 pairs
//! per expert) chooses.
//!
//! Elsewhere (or with it off), prefill steps of 64+ pairs per expert outside a CUDA graph
//! capture run the two GEMMs on cuBLAS's grouped GEMM (`cublas.rs`): the counts go to the host
//! once, the token rows are gathered into expert order without padding, and the reduction reads
//! them through each pair's row. `OMNI_CUDA_MOE_CUBLAS=0` keeps the kernels below.
//!
//! Here: the shape and the workspace layout; in `tiles.rs` the two tile configurations, in
//! `source.rs` the kernels' source (`kernels/moe/*`, with one `extern "C"` entry per tile and
//! GEMM), in `launch.rs` the launchers. Steps of at most 8 tokens have a three-kernel path of
//! their own, norm and routing included (`small.rs`; host emulators in `small_emu.rs`, GPU
//! tests in `small_tests.rs`), and one-token steps on Hopper the same in one launch
//! (`block1.rs`); longer steps' router logits come from `router.rs` (f32-accurate
//! products on tensor cores).

#[cfg(test)]
mod align_emu;
pub(super) mod block1;
#[cfg(test)]
mod block1_emu;
#[cfg(test)]
mod block1_tests;
mod cublas;
mod launch;
mod route_mma;
#[cfg(test)]
mod route_mma_emu;
mod router;
#[cfg(test)]
mod router_tests;
pub(super) mod small;
#[cfg(test)]
mod small_emu;
#[cfg(test)]
mod small_tests;
pub(super) mod source;
#[cfg(test)]
mod tests;
mod tiles;
#[cfg(test)]
mod timing_tests;
mod tma;
#[cfg(test)]
mod topk_emu;

pub use block1::{MOE_BLOCK1_BARRIER_ENV, MOE_ONE_LAUNCH_ENV, MoeBlock1Buffers};
pub use cublas::MOE_CUBLAS_ENV;
pub use launch::MoeOutElem;
pub use route_mma::{
    MOE_ROUTE_MMA_ENV, ROUTE_MMA_MAX_EXPERTS, ROUTE_MMA_MIN_TOKENS, RouteMmaBuffers,
    moe_route_mma_enabled, moe_route_mma_workspace_len,
};
pub use router::RouterSplit;
pub use small::{
    MOE_SMALL_MAX_HIDDEN, MOE_SMALL_MAX_INTER, MOE_SMALL_MAX_PAIRS, MOE_SMALL_MAX_TOKENS,
    MoeRouteBuffers, moe_small_act_len,
};
pub use source::MOE_TOPK_REGS_ENV;
pub use tiles::MOE_WGMMA_ENV;

#[cfg(doc)]
use super::CudaContext;

use tiles::{LARGE, LARGE_WG2, SMALL, TileCfg};

/// Largest expert count the routing and alignment kernels support (their per-expert tables live
/// in shared memory).
pub const MOE_MAX_EXPERTS: usize = 1024;

/// Dimensions of one fused MoE call (one layer, one tensor-parallel rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Tokens `T` (rows of `x` and `out`).
    pub tokens: usize,
    /// Hidden size `H` (a positive multiple of 8).
    pub hidden: usize,
    /// This rank's expert intermediate size `I` (a positive multiple of 8).
    pub inter: usize,
    /// Experts `E` (`1..=`[`MOE_MAX_EXPERTS`]).
    pub num_experts: usize,
    /// Experts per token `k` (`1..=E`).
    pub top_k: usize,
}

impl MoeShape {
    fn pairs(&self) -> usize {
        self.tokens * self.top_k
    }
}

/// Byte offsets of the workspace parts for one tile configuration.
#[derive(Debug, Clone, Copy)]
struct Layout {
    max_blocks: usize,
    sorted: usize,
    block_expert: usize,
    act: usize,
    y: usize,
    total: usize,
}

fn align256(x: usize) -> usize {
    x.div_ceil(256) * 256
}

impl Layout {
    fn new(shape: &MoeShape, cfg: &TileCfg) -> Self {
        let max_blocks = cfg.max_blocks(shape.pairs(), shape.num_experts);
        let rows = max_blocks * cfg.bm;
        let sorted = 0;
        let block_expert = align256(sorted + rows * 4);
        let act = align256(block_expert + max_blocks * 4);
        let y = align256(act + rows * shape.inter * 2);
        let total = align256(y + shape.pairs() * shape.hidden * 2);
        Self {
            max_blocks,
            sorted,
            block_expert,
            act,
            y,
            total,
        }
    }
}

/// Bytes of device workspace [`CudaContext::fused_moe_bf16`] needs for `shape`. The size grows
/// with `tokens` (other dimensions fixed), so a workspace sized for the largest batch serves every
/// smaller one.
pub fn fused_moe_workspace_bytes(shape: MoeShape) -> usize {
    Layout::new(&shape, &SMALL)
        .total
        .max(Layout::new(&shape, &LARGE).total)
        .max(Layout::new(&shape, &LARGE_WG2).total)
        .max(cublas::CublasLayout::new(&shape).total)
}
