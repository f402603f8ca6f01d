//! GPU tests against the CPU backend's f32 results. Each one SKIPS (passes, printing why) when
//! no CUDA driver is present, so they run everywhere; `scripts/gpu-check.sh` runs them on a GPU.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::{linalg, ops};

/// Relative error `||got - want|| / ||want||` (Frobenius).
pub(crate) fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        assert!(g.is_finite(), "non-finite GPU output");
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Deterministic values in [-1, 1), already rounded to bf16 so CPU and GPU see the same inputs.
pub(crate) fn rand_bf16_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32) / (1u64 << 24) as f32;
            bf16::from_f32(2.0 * u - 1.0).to_f32()
        })
        .collect()
}

/// A context on device 0, or `None` (test skipped) when there is no driver.
pub(crate) fn ctx_or_skip(test: &str) -> Option<CudaContext> {
    match driver_status() {
        Err(e) => {
            println!("SKIP {test}: {e}");
            None
        }
        Ok(info) => {
            println!("{test}: running on {info:?}");
            Some(CudaContext::new(0).expect("driver present but the CUDA context failed"))
        }
    }
}

#[test]
fn driver_status_never_panics() {
    match driver_status() {
        Ok(info) => {
            println!("CUDA device: {info:?}, arch {}", info.sm_arch());
            assert!(!info.name.is_empty());
            assert!(info.total_mem > 0);
            assert!(info.compute_capability.0 >= 1);
            assert!(info.device_count >= 1);
        }
        Err(e) => {
            let msg = e.to_string();
            println!("SKIP driver_status_never_panics: {msg}");
            assert!(
                msg.starts_with("no CUDA driver: libcuda.so could not be loaded"),
                "{msg}"
            );
            assert!(matches!(
                CudaContext::new(0),
                Err(CudaError::Unavailable(_))
            ));
        }
    }
}

#[test]
fn gemm_bf16_matches_cpu() {
    let Some(cx) = ctx_or_skip("gemm_bf16_matches_cpu") else {
        return;
    };
    for &(m, k, n) in &[(1, 64, 32), (37, 256, 96), (128, 1024, 320), (5, 4096, 33)] {
        let a = rand_bf16_f32(m * k, 1 + m as u64);
        let w = rand_bf16_f32(n * k, 2 + n as u64);
        let mut want = vec![0f32; m * n];
        linalg::matmul_nt(&a, &w, &mut want, m, k, n).unwrap();
        let da = cx.upload_f32_as_bf16(&a).unwrap();
        let dw = cx.upload_f32_as_bf16(&w).unwrap();
        let mut dout = cx
            .upload_bf16(&vec![bf16::NAN; m * n])
            .expect("poisoned output");
        cx.matmul_nt_bf16(&da, &dw, &mut dout, m, k, n).unwrap();
        let got = cx.download_f32(&dout).unwrap();
        let err = rel_err(&got, &want);
        println!("gemm bf16 m={m} k={k} n={n}: rel err vs CPU f32 {err:.2e}");
        assert!(err <= 2e-2, "m={m} k={k} n={n}: rel err {err}");
    }
    // Shape errors are reported, not launched.
    let da = cx.zeros_bf16(6).unwrap();
    let mut dout = cx.zeros_bf16(4).unwrap();
    assert!(matches!(
        cx.matmul_nt_bf16(&da, &da, &mut dout, 2, 3, 3),
        Err(CudaError::Shape(_))
    ));
}

#[test]
fn rms_norm_bf16_matches_cpu() {
    let Some(cx) = ctx_or_skip("rms_norm_bf16_matches_cpu") else {
        return;
    };
    for &(rows, dim) in &[(1, 64), (7, 100), (33, 4096), (3, 5120)] {
        let x = rand_bf16_f32(rows * dim, 11 + dim as u64);
        let w: Vec<f32> = rand_bf16_f32(dim, 13)
            .iter()
            .map(|v| bf16::from_f32(1.0 + 0.5 * v).to_f32())
            .collect();
        let eps = 1e-6;
        let mut want = vec![0f32; rows * dim];
        ops::rms_norm(&x, &w, &mut want, dim, eps).unwrap();
        let dx = cx.upload_f32_as_bf16(&x).unwrap();
        let dw = cx.upload_f32_as_bf16(&w).unwrap();
        let mut dout = cx.upload_bf16(&vec![bf16::NAN; rows * dim]).unwrap();
        cx.rms_norm_bf16(&dx, &dw, &mut dout, dim, eps).unwrap();
        let got = cx.download_f32(&dout).unwrap();
        let err = rel_err(&got, &want);
        println!("rmsnorm bf16 rows={rows} dim={dim}: rel err vs CPU f32 {err:.2e}");
        assert!(err <= 2e-2, "rows={rows} dim={dim}: rel err {err}");
    }
    // The CUBIN was compiled once and cached (keyed by source hash + arch).
    assert!(kernels::cached_count() >= 1);
    let before = kernels::cached_count();
    let again = CudaContext::new(0).unwrap();
    let dx = again.zeros_bf16(64).unwrap();
    let dw = again.zeros_bf16(64).unwrap();
    let mut dout = again.zeros_bf16(64).unwrap();
    again.rms_norm_bf16(&dx, &dw, &mut dout, 64, 1e-6).unwrap();
    again.synchronize().unwrap();
    assert_eq!(kernels::cached_count(), before);
}

/// Times a 4096^3 bf16 GEMM (TN, f32 accumulation) and spot-checks entries against f64 dots.
#[test]
fn gemm_bf16_4096_throughput() {
    let Some(cx) = ctx_or_skip("gemm_bf16_4096_throughput") else {
        return;
    };
    let s = 4096usize;
    let a = rand_bf16_f32(s * s, 31);
    let w = rand_bf16_f32(s * s, 37);
    let da = cx.upload_f32_as_bf16(&a).unwrap();
    let dw = cx.upload_f32_as_bf16(&w).unwrap();
    let mut dout = cx.zeros_bf16(s * s).unwrap();
    for _ in 0..5 {
        cx.matmul_nt_bf16(&da, &dw, &mut dout, s, s, s).unwrap();
    }
    cx.synchronize().unwrap();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let e0 = cx.raw().new_event(flags).unwrap();
    let e1 = cx.raw().new_event(flags).unwrap();
    let (reps, per) = (7, 20);
    let mut ms = Vec::new();
    for _ in 0..reps {
        e0.record(cx.stream()).unwrap();
        for _ in 0..per {
            cx.matmul_nt_bf16(&da, &dw, &mut dout, s, s, s).unwrap();
        }
        e1.record(cx.stream()).unwrap();
        e1.synchronize().unwrap();
        ms.push(e0.elapsed_ms(&e1).unwrap() as f64 / per as f64);
    }
    ms.sort_by(f64::total_cmp);
    let (med, best) = (ms[reps / 2], ms[0]);
    let tflops = |t: f64| 2.0 * (s as f64).powi(3) / (t * 1e-3) / 1e12;
    println!(
        "GEMM bf16 {s}^3 TN (cuBLAS gemm_ex, f32 accumulate): median {med:.4} ms = {:.1} TFLOP/s, best {best:.4} ms = {:.1} TFLOP/s",
        tflops(med),
        tflops(best)
    );
    let got = cx.download_f32(&dout).unwrap();
    let (mut num, mut den) = (0f64, 0f64);
    for t in 0..64usize {
        let (i, j) = ((t * 977) % s, (t * 1601 + 13) % s);
        let want: f64 = (0..s)
            .map(|p| a[i * s + p] as f64 * w[j * s + p] as f64)
            .sum();
        num += (got[i * s + j] as f64 - want).powi(2);
        den += want * want;
    }
    let err = (num / den).sqrt();
    println!("GEMM bf16 {s}^3 spot check (64 entries): rel err vs f64 {err:.2e}");
    assert!(err <= 2e-2, "rel err {err}");
}

#[test]
fn rope_neox_bf16_matches_cpu() {
    let Some(cx) = ctx_or_skip("rope_neox_bf16_matches_cpu") else {
        return;
    };
    for &(tokens, heads, head_dim, theta) in &[
        (1usize, 1usize, 4usize, 10_000f32),
        (5, 8, 64, 10_000.0),
        (17, 32, 128, 1_000_000.0),
        (3, 4, 256, 500_000.0),
    ] {
        let x = rand_bf16_f32(tokens * heads * head_dim, 41 + head_dim as u64);
        let positions: Vec<usize> = (0..tokens).map(|t| t * 997 % 4099 + t).collect();
        let rope =
            crate::rope::Rope::new(head_dim, theta, &crate::rope::RopeScaling::None).unwrap();
        let mut cs = Vec::new();
        rope.cos_sin(&positions, &mut cs);
        let mut want = x.clone();
        rope.apply(&mut want, heads, &cs).unwrap();
        let mut dx = cx.upload_f32_as_bf16(&x).unwrap();
        let pos32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let dpos = cx.stream().clone_htod(&pos32).unwrap();
        cx.rope_neox_bf16(&mut dx, &dpos, heads, head_dim, theta)
            .unwrap();
        let got = cx.download_f32(&dx).unwrap();
        let err = rel_err(&got, &want);
        println!(
            "rope bf16 tokens={tokens} heads={heads} head_dim={head_dim} theta={theta}: rel err vs CPU f32 {err:.2e}"
        );
        assert!(err <= 2e-2, "head_dim={head_dim}: rel err {err}");
    }
    let mut dx = cx.zeros_bf16(12).unwrap();
    let dpos = cx.stream().clone_htod(&[0u32, 1]).unwrap();
    assert!(matches!(
        cx.rope_neox_bf16(&mut dx, &dpos, 2, 3, 10_000.0),
        Err(CudaError::Shape(_))
    ));
}

#[test]
fn silu_and_mul_bf16_matches_cpu() {
    let Some(cx) = ctx_or_skip("silu_and_mul_bf16_matches_cpu") else {
        return;
    };
    for &(tokens, inter) in &[(1usize, 1usize), (7, 100), (33, 4096), (2, 12288)] {
        let gu: Vec<f32> = rand_bf16_f32(tokens * 2 * inter, 51 + inter as u64)
            .iter()
            .map(|v| bf16::from_f32(4.0 * v).to_f32())
            .collect();
        let mut want = vec![0f32; tokens * inter];
        ops::silu_and_mul(&gu, &mut want, inter).unwrap();
        let dgu = cx.upload_f32_as_bf16(&gu).unwrap();
        let mut dout = cx.upload_bf16(&vec![bf16::NAN; tokens * inter]).unwrap();
        cx.silu_and_mul_bf16(&dgu, &mut dout, inter).unwrap();
        let got = cx.download_f32(&dout).unwrap();
        let err = rel_err(&got, &want);
        println!("silu_and_mul bf16 tokens={tokens} inter={inter}: rel err vs CPU f32 {err:.2e}");
        assert!(err <= 2e-2, "inter={inter}: rel err {err}");
    }
    let dgu = cx.zeros_bf16(6).unwrap();
    let mut dout = cx.zeros_bf16(2).unwrap();
    assert!(matches!(
        cx.silu_and_mul_bf16(&dgu, &mut dout, 2),
        Err(CudaError::Shape(_))
    ));
}

#[test]
fn embedding_bf16_matches_cpu_and_rejects_bad_ids() {
    let Some(cx) = ctx_or_skip("embedding_bf16_matches_cpu_and_rejects_bad_ids") else {
        return;
    };
    for &(vocab, hidden, n_ids) in &[(1usize, 8usize, 1usize), (50, 100, 9), (1000, 4096, 33)] {
        let table = rand_bf16_f32(vocab * hidden, 61 + hidden as u64);
        let ids: Vec<u32> = (0..n_ids)
            .map(|t| ((t * 7919 + 3) % vocab) as u32)
            .chain([vocab as u32 - 1, 0])
            .collect();
        let mut want = vec![0f32; ids.len() * hidden];
        ops::embedding(&table, hidden, &ids, &mut want).unwrap();
        let dt = cx.upload_f32_as_bf16(&table).unwrap();
        let mut dout = cx
            .upload_bf16(&vec![bf16::NAN; ids.len() * hidden])
            .unwrap();
        cx.embedding_bf16(&dt, hidden, &ids, &mut dout).unwrap();
        let got = cx.download_f32(&dout).unwrap();
        let err = rel_err(&got, &want);
        println!(
            "embedding bf16 vocab={vocab} hidden={hidden} ids={}: rel err vs CPU f32 {err:.2e}",
            ids.len()
        );
        assert!(err <= 2e-2, "hidden={hidden}: rel err {err}");
    }
    // Out-of-range id: an error before any launch, and the output is untouched.
    let dt = cx.upload_f32_as_bf16(&[1.0; 8]).unwrap();
    let mut dout = cx.upload_bf16(&[bf16::from_f32(7.0); 4]).unwrap();
    let r = cx.embedding_bf16(&dt, 2, &[1, 4], &mut dout);
    assert!(matches!(r, Err(CudaError::Shape(_))), "{r:?}");
    assert_eq!(cx.download_f32(&dout).unwrap(), vec![7.0; 4]);
}

#[test]
fn add_residual_bf16_matches_cpu() {
    let Some(cx) = ctx_or_skip("add_residual_bf16_matches_cpu") else {
        return;
    };
    for &n in &[1usize, 100, 4096 * 33, 1 << 24] {
        let x = rand_bf16_f32(n, 71 + n as u64);
        let y = rand_bf16_f32(n, 73 + n as u64);
        let mut want = x.clone();
        ops::add_inplace(&mut want, &y).unwrap();
        let mut dx = cx.upload_f32_as_bf16(&x).unwrap();
        let dy = cx.upload_f32_as_bf16(&y).unwrap();
        cx.add_residual_bf16(&mut dx, &dy).unwrap();
        let got = cx.download_f32(&dx).unwrap();
        let err = rel_err(&got, &want);
        println!("add_residual bf16 n={n}: rel err vs CPU f32 {err:.2e}");
        assert!(err <= 2e-2, "n={n}: rel err {err}");
    }
    let mut dx = cx.zeros_bf16(3).unwrap();
    let dy = cx.zeros_bf16(4).unwrap();
    assert!(matches!(
        cx.add_residual_bf16(&mut dx, &dy),
        Err(CudaError::Shape(_))
    ));
}

/// The CPU sampler's greedy pick (omni-models `sampler::argmax`): the largest logit above
/// `-inf`, lowest index on ties, `None` when there is none.
fn cpu_argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l > f32::NEG_INFINITY && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, _)| i as u32)
}

#[test]
fn argmax_f32_rows_matches_cpu_sampler() {
    let Some(cx) = ctx_or_skip("argmax_f32_rows_matches_cpu_sampler") else {
        return;
    };
    for &(rows, vocab) in &[(1usize, 1usize), (4, 31), (8, 1000), (5, 151_936)] {
        let mut logits = rand_bf16_f32(rows * vocab, 81 + vocab as u64);
        if vocab > 10 {
            // Ties across threads and warps: the lowest index must win.
            let r0 = &mut logits[..vocab];
            r0[vocab - 1] = 5.0;
            r0[vocab / 2] = 5.0;
            r0[3] = 5.0;
            // -inf / NaN never win; an all -inf row has no pick.
            let r1 = &mut logits[vocab..2 * vocab];
            r1[0] = f32::NAN;
            r1[1] = f32::INFINITY;
            let r2 = &mut logits[2 * vocab..3 * vocab];
            r2.fill(f32::NEG_INFINITY);
            r2[vocab - 2] = -3.0;
            logits[3 * vocab..4 * vocab].fill(f32::NEG_INFINITY);
        }
        let want: Vec<Option<u32>> = logits.chunks_exact(vocab).map(cpu_argmax).collect();
        let dl = cx.stream().clone_htod(&logits).unwrap();
        let got = cx.argmax_f32_rows(&dl, vocab).unwrap();
        let mismatches = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        println!(
            "argmax f32 rows={rows} vocab={vocab}: {mismatches} mismatches vs CPU sampler (rel err 0), picks {:?}",
            &got[..rows.min(4)]
        );
        assert_eq!(got, want, "rows={rows} vocab={vocab}");
    }
    let dl = cx.stream().clone_htod(&[0f32; 5]).unwrap();
    assert!(matches!(
        cx.argmax_f32_rows(&dl, 2),
        Err(CudaError::Shape(_))
    ));
}
