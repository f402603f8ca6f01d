//! Qwen3-Omni's Code2Wav on a CUDA GPU (`omni_models::cuda_code2wav`) against the f32 CPU
//! Code2Wav (itself within 1e-4 of transformers) on the tiny fixture (feature `cuda`; every test
//! SKIPs, printing why, on a machine without an NVIDIA driver):
//!
//! - one-shot decodes of T = 1, 4, 25, 29, 50, 80 frames (graphs on: each padded to its frame
//!   bucket) within bf16 tolerance (max abs error and SNR printed);
//! - vLLM-Omni's streaming windows, alone and batched, and their gap-free concatenation;
//! - graph replays equal eager runs of the same padded shape bit for bit;
//! - a batch of different lengths equals the single decodes.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::{config, dir, reference_json, reference_tensor};
use omni_backend::cuda::{CudaContext, driver_status};
use omni_models::cuda_code2wav::CudaCode2Wav;
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::code2wav::Code2Wav;

const FIXTURE: &str = "qwen3-omni";
/// Batch-frames of the device buffers (the 80-frame decode runs in the 128 bucket).
const CAP: usize = 512;
/// Waveforms are in [-1, 1]. bf16 activations through the ~45 layers of the conv stack give,
/// on this fixture on an H200 (2026-12-01), max abs errors of 1.2e-2 .. 5.3e-2 and an SNR of
/// 31.7 .. 37.1 dB against the f32 CPU; the bounds leave a margin over those.
const MAX_ABS: f32 = 0.08;
const MIN_SNR_DB: f64 = 28.0;

fn models(test: &str) -> Option<(Code2Wav, CudaCode2Wav)> {
    if let Err(e) = driver_status() {
        println!("SKIP {test}: {e}");
        return None;
    }
    let cfg = config(FIXTURE);
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    let cpu = Code2Wav::load(&cfg, &ws).unwrap();
    let cx = Arc::new(CudaContext::new(0).unwrap());
    let gpu = CudaCode2Wav::load(cx, &cfg, &ws, CAP).unwrap();
    Some((cpu, gpu))
}

/// Codes `[16, T]` (stored as f32), codebook-major, and T.
fn codes(name: &str) -> (Vec<u32>, usize) {
    let (data, shape) = reference_tensor(FIXTURE, name);
    (data.iter().map(|&v| v as u32).collect(), shape[1])
}

fn lengths() -> Vec<usize> {
    reference_json(FIXTURE)["code2wav.lengths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect()
}

/// (max abs error, SNR in dB of `want` over the error).
fn compare(got: &[f32], want: &[f32]) -> (f32, f64) {
    assert_eq!(got.len(), want.len());
    let (mut sig, mut err, mut max) = (0f64, 0f64, 0f32);
    for (&g, &w) in got.iter().zip(want) {
        assert!(g.is_finite());
        sig += f64::from(w) * f64::from(w);
        err += f64::from(g - w) * f64::from(g - w);
        max = max.max((g - w).abs());
    }
    (max, 10.0 * (sig / err.max(1e-30)).log10())
}

/// Prints the comparison; returns it as a failure message when out of tolerance (tests
/// assert after printing every case).
fn check(what: &str, got: &[f32], want: &[f32]) -> Option<String> {
    let (max, snr) = compare(got, want);
    println!(
        "{what}: {} samples, max abs err {max:.3e}, SNR {snr:.1} dB",
        want.len()
    );
    (max > MAX_ABS || snr < MIN_SNR_DB).then(|| format!("{what}: max abs err {max}, SNR {snr} dB"))
}

fn assert_none(fails: &[Option<String>]) {
    let bad: Vec<&String> = fails.iter().flatten().collect();
    assert!(bad.is_empty(), "out of tolerance: {bad:?}");
}

#[test]
fn one_shot_decodes_match_the_cpu() {
    let Some((cpu, mut gpu)) = models("one_shot_decodes_match_the_cpu") else {
        return;
    };
    let mut fails = Vec::new();
    for t in lengths() {
        let (c, frames) = codes(&format!("code2wav.codes.{t}"));
        assert_eq!(frames, t);
        let want = cpu.decode(&c, t).unwrap();
        let got = gpu.decode(&c, t).unwrap();
        assert_eq!(got.len(), 1920 * t - 555);
        fails.push(check(&format!("T = {t} (graph)"), &got, &want));
    }
    gpu.set_graphs(false);
    let (c, _) = codes("code2wav.codes.29");
    let want = cpu.decode(&c, 29).unwrap();
    fails.push(check(
        "T = 29 (eager, unpadded)",
        &gpu.decode(&c, 29).unwrap(),
        &want,
    ));
    gpu.set_graphs(true);
    println!("graphs captured: {:?}", gpu.graph_shapes());
    assert_none(&fails);
}

#[test]
fn streaming_windows_match_the_cpu_and_concatenate_gap_free() {
    let Some((cpu, mut gpu)) = models("streaming_windows_match_the_cpu_and_concatenate_gap_free")
    else {
        return;
    };
    let (all, frames) = codes("code2wav.stream.codes");
    let windows: Vec<(Vec<u32>, usize, usize)> = reference_json(FIXTURE)["code2wav.stream.windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            let w: Vec<usize> = w
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let (start, end, left) = (w[0], w[1], w[2]);
            let codes: Vec<u32> = all
                .chunks_exact(frames)
                .flat_map(|row| row[start..end].iter().copied())
                .collect();
            (codes, end - start, left)
        })
        .collect();
    let mut total = 0;
    let mut fails = Vec::new();
    for (k, (c, t, left)) in windows.iter().enumerate() {
        let want = cpu.decode_window(c, *t, *left).unwrap();
        let got = gpu.decode_window(c, *t, *left).unwrap();
        fails.push(check(
            &format!("window {k} ({t} frames, left {left})"),
            &got,
            &want,
        ));
        total += got.len();
    }
    assert_eq!(total, 1920 * frames - 555);
    let batch: Vec<(&[u32], usize, usize)> = windows
        .iter()
        .map(|(c, t, l)| (c.as_slice(), *t, *l))
        .collect();
    let together = gpu.decode_windows(&batch).unwrap();
    for (k, (got, (c, t, left))) in together.iter().zip(&windows).enumerate() {
        let want = cpu.decode_window(c, *t, *left).unwrap();
        fails.push(check(&format!("window {k} in one batch of 3"), got, &want));
    }
    assert_none(&fails);
}

#[test]
fn graph_replays_equal_eager_runs_of_the_same_shape() {
    let Some((_, mut gpu)) = models("graph_replays_equal_eager_runs_of_the_same_shape") else {
        return;
    };
    let nq = gpu.config().num_quantizers;
    for (t, bucket) in [(4, 4), (29, 32), (50, 50)] {
        let (c, _) = codes(&format!("code2wav.codes.{t}"));
        let graphed = gpu.decode(&c, t).unwrap();
        // The same codes zero-padded to the bucket by hand, run eagerly at that length.
        let mut padded = vec![0u32; nq * bucket];
        for q in 0..nq {
            padded[q * bucket..q * bucket + t].copy_from_slice(&c[q * t..(q + 1) * t]);
        }
        gpu.set_graphs(false);
        let eager = gpu.decode(&padded, bucket).unwrap();
        gpu.set_graphs(true);
        assert_eq!(
            &eager[..graphed.len()],
            graphed.as_slice(),
            "T = {t}: graph replay differs from the eager run"
        );
        println!("T = {t} (bucket {bucket}): graph == eager, bit for bit");
    }
    assert!(gpu.graph_shapes().contains(&(1, 32)));
}

#[test]
fn a_batch_of_different_lengths_equals_single_decodes() {
    let Some((cpu, mut gpu)) = models("a_batch_of_different_lengths_equals_single_decodes") else {
        return;
    };
    let all: Vec<(Vec<u32>, usize)> = [4, 25, 29, 50]
        .iter()
        .map(|t| codes(&format!("code2wav.codes.{t}")))
        .collect();
    let reqs: Vec<(&[u32], usize)> = all.iter().map(|(c, t)| (c.as_slice(), *t)).collect();
    let batched = gpu.decode_batch(&reqs).unwrap();
    let mut fails = Vec::new();
    for ((c, t), got) in all.iter().zip(&batched) {
        let alone = gpu.decode(c, *t).unwrap();
        let (max, snr) = compare(got, &alone);
        println!("T = {t} in a batch of 4 vs alone: max abs diff {max:.3e}, SNR {snr:.1} dB");
        if max > 1e-2 {
            fails.push(Some(format!(
                "T = {t}: batched differs from alone by {max}"
            )));
        }
        fails.push(check(
            &format!("T = {t} in a batch of 4 vs the CPU"),
            got,
            &cpu.decode(c, *t).unwrap(),
        ));
    }
    // More frames than one run holds: split into several runs (4 x 128-frame bucket = 512).
    let (c80, _) = codes("code2wav.codes.80");
    let many: Vec<(&[u32], usize)> = (0..6).map(|_| (c80.as_slice(), 80)).collect();
    let out = gpu.decode_batch(&many).unwrap();
    let alone = gpu.decode(&c80, 80).unwrap();
    for o in &out {
        let max = compare(o, &alone).0;
        if max > 1e-2 {
            fails.push(Some(format!(
                "T = 80 in 2 runs of a batch of 6: differs by {max}"
            )));
        }
    }
    println!("graphs captured: {:?}", gpu.graph_shapes());
    assert_none(&fails);
}
