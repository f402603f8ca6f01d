//! Code2Wav on the tiny Qwen3-Omni fixture against transformers' waveforms: one-shot decodes of
//! several lengths, a zero-padded batch of two lengths, vLLM-Omni's streaming windows, and the
//! stage interface (codes as input ids).

#![allow(clippy::unwrap_used)]

mod common;

use common::dir;
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::code2wav::Code2Wav;
use omni_models::registry::read_config;
use omni_models::{ForwardBatch, ModelInputs, ModelStage, SeqChunk, StageModel};

const FIXTURE: &str = "qwen3-omni";
/// Waveform samples are in `[-1, 1]`; transformers computes in f32 on the same weights.
const TOL: f32 = 1e-4;

fn model() -> Code2Wav {
    let d = dir(FIXTURE);
    Code2Wav::load(
        &read_config(&d).unwrap(),
        &SafetensorsDir::open(&d).unwrap(),
    )
    .unwrap()
}

/// A float32 tensor of the fixture's `reference.safetensors`: (data, shape).
fn tensor(name: &str) -> (Vec<f32>, Vec<usize>) {
    common::reference_tensor(FIXTURE, name)
}

/// Codes `[16, T]` (stored as f32), codebook-major, and T.
fn codes(name: &str) -> (Vec<u32>, usize) {
    let (data, shape) = tensor(name);
    (data.iter().map(|&v| v as u32).collect(), shape[1])
}

fn reference_json() -> serde_json::Value {
    let text = std::fs::read_to_string(dir(FIXTURE).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn max_abs_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn lengths() -> Vec<usize> {
    reference_json()["code2wav.lengths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect()
}

#[test]
fn one_shot_decodes_match_transformers() {
    let m = model();
    for t in lengths() {
        let (c, frames) = codes(&format!("code2wav.codes.{t}"));
        assert_eq!(frames, t);
        let (want, _) = tensor(&format!("code2wav.wav.{t}"));
        let got = m.decode(&c, t).unwrap();
        assert_eq!(got.len(), 1920 * t - 555);
        let err = max_abs_err(&got, &want);
        eprintln!("T = {t}: max abs err {err:.3e}");
        assert!(err <= TOL, "T = {t}: max abs err {err}");
    }
}

#[test]
fn padded_batch_equals_single_decodes() {
    let m = model();
    let (c4, _) = codes("code2wav.codes.4");
    let (c25, _) = codes("code2wav.codes.25");
    let batch = m.decode_batch(&[(&c4, 4), (&c25, 25)]).unwrap();
    for (got, t) in batch.iter().zip([4, 25]) {
        let (want, _) = tensor(&format!("code2wav.wav.{t}"));
        let err = max_abs_err(got, &want);
        assert!(err <= TOL, "T = {t} in a batch: max abs err {err}");
    }
    let alone = m.decode(&c4, 4).unwrap();
    assert!(max_abs_err(&batch[0], &alone) <= 1e-5);
}

#[test]
fn streaming_windows_match_and_concatenate_gap_free() {
    let m = model();
    let (all, frames) = codes("code2wav.stream.codes");
    let windows = reference_json()["code2wav.stream.windows"].clone();
    let mut total = 0;
    for (k, w) in windows.as_array().unwrap().iter().enumerate() {
        let w: Vec<usize> = w
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let (start, end, left) = (w[0], w[1], w[2]);
        let t = end - start;
        // Codebook-major [16, frames] -> the window's [16, t].
        let window: Vec<u32> = all
            .chunks_exact(frames)
            .flat_map(|row| row[start..end].iter().copied())
            .collect();
        let got = m.decode_window(&window, t, left).unwrap();
        let (want, _) = tensor(&format!("code2wav.stream.wav.{k}"));
        let err = max_abs_err(&got, &want);
        eprintln!("window {k} ({start}..{end}, left {left}): max abs err {err:.3e}");
        assert!(err <= TOL, "window {k}: max abs err {err}");
        total += got.len();
    }
    assert_eq!(total, 1920 * frames - 555);
}

#[test]
fn stage_interface_takes_flattened_codes_per_sequence() {
    let m = model();
    assert_eq!(m.stage(), ModelStage::Code2Wav);
    assert!(m.kv_cache_spec().is_none());
    let (c1, _) = codes("code2wav.codes.1");
    let (c4, _) = codes("code2wav.codes.4");
    let chunks = [
        SeqChunk {
            tokens: &c4,
            start_pos: 0,
            block_table: &[0; 16],
        },
        SeqChunk {
            tokens: &c1,
            start_pos: 0,
            block_table: &[0; 16],
        },
    ];
    let batch = ForwardBatch::from_chunks(&chunks, 16).unwrap();
    let out = m.forward(&ModelInputs::text(&batch), &mut []).unwrap();
    assert_eq!(out.audio.len(), 2);
    for (a, t) in out.audio.iter().zip([4, 1]) {
        let (want, _) = tensor(&format!("code2wav.wav.{t}"));
        assert_eq!(a.shape, vec![1920 * t - 555]);
        assert!(max_abs_err(&a.data, &want) <= TOL);
    }
}
