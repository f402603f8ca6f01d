//! The MoE kernels' source: `kernels/moe/*.cu(h)` after the bf16 helpers, with one `extern "C"`
//! entry point per tile configuration and GEMM instantiating the `moe_gemm` template; and the
//! Hopper modules (sm_90a) of the warpgroup-MMA GEMMs (`moe_gemm_wg`; the persistent
//! warp-specialized `moe_gemm_ws` with cp.async or TMA weight copies in a module of its own),
//! with their generated `wgmma` wrappers.

use super::tiles::{LARGE, LARGE_TMA, LARGE_WG, LARGE_WG2, SMALL, TileCfg};
use crate::cuda::kernels::{BF16_HELPERS, kernel_file};

/// PTX wrappers (sm_80+): `cp.async` with zero fill, `ldmatrix`, bf16 `mma.sync`.
const PTX_HELPERS: &str = kernel_file!("moe/ptx.cuh");
/// The dynamic shared memory all MoE kernels use, bf16x2 packing.
const COMMON: &str = kernel_file!("moe/common.cuh");
/// One token's routing by one warp (shared with the small-batch router).
const TOPK_WARP_FILE: &str = kernel_file!("moe/topk_warp.cuh");

/// The MoE modules route tokens of up to 256 experts from registers (`moe_topk_regs`: two
/// `redux.sync` a pick; the same experts and weights as the shared-memory form, checked on the
/// CPU by `topk_emu.rs`) unless this is `0`. On by default since measured (H100, 2026-12-07:
/// batch-1 decode +1.5%). Read once per process.
pub const MOE_TOPK_REGS_ENV: &str = "OMNI_CUDA_MOE_TOPK_REGS";

/// The define that selects the shared-memory top-k for every expert count (prepended to a
/// module's source).
pub(crate) const TOPK_SMEM_DEFINE: &str = "#define MOE_TOPK_FROM_SMEM\n";

/// The warp top-k's source (`topk_warp.cuh`), with [`TOPK_SMEM_DEFINE`] when
/// [`MOE_TOPK_REGS_ENV`] is `0`.
pub(super) fn topk_warp() -> &'static str {
    static SRC: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SRC.get_or_init(|| {
        let regs = crate::cuda::switch_on(MOE_TOPK_REGS_ENV);
        let define = if regs { "" } else { TOPK_SMEM_DEFINE };
        format!("{define}{TOPK_WARP_FILE}")
    })
}
/// Routing: softmax over the experts, top-k.
const TOPK_SOFTMAX: &str = kernel_file!("moe/topk_softmax.cu");
/// The router of long steps on tensor cores with its top-k (`moe_route_mma`).
const ROUTE_MMA: &str = kernel_file!("moe/route_mma.cu");
/// Alignment of the (token, slot) pairs into tile-padded row blocks per expert.
const ALIGN: &str = kernel_file!("moe/align.cu");
/// The grouped GEMM template (`moe_gemm`).
const GROUPED_GEMM: &str = kernel_file!("moe/grouped_gemm.cu");
/// The weighted reduction over a token's slots.
const REDUCE: &str = kernel_file!("moe/reduce.cu");
/// The grouped GEMM template on warpgroup MMA (`moe_gemm_wg`, sm_90a).
const GROUPED_GEMM_WG: &str = kernel_file!("moe/grouped_gemm_wg.cu");
/// Shared-memory mbarriers and the TMA tensor copy (the warp-specialized GEMMs').
const MBARRIER: &str = kernel_file!("moe/mbarrier.cuh");
/// Its warp-specialized form (`moe_gemm_ws`: cp.async or TMA weight copies).
const GROUPED_GEMM_WS: &str = kernel_file!("moe/grouped_gemm_ws.cu");
/// The cuBLAS prefill path's counts and gather.
const GATHER: &str = kernel_file!("moe/gather.cu");

pub(super) const TOPK_FN: &str = "moe_topk_softmax";
pub(super) const ALIGN_FN: &str = "moe_align";
pub(super) const REDUCE_FN: &str = "moe_reduce";
pub(super) const COUNT_FN: &str = "moe_count";
pub(super) const GATHER_FN: &str = "moe_gather";

/// The architecture the warpgroup-MMA module is compiled for (`wgmma` needs the
/// architecture-specific `a` target).
pub(crate) const WGMMA_ARCH: &str = "sm_90a";

/// The `extern "C"` wrapper instantiating `moe_gemm` (or `moe_gemm_wg`, `moe_gemm_ws`) for one
/// tile configuration.
fn gemm_entry(cfg: &TileCfg, gate_up: bool) -> String {
    let name = if gate_up { cfg.gate_up_fn } else { cfg.down_fn };
    let TileCfg {
        bm,
        bn,
        bk,
        warps_m,
        warps_n,
        stages,
        min_ctas,
        producer_warps,
        ..
    } = *cfg;
    let threads = cfg.threads();
    let (template, args) = if producer_warps > 0 {
        let (tma, wgs) = (cfg.tma, bm / 64);
        (
            "moe_gemm_ws",
            format!("{bn}, {stages}, {producer_warps}, {wgs}, {tma}"),
        )
    } else if cfg.wgmma {
        ("moe_gemm_wg", format!("{bn}, {bk}, {stages}, {}", bm / 64))
    } else {
        (
            "moe_gemm",
            format!("{bm}, {bn}, {bk}, {warps_m}, {warps_n}, {stages}"),
        )
    };
    // The persistent warp-specialized template also takes the number of row blocks, and the
    // weights' tensor map (TMA tiles: one more parameter, by value) or null.
    let (map_param, map_arg) = match (producer_warps > 0, cfg.tma) {
        (true, true) => (
            ", int max_blocks, const __grid_constant__ MoeTensorMap wmap",
            ", max_blocks, &wmap",
        ),
        (true, false) => (", int max_blocks", ", max_blocks, nullptr"),
        _ => ("", ""),
    };
    format!(
        r#"
extern "C" __global__ void __launch_bounds__({threads}, {min_ctas}) {name}(
        const unsigned short* __restrict__ a, const unsigned short* __restrict__ w,
        const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
        unsigned short* __restrict__ dst, int hidden, int inter, int top_k{map_param}) {{
    {template}<{args}, {gate_up}>(a, w, sorted_ids, block_expert, dst, hidden, inter, top_k{map_arg});
}}
"#
    )
}

/// Full source of the MoE module (every MoE entry point).
pub(crate) fn moe_source() -> String {
    let mut s = format!(
        "{BF16_HELPERS}{PTX_HELPERS}{COMMON}{}{TOPK_SOFTMAX}{ROUTE_MMA}{ALIGN}{GROUPED_GEMM}{REDUCE}{GATHER}",
        topk_warp()
    );
    for cfg in [SMALL, LARGE] {
        s.push_str(&gemm_entry(&cfg, true));
        s.push_str(&gemm_entry(&cfg, false));
    }
    #[cfg(test)]
    for cfg in super::tiles::CANDIDATES
        .into_iter()
        .chain(super::tiles::LARGE_CANDIDATES)
    {
        s.push_str(&gemm_entry(&cfg, true));
        s.push_str(&gemm_entry(&cfg, false));
    }
    s
}

/// `wgmma_bf16<n>(d, desc_a, desc_b)`: one `wgmma.mma_async` m64n{n}k16, bf16 in, f32
/// accumulated into the `n / 2` floats of `d` (scale-d 1, no negation, both operands K-major);
/// `wgmma_bf16_first<n>` the same overwriting `d` (scale-d 0: a tile's first MMA, with no
/// register writes before it that ptxas would have to order against the MMAs).
fn wgmma_wrapper(n: usize) -> String {
    let mut s = String::new();
    for (name, overwrite) in [("wgmma_bf16", false), ("wgmma_bf16_first", true)] {
        let asm = crate::cuda::wgmma::ss_asm(n, overwrite);
        s.push_str(&format!(
            "\ntemplate <> __device__ __forceinline__ void {name}<{n}>(float* d, unsigned long long da, unsigned long long db) {{\n    {asm}\n}}\n"
        ));
    }
    s
}

/// The warpgroup-MMA tiles of the `moe_gemm_wg` module: [`LARGE_WG`], [`LARGE_WG2`], and in
/// test builds the timing test's candidates.
fn wg_tiles() -> Vec<TileCfg> {
    #[allow(unused_mut)]
    let mut v = vec![LARGE_WG, LARGE_WG2];
    #[cfg(test)]
    v.extend(super::tiles::WG_CANDIDATES);
    v
}

/// The warp-specialized tiles of the `moe_gemm_ws` module: [`LARGE_TMA`], and in test builds
/// the timing test's other TMA depths and cp.async-producer candidates.
fn ws_tiles() -> Vec<TileCfg> {
    #[allow(unused_mut)]
    let mut v = vec![LARGE_TMA];
    #[cfg(test)]
    v.extend(super::tiles::TMA_CANDIDATES);
    #[cfg(test)]
    v.extend(super::tiles::WS_CANDIDATES);
    v
}

/// A Hopper MoE module (compiled for [`WGMMA_ARCH`]): the helpers, the `wgmma` wrappers of the
/// tiles' widths, `moe_gemm_wg` (whose descriptor, copy and epilogue helpers every tile uses),
/// `extra` kernel sources, and the entries of `tiles`.
fn hopper_module(tiles: &[TileCfg], extra: &[&str]) -> String {
    let mut s = format!(
        "{BF16_HELPERS}{PTX_HELPERS}{COMMON}\ntemplate <int N> __device__ __forceinline__ void wgmma_bf16(float* d, unsigned long long da, unsigned long long db);\ntemplate <int N> __device__ __forceinline__ void wgmma_bf16_first(float* d, unsigned long long da, unsigned long long db);\n"
    );
    let mut widths: Vec<usize> = tiles.iter().map(|t| t.bn).collect();
    widths.sort_unstable();
    widths.dedup();
    for n in widths {
        s.push_str(&wgmma_wrapper(n));
    }
    s.push_str(GROUPED_GEMM_WG);
    for e in extra {
        s.push_str(e);
    }
    for cfg in tiles {
        s.push_str(&gemm_entry(cfg, true));
        s.push_str(&gemm_entry(cfg, false));
    }
    s
}

/// The warpgroup-MMA grouped GEMMs of every tile in [`wg_tiles`] (the default prefill tiles).
pub(crate) fn moe_wgmma_source() -> String {
    hopper_module(&wg_tiles(), &[])
}

/// The warp-specialized grouped GEMMs of every tile in [`ws_tiles`], a module of their own so
/// that the default tiles' module (compiled at every worker's start-up) does not grow with
/// them.
pub(crate) fn moe_ws_source() -> String {
    hopper_module(&ws_tiles(), &[MBARRIER, GROUPED_GEMM_WS])
}
