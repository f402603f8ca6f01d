//! GPU tests of routing and the fused expert block against CPU references, and the
//! workspace bound.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::{CudaSlice, DevicePtrMut};

use super::launch::{MoeGemm, MoeOut};
use super::tiles::{
    LARGE_TMA, LARGE_WG, LARGE_WG2, TMA_CANDIDATES, TileCfg, WG_CANDIDATES, WS_CANDIDATES, Wgmma,
};
use super::*;
use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
use crate::cuda::{CudaContext, CudaError, bf16};
use crate::{linalg, ops};

#[test]
fn moe_workspace_bound_and_tiles() {
    // The row-block bound holds for adversarial routings: all pairs on one expert, one pair
    // per expert, skewed and uniform spreads.
    for cfg in [SMALL, LARGE] {
        for &(pairs, experts) in &[
            (1usize, 8usize),
            (8, 128),
            (128, 128),
            (300, 7),
            (16384, 128),
        ] {
            let bound = cfg.max_blocks(pairs, experts);
            let mut routings: Vec<Vec<usize>> = vec![
                (0..pairs).map(|_| 0).collect(),
                (0..pairs).map(|p| p % experts).collect(),
                (0..pairs).map(|p| (p * p + 7 * p) % experts).collect(),
            ];
            let mut s = 12345u64;
            routings.push(
                (0..pairs)
                    .map(|_| {
                        s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                        (s >> 33) as usize % experts
                    })
                    .collect(),
            );
            for r in routings {
                let mut count = vec![0usize; experts];
                for e in r {
                    count[e] += 1;
                }
                let used: usize = count.iter().map(|c| c.div_ceil(cfg.bm)).sum();
                assert!(
                    used <= bound,
                    "{cfg:?} pairs={pairs} experts={experts}: {used} > {bound}"
                );
            }
        }
    }
    let mut last = 0;
    for t in [1usize, 2, 8, 64, 255, 256, 257, 2048] {
        let s = MoeShape {
            tokens: t,
            hidden: 2048,
            inter: 768,
            num_experts: 128,
            top_k: 8,
        };
        let b = fused_moe_workspace_bytes(s);
        for wgmma in Wgmma::ALL {
            assert!(b >= Layout::new(&s, &TileCfg::select(&s, wgmma)).total);
        }
        assert!(b >= last);
        last = b;
    }
    assert!(LARGE.smem_bytes() <= 113 * 1024, "two prefill CTAs per SM");
    assert!(LARGE_WG.smem_bytes() <= 113 * 1024, "two wgmma CTAs per SM");
    assert!(
        LARGE_WG2.smem_bytes() <= 113 * 1024,
        "two 2-warpgroup CTAs per SM"
    );
    assert_eq!((LARGE_WG2.bm, LARGE_WG2.threads()), (128, 256));
    for ws in WS_CANDIDATES
        .into_iter()
        .chain([LARGE_TMA])
        .chain(TMA_CANDIDATES)
    {
        // The warp-specialized tiles run on LARGE_WG2's (or LARGE_WG's) alignment and
        // workspace: one consumer warpgroup per 64 rows.
        assert!(ws.bm == 128 || ws.bm == LARGE_WG.bm, "{ws:?}");
        assert_eq!(ws.threads(), 2 * ws.bm + 32 * ws.producer_warps);
        assert!(
            ws.min_ctas * (ws.smem_bytes() + 1024) <= 228 * 1024,
            "{ws:?}"
        );
    }
    for c in WG_CANDIDATES {
        assert!(c.min_ctas * (c.smem_bytes() + 1024) <= 228 * 1024, "{c:?}");
        assert_eq!(c.threads(), 2 * c.bm, "{c:?}: one warpgroup per 64 rows");
    }
    // The warpgroup-MMA tile runs on the prefill tile's alignment and workspace.
    assert_eq!((LARGE_WG.bm, LARGE_WG.threads()), (LARGE.bm, 128));
}

/// The CPU routing of omni-models' `DecoderModel::moe`: softmax in f32, experts sorted by
/// probability (ties: lower id), optional renormalisation.
pub(super) fn cpu_topk(logits: &[f32], e: usize, k: usize, renorm: bool) -> (Vec<i32>, Vec<f32>) {
    let (mut ids, mut ws) = (Vec::new(), Vec::new());
    for row in logits.chunks_exact(e) {
        let mut p = row.to_vec();
        ops::softmax_inplace(&mut p);
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let top = &order[..k];
        let sum: f32 = top.iter().map(|&i| p[i]).sum();
        for &i in top {
            ids.push(i as i32);
            ws.push(if renorm { p[i] / sum } else { p[i] });
        }
    }
    (ids, ws)
}

/// Router logits in [-4, 4), bf16-exact, with exact ties in every third row.
fn test_logits(t: usize, e: usize, seed: u64) -> Vec<f32> {
    let mut l: Vec<f32> = rand_bf16_f32(t * e, seed).iter().map(|v| 4.0 * v).collect();
    for row in l.chunks_exact_mut(e).step_by(3) {
        let top = 5.0;
        row[e - 1] = top;
        row[e / 2] = top;
        row[0] = top;
        if e > 6 {
            row[5] = row[4];
        }
    }
    l
}

pub(super) fn run_topk(
    cx: &CudaContext,
    logits: &[f32],
    t: usize,
    e: usize,
    k: usize,
    renorm: bool,
) -> (Vec<i32>, Vec<f32>) {
    let dl = cx.stream().clone_htod(logits).unwrap();
    let mut di = cx.stream().clone_htod(&vec![-7i32; t * k]).unwrap();
    let mut dw = cx.stream().clone_htod(&vec![f32::NAN; t * k]).unwrap();
    cx.moe_topk_softmax(&dl, &mut di, &mut dw, t, e, k, renorm)
        .unwrap();
    (
        cx.stream().clone_dtoh(&di).unwrap(),
        cx.stream().clone_dtoh(&dw).unwrap(),
    )
}

#[test]
fn moe_topk_softmax_matches_cpu() {
    let Some(cx) = ctx_or_skip("moe_topk_softmax_matches_cpu") else {
        return;
    };
    for &(t, e, k) in &[
        (1usize, 8usize, 2usize),
        (37, 128, 8),
        (5, 256, 8),
        (64, 60, 4),
        (3, 1024, 16),
        (9, 5, 5),
    ] {
        let mut logits = test_logits(t, e, 7 + e as u64);
        if t > 1 {
            // Part of a row at -inf: those experts get probability 0.
            for v in logits[e..2 * e].iter_mut().step_by(2) {
                *v = f32::NEG_INFINITY;
            }
        }
        if t > 2 {
            // Ties: a row of equal logits routes to the lowest ids, and equal pairs across
            // lanes (expert i and i + 33) in another go to the lower id first.
            logits[2 * e..3 * e].fill(0.25);
            if t > 3 && e > 40 {
                let r = &mut logits[3 * e..4 * e];
                r[7] = 4.0;
                r[40] = 4.0;
            }
        }
        for renorm in [false, true] {
            let (want_i, want_w) = cpu_topk(&logits, e, k, renorm);
            let (got_i, got_w) = run_topk(&cx, &logits, t, e, k, renorm);
            assert_eq!(got_i, want_i, "ids t={t} e={e} k={k} renorm={renorm}");
            let max_dw = got_w
                .iter()
                .zip(&want_w)
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            println!(
                "moe topk t={t} e={e} k={k} renorm={renorm}: ids equal, max |dw| {max_dw:.2e}"
            );
            assert!(max_dw <= 1e-5, "weights t={t} e={e} k={k}: {max_dw}");
        }
    }
    let dl = cx.stream().alloc_zeros::<f32>(8).unwrap();
    let mut di = cx.stream().alloc_zeros::<i32>(9).unwrap();
    let mut dw = cx.stream().alloc_zeros::<f32>(9).unwrap();
    let r = cx.moe_topk_softmax(&dl, &mut di, &mut dw, 1, 8, 9, true);
    assert!(matches!(r, Err(CudaError::Shape(_))), "{r:?}");
}

/// CPU f32 reference of the expert block for token rows `rows` (inputs bf16-exact), from
/// the CPU building blocks, each expert's weights widened once.
#[allow(clippy::too_many_arguments)]
pub(super) fn cpu_moe_rows(
    x: &[f32],
    w13: &[bf16],
    w2: &[bf16],
    ids: &[i32],
    ws: &[f32],
    s: MoeShape,
    rows: &[usize],
) -> Vec<f32> {
    let (h, i, k, e_n) = (s.hidden, s.inter, s.top_k, s.num_experts);
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_n];
    for (ri, &t) in rows.iter().enumerate() {
        for slot in 0..k {
            let e = ids[t * k + slot];
            if (0..e_n as i32).contains(&e) {
                routed[e as usize].push((ri, ws[t * k + slot]));
            }
        }
    }
    let mut out = vec![0f32; rows.len() * h];
    for (e, toks) in routed.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let w13e: Vec<f32> = w13[e * 2 * i * h..(e + 1) * 2 * i * h]
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let w2e: Vec<f32> = w2[e * h * i..(e + 1) * h * i]
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let m = toks.len();
        let mut xg = Vec::with_capacity(m * h);
        for &(ri, _) in toks {
            let t = rows[ri];
            xg.extend_from_slice(&x[t * h..(t + 1) * h]);
        }
        let mut gu = vec![0f32; m * 2 * i];
        linalg::matmul_nt(&xg, &w13e, &mut gu, m, h, 2 * i).unwrap();
        let mut act = vec![0f32; m * i];
        ops::silu_and_mul(&gu, &mut act, i).unwrap();
        let mut y = vec![0f32; m * h];
        linalg::matmul_nt(&act, &w2e, &mut y, m, i, h).unwrap();
        for (r, &(ri, w)) in toks.iter().enumerate() {
            for (d, v) in out[ri * h..(ri + 1) * h]
                .iter_mut()
                .zip(&y[r * h..(r + 1) * h])
            {
                *d += w * v;
            }
        }
    }
    out
}

pub(super) fn rand_bf16_scaled(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    rand_bf16_f32(n, seed)
        .iter()
        .map(|&v| bf16::from_f32(v * scale))
        .collect()
}

/// Device copies of one MoE layer's inputs.
struct DevMoe {
    x: CudaSlice<bf16>,
    w13: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    ws: CudaSlice<f32>,
}

fn upload(
    cx: &CudaContext,
    x: &[f32],
    w13: &[bf16],
    w2: &[bf16],
    ids: &[i32],
    ws: &[f32],
) -> DevMoe {
    DevMoe {
        x: cx.upload_f32_as_bf16(x).unwrap(),
        w13: cx.upload_bf16(w13).unwrap(),
        w2: cx.upload_bf16(w2).unwrap(),
        ids: cx.stream().clone_htod(ids).unwrap(),
        ws: cx.stream().clone_htod(ws).unwrap(),
    }
}

/// Workspace bytes for `s` on the public selection or any of `tiles`: the public bound, or more
/// for test-only candidate tiles of longer row blocks.
pub(super) fn workspace_bytes_for(s: MoeShape, tiles: impl IntoIterator<Item = TileCfg>) -> usize {
    tiles
        .into_iter()
        .map(|t| Layout::new(&s, &t).total)
        .fold(fused_moe_workspace_bytes(s), usize::max)
}

/// Runs the fused block (on `gemm`, or the public selection) into a NaN-poisoned output
/// with a 0xff-poisoned workspace; returns the raw bf16 output.
fn run_fused(cx: &CudaContext, d: &DevMoe, s: MoeShape, gemm: Option<MoeGemm>) -> Vec<bf16> {
    let mut out = cx
        .upload_bf16(&vec![bf16::NAN; s.tokens * s.hidden])
        .unwrap();
    let tile = match gemm {
        Some(MoeGemm::Tiles(t)) => Some(t),
        _ => None,
    };
    let mut ws = cx
        .stream()
        .clone_htod(&vec![0xffu8; workspace_bytes_for(s, tile)])
        .unwrap();
    match gemm {
        None => cx.fused_moe_bf16(&d.x, &d.w13, &d.w2, &d.ids, &d.ws, &mut out, &mut ws, s),
        Some(g) => {
            let o = bf16_out(cx, &mut out);
            cx.fused_moe_on(&d.x, &d.w13, &d.w2, &d.ids, &d.ws, o, &mut ws, s, g)
        }
    }
    .unwrap();
    let got = cx.stream().clone_dtoh(&out).unwrap();
    // The f32 output of the same path: the same values, widened.
    let mut out32 = cx
        .stream()
        .clone_htod(&vec![f32::NAN; s.tokens * s.hidden])
        .unwrap();
    match gemm {
        None => cx.fused_moe_bf16(&d.x, &d.w13, &d.w2, &d.ids, &d.ws, &mut out32, &mut ws, s),
        Some(g) => {
            let len = out32.len();
            let o = (MoeOut::F32(out32.device_ptr_mut(cx.stream()).0), len);
            cx.fused_moe_on(&d.x, &d.w13, &d.w2, &d.ids, &d.ws, o, &mut ws, s, g)
        }
    }
    .unwrap();
    let wide: Vec<u32> = got.iter().map(|v| v.to_f32().to_bits()).collect();
    let got32: Vec<u32> = cx
        .stream()
        .clone_dtoh(&out32)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(
        got32, wide,
        "{gemm:?}: the f32 output is the bf16 one widened"
    );
    got
}

/// `out` as [`CudaContext::fused_moe_on`] takes it (the tests' stream orders every access).
pub(super) fn bf16_out(cx: &CudaContext, out: &mut CudaSlice<bf16>) -> (MoeOut, usize) {
    let len = out.len();
    (MoeOut::Bf16(out.device_ptr_mut(cx.stream()).0), len)
}

fn f32s(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// The paths every correctness test runs: the public selection, both tiles, cuBLAS, and on
/// sm_90 the warpgroup-MMA tile.
fn gemms(cx: &CudaContext) -> Vec<(&'static str, Option<MoeGemm>)> {
    let mut v = vec![
        ("public", None),
        ("small", Some(MoeGemm::Tiles(SMALL))),
        ("large", Some(MoeGemm::Tiles(LARGE))),
        ("cublas", Some(CUBLAS)),
    ];
    if cx.info().compute_capability == (9, 0) {
        v.push(("wgmma", Some(MoeGemm::Tiles(LARGE_WG))));
        v.push(("wgmma2", Some(MoeGemm::Tiles(LARGE_WG2))));
        let tma = [LARGE_TMA].into_iter().chain(TMA_CANDIDATES);
        for t in tma.chain(WG_CANDIDATES).chain(WS_CANDIDATES) {
            v.push((t.down_fn, Some(MoeGemm::Tiles(t))));
        }
    }
    v
}

/// The byte a 128-byte-swizzled shared-memory layout puts at `linear` (an offset from a
/// 1024-aligned base): 16-byte chunk bits 4-6 XOR row-in-atom bits 7-9, as wgmma reads it.
fn swizzle128(linear: usize) -> usize {
    linear ^ (((linear >> 7) & 7) << 4)
}

/// `moe_gemm_wg`'s stage layout on the host, for each warpgroup-MMA tile: the (row, k) every
/// thread's copies put at each byte of an A and a B stage (`load_stage`: sub-tile j of a
/// `bk`-wide stage at j * rows * 128 bytes, chunk `tid % 8` of rows `tid / 8 + i * NT / 8`,
/// XOR-swizzled), against the (row, k) each MMA reads through its descriptor (warpgroup wg's
/// rows at 8192 wg bytes, sub-tile j, K step ks at 32 ks bytes; 8-row atoms 1024 bytes apart).
#[test]
fn wg_stage_layout_is_what_the_descriptors_read() {
    let tiles: Vec<TileCfg> = [LARGE_WG, LARGE_WG2]
        .into_iter()
        .chain(WG_CANDIDATES)
        .collect();
    for t in tiles {
        let (nt, ks_n) = (t.threads(), t.bk / 64);
        let rstep = nt / 8;
        // A: each warpgroup's 64 rows; B: every weight row from the tile's start.
        for (rows, groups) in [(t.bm, t.bm / 64), (t.bn, 1)] {
            let sub = rows * 128;
            let mut at = vec![None; ks_n * sub];
            for tid in 0..nt {
                let (chunk, row0) = (tid % 8, tid / 8);
                let swz = (chunk ^ (row0 & 7)) * 16;
                for j in 0..ks_n {
                    for i in 0..rows / rstep {
                        let dst = j * sub + row0 * 128 + swz + i * rstep * 128;
                        for b in 0..16 {
                            assert!(at[dst + b].is_none(), "{t:?}: byte {} twice", dst + b);
                            at[dst + b] = Some((row0 + i * rstep, j * 64 + chunk * 8 + b / 2));
                        }
                    }
                }
            }
            assert!(
                at.iter().all(Option::is_some),
                "{t:?}: bytes no copy writes"
            );
            for wg in 0..groups {
                for j in 0..ks_n {
                    for ks in 0..4 {
                        let start = wg * 64 * 128 + j * sub + ks * 32;
                        for r in 0..rows / groups {
                            for kk in 0..16 {
                                let linear = start + (r / 8) * 1024 + (r % 8) * 128 + kk * 2;
                                let want = (wg * 64 + r, j * 64 + ks * 16 + kk);
                                assert_eq!(at[swizzle128(linear)], Some(want), "{t:?}");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The cuBLAS path with its default buckets.
pub(super) const CUBLAS: MoeGemm = MoeGemm::Cublas {
    quantum: cublas::DEFAULT_QUANTUM,
};

#[test]
fn fused_moe_matches_cpu() {
    let Some(cx) = ctx_or_skip("fused_moe_matches_cpu") else {
        return;
    };
    // (hidden, inter, experts, top_k): the test fixture, then odd-ish sizes that are ragged
    // against every tile (N and K tails, tiny expert counts).
    for &(h, i, e, k) in &[
        (64usize, 32usize, 8usize, 2usize),
        (136, 40, 5, 3),
        (264, 200, 16, 4),
        (520, 72, 3, 3),
    ] {
        let w13 = rand_bf16_scaled(e * 2 * i * h, 101 + h as u64, 2.0 / (h as f32).sqrt());
        let w2 = rand_bf16_scaled(e * h * i, 103 + i as u64, 2.0 / (i as f32).sqrt());
        for &t in &[1usize, 3, 64, 300] {
            let s = MoeShape {
                tokens: t,
                hidden: h,
                inter: i,
                num_experts: e,
                top_k: k,
            };
            let x = rand_bf16_f32(t * h, 107 + t as u64);
            let logits = test_logits(t, e, 109 + t as u64);
            let (mut ids, ws) = cpu_topk(&logits, e, k, t % 2 == 1);
            if h == 136 {
                // Expert ids outside 0..E (e.g. other ranks' experts) are skipped.
                for (n, id) in ids.iter_mut().enumerate().skip(2).step_by(5) {
                    *id = if n % 2 == 0 { -1 } else { e as i32 + 2 };
                }
            }
            let rows: Vec<usize> = (0..t).collect();
            let want = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &rows);
            let d = upload(&cx, &x, &w13, &w2, &ids, &ws);
            let public = run_fused(&cx, &d, s, None);
            for (name, gemm) in gemms(&cx) {
                let got = if gemm.is_none() {
                    public.clone()
                } else {
                    run_fused(&cx, &d, s, gemm)
                };
                let err = rel_err(&f32s(&got), &want);
                println!(
                    "moe fused t={t} h={h} i={i} e={e} k={k} tile={name}: rel err vs CPU f32 {err:.2e}"
                );
                assert!(err <= 2e-2, "t={t} h={h} i={i} e={e} k={k} {name}: {err}");
            }
            // Deterministic: bit-identical on a second run, on either path (the cuBLAS path's
            // row order inside an expert varies with the gather's atomics; no row's result
            // depends on it).
            for gemm in [None, Some(CUBLAS)] {
                let first = run_fused(&cx, &d, s, gemm);
                let again = run_fused(&cx, &d, s, gemm);
                assert!(
                    again
                        .iter()
                        .zip(&first)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "t={t} h={h} {gemm:?}: not deterministic"
                );
            }
        }
    }
}

/// Routings where one expert receives every token (the qwen3-moe fixture's 5-token prefill:
/// layer 0 sends tokens 0-2 to [1, 3] and 3-4 to [1, 2]), at token counts around the tile
/// heights (an expert with exactly 16 / 17 / 64 / 65 rows), on both tiles.
#[test]
fn fused_moe_one_expert_gets_every_token() {
    let Some(cx) = ctx_or_skip("fused_moe_one_expert_gets_every_token") else {
        return;
    };
    let (h, i, e, k) = (64usize, 32usize, 8usize, 2usize);
    // Fixture-like weight scale (std ~0.2).
    let w13 = rand_bf16_scaled(e * 2 * i * h, 301, 0.35);
    let w2 = rand_bf16_scaled(e * h * i, 303, 0.45);
    for &t in &[2usize, 4, 5, 6, 7, 9, 16, 17, 64, 65] {
        let s = MoeShape {
            tokens: t,
            hidden: h,
            inter: i,
            num_experts: e,
            top_k: k,
        };
        let x = rand_bf16_f32(t * h, 305 + t as u64);
        let (ids, ws): (Vec<i32>, Vec<f32>) = if t == 5 {
            let p = [
                (0.41f32, 0.14f32),
                (0.38, 0.19),
                (0.88, 0.07),
                (0.94, 0.02),
                (0.38, 0.20),
            ];
            (
                vec![1, 3, 1, 3, 1, 3, 1, 2, 1, 2],
                p.iter()
                    .flat_map(|&(a, b)| [a / (a + b), b / (a + b)])
                    .collect(),
            )
        } else {
            // Slot 0 always expert 1; slot 1 spread over 2..8 (or the same expert 5 for
            // every token when t is even, so two experts get every token).
            (
                (0..t)
                    .flat_map(|r| {
                        [
                            1,
                            if t % 2 == 0 {
                                5
                            } else {
                                2 + (r * 3 % 6) as i32
                            },
                        ]
                    })
                    .collect(),
                (0..t)
                    .flat_map(|r| {
                        let a = 0.55 + 0.4 * ((r * 7 % 10) as f32 / 10.0);
                        [a, 1.0 - a]
                    })
                    .collect(),
            )
        };
        let want = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &(0..t).collect::<Vec<_>>());
        let d = upload(&cx, &x, &w13, &w2, &ids, &ws);
        for (name, gemm) in gemms(&cx) {
            let got = f32s(&run_fused(&cx, &d, s, gemm));
            let err = rel_err(&got, &want);
            println!("moe one-expert-all t={t} tile={name}: rel err vs CPU f32 {err:.2e}");
            assert!(err <= 2e-2, "t={t} {name}: {err}");
        }
    }
}

/// Routing on the device feeding the fused block, eager and captured in a CUDA graph: at 29
/// tokens (the decode tile) the replay is bit-identical to the eager run; at 600 (64+ pairs per
/// expert) the eager run takes cuBLAS (on sm_90 the warpgroup-MMA tile) and the capture falls
/// back to the prefill tile (on sm_90 the same tile), whose replay equals that tile's eager run
/// bit for bit.
#[test]
fn fused_moe_after_gpu_routing_and_in_a_cuda_graph() {
    let Some(cx) = ctx_or_skip("fused_moe_after_gpu_routing_and_in_a_cuda_graph") else {
        return;
    };
    let (h, i, e, k) = (128usize, 64usize, 16usize, 4usize);
    let w13 = rand_bf16_scaled(e * 2 * i * h, 205, 0.2);
    let w2 = rand_bf16_scaled(e * h * i, 207, 0.2);
    for t in [29usize, 600] {
        let s = MoeShape {
            tokens: t,
            hidden: h,
            inter: i,
            num_experts: e,
            top_k: k,
        };
        let x = rand_bf16_f32(t * h, 201 + t as u64);
        let logits = test_logits(t, e, 203 + t as u64);
        let (ids, ws) = cpu_topk(&logits, e, k, true);
        let want = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &(0..t).collect::<Vec<_>>());
        let eager_gemm = cx.select_gemm(&s).unwrap();
        assert_eq!(
            eager_gemm == CUBLAS,
            t == 600 && cublas::cublas_enabled() && cx.moe_wgmma() == Wgmma::Off,
            "t={t}: {eager_gemm:?}"
        );

        // Routing on the device feeding the fused block, all queued without a host sync.
        let mut d = upload(&cx, &x, &w13, &w2, &vec![0; t * k], &vec![0.0; t * k]);
        let dl = cx.stream().clone_htod(&logits).unwrap();
        let mut out = cx.zeros_bf16(t * h).unwrap();
        let mut wsp = cx
            .stream()
            .alloc_zeros::<u8>(fused_moe_workspace_bytes(s))
            .unwrap();
        let step = |d: &mut DevMoe, out: &mut CudaSlice<bf16>, wsp: &mut CudaSlice<u8>| {
            cx.moe_topk_softmax(&dl, &mut d.ids, &mut d.ws, t, e, k, true)
                .unwrap();
            cx.fused_moe_bf16(&d.x, &d.w13, &d.w2, &d.ids, &d.ws, out, wsp, s)
                .unwrap();
        };
        step(&mut d, &mut out, &mut wsp);
        let eager = cx.stream().clone_dtoh(&out).unwrap();
        let err = rel_err(&f32s(&eager), &want);
        println!("moe routing + fused t={t} ({eager_gemm:?}): rel err vs CPU f32 {err:.2e}");
        assert!(err <= 2e-2, "{err}");
        // What the capture must replay: the tile the selection falls back to.
        let tiles = run_fused(
            &cx,
            &d,
            s,
            Some(MoeGemm::Tiles(TileCfg::select(&s, cx.moe_wgmma()))),
        );

        // The same step captured into a CUDA graph and replayed over a zeroed output.
        cx.synchronize().unwrap();
        cx.stream()
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .unwrap();
        step(&mut d, &mut out, &mut wsp);
        let graph = cx
            .stream()
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("captured graph");
        cx.stream().memset_zeros(&mut out).unwrap();
        graph.launch().unwrap();
        let replay = cx.stream().clone_dtoh(&out).unwrap();
        assert!(
            replay
                .iter()
                .zip(&tiles)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "t={t}: graph replay differs from the tile's eager run"
        );
        println!("moe routing + fused t={t}: CUDA graph replay bit-identical to the tile path");
    }
}

#[test]
fn fused_moe_rejects_bad_shapes() {
    let Some(cx) = ctx_or_skip("fused_moe_rejects_bad_shapes") else {
        return;
    };
    let s = MoeShape {
        tokens: 2,
        hidden: 12,
        inter: 8,
        num_experts: 2,
        top_k: 1,
    };
    let x = cx.zeros_bf16(24).unwrap();
    let w13 = cx.zeros_bf16(2 * 16 * 12).unwrap();
    let w2 = cx.zeros_bf16(2 * 12 * 8).unwrap();
    let ids = cx.stream().alloc_zeros::<i32>(2).unwrap();
    let ws = cx.stream().alloc_zeros::<f32>(2).unwrap();
    let mut out = cx.zeros_bf16(24).unwrap();
    let mut wsp = cx.stream().alloc_zeros::<u8>(1 << 20).unwrap();
    let r = cx.fused_moe_bf16(&x, &w13, &w2, &ids, &ws, &mut out, &mut wsp, s);
    assert!(matches!(r, Err(CudaError::Shape(_))), "hidden 12: {r:?}");
    let s = MoeShape { hidden: 16, ..s };
    let x = cx.zeros_bf16(32).unwrap();
    let w13 = cx.zeros_bf16(2 * 16 * 16).unwrap();
    let w2 = cx.zeros_bf16(2 * 16 * 8).unwrap();
    let mut out = cx.zeros_bf16(32).unwrap();
    let mut small = cx.stream().alloc_zeros::<u8>(16).unwrap();
    let r = cx.fused_moe_bf16(&x, &w13, &w2, &ids, &ws, &mut out, &mut small, s);
    assert!(matches!(r, Err(CudaError::Shape(_))), "workspace: {r:?}");
    cx.fused_moe_bf16(&x, &w13, &w2, &ids, &ws, &mut out, &mut wsp, s)
        .unwrap();
}
