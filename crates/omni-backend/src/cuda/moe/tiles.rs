//! The tile configurations of the grouped GEMMs (decode, prefill, and the prefill tile on
//! Hopper's warpgroup MMA) and the choice between them.

use super::MoeShape;

/// `OMNI_CUDA_MOE_WGMMA` picks the warpgroup-MMA tiles of sm_90 devices ([`Wgmma`]): `0` keeps
/// them off (prefill steps then run [`LARGE`] and the cuBLAS path, as other GPUs do), `64` runs
/// only the one-warpgroup tile [`LARGE_WG`], `128` the two-warpgroup tile [`LARGE_WG2`] wherever
/// a warpgroup-MMA tile runs, `tma` the default's choice with [`LARGE_TMA`] for [`LARGE_WG2`];
/// unset or any other value: the default ([`Wgmma::Auto`]).
pub const MOE_WGMMA_ENV: &str = "OMNI_CUDA_MOE_WGMMA";

/// Which warpgroup-MMA tiles an sm_90 device's MoE prefill steps run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wgmma {
    /// None: [`LARGE`] and the cuBLAS path.
    Off,
    /// [`LARGE_WG`] only.
    Rows64,
    /// [`LARGE_WG2`] only.
    Rows128,
    /// [`LARGE_WG`], [`LARGE_WG2`] from [`WG2_MIN_PAIRS_PER_EXPERT`], [`LARGE_TMA`] from
    /// [`TMA_MIN_PAIRS_PER_EXPERT`].
    Auto,
    /// [`LARGE_WG`], and [`LARGE_TMA`] from [`WG2_MIN_PAIRS_PER_EXPERT`].
    Tma,
}

impl Wgmma {
    #[cfg(test)]
    pub(super) const ALL: [Wgmma; 5] = [
        Wgmma::Off,
        Wgmma::Rows64,
        Wgmma::Rows128,
        Wgmma::Auto,
        Wgmma::Tma,
    ];

    fn parse(v: Option<&str>) -> Self {
        match v.map(str::trim) {
            Some("0") => Wgmma::Off,
            Some("64") => Wgmma::Rows64,
            Some("128") => Wgmma::Rows128,
            Some("tma") => Wgmma::Tma,
            _ => Wgmma::Auto,
        }
    }
}

/// [`MOE_WGMMA_ENV`] as read once per process.
pub(super) fn wgmma_env() -> Wgmma {
    static MODE: std::sync::OnceLock<Wgmma> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| Wgmma::parse(std::env::var(MOE_WGMMA_ENV).ok().as_deref()))
}

/// Average pairs per expert from which [`Wgmma::Auto`] runs [`LARGE_WG2`] (1024 tokens of
/// Qwen3-30B-A3B; measured faster in the engine from there up, 2-5%).
pub(super) const WG2_MIN_PAIRS_PER_EXPERT: usize = 64;

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
    /// Hopper's warpgroup MMA (`moe_gemm_wg`, sm_90a only; `bk` 64 or 128, `bm` / 64 warpgroups, so
    /// `warps_m` = 4 `bm` / 64 and `warps_n` = 1) rather than `mma.sync` (`moe_gemm`).
    pub(super) wgmma: bool,
    /// Warp-specialized warpgroup-MMA tile (`moe_gemm_ws`, `bm` 128): this many producer warps
    /// issue the copies while the `warps_m` x `warps_n` consumer warps only compute; 0 for
    /// the other tiles.
    pub(super) producer_warps: usize,
    /// A warp-specialized tile whose weight tiles the Tensor Memory Accelerator brings in
    /// (one producer thread issues them; the producers still copy the A rows).
    pub(super) tma: bool,
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
    producer_warps: 0,
    tma: false,
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
    producer_warps: 0,
    tma: false,
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
    producer_warps: 0,
    tma: false,
};

/// [`LARGE_WG`] on 128-row blocks: two warpgroups, each issuing m64n128k16 on its 64 rows
/// against the one weight tile they share (half the weight traffic per row), 3 stages; ~98 KiB
/// of shared memory, 116 registers, 2 CTAs per SM. Its blocks pad each expert's pairs to 128
/// rows (a warpgroup with only padding skips its MMAs), so it runs where experts get many
/// pairs. On an H200 (Qwen3-30B-A3B) a 2048-token prefill 42.99 -> 41.07 ms to the first token,
/// 4000 tokens 88.70 -> 83.80, 1024 22.66 -> 22.17 against [`LARGE_WG`] (the layer alone,
/// with the timing test's routing: 0.98-1.07x its time;
/// `bench/results/gpu-prefill-wgmma-h200-2026-12-04.md`).
pub(super) const LARGE_WG2: TileCfg = TileCfg {
    gate_up_fn: "moe_gate_up_wg2",
    down_fn: "moe_down_wg2",
    bm: 128,
    bn: 128,
    bk: 64,
    warps_m: 8,
    warps_n: 1,
    stages: 3,
    min_ctas: 2,
    wgmma: true,
    producer_warps: 0,
    tma: false,
};

/// [`LARGE_WG2`]'s 128-row blocks against 256 weight rows, warp-specialized and persistent, with
/// the weight tiles brought in by the Tensor Memory Accelerator (`moe_gemm_ws` with TMA): a
/// producer warpgroup (one thread issues each stage's tensor copies of the weights, all 128
/// copy the gathered A rows) fills 4 stages handed over by mbarriers while the two consumer
/// warpgroups only issue MMAs, one stage's in flight; one CTA per SM (~193 KiB, 156
/// registers) loops over the tiles. On an H100 (Qwen3-30B-A3B layer, the timing test's
/// routing) 976.5 against [`LARGE_WG2`]'s 1034.1 µs at 4096 tokens, 656.4 against 628.7 at 2048
/// (`bench/results/gpu-tma-h100-2026-12-06.md`); [`Wgmma::Auto`] runs it from
/// [`TMA_MIN_PAIRS_PER_EXPERT`], `OMNI_CUDA_MOE_WGMMA=tma` wherever [`LARGE_WG2`] would run.
pub(super) const LARGE_TMA: TileCfg = TileCfg {
    bn: 256,
    ..tma_tile("moe_gate_up_tma", "moe_down_tma", 4, 1)
};

/// Average pairs per expert from which [`Wgmma::Auto`] runs [`LARGE_TMA`] (3072 tokens of
/// Qwen3-30B-A3B: between the 2048 tokens where it is 1.04x [`LARGE_WG2`]'s time and the 4096
/// where it is 0.94x).
pub(super) const TMA_MIN_PAIRS_PER_EXPERT: usize = 192;

/// A 128 x 128 warp-specialized tile with TMA weight copies, `stages` stages.
const fn tma_tile(
    gate_up_fn: &'static str,
    down_fn: &'static str,
    stages: usize,
    min_ctas: usize,
) -> TileCfg {
    TileCfg {
        producer_warps: 4,
        tma: true,
        ..wg_tile(gate_up_fn, down_fn, 128, 64, stages, min_ctas)
    }
}

/// Other forms of [`LARGE_TMA`] the timing test measures (test builds only), one CTA per SM:
/// 128 weight rows per tile with 4 stages (~131 KiB; 1.04-1.08x [`LARGE_WG2`]'s time at 2048
/// and 4096 tokens on an H100), 6 (~195 KiB) and 3 (~99 KiB), and 256 rows with 3 stages (~145
/// KiB). (Two CTAs per SM leave 80 registers a thread, too few for ptxas to compile the
/// consumers' MMAs.) And [`LARGE_WG`]'s 64-row blocks with one consumer warpgroup against 128
/// weight rows, two CTAs per SM (256 threads, ~97 KiB each): the padding of 128-row blocks is
/// half the rows at 2048 tokens of Qwen3-30B-A3B. Not yet run on a GPU.
#[cfg(test)]
pub(super) const TMA_CANDIDATES: [TileCfg; 5] = [
    tma_tile("moe_gate_up_tmab128", "moe_down_tmab128", 4, 1),
    tma_tile("moe_gate_up_tmas6", "moe_down_tmas6", 6, 1),
    tma_tile("moe_gate_up_tmas3", "moe_down_tmas3", 3, 1),
    TileCfg {
        bn: 256,
        ..tma_tile("moe_gate_up_tman256s3", "moe_down_tman256s3", 3, 1)
    },
    TileCfg {
        bm: 64,
        warps_m: 4,
        ..tma_tile("moe_gate_up_tmam64", "moe_down_tmam64", 4, 2)
    },
];

/// Warpgroup-MMA tiles the timing test measures against [`LARGE_WG`] (test builds only). The
/// 128-wide K stages halve the CTA barriers per K (the top stall of [`LARGE_WG2`]'s gate_up on
/// an H200), but took 1.00-1.07x [`LARGE_WG2`]'s time on an H100
/// (`bench/results/gpu-tma-h100-2026-12-06.md`). The 256-row blocks of four warpgroups (one
/// CTA per SM) read each expert's weight tile once for up to 256 pairs, where [`LARGE_WG2`]
/// gives about half the experts a second 128-row block at 2048 tokens (~20% fewer L2 -> SM
/// bytes, and that gate_up is L2-bound), yet at 2048 tokens on an H100 they took 663.7 (4
/// stages) and 803.7 µs (3) against [`LARGE_WG2`]'s 634.0, and a 2048-token prefill 43.89
/// against 41.47 ms (`bench/results/gpu-l2-prefetch-2026-12-06.md`).
#[cfg(test)]
pub(super) const WG_CANDIDATES: [TileCfg; 9] = [
    // 256-row blocks (four warpgroups, 512 threads) against 128 weight rows: 3 stages (~147
    // KiB) and 4 (~195 KiB), one CTA per SM.
    wg_tile("moe_gate_up_wg4s3", "moe_down_wg4s3", 256, 64, 3, 1),
    wg_tile("moe_gate_up_wg4s4", "moe_down_wg4s4", 256, 64, 4, 1),
    // LARGE_WG2 with 128-wide K stages: 3 stages, one CTA per SM (~193 KiB).
    wg_tile(
        "moe_gate_up_wg2k128s3",
        "moe_down_wg2k128s3",
        128,
        128,
        3,
        1,
    ),
    // LARGE_WG2 with 128-wide K stages: 2 stages, one CTA per SM (~129 KiB).
    wg_tile(
        "moe_gate_up_wg2k128s2",
        "moe_down_wg2k128s2",
        128,
        128,
        2,
        1,
    ),
    // LARGE_WG with 128-wide K stages: 2 stages, two CTAs per SM (~97 KiB).
    wg_tile("moe_gate_up_wgk128s2", "moe_down_wgk128s2", 64, 128, 2, 2),
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
    },
];

/// A warpgroup-MMA tile of `bm` rows (64 per warpgroup) against 128 weight rows with `bk`-wide
/// K stages.
const fn wg_tile(
    gate_up_fn: &'static str,
    down_fn: &'static str,
    bm: usize,
    bk: usize,
    stages: usize,
    min_ctas: usize,
) -> TileCfg {
    TileCfg {
        gate_up_fn,
        down_fn,
        bm,
        bn: 128,
        bk,
        warps_m: bm / 16,
        warps_n: 1,
        stages,
        min_ctas,
        wgmma: true,
        producer_warps: 0,
        tma: false,
    }
}

/// Warp-specialized forms of [`LARGE_WG2`] (`moe_gemm_ws`, test builds only): producer warps
/// fill the stages through mbarriers while two consumer warpgroups only compute. On an H200 one
/// producer warp was 2.5x [`LARGE_WG`]'s time at 1024-2048 tokens (3 stages; 4.5x with 6): a
/// single warp cannot issue a stage's 2048 copies fast enough.
#[cfg(test)]
pub(super) const WS_CANDIDATES: [TileCfg; 3] = [
    ws_tile("moe_gate_up_ws1s3", "moe_down_ws1s3", 1, 3, 2),
    ws_tile("moe_gate_up_ws2s3", "moe_down_ws2s3", 2, 3, 2),
    ws_tile("moe_gate_up_ws4s6", "moe_down_ws4s6", 4, 6, 1),
];

/// A warp-specialized 128 x 128 tile with `producer_warps` producers and `stages` stages.
#[cfg(test)]
const fn ws_tile(
    gate_up_fn: &'static str,
    down_fn: &'static str,
    producer_warps: usize,
    stages: usize,
    min_ctas: usize,
) -> TileCfg {
    TileCfg {
        producer_warps,
        ..wg_tile(gate_up_fn, down_fn, 128, 64, stages, min_ctas)
    }
}

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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
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
        producer_warps: 0,
        tma: false,
    },
];

impl TileCfg {
    /// The tile the public entry point uses: the decode tile while the average expert gets at
    /// most 8 pairs, the prefill tile above (on an H200 at 16 pairs per expert, 256 tokens of
    /// Qwen3-30B-A3B: 353 against 464 µs; at 8 the decode tile took 336). On sm_90 with the
    /// warpgroup-MMA tiles on, from 8 pairs per expert [`LARGE_WG`] (310 µs there),
    /// [`LARGE_WG2`] or [`LARGE_TMA`] as `wgmma` says.
    pub(super) fn select(shape: &MoeShape, wgmma: Wgmma) -> Self {
        let per_expert = |n: usize| n * shape.num_experts;
        let pairs = shape.pairs();
        match wgmma {
            Wgmma::Off => {}
            _ if pairs < per_expert(8) => {}
            Wgmma::Rows64 => return LARGE_WG,
            Wgmma::Rows128 => return LARGE_WG2,
            Wgmma::Auto if pairs >= per_expert(TMA_MIN_PAIRS_PER_EXPERT) => return LARGE_TMA,
            Wgmma::Auto if pairs >= per_expert(WG2_MIN_PAIRS_PER_EXPERT) => return LARGE_WG2,
            Wgmma::Auto => return LARGE_WG,
            Wgmma::Tma if pairs >= per_expert(WG2_MIN_PAIRS_PER_EXPERT) => return LARGE_TMA,
            Wgmma::Tma => return LARGE_WG,
        }
        if pairs <= per_expert(8) { SMALL } else { LARGE }
    }

    pub(super) fn threads(&self) -> usize {
        32 * (self.warps_m * self.warps_n + self.producer_warps)
    }

    pub(super) fn smem_bytes(&self) -> usize {
        if self.producer_warps > 0 {
            // As below, with two mbarriers per stage instead of the row table.
            self.stages * (self.bm + self.bn) * self.bk * 2 + self.stages * 16 + 1024
        } else if self.wgmma {
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
