//! Qwen3-Omni's encoder towers on a CUDA GPU (`omni_models::cuda_encoders`) against the f32 host
//! towers (themselves within 1e-4 of transformers) on the tiny fixture `qwen3-omni-mm`, fed the
//! same bf16 wire inputs (feature `cuda`; every test SKIPs, printing why, without a driver):
//!
//! - the vision tower's merged rows and deepstack features for each image alone, and for all
//!   items in one call, within bf16 tolerance; one call == each item alone;
//! - the audio tower's embeddings for each clip;
//! - timings of the real shapes with dummy weights: a 1280x720 image (3520 patches, one segment)
//!   through the vision tower, a 30 s clip through the audio tower.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::Instant;

use common::{config, dir, fro_err, reference_json};
use half::bf16;
use omni_backend::cuda::CudaContext;
use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_models::SubmodelWeights;
use omni_models::cuda_encoders::{CudaAudioEncoder, CudaVisionEncoder};
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::audio_encoder::{AudioEncoder, AudioEncoderConfig};
use omni_models::qwen3_omni::vision_encoder::{VisionEncoder, VisionEncoderConfig};
use serde_json::Value;

const FIXTURE: &str = "qwen3-omni-mm";
/// bf16 weights and activations against the f32 host towers.
const TOL: f32 = 2e-2;
/// One call against each item alone: the same kernels, but cuBLAS may pick other algorithms
/// (other bf16 roundings) for other row counts, so the bound is half of `TOL`, not zero.
const BATCH_TOL: f32 = 1e-2;

fn tower_cfg<T: serde::de::DeserializeOwned>(c: &Value, key: &str) -> T {
    serde_json::from_value(c["thinker_config"][key].clone()).unwrap()
}

/// A bf16 tensor of `reference.safetensors` as values, and its shape.
fn bf16_tensor(key: &str) -> (Vec<bf16>, Vec<usize>) {
    let bytes = std::fs::read(dir(FIXTURE).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(key).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::BF16, "{key}");
    let v = t
        .data()
        .chunks_exact(2)
        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
        .collect();
    (v, t.shape().to_vec())
}

fn f32s(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn download(cx: &CudaContext, d: &CudaSlice<bf16>) -> Vec<f32> {
    f32s(&cx.stream().clone_dtoh(d).unwrap())
}

/// Prints the error; returns a failure message when above `tol`.
fn check(what: &str, got: &[f32], want: &[f32], tol: f32) -> Option<String> {
    assert_eq!(got.len(), want.len(), "{what}");
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let e = fro_err(got, want);
    println!("gpu {what}: {} values, rel err {e:.3e}", want.len());
    (e > tol).then(|| format!("{what}: rel err {e} > {tol}"))
}

#[test]
fn cuda_vision_tower_matches_the_host_tower() {
    let Some(cx) = common::gpu_or_skip("cuda_vision_tower_matches_the_host_tower") else {
        return;
    };
    let c = config(FIXTURE);
    let vc: VisionEncoderConfig = tower_cfg(&c, "vision_config");
    let st = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    let ws = SubmodelWeights::new(&st, "thinker.visual.", &[]);
    let host = VisionEncoder::load(vc.clone(), &ws).unwrap();
    let gpu = CudaVisionEncoder::load(cx.clone(), vc.clone(), &ws).unwrap();
    let grids: Vec<[usize; 3]> =
        serde_json::from_value(reference_json(FIXTURE)["vision.grid_thw"].clone()).unwrap();
    let (pixels, shape) = bf16_tensor("vision.pixel_values");
    let row = shape[1];
    let (unit, out_h) = (vc.merge_unit(), vc.out_hidden_size);
    let mut fails = Vec::new();
    // Each item alone against the host, kept for the one-call comparison.
    let mut alone: Vec<(Vec<f32>, Vec<Vec<f32>>)> = Vec::new();
    let mut start = 0;
    for (i, g) in grids.iter().enumerate() {
        let n = g[0] * g[1] * g[2];
        let px = &pixels[start * row..(start + n) * row];
        start += n;
        let want = host.encode(&f32s(px), &[*g]).unwrap();
        let got = gpu.encode(px, &[*g]).unwrap();
        let merged = download(&cx, &got.merged);
        fails.extend(check(
            &format!("image {i} {g:?} merged"),
            &merged,
            &want.merged.data,
            TOL,
        ));
        assert_eq!(got.deepstack.len(), want.deepstack.len());
        let mut ds = Vec::new();
        for (j, (d, w)) in got.deepstack.iter().zip(&want.deepstack).enumerate() {
            let d = download(&cx, d);
            fails.extend(check(&format!("image {i} deepstack {j}"), &d, &w.data, TOL));
            ds.push(d);
        }
        alone.push((merged, ds));
    }
    // All items in one call: against the host's one call, and against each alone.
    let want = host.encode(&f32s(&pixels), &grids).unwrap();
    let got = gpu.encode(&pixels, &grids).unwrap();
    let merged = download(&cx, &got.merged);
    fails.extend(check("one call: merged", &merged, &want.merged.data, TOL));
    let ds: Vec<Vec<f32>> = got.deepstack.iter().map(|d| download(&cx, d)).collect();
    for (j, (d, w)) in ds.iter().zip(&want.deepstack).enumerate() {
        fails.extend(check(&format!("one call: deepstack {j}"), d, &w.data, TOL));
    }
    let mut row0 = 0;
    for (i, (g, (m, d))) in grids.iter().zip(&alone).enumerate() {
        let n = g[0] * g[1] * g[2] / unit;
        let rows = |v: &[f32]| v[row0 * out_h..(row0 + n) * out_h].to_vec();
        fails.extend(check(
            &format!("one call vs alone: item {i}"),
            &rows(&merged),
            m,
            BATCH_TOL,
        ));
        for (j, (b, a)) in ds.iter().zip(d).enumerate() {
            let what = format!("one call vs alone: item {i} deepstack {j}");
            fails.extend(check(&what, &rows(b), a, BATCH_TOL));
        }
        row0 += n;
    }
    assert!(fails.is_empty(), "{fails:#?}");
}

#[test]
fn cuda_audio_tower_matches_the_host_tower() {
    let Some(cx) = common::gpu_or_skip("cuda_audio_tower_matches_the_host_tower") else {
        return;
    };
    let c = config(FIXTURE);
    let ac: AudioEncoderConfig = tower_cfg(&c, "audio_config");
    let st = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    let ws = SubmodelWeights::new(&st, "thinker.audio_tower.", &[]);
    let host = AudioEncoder::load(ac.clone(), &ws).unwrap();
    let gpu = CudaAudioEncoder::load(cx.clone(), ac.clone(), &ws).unwrap();
    let frames: Vec<usize> =
        serde_json::from_value(reference_json(FIXTURE)["audio.frames"].clone()).unwrap();
    let mut fails = Vec::new();
    for (k, &f) in frames.iter().enumerate() {
        let (feat, _) = bf16_tensor(&format!("audio.features.{k}"));
        let want = host.encode(&f32s(&feat), f).unwrap();
        let got = download(&cx, &gpu.encode(&feat, f).unwrap());
        assert_eq!(want.shape, [ac.output_len(f), ac.output_dim]);
        fails.extend(check(
            &format!("clip {k} ({f} frames)"),
            &got,
            &want.data,
            TOL,
        ));
        // A clip shorter than one chunk (one chunk, no padding) and one of exactly one chunk.
        for cut in [37, 2 * ac.n_window] {
            if cut >= f {
                continue;
            }
            let part: Vec<bf16> = feat
                .chunks_exact(f)
                .flat_map(|r| r[..cut].to_vec())
                .collect();
            let want = host.encode(&f32s(&part), cut).unwrap();
            let got = download(&cx, &gpu.encode(&part, cut).unwrap());
            fails.extend(check(
                &format!("clip {k} first {cut} frames"),
                &got,
                &want.data,
                TOL,
            ));
        }
    }
    assert!(fails.is_empty(), "{fails:#?}");
}

/// The real checkpoint's `config.json` (`bench/models/`), from the crate or the repository root.
fn real_config() -> Value {
    let rel = "bench/models/qwen3-omni-30b-a3b/config.json";
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    let path = if built.is_file() {
        built
    } else {
        PathBuf::from(rel)
    };
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Median milliseconds of `run` (which synchronizes) over 5 runs after one warm-up.
fn time_ms(mut run: impl FnMut()) -> f64 {
    run();
    let mut ms: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms[2]
}

#[test]
fn bench_real_shape_towers_with_dummy_weights() {
    let Some(cx) = common::gpu_or_skip("bench_real_shape_towers_with_dummy_weights") else {
        return;
    };
    let c = real_config();
    let vc: VisionEncoderConfig = tower_cfg(&c, "vision_config");
    let v = CudaVisionEncoder::load_dummy(cx.clone(), vc.clone(), 7).unwrap();
    // 1280x720 resized by the processor to multiples of 32: 1280x704, a 44 x 80 patch grid.
    let grid = [1, 44, 80];
    let n = 44 * 80;
    let px: Vec<bf16> = (0..n * vc.patch_values())
        .map(|i| bf16::from_f32(((i * 7919) % 255) as f32 / 127.5 - 1.0))
        .collect();
    let ms = time_ms(|| {
        let o = v.encode(&px, &[grid]).unwrap();
        cx.synchronize().unwrap();
        drop(o);
    });
    let o = v.encode(&px, &[grid]).unwrap();
    let merged = download(&cx, &o.merged);
    assert!(merged.iter().all(|x| x.is_finite()));
    println!(
        "bench vision tower 1280x720 ({n} patches -> {} tokens, depth {}): {ms:.2} ms",
        merged.len() / vc.out_hidden_size,
        vc.depth
    );
    drop((o, v));
    let ac: AudioEncoderConfig = tower_cfg(&c, "audio_config");
    let a = CudaAudioEncoder::load_dummy(cx.clone(), ac.clone(), 7).unwrap();
    let frames = 3000;
    let feat: Vec<bf16> = (0..ac.num_mel_bins * frames)
        .map(|i| bf16::from_f32(((i * 104_729) % 199) as f32 / 99.5 - 1.0))
        .collect();
    let ms = time_ms(|| {
        let o = a.encode(&feat, frames).unwrap();
        cx.synchronize().unwrap();
        drop(o);
    });
    let out = download(&cx, &a.encode(&feat, frames).unwrap());
    assert!(out.iter().all(|x| x.is_finite()));
    println!(
        "bench audio tower 30 s ({frames} frames -> {} tokens, {} layers): {ms:.2} ms",
        out.len() / ac.output_dim,
        ac.encoder_layers
    );
}
