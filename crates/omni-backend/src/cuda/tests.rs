//! Tests of the context (driver status, GEMM, SiLU-and-mul) against the CPU backend's f32 results,
//! and the helpers every CUDA test module uses. Each GPU test SKIPS (passes, printing why) when no
//! CUDA driver is present, so they run everywhere; `scripts/gpu-check.sh` runs them on a GPU.

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

impl CudaContext {
    /// Rounds `host` to bf16 and uploads it.
    pub(crate) fn upload_f32_as_bf16(&self, host: &[f32]) -> CudaResult<CudaSlice<bf16>> {
        let v: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
        self.upload_bf16(&v)
    }

    /// Downloads a bf16 buffer, widened to f32 (synchronizes the stream).
    pub(crate) fn download_f32(&self, dev: &CudaSlice<bf16>) -> CudaResult<Vec<f32>> {
        let v = self.stream.clone_dtoh(dev)?;
        Ok(v.iter().map(|x| x.to_f32()).collect())
    }
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

/// Best of 5 timings of 10 back-to-back calls of `f` (after 3 warm-up calls), in µs per call.
pub(crate) fn eager_us(cx: &CudaContext, f: &mut dyn FnMut()) -> f64 {
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let e0 = cx.raw().new_event(flags).unwrap();
    let e1 = cx.raw().new_event(flags).unwrap();
    for _ in 0..3 {
        f();
    }
    cx.synchronize().unwrap();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        e0.record(cx.stream()).unwrap();
        for _ in 0..10 {
            f();
        }
        e1.record(cx.stream()).unwrap();
        e1.synchronize().unwrap();
        best = best.min(e0.elapsed_ms(&e1).unwrap() as f64 * 100.0);
    }
    best
}

/// Best of 5 replays of a CUDA graph of 20 calls of `f`, in µs per call (GPU time with the
/// launch gaps of a captured decode step).
pub(crate) fn graph_us(cx: &CudaContext, f: &mut dyn FnMut()) -> f64 {
    f();
    cx.synchronize().unwrap();
    let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    cx.stream().begin_capture(mode).unwrap();
    for _ in 0..20 {
        f();
    }
    let graph = cx
        .stream()
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let e0 = cx.raw().new_event(flags).unwrap();
    let e1 = cx.raw().new_event(flags).unwrap();
    graph.launch().unwrap();
    cx.synchronize().unwrap();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        e0.record(cx.stream()).unwrap();
        graph.launch().unwrap();
        e1.record(cx.stream()).unwrap();
        e1.synchronize().unwrap();
        best = best.min(e0.elapsed_ms(&e1).unwrap() as f64 * 1000.0 / 20.0);
    }
    best
}

/// The bit patterns of a device f32 buffer (for bit-for-bit comparisons).
pub(crate) fn bits32(cx: &CudaContext, v: &CudaSlice<f32>) -> Vec<u32> {
    let host = cx.stream().clone_dtoh(v).unwrap();
    host.iter().map(|f| f.to_bits()).collect()
}

/// The bit patterns of a device bf16 buffer.
pub(crate) fn bits16(cx: &CudaContext, v: &CudaSlice<bf16>) -> Vec<u16> {
    let host = cx.stream().clone_dtoh(v).unwrap();
    host.iter().map(|b| b.to_bits()).collect()
}

/// Prints where a one-launch kernel's time goes: `stamps` holds each CTA's `names.len()`
/// %globaltimer readings (ns); per point the minimum, median and maximum µs after the first
/// CTA's entry.
pub(crate) fn print_stamps(what: &str, names: &[&str], stamps: &[u64]) {
    let n = names.len();
    let Some(t0) = stamps.chunks(n).map(|c| c[0]).min() else {
        return;
    };
    for (i, name) in names.iter().enumerate() {
        let mut v: Vec<f64> = stamps.chunks(n).map(|c| (c[i] - t0) as f64 / 1e3).collect();
        v.sort_by(f64::total_cmp);
        println!(
            "{what} stamps {name:>10}: min {:6.2} median {:6.2} max {:6.2} µs",
            v[0],
            v[v.len() / 2],
            v[v.len() - 1]
        );
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
