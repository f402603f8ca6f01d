//! The tile configurations of the grouped GEMMs (decode, prefill, and the prefill tile on
//! Hopper's warpgroup MMA) and the choice between them.

use super::MoeShape;

/// `OMNI_CUDA_MOE_WGMMA=0` keeps sm_90 devices off the warpgroup-MMA tile ([`LARGE_WG`]):
/// their prefill steps then run [`LARGE`] and the cuBLAS path, as other GPUs do. Unset or any
/// other value: on.
pub const MOE_WGMMA_ENV: &str = "OMNI_CUDA_MOE_WGMMA";

/// Whether [`MOE_WGMMA_ENV`] leaves the warpgroup-MMA tile on (the default).
pub(super) fn wgmma_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(MOE_WGMMA_ENV).map_or(true, |v| v != "0"))
}

/// One tile configuration of the grouped GEMMs (the template arguments of its entry points in
/// the kernel source, emitted by `source.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TileCfg {
    pub(super) gate_up_fn: &'static str,
    pub(super) down_fn: &'static str,
    /// Rows (sorted pairs) per CTA.
    pub(super) bm: usize,
    /// Weight rows per CTA (for gate_up: `bn / 2` gate rows and the matching `bn / 2` up rows).
    pub(super) bn: usize,
    /// K per pipeline stage.
    pub(super) bk: usize,
    pub(super) warps_m: usize,
    pub(super) warps_n: usize,
    pub(super) stages: usize,
    /// `__launch_bounds__` minimum CTAs per SM.
    pub(super) min_ctas: usize,
    /// Hopper's warpgroup MMA (`moe_gemm_wg`, sm_90a only; `bm` 64, `bk` 64, one warpgroup as
    /// `warps_m` 4 x `warps_n` 1) rather than `mma.sync` (`moe_gemm`).
    pub(super) wgmma: bool,
}

/// Decode tile: 16 sorted rows x 32 weight rows, 2 warps, 128-wide K stages (8 KiB of weights
/// per stage), 4 stages; ~52 KiB of shared memory, 4 CTAs per SM.
pub(super) const SMALL: TileCfg = TileCfg {
    gate_up_fn: "moe_gate_up_small",
    down_fn: "moe_down_small",
    bm: 16,
    bn: 32,
    bk: 128,
    warps_m: 1,
    warps_n: 2,
    stages: 4,
    min_ctas: 4,
    wgmma: false,
};

/// Prefill tile: 64 sorted rows x 128 weight rows, 4 warps of 32 x 64, 64-wide K stages (each
/// copy is 128 contiguous bytes of a weight row), 3 stages; ~83 KiB of shared memory, 2 CTAs
/// per SM. On an H200 (Qwen3-30B-A3B layer) 0.70-0.94x the time of the 64 x 256 tile with
/// 32-wide stages from 256 to 2048 tokens (353 µs at 256, 378 at 512, 401 at 768), and faster
/// than the cuBLAS path up to 768 tokens (`bench/results/gpu-moe-wgmma-h200-2026-12-04.md`).
pub(super) const LARGE: TileCfg = TileCfg {
    gate_up_fn: "moe_gate_up_large",
    down_fn: "moe_down_large",
    bm: 64,
    bn: 128,
    bk: 64,
    warps_m: 2,
    warps_n: 2,
    stages: 3,
    min_ctas: 2,
    wgmma: false,
};

/// Prefill tile on Hopper (sm_90): the 64-row blocks of [`LARGE`] (the same alignment and
/// workspace) against 128 weight rows, one warpgroup issuing `wgmma.mma_async` m64n128k16 from
/// shared memory, 3 stages of 64-wide K; ~74 KiB of shared memory and 142 registers, 3 CTAs per
/// SM. On an H200 (Qwen3-30B-A3B layer) 0.85-0.91x the time of [`LARGE`] from 128 to 768
/// tokens and 0.66x at 2048; at 1024+ tokens 0.88-1.36x the cuBLAS path's, which it replaces
/// there: it needs no host synchronization (a 2048-token prefill 47.0 against 64.4 ms to the
/// first token; `bench/results/gpu-moe-wgmma-h200-2026-12-04.md`).
pub(super) const LARGE_WG: TileCfg = TileCfg {
    gate_up_fn: "moe_gate_up_wg",
    down_fn: "moe_down_wg",
    bm: 64,
    bn: 128,
    bk: 64,
    warps_m: 4,
    warps_n: 1,
    stages: 3,
    min_ctas: 2,
    wgmma: true,
};

/// Warpgroup-MMA tiles the timing test measures against [`LARGE_WG`] (test builds only).
#[cfg(test)]
pub(super) const WG_CANDIDATES: [TileCfg; 4] = [
    // 192 weight rows (96 gate + 96 up), 3 stages, 2 CTAs per SM.
    TileCfg {
        gate_up_fn: "moe_gate_up_wg192s3",
        down_fn: "moe_down_wg192s3",
        bm: 64,
        bn: 192,
        bk: 64,
        warps_m: 4,
        warps_n: 1,
        stages: 3,
        min_ctas: 2,
        wgmma: true,
    },
    // 256 weight rows, 2 stages, 2 CTAs per SM.
    TileCfg {
        gate_up_fn: "moe_gate_up_wg256s2",
        down_fn: "moe_down_wg256s2",
        bm: 64,
        bn: 256,
        bk: 64,
        warps_m: 4,
        warps_n: 1,
        stages: 2,
        min_ctas: 2,
        wgmma: true,
    },
    // LARGE_WG with 4 stages (2 CTAs per SM).
    TileCfg {
        gate_up_fn: "moe_gate_up_wg128s4",
        down_fn: "moe_down_wg128s4",
        bm: 64,
        bn: 128,
        bk: 64,
        warps_m: 4,
        warps_n: 1,
        stages: 4,
        min_ctas: 2,
        wgmma: true,
    },
    // 256 weight rows, 3 stages, one CTA per SM.
    TileCfg {
        gate_up_fn: "moe_gate_up_wg256s3",
        down_fn: "moe_down_wg256s3",
        bm: 64,
        bn: 256,
        bk: 64,
        warps_m: 4,
        warps_n: 1,
        stages: 3,
        min_ctas: 1,
        wgmma: true,
    },
];

/// Decode tiles the timing test measures against [`SMALL`] (test builds only): more weight rows
/// per CTA, deeper pipelines, one-warp CTAs, wider K stages. All keep `bm` 16, so the alignment
/// and the workspace are [`SMALL`]'s.
#[cfg(test)]
pub(super) const CANDIDATES: [TileCfg; 4] = [
    TileCfg {
        gate_up_fn: "moe_gate_up_c64x64s6",
        down_fn: "moe_down_c64x64s6",
        bm: 16,
        bn: 64,
        bk: 64,
        warps_m: 1,
        warps_n: 4,
        stages: 6,
        min_ctas: 3,
        wgmma: false,
    },
    TileCfg {
        gate_up_fn: "moe_gate_up_c32x128s6",
        down_fn: "moe_down_c32x128s6",
        bm: 16,
        bn: 32,
        bk: 128,
        warps_m: 1,
        warps_n: 2,
        stages: 6,
        min_ctas: 2,
        wgmma: false,
    },
    TileCfg {
        gate_up_fn: "moe_gate_up_c16x128s4",
        down_fn: "moe_down_c16x128s4",
        bm: 16,
        bn: 16,
        bk: 128,
        warps_m: 1,
        warps_n: 1,
        stages: 4,
        min_ctas: 6,
        wgmma: false,
    },
    TileCfg {
        gate_up_fn: "moe_gate_up_c64x128s4",
        down_fn: "moe_down_c64x128s4",
        bm: 16,
        bn: 64,
        bk: 128,
        warps_m: 1,
        warps_n: 4,
        stages: 4,
        min_ctas: 2,
        wgmma: false,
    },
];

/// Prefill tiles the timing test measures against [`LARGE`] (test builds only). All keep `bm`
/// 64, so the alignment and the workspace are [`LARGE`]'s.
#[cfg(test)]
pub(super) const LARGE_CANDIDATES: [TileCfg; 4] = [
    // The previous prefill tile: 4 warps of 64 x 64 over 256 weight rows, 32-wide K stages.
    TileCfg {
        gate_up_fn: "moe_gate_up_l64x256k32",
        down_fn: "moe_down_l64x256k32",
        bm: 64,
        bn: 256,
        bk: 32,
        warps_m: 1,
        warps_n: 4,
        stages: 4,
        min_ctas: 2,
        wgmma: false,
    },
    // LARGE with 4 stages.
    TileCfg {
        gate_up_fn: "moe_gate_up_l64x128k64s4",
        down_fn: "moe_down_l64x128k64s4",
        bm: 64,
        bn: 128,
        bk: 64,
        warps_m: 2,
        warps_n: 2,
        stages: 4,
        min_ctas: 2,
        wgmma: false,
    },
    // LARGE with warps of 64 x 32.
    TileCfg {
        gate_up_fn: "moe_gate_up_l64x128w1x4",
        down_fn: "moe_down_l64x128w1x4",
        bm: 64,
        bn: 128,
        bk: 64,
        warps_m: 1,
        warps_n: 4,
        stages: 3,
        min_ctas: 2,
        wgmma: false,
    },
    // LARGE with 32-wide K stages, 4 of them, 3 CTAs per SM.
    TileCfg {
        gate_up_fn: "moe_gate_up_l64x128k32s4",
        down_fn: "moe_down_l64x128k32s4",
        bm: 64,
        bn: 128,
        bk: 32,
        warps_m: 2,
        warps_n: 2,
        stages: 4,
        min_ctas: 3,
        wgmma: false,
    },
];

impl TileCfg {
    /// The tile the public entry point uses: the decode tile while the average expert gets at
    /// most 8 pairs, the prefill tile above (on an H200 at 16 pairs per expert, 256 tokens of
    /// Qwen3-30B-A3B: 353 against 464 µs; at 8 the decode tile took 336). With `wgmma` (an
    /// sm_90 device, [`MOE_WGMMA_ENV`] on) [`LARGE_WG`] from 8 pairs per expert (310 µs there).
    pub(super) fn select(shape: &MoeShape, wgmma: bool) -> Self {
        let per_expert_8 = 8 * shape.num_experts;
        if wgmma && shape.pairs() >= per_expert_8 {
            LARGE_WG
        } else if shape.pairs() <= per_expert_8 {
            SMALL
        } else {
            LARGE
        }
    }

    pub(super) fn threads(&self) -> usize {
        32 * self.warps_m * self.warps_n
    }

    pub(super) fn smem_bytes(&self) -> usize {
        if self.wgmma {
            // Unpadded swizzled rows, and up to 1024 bytes to align the first tile.
            self.stages * (self.bm + self.bn) * self.bk * 2 + self.bm * 4 + 1024
        } else {
            self.stages * (self.bm + self.bn) * (self.bk + 8) * 2 + self.bm * 4
        }
    }

    /// Upper bound on the `bm`-row blocks the alignment can use for `pairs` pairs over
    /// `experts` experts: each non-empty expert wastes at most `bm - 1` padding rows, and every
    /// used block holds at least one pair.
    pub(super) fn max_blocks(&self, pairs: usize, experts: usize) -> usize {
        let bound = (pairs + pairs.min(experts) * (self.bm - 1)).div_ceil(self.bm);
        bound.min(pairs)
    }
}
