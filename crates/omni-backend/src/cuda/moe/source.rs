//! The MoE kernels' source: `kernels/moe/*.cu(h)` after the bf16 helpers, with one `extern "C"`
//! entry point per tile configuration and GEMM instantiating the `moe_gemm` template.

use super::tiles::{LARGE, SMALL, TileCfg};
use crate::cuda::kernels::{BF16_HELPERS, kernel_file};

/// PTX wrappers (sm_80+): `cp.async` with zero fill, `ldmatrix`, bf16 `mma.sync`.
const PTX_HELPERS: &str = kernel_file!("moe/ptx.cuh");
/// The dynamic shared memory all MoE kernels use, bf16x2 packing.
const COMMON: &str = kernel_file!("moe/common.cuh");
/// One token's routing by one warp (shared with the small-batch router).
pub(super) const TOPK_WARP: &str = kernel_file!("moe/topk_warp.cuh");
/// Routing: softmax over the experts, top-k.
const TOPK_SOFTMAX: &str = kernel_file!("moe/topk_softmax.cu");
/// Alignment of the (token, slot) pairs into tile-padded row blocks per expert.
const ALIGN: &str = kernel_file!("moe/align.cu");
/// The grouped GEMM template (`moe_gemm`).
const GROUPED_GEMM: &str = kernel_file!("moe/grouped_gemm.cu");
/// The weighted reduction over a token's slots.
const REDUCE: &str = kernel_file!("moe/reduce.cu");
/// The cuBLAS prefill path's counts and gather.
const GATHER: &str = kernel_file!("moe/gather.cu");

pub(super) const TOPK_FN: &str = "moe_topk_softmax";
pub(super) const ALIGN_FN: &str = "moe_align";
pub(super) const REDUCE_FN: &str = "moe_reduce";
pub(super) const COUNT_FN: &str = "moe_count";
pub(super) const GATHER_FN: &str = "moe_gather";

/// The `extern "C"` wrapper instantiating `moe_gemm` for one tile configuration.
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
        ..
    } = *cfg;
    let threads = cfg.threads();
    format!(
        r#"
extern "C" __global__ void __launch_bounds__({threads}, {min_ctas}) {name}(
        const unsigned short* __restrict__ a, const unsigned short* __restrict__ w,
        const int* __restrict__ sorted_ids, const int* __restrict__ block_expert,
        unsigned short* __restrict__ dst, int hidden, int inter, int top_k) {{
    moe_gemm<{bm}, {bn}, {bk}, {warps_m}, {warps_n}, {stages}, {gate_up}>(a, w, sorted_ids, block_expert, dst, hidden, inter, top_k);
}}
"#
    )
}

/// Full source of the MoE module (every MoE entry point).
pub(crate) fn moe_source() -> String {
    let mut s = format!(
        "{BF16_HELPERS}{PTX_HELPERS}{COMMON}{TOPK_WARP}{TOPK_SOFTMAX}{ALIGN}{GROUPED_GEMM}{REDUCE}{GATHER}"
    );
    for cfg in [SMALL, LARGE] {
        s.push_str(&gemm_entry(&cfg, true));
        s.push_str(&gemm_entry(&cfg, false));
    }
    #[cfg(test)]
    for cfg in super::tiles::CANDIDATES {
        s.push_str(&gemm_entry(&cfg, true));
        s.push_str(&gemm_entry(&cfg, false));
    }
    s
}
