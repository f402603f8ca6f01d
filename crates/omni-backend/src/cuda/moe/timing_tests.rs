//! GPU timings of the fused expert block on the real Qwen3-30B-A3B layer shape (each path,
//! decode and prefill token counts; checked against the CPU on sampled rows first), and the
//! timing helper the MoE tests share.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::MoeShape;
use super::launch::MoeGemm;
use super::tests::{
    CUBLAS, bf16_out, cpu_moe_rows, rand_bf16_scaled, run_topk, workspace_bytes_for,
};
use super::tiles::{
    LARGE, LARGE_TMA, LARGE_WG, LARGE_WG2, SMALL, TMA_CANDIDATES, TileCfg, WG_CANDIDATES,
    WS_CANDIDATES,
};
use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
use crate::cuda::{CudaContext, bf16};

/// Median time of `per` back-to-back calls of `f`, in µs per call.
pub(super) fn time_us(cx: &CudaContext, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    cx.synchronize().unwrap();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let e0 = cx.raw().new_event(flags).unwrap();
    let e1 = cx.raw().new_event(flags).unwrap();
    let (reps, per) = (7, 10);
    let mut ms = Vec::new();
    for _ in 0..reps {
        e0.record(cx.stream()).unwrap();
        for _ in 0..per {
            f();
        }
        e1.record(cx.stream()).unwrap();
        e1.synchronize().unwrap();
        ms.push(e0.elapsed_ms(&e1).unwrap() as f64 / per as f64);
    }
    ms.sort_by(f64::total_cmp);
    ms[reps / 2] * 1e3
}

/// Real Qwen3-30B-A3B layer shape (TP1): checked against the CPU on a sample of rows, then
/// timed (not asserted) for decode and prefill batch sizes.
#[test]
fn fused_moe_real_shape_and_timing() {
    let Some(cx) = ctx_or_skip("fused_moe_real_shape_and_timing") else {
        return;
    };
    let (h, i, e, k) = (2048usize, 768usize, 128usize, 8usize);
    let mut w13 = Vec::with_capacity(e * 2 * i * h);
    let mut w2 = Vec::with_capacity(e * h * i);
    for ex in 0..e as u64 {
        // Power-of-two scales keep the values bf16-exact.
        w13.extend(rand_bf16_scaled(2 * i * h, 1000 + ex, 1.0 / 32.0));
        w2.extend(rand_bf16_scaled(h * i, 3000 + ex, 1.0 / 32.0));
    }
    // The warpgroup-MMA tiles run on sm_90 only.
    let hopper = cx.info().compute_capability == (9, 0);
    let dw13 = cx.upload_bf16(&w13).unwrap();
    let dw2 = cx.upload_bf16(&w2).unwrap();
    let shape = |t| MoeShape {
        tokens: t,
        hidden: h,
        inter: i,
        num_experts: e,
        top_k: k,
    };
    // Inputs and device routing for `t` tokens.
    let setup = |t: usize| {
        let x = rand_bf16_f32(t * h, 5000 + t as u64);
        let logits: Vec<f32> = rand_bf16_f32(t * e, 6000 + t as u64)
            .iter()
            .map(|v| 4.0 * v)
            .collect();
        let (ids, ws) = run_topk(&cx, &logits, t, e, k, true);
        (x, ids, ws)
    };
    let mut ws_buf = cx
        .stream()
        .alloc_zeros::<u8>(workspace_bytes_for(shape(4096), WG_CANDIDATES))
        .unwrap();

    for &(t, sample) in &[(4usize, 4usize), (512, 16)] {
        let s = shape(t);
        let (x, ids, ws) = setup(t);
        let rows: Vec<usize> = (0..sample)
            .map(|r| r * t / sample + r % 3)
            .map(|r| r.min(t - 1))
            .collect();
        let want = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &rows);
        let dx = cx.upload_f32_as_bf16(&x).unwrap();
        let dids = cx.stream().clone_htod(&ids).unwrap();
        let dws = cx.stream().clone_htod(&ws).unwrap();
        let candidates = super::tiles::CANDIDATES.map(|c| (c.down_fn, MoeGemm::Tiles(c)));
        let large = super::tiles::LARGE_CANDIDATES.map(|c| (c.down_fn, MoeGemm::Tiles(c)));
        let wg: Vec<_> = if hopper {
            [LARGE_WG, LARGE_WG2, LARGE_TMA]
                .into_iter()
                .chain(TMA_CANDIDATES)
                .chain(WG_CANDIDATES)
                .chain(WS_CANDIDATES)
                .map(|c| (c.down_fn, MoeGemm::Tiles(c)))
                .collect()
        } else {
            Vec::new()
        };
        for (name, gemm) in [
            ("small", MoeGemm::Tiles(SMALL)),
            ("large", MoeGemm::Tiles(LARGE)),
            ("cublas", CUBLAS),
        ]
        .into_iter()
        .chain(candidates.into_iter().filter(|_| t <= 64))
        .chain(large.into_iter().filter(|_| t >= 512))
        .chain(wg)
        {
            let mut out = cx.upload_bf16(&vec![bf16::NAN; t * h]).unwrap();
            cx.fused_moe_on(
                &dx,
                &dw13,
                &dw2,
                &dids,
                &dws,
                bf16_out(&cx, &mut out),
                &mut ws_buf,
                s,
                gemm,
            )
            .unwrap();
            let got = cx.download_f32(&out).unwrap();
            let got_rows: Vec<f32> = rows
                .iter()
                .flat_map(|&r| got[r * h..(r + 1) * h].to_vec())
                .collect();
            let err = rel_err(&got_rows, &want);
            println!(
                "moe real shape t={t} tile={name}: rel err vs CPU f32 on {sample} rows {err:.2e}"
            );
            assert!(err <= 2e-2, "t={t} {name}: {err}");
        }
    }

    // Timing: the fused block only (routing precomputed on the device).
    let bytes_per_expert = (3 * i * h * 2) as f64;
    // OMNI_MOE_TIMING_TOKENS (comma-separated) times only those token counts (a profiler run).
    let only: Option<Vec<usize>> = std::env::var("OMNI_MOE_TIMING_TOKENS")
        .ok()
        .map(|v| v.split(',').filter_map(|t| t.trim().parse().ok()).collect());
    for &t in &[1usize, 8, 64, 128, 256, 512, 768, 1024, 2048, 4096] {
        if only.as_ref().is_some_and(|o| !o.contains(&t)) {
            continue;
        }
        let s = shape(t);
        let (x, ids, ws) = setup(t);
        let touched = {
            let mut seen = vec![false; e];
            for &id in &ids {
                seen[id as usize] = true;
            }
            seen.iter().filter(|&&b| b).count()
        };
        let dx = cx.upload_f32_as_bf16(&x).unwrap();
        let dids = cx.stream().clone_htod(&ids).unwrap();
        let dws = cx.stream().clone_htod(&ws).unwrap();
        let mut out = cx.zeros_bf16(t * h).unwrap();
        let mut run_on = |gemm: MoeGemm| {
            time_us(&cx, || {
                cx.fused_moe_on(
                    &dx,
                    &dw13,
                    &dw2,
                    &dids,
                    &dws,
                    bf16_out(&cx, &mut out),
                    &mut ws_buf,
                    s,
                    gemm,
                )
                .unwrap()
            })
        };
        let (us_small, us_large) = (run_on(MoeGemm::Tiles(SMALL)), run_on(MoeGemm::Tiles(LARGE)));
        let quanta = [1usize, 32, 64, 128];
        let us_var = quanta.map(|quantum| {
            if t >= 64 {
                run_on(MoeGemm::Cublas { quantum })
            } else {
                f64::NAN
            }
        });
        let us_cublas = us_var[1];
        let mut run = |tile: TileCfg| run_on(MoeGemm::Tiles(tile));
        let (us_wg, us_wg2) = if hopper && t >= 128 {
            (run(LARGE_WG), run(LARGE_WG2))
        } else {
            (f64::NAN, f64::NAN)
        };
        let chosen = cx.select_gemm(&s).unwrap();
        let us = match chosen {
            MoeGemm::Tiles(t) if t == SMALL => us_small,
            MoeGemm::Tiles(t) if t == LARGE_WG => us_wg,
            MoeGemm::Tiles(t) if t == LARGE_WG2 => us_wg2,
            MoeGemm::Tiles(t) if t == LARGE_TMA => run(LARGE_TMA),
            MoeGemm::Tiles(_) => us_large,
            MoeGemm::Cublas { .. } => us_cublas,
        };
        let gbs = touched as f64 * bytes_per_expert / (us * 1e-6) / 1e9;
        let tflops = 2.0 * (t * k * 3 * h * i) as f64 / (us * 1e-6) / 1e12;
        if t <= 64 {
            println!(
                "moe decode T={t}: {us:.1} µs, {gbs:.0} GB/s of expert weights ({touched} experts, {:.1} MB), {tflops:.1} TFLOP/s",
                touched as f64 * bytes_per_expert / 1e6
            );
        } else {
            println!(
                "moe prefill T={t}: {us:.1} µs, {tflops:.1} TFLOP/s, {gbs:.0} GB/s of expert weights ({touched} experts)"
            );
        }
        let tf = |us: f64| 2.0 * (t * k * 3 * h * i) as f64 / (us * 1e-6) / 1e12;
        println!(
            "moe paths T={t}: small {us_small:.1} µs, large {us_large:.1} µs ({:.0} TFLOP/s), cublas {us_cublas:.1} µs ({:.0} TFLOP/s), wgmma {us_wg:.1} µs ({:.0} TFLOP/s), wgmma2 {us_wg2:.1} µs ({:.0} TFLOP/s, {:.2}x wgmma), chosen {}",
            tf(us_large),
            tf(us_cublas),
            tf(us_wg),
            tf(us_wg2),
            us_wg2 / us_wg,
            match chosen {
                MoeGemm::Tiles(t) => t.down_fn,
                MoeGemm::Cublas { .. } => "cublas",
            }
        );
        if t >= 512 {
            // The ceiling: the same FLOPs as two dense cuBLAS GEMMs over all pairs.
            let p = t * k;
            let a = cx.zeros_bf16(p * h).unwrap();
            let mut g = cx.zeros_bf16(p * 2 * i).unwrap();
            let mut y = cx.zeros_bf16(p * h).unwrap();
            let w_gu = dw13.slice(..2 * i * h);
            let w_d = dw2.slice(..h * i);
            let us_dense = time_us(&cx, || {
                cx.matmul_nt_bf16(&a, &w_gu, &mut g, p, h, 2 * i).unwrap();
                cx.matmul_nt_bf16(&g.slice(..p * i), &w_d, &mut y, p, i, h)
                    .unwrap();
            });
            println!(
                "moe dense-equivalent T={t}: {us_dense:.1} µs ({:.0} TFLOP/s)",
                tf(us_dense)
            );
        }
        if t >= 64 {
            println!(
                "moe cublas T={t}: bucket quantum 1 {:.1} µs, 32 {:.1} µs, 64 {:.1} µs, 128 {:.1} µs",
                us_var[0], us_var[1], us_var[2], us_var[3]
            );
        }
        if t >= 256 {
            for cand in super::tiles::LARGE_CANDIDATES {
                let us_c = run(cand);
                println!(
                    "moe large candidate T={t} {} (bn {} bk {} warps {}x{} stages {}): {us_c:.1} µs ({:.0} TFLOP/s, {:.2}x large, {:.2}x cublas)",
                    cand.down_fn,
                    cand.bn,
                    cand.bk,
                    cand.warps_m,
                    cand.warps_n,
                    cand.stages,
                    tf(us_c),
                    us_c / us_large,
                    us_c / us_cublas
                );
            }
        }
        if t >= 128 && hopper {
            let tma = [LARGE_TMA].into_iter().chain(TMA_CANDIDATES);
            for cand in tma.chain(WG_CANDIDATES).chain(WS_CANDIDATES) {
                let us_c = run(cand);
                println!(
                    "moe wgmma T={t} {} (bm {} bn {} bk {} stages {} producer warps {} tma {}): {us_c:.1} µs ({:.0} TFLOP/s, {:.2}x wgmma, {:.2}x wgmma2, {:.2}x large, {:.2}x cublas)",
                    cand.down_fn,
                    cand.bm,
                    cand.bn,
                    cand.bk,
                    cand.stages,
                    cand.producer_warps,
                    cand.tma,
                    tf(us_c),
                    us_c / us_wg,
                    us_c / us_wg2,
                    us_c / us_large,
                    us_c / us_cublas
                );
            }
        }
        if t <= 64 {
            for cand in super::tiles::CANDIDATES {
                let us_c = run(cand);
                println!(
                    "moe tile candidate T={t} {} (bn {} bk {} warps {} stages {}): {us_c:.1} µs ({:.2}x small)",
                    cand.down_fn,
                    cand.bn,
                    cand.bk,
                    cand.warps_n,
                    cand.stages,
                    us_c / us_small
                );
            }
        }
    }
    let logits = cx.stream().clone_htod(&rand_bf16_f32(2048 * e, 9)).unwrap();
    let mut di = cx.stream().alloc_zeros::<i32>(2048 * k).unwrap();
    let mut dw = cx.stream().alloc_zeros::<f32>(2048 * k).unwrap();
    for t in [1usize, 2048] {
        let us = time_us(&cx, || {
            let mut vi = di.slice_mut(..t * k);
            let mut vw = dw.slice_mut(..t * k);
            let vl = logits.slice(..t * e);
            cx.moe_topk_softmax(&vl, &mut vi, &mut vw, t, e, k, true)
                .unwrap()
        });
        println!("moe topk T={t}: {us:.1} µs");
    }
}
