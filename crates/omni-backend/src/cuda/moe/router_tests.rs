//! GPU tests of the split-bf16 router (`router.rs`; each SKIPs without a CUDA driver): the
//! norm's three bf16 terms sum to its f32 output exactly, and the router logits match an f64
//! reference as closely as cuBLAS's SGEMM does, with the same top-k wherever it is clear; the
//! one-launch router and top-k (`route_mma.rs`) as accurate, its routing `moe_topk_softmax`'s
//! on its logits, its bits the same on a second launch and for fewer tokens.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaSlice;

use super::small_emu::{test_residual, test_router};
use super::{RouteMmaBuffers, RouterSplit, moe_route_mma_workspace_len};
use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32};
use crate::cuda::{CudaContext, L2Prefetch, NormExtra, ResidualUpdate, bf16};

/// Largest `|got - ref| / sum |x_k w_k|` over every logit.
fn worst(got: &[f32], want: &[f64], scale: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .zip(scale)
        .map(|((&g, &w), &s)| (g as f64 - w).abs() / s.max(f64::MIN_POSITIVE))
        .fold(0.0, f64::max)
}

/// The experts of the `k` largest logits of a row, sorted, when the k-th leads the next by
/// more than `gap` (else `None`: a near-tie that any rounding may flip).
fn top_k(row: &[f64], k: usize, gap: f64) -> Option<Vec<usize>> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    if k < row.len() && row[idx[k - 1]] - row[idx[k]] <= gap {
        return None;
    }
    let mut top = idx[..k].to_vec();
    top.sort_unstable();
    Some(top)
}

/// One case's inputs on the device: the norm's outputs (`hb`, `h_lo`, and `v32` on the host:
/// its f32 output, checked to be `hi + mid + lo` exactly), the f32 router (host) and its split.
struct Case {
    what: String,
    t: usize,
    h: usize,
    e: usize,
    hb: CudaSlice<bf16>,
    h_lo: CudaSlice<bf16>,
    h32: CudaSlice<f32>,
    v32: Vec<f32>,
    router: Vec<f32>,
    split: RouterSplit,
}

/// (tokens, hidden, experts, router of bf16 values, seed)
const CASES: [(usize, usize, usize, bool, u64); 4] = [
    (130, 2048, 128, false, 1),
    (130, 2048, 128, true, 2),
    (77, 384, 16, false, 3),
    (300, 512, 60, true, 4),
];

fn case(cx: &CudaContext, (t, h, e, bf16_router, seed): (usize, usize, usize, bool, u64)) -> Case {
    let st = cx.stream();
    let what = format!("t={t} h={h} e={e} bf16 router={bf16_router}");
    let residual = test_residual(t, h, seed);
    let delta: Vec<f32> = rand_bf16_f32(t * h, seed + 10)
        .iter()
        .map(|v| 0.5 * v)
        .collect();
    let nw: Vec<f32> = rand_bf16_f32(h, seed + 20)
        .iter()
        .map(|v| 1.0 + 0.5 * v)
        .collect();
    let mut router = test_router(e, h, seed + 30, &[]);
    if bf16_router {
        router
            .iter_mut()
            .for_each(|w| *w = bf16::from_f32(*w).to_f32());
    }

    let mut x = st.clone_htod(&residual).unwrap();
    let d = st.clone_htod(&delta).unwrap();
    let nw_dev = cx.upload_f32_as_bf16(&nw).unwrap();
    let mut hb = cx.zeros_bf16(t * h).unwrap();
    let mut h32 = st.alloc_zeros::<f32>(t * h).unwrap();
    let mut h_lo = cx.zeros_bf16(2 * t * h).unwrap();
    cx.fused_add_rms_norm_prefetch(
        &mut x,
        ResidualUpdate::Add(d.slice(..)),
        &nw_dev,
        &mut hb,
        NormExtra {
            out32: Some(&mut h32.slice_mut(..)),
            out_lo: Some(&mut h_lo.slice_mut(..)),
        },
        (t, h, 1e-6),
        L2Prefetch::NONE,
    )
    .unwrap();
    let (hi, v32, lo) = (
        st.clone_dtoh(&hb).unwrap(),
        st.clone_dtoh(&h32).unwrap(),
        st.clone_dtoh(&h_lo).unwrap(),
    );
    for r in 0..t {
        for i in 0..h {
            let (mid, low) = (lo[2 * r * h + i], lo[2 * r * h + h + i]);
            let sum = hi[r * h + i].to_f32() as f64 + mid.to_f32() as f64 + low.to_f32() as f64;
            assert_eq!(sum, v32[r * h + i] as f64, "{what}: row {r} col {i}");
        }
    }
    let split = RouterSplit::upload(cx, &router, e, h).unwrap();
    // Weights off the bf16 grid need the third GEMM (test_router scales bf16 values by
    // 1 / sqrt(hidden): a power of two at hidden 256 would keep them bf16).
    let off_grid = router.iter().any(|&w| bf16::from_f32(w).to_f32() != w);
    assert_eq!(off_grid, !bf16_router, "{what}: the case's router");
    assert_eq!(split.has_lo(), off_grid, "{what}");
    Case {
        what,
        t,
        h,
        e,
        hb,
        h_lo,
        h32,
        v32,
        router,
        split,
    }
}

/// The f64 logits `x . w` of a case, and each one's `sum |x_k w_k|`.
fn reference(c: &Case) -> (Vec<f64>, Vec<f64>) {
    let (t, h, e) = (c.t, c.h, c.e);
    let (mut want, mut scale) = (vec![0f64; t * e], vec![0f64; t * e]);
    for r in 0..t {
        for j in 0..e {
            let (xr, wr) = (&c.v32[r * h..(r + 1) * h], &c.router[j * h..(j + 1) * h]);
            for (&a, &b) in xr.iter().zip(wr) {
                want[r * e + j] += a as f64 * b as f64;
                scale[r * e + j] += (a as f64 * b as f64).abs();
            }
        }
    }
    (want, scale)
}

/// Asserts that `got`'s top-k of each row is the reference's wherever that is clear; returns
/// how many rows were.
fn same_clear_top_k(c: &Case, got: &[f32], want: &[f64], scale: &[f64], who: &str) -> usize {
    let (t, e) = (c.t, c.e);
    let k = 8.min(e - 1);
    let mut clear = 0;
    for r in 0..t {
        let row = got[r * e..(r + 1) * e]
            .iter()
            .map(|&x| x as f64)
            .collect::<Vec<_>>();
        let gap = 1e-4
            * scale[r * e..(r + 1) * e]
                .iter()
                .fold(0.0, |a: f64, &b| a.max(b));
        if let Some(ref_top) = top_k(&want[r * e..(r + 1) * e], k, gap) {
            clear += 1;
            assert_eq!(
                top_k(&row, k, 0.0),
                Some(ref_top),
                "{}: token {r} ({who})",
                c.what
            );
        }
    }
    assert!(
        clear * 10 >= t * 9,
        "{}: only {clear} of {t} routings are clear",
        c.what
    );
    clear
}

#[test]
fn router_split_matches_f64_like_sgemm() {
    let Some(cx) = ctx_or_skip("router_split_matches_f64_like_sgemm") else {
        return;
    };
    let st = cx.stream();
    for spec in CASES {
        let c = case(&cx, spec);
        let (t, h, e, what) = (c.t, c.h, c.e, &c.what);
        let mut logits = st.alloc_zeros::<f32>(t * e).unwrap();
        cx.moe_router_split(&c.hb, &c.h_lo, &c.split, &mut logits, t)
            .unwrap();
        let router_dev = st.clone_htod(&c.router).unwrap();
        let mut sgemm = st.alloc_zeros::<f32>(t * e).unwrap();
        cx.matmul_nt_f32(&c.h32, &router_dev, &mut sgemm, t, h, e)
            .unwrap();
        let (got, sg) = (
            st.clone_dtoh(&logits).unwrap(),
            st.clone_dtoh(&sgemm).unwrap(),
        );
        let (want, scale) = reference(&c);
        let (err, err_sgemm) = (worst(&got, &want, &scale), worst(&sg, &want, &scale));
        println!("{what}: worst logit error / sum |x w|: split {err:.2e}, sgemm {err_sgemm:.2e}");
        // bf16 inputs alone would be off by ~2^-9; the dropped terms of a non-bf16 router are
        // below 2^-16 of each product.
        let bound = if c.split.has_lo() { 6e-5 } else { 1e-5 };
        assert!(err <= bound, "{what}: {err:e}");
        assert!(
            err <= 4.0 * err_sgemm + 4e-6,
            "{what}: {err:e} vs sgemm {err_sgemm:e}"
        );
        // The same experts wherever the reference's k-th logit is clear of the next.
        same_clear_top_k(&c, &got, &want, &scale, "split");
        same_clear_top_k(&c, &sg, &want, &scale, "sgemm");
    }
}

/// The one-launch router (`moe_route_mma`): logits as accurate as the three GEMMs', its ids
/// and weights those of `moe_topk_softmax` on its own logits, bit for bit; a second launch
/// (counters reset by the first) and a launch of fewer tokens (the splits depend on the hidden
/// size alone) give the same bits.
#[test]
fn route_mma_matches_f64_and_the_top_k_kernel() {
    let Some(cx) = ctx_or_skip("route_mma_matches_f64_and_the_top_k_kernel") else {
        return;
    };
    let st = cx.stream();
    for spec in CASES {
        let c = case(&cx, spec);
        let (t, h, e, what) = (c.t, c.h, c.e, &c.what);
        let k = 8.min(e - 1);
        let (pl, cl) = moe_route_mma_workspace_len(t, h, e);
        let mut part = st.alloc_zeros::<f32>(pl).unwrap();
        let mut cnt = st.alloc_zeros::<i32>(cl).unwrap();
        let run = |tokens: usize, part: &mut CudaSlice<f32>, cnt: &mut CudaSlice<i32>| {
            let mut logits = st.alloc_zeros::<f32>(tokens * e).unwrap();
            let mut ids = st.alloc_zeros::<i32>(tokens * k).unwrap();
            let mut wts = st.alloc_zeros::<f32>(tokens * k).unwrap();
            let bufs = RouteMmaBuffers {
                partials: part,
                counters: cnt,
                logits: Some(&mut logits),
                ids: &mut ids,
                weights: &mut wts,
            };
            cx.moe_route_mma(&c.hb, &c.h_lo, &c.split, bufs, tokens, k, true)
                .unwrap();
            (
                st.clone_dtoh(&logits).unwrap(),
                st.clone_dtoh(&ids).unwrap(),
                st.clone_dtoh(&wts).unwrap(),
            )
        };
        let (got, ids, wts) = run(t, &mut part, &mut cnt);
        let (want, scale) = reference(&c);
        let err = worst(&got, &want, &scale);
        println!("{what}: route_mma worst logit error / sum |x w| {err:.2e}");
        let bound = if c.split.has_lo() { 6e-5 } else { 1e-5 };
        assert!(err <= bound, "{what}: {err:e}");
        same_clear_top_k(&c, &got, &want, &scale, "route_mma");

        // The top-k kernel on the same logits: the same ids and weights.
        let logits_dev = st.clone_htod(&got).unwrap();
        let mut ids2 = st.alloc_zeros::<i32>(t * k).unwrap();
        let mut wts2 = st.alloc_zeros::<f32>(t * k).unwrap();
        cx.moe_topk_softmax(&logits_dev, &mut ids2, &mut wts2, t, e, k, true)
            .unwrap();
        assert_eq!(ids, st.clone_dtoh(&ids2).unwrap(), "{what}: ids");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&wts), bits(&st.clone_dtoh(&wts2).unwrap()), "{what}");

        // Again (the counters are back at zero), and for the first tokens alone.
        let again = run(t, &mut part, &mut cnt);
        assert_eq!(bits(&again.0), bits(&got), "{what}: second launch");
        assert_eq!(again.1, ids, "{what}: second launch ids");
        let fewer = t / 2 + 1;
        let part_few = run(fewer, &mut part, &mut cnt);
        assert_eq!(
            bits(&part_few.0),
            bits(&got[..fewer * e]),
            "{what}: {fewer} tokens alone"
        );
        assert_eq!(
            st.clone_dtoh(&cnt).unwrap(),
            vec![0; cl],
            "{what}: counters"
        );
    }
}

/// Timing (not asserted) of a Qwen3-30B-A3B layer's routing at 512, 2048 and 4096 tokens: the
/// split router's GEMMs then `moe_topk_softmax`, against `moe_route_mma` (one launch).
#[test]
fn route_mma_timing() {
    let Some(cx) = ctx_or_skip("route_mma_timing") else {
        return;
    };
    let st = cx.stream();
    let (h, e, k) = (2048, 128, 8);
    let router = test_router(e, h, 41, &[]);
    let router: Vec<f32> = router.iter().map(|&w| bf16::from_f32(w).to_f32()).collect();
    let split = RouterSplit::upload(&cx, &router, e, h).unwrap();
    for t in [512usize, 2048, 4096] {
        let hb = cx.upload_f32_as_bf16(&rand_bf16_f32(t * h, 42)).unwrap();
        let lo: Vec<f32> = rand_bf16_f32(2 * t * h, 43)
            .iter()
            .map(|v| v / 512.0)
            .collect();
        let h_lo = cx.upload_f32_as_bf16(&lo).unwrap();
        let mut logits = st.alloc_zeros::<f32>(t * e).unwrap();
        let mut ids = st.alloc_zeros::<i32>(t * k).unwrap();
        let mut wts = st.alloc_zeros::<f32>(t * k).unwrap();
        let split_us = super::timing_tests::time_us(&cx, || {
            cx.moe_router_split(&hb, &h_lo, &split, &mut logits, t)
                .unwrap();
            cx.moe_topk_softmax(&logits, &mut ids, &mut wts, t, e, k, true)
                .unwrap();
        });
        let (pl, cl) = moe_route_mma_workspace_len(t, h, e);
        let mut part = st.alloc_zeros::<f32>(pl).unwrap();
        let mut cnt = st.alloc_zeros::<i32>(cl).unwrap();
        let mma_us = super::timing_tests::time_us(&cx, || {
            let bufs = RouteMmaBuffers {
                partials: &mut part,
                counters: &mut cnt,
                logits: Some(&mut logits),
                ids: &mut ids,
                weights: &mut wts,
            };
            cx.moe_route_mma(&hb, &h_lo, &split, bufs, t, k, true)
                .unwrap();
        });
        println!(
            "moe route T={t}: split GEMMs + top-k {split_us:.1} µs, one launch {mma_us:.1} µs \
             ({:.2}x)",
            split_us / mma_us
        );
    }
}
