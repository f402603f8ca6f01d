//! The two tile configurations of the grouped GEMMs and the choice between them.

use super::MoeShape;

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
};

/// Prefill tile: 64 sorted rows x 256 weight rows, 4 warps of 64 x 64, 32-wide K stages, 4
/// stages; 100 KiB of shared memory, 2 CTAs per SM.
pub(super) const LARGE: TileCfg = TileCfg {
    gate_up_fn: "moe_gate_up_large",
    down_fn: "moe_down_large",
    bm: 64,
    bn: 256,
    bk: 32,
    warps_m: 1,
    warps_n: 4,
    stages: 4,
    min_ctas: 2,
};

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
    },
];

impl TileCfg {
    /// The tile the public entry point uses: the decode tile while the average expert gets at
    /// most 16 pairs, the prefill tile above.
    pub(super) fn select(shape: &MoeShape) -> Self {
        if shape.pairs() <= 16 * shape.num_experts {
            SMALL
        } else {
            LARGE
        }
    }

    pub(super) fn threads(&self) -> usize {
        32 * self.warps_m * self.warps_n
    }

    pub(super) fn smem_bytes(&self) -> usize {
        self.stages * (self.bm + self.bn) * (self.bk + 8) * 2 + self.bm * 4
    }

    /// Upper bound on the `bm`-row blocks the alignment can use for `pairs` pairs over
    /// `experts` experts: each non-empty expert wastes at most `bm - 1` padding rows, and every
    /// used block holds at least one pair.
    pub(super) fn max_blocks(&self, pairs: usize, experts: usize) -> usize {
        let bound = (pairs + pairs.min(experts) * (self.bm - 1)).div_ceil(self.bm);
        bound.min(pairs)
    }
}
