//! Tests of the staged GEMV: its plan on the host, and on the device the same bits as the
//! plain GEMV under every plan shape (all rows staged, partly staged, none, many rows a
//! block), plus a timing line.

#![allow(clippy::unwrap_used)]

use super::*;

/// Every output row is owned by exactly one block, in row order; a block stages a prefix of
/// its rows that fits the budget (at most 256: one mbarrier per 8 rows, 32 of them).
#[test]
fn staged_plan_covers_every_row_once() {
    for (n, k, sms, budget) in [
        (2048usize, 4096usize, 132usize, 160 * 1024),
        (5120, 2048, 132, 160 * 1024),
        (6144, 4096, 132, 160 * 1024),
        (300, 1024, 3, 1 << 20),
        (7, 8, 132, 0),
        (1, 8, 1, 4096),
    ] {
        let rows = 1 + n % 8;
        let p = StagedPlan::new(n, k, rows, sms, budget);
        assert_eq!(p.input_bytes, (rows * k * 2).div_ceil(128) * 128);
        assert!(
            p.blocks <= sms.max(1) && p.blocks * p.rows_per_block >= n,
            "{p:?}"
        );
        assert!(p.staged_rows <= p.rows_per_block.min(256), "{p:?}");
        if p.staged_rows > 0 {
            assert!(p.smem_bytes(k) <= budget, "{p:?} k {k}");
        }
        let owners = p.owners(n);
        for (o, &(b, j, staged)) in owners.iter().enumerate() {
            assert_eq!(b * p.rows_per_block + j, o);
            assert!(b < p.blocks && j < p.rows_per_block);
            assert_eq!(staged, j < p.staged_rows);
        }
    }
    // The 30B-A3B shapes on 132 SMs stage every row within the default budget.
    let qkv = StagedPlan::new(5120, 2048, 1, 132, DEFAULT_STAGED_KB * 1024);
    assert_eq!((qkv.rows_per_block, qkv.staged_rows), (39, 39));
    let o = StagedPlan::new(2048, 4096, 1, 132, DEFAULT_STAGED_KB * 1024);
    assert_eq!((o.blocks, o.rows_per_block, o.staged_rows), (128, 16, 16));
    assert!(qkv.is_whole() && o.is_whole());
    // Qwen3-8B's (QKV 4096 -> 6144, o_proj 4096 -> 4096) do not fit: they keep cuBLAS.
    for (n, k) in [(6144, 4096), (4096, 4096)] {
        let p = StagedPlan::new(n, k, 1, 132, DEFAULT_STAGED_KB * 1024);
        assert!(!p.is_whole(), "{n}x{k}: {p:?}");
    }
}

/// On the device: the staged GEMV gives the plain GEMV's bits (bf16 and f32 out) under the
/// device's plan and under plans that stage part of a block's rows, none of them, or more
/// rows than one mbarrier group per warp covers; and it is the product within bf16 rounding.
#[test]
fn staged_gemv_equals_the_plain_gemv_bitwise() {
    use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32};
    let Some(cx) = ctx_or_skip("staged_gemv_equals_the_plain_gemv_bitwise") else {
        return;
    };
    if cx.info().compute_capability.0 < 9 {
        println!("SKIP staged_gemv_equals_the_plain_gemv_bitwise: below sm_90");
        return;
    }
    let s = cx.stream().clone();
    for (k, n, rows) in [
        (1024usize, 300usize, 1usize),
        (1024, 300, 3),
        (2048, 5120, 1),
        (4096, 2048, 2),
        (4096, 2048, 8),
        (64, 9, 5),
    ] {
        let wh = rand_bf16_f32(n * k, 11);
        let xh = rand_bf16_f32(rows * k, 12);
        let w = cx.upload_f32_as_bf16(&wh).unwrap();
        let x = cx.upload_f32_as_bf16(&xh).unwrap();
        let mut plain = s.alloc_zeros::<bf16>(rows * n).unwrap();
        cx.gemv_nt_bf16(&x, &w, &mut plain, rows, k, n).unwrap();
        let mut plain32 = s.alloc_zeros::<f32>(rows * n).unwrap();
        cx.gemv_nt_bf16_f32(&x, &w, &mut plain32, rows, k, n)
            .unwrap();
        let want: Vec<u16> = s
            .clone_dtoh(&plain)
            .unwrap()
            .iter()
            .map(|b| b.to_bits())
            .collect();
        let sms = cx.info().sm_count;
        let plans = [
            ("device", cx.staged_plan(n, k, rows)),
            (
                "partly staged",
                StagedPlan::new(n, k, rows, sms, 256 + 2 * k * (rows + 3)),
            ),
            ("none staged", StagedPlan::new(n, k, rows, sms, 0)),
            ("three blocks", StagedPlan::new(n, k, rows, 3, 200 * 1024)),
        ];
        for (name, plan) in plans {
            let mut y = s.alloc_zeros::<bf16>(rows * n).unwrap();
            cx.gemv_staged_bf16_with(&x, &w, &mut y, (rows, k, n), Some(plan))
                .unwrap();
            let got: Vec<u16> = s
                .clone_dtoh(&y)
                .unwrap()
                .iter()
                .map(|b| b.to_bits())
                .collect();
            assert_eq!(got, want, "k {k} n {n} rows {rows}: {name} plan {plan:?}");
        }
        let mut y32 = s.alloc_zeros::<f32>(rows * n).unwrap();
        cx.gemv_staged_f32(&x, &w, &mut y32, rows, k, n).unwrap();
        let (got, want32) = (s.clone_dtoh(&y32).unwrap(), s.clone_dtoh(&plain32).unwrap());
        assert!(
            got.iter()
                .zip(&want32)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        // Against the f64 product: within f32 accumulation error.
        for r in 0..rows {
            for o in 0..n {
                let d: f64 = (0..k)
                    .map(|i| f64::from(xh[r * k + i]) * f64::from(wh[o * k + i]))
                    .sum();
                let g = f64::from(got[r * n + o]);
                assert!(
                    (g - d).abs() <= 1e-4 * (1.0 + d.abs()),
                    "row {r} col {o}: {g} vs {d}"
                );
            }
        }
        println!("staged gemv k {k} n {n} rows {rows}: bitwise equal to the plain GEMV");
    }
}

/// On the device: the staged GEMV of a normalised input gives the input norm then the plain
/// GEMV, bit for bit, for a kept residual and one set from bf16 rows (written back once), under
/// the device's plan and a partly staged one.
#[test]
fn staged_norm_gemv_equals_the_norm_then_the_gemv() {
    use crate::cuda::ResidualUpdate;
    use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32};
    let Some(cx) = ctx_or_skip("staged_norm_gemv_equals_the_norm_then_the_gemv") else {
        return;
    };
    if cx.info().compute_capability.0 < 9 {
        return;
    }
    let s = cx.stream().clone();
    let eps = 1e-6f32;
    for (k, n, rows) in [
        (2048usize, 5120usize, 1usize),
        (1024, 300, 3),
        (4096, 700, 8),
    ] {
        let w = cx.upload_f32_as_bf16(&rand_bf16_f32(n * k, 21)).unwrap();
        let wn: Vec<f32> = rand_bf16_f32(k, 22).iter().map(|x| 1.0 + x / 4.0).collect();
        let wn = cx.upload_f32_as_bf16(&wn).unwrap();
        let init = cx.upload_f32_as_bf16(&rand_bf16_f32(rows * k, 23)).unwrap();
        let res0 = s.clone_htod(&rand_bf16_f32(rows * k, 24)).unwrap();
        let sms = cx.info().sm_count;
        for set in [false, true] {
            // Unfused: h = norm(x) (x kept, or set from init), y = h W.
            let mut x = s.clone_htod(&s.clone_dtoh(&res0).unwrap()).unwrap();
            let mut h = s.alloc_zeros::<bf16>(rows * k).unwrap();
            let update = if set {
                ResidualUpdate::Set(init.slice(..))
            } else {
                ResidualUpdate::Keep
            };
            cx.fused_add_rms_norm(&mut x, update, &wn, &mut h, rows, k, eps)
                .unwrap();
            let mut want = s.alloc_zeros::<bf16>(rows * n).unwrap();
            cx.gemv_nt_bf16(&h, &w, &mut want, rows, k, n).unwrap();
            let want_x = s.clone_dtoh(&x).unwrap();
            let want = s.clone_dtoh(&want).unwrap();
            for plan in [
                None,
                Some(StagedPlan::new(
                    n,
                    k,
                    rows,
                    sms,
                    256 + 2 * k * (rows + 5) + 128,
                )),
            ] {
                let mut fx = s.clone_htod(&s.clone_dtoh(&res0).unwrap()).unwrap();
                let mut y = s.alloc_zeros::<bf16>(rows * n).unwrap();
                let input = if set {
                    GemvIn::SetNorm {
                        init: init.slice(..),
                        residual: &mut fx,
                        weight: &wn,
                        eps,
                    }
                } else {
                    GemvIn::Norm {
                        residual: &mut fx,
                        weight: &wn,
                        eps,
                    }
                };
                cx.gemv_staged_norm_bf16(&w, input, &mut y, (rows, k, n), plan)
                    .unwrap();
                let got = s.clone_dtoh(&y).unwrap();
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "k {k} n {n} rows {rows} set {set} plan {plan:?}: outputs differ"
                );
                let got_x = s.clone_dtoh(&fx).unwrap();
                assert!(
                    got_x
                        .iter()
                        .zip(&want_x)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "k {k} rows {rows} set {set}: residual differs"
                );
            }
            println!("staged gemv norm k {k} n {n} rows {rows} set {set}: bitwise equal");
        }
    }
}

/// Timing lines, not a check: the staged GEMV against the plain one and cuBLAS on the 30B-A3B
/// projections, weights cold in L2, each call alone in a CUDA graph (no predecessor to hide
/// the copies under: its floor, not its gain in a step).
#[test]
fn staged_gemv_timing() {
    use crate::cuda::tests::{ctx_or_skip, graph_us, rand_bf16_f32};
    let Some(cx) = ctx_or_skip("staged_gemv_timing") else {
        return;
    };
    if cx.info().compute_capability.0 < 9 {
        return;
    }
    let s = cx.stream().clone();
    for (name, k, n) in [("30b qkv", 2048usize, 5120usize), ("30b o", 4096, 2048)] {
        let copies = 12;
        // Distinct copies (weights cold in L2), each exactly the [n, k] the kernels check for.
        let ws: Vec<CudaSlice<bf16>> = (0..copies)
            .map(|_| s.alloc_zeros::<bf16>(n * k).unwrap())
            .collect();
        let x = cx.upload_f32_as_bf16(&rand_bf16_f32(k, 9)).unwrap();
        let mut y = s.alloc_zeros::<bf16>(n).unwrap();
        let mut i = 0usize;
        let mut time = |f: &dyn Fn(&CudaSlice<bf16>, &mut CudaSlice<bf16>)| {
            graph_us(&cx, &mut || {
                let w = &ws[i % copies];
                i += 1;
                f(w, &mut y);
            })
        };
        let staged = time(&|w, y| cx.gemv_staged_bf16(&x, w, y, 1, k, n).unwrap());
        let plain = time(&|w, y| cx.gemv_nt_bf16(&x, w, y, 1, k, n).unwrap());
        let cublas = time(&|w, y| cx.matmul_nt_bf16(&x, w, y, 1, k, n).unwrap());
        let mb = (n * k * 2) as f64 / 1e6;
        println!(
            "staged gemv {name}: staged {staged:.1} µs ({:.2} TB/s), plain {plain:.1}, cuBLAS {cublas:.1}; plan {:?}",
            mb / staged,
            cx.staged_plan(n, k, 1)
        );
    }
}
