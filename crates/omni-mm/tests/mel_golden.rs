//! `log_mel` against transformers' `WhisperFeatureExtractor` as the Qwen3-Omni processor calls it
//! (torch path, one clip of 160000 + 37 samples: not a multiple of the hop).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bytes, f32s, golden};
use omni_mm::{MediaLimits, WhisperFeatureConfig, audio_output_tokens, decode_audio, log_mel};

#[test]
fn log_mel_of_160037_samples_matches_transformers() {
    let g = golden();
    let c = &g["mel"];
    let audio = decode_audio(
        &bytes("clip_160037.wav"),
        Some("wav"),
        &MediaLimits::default(),
    )
    .unwrap();
    assert_eq!(audio.sample_rate, 16_000);
    assert_eq!(audio.samples.len(), 160_037);
    let f = log_mel(&audio.samples, &WhisperFeatureConfig::default()).unwrap();
    // floor(160037 / 160) = 1000 frames; the mask (all ones) is trimmed to match.
    assert_eq!(f.num_frames, 1000);
    assert_eq!(f.num_frames as u64, c["mask_sum"].as_u64().unwrap());
    let want = f32s("clip_160037.mel.f32");
    assert_eq!(want.len(), 128 * 1000);
    let (mut max_abs, mut max_rel) = (0f64, 0f64);
    for (a, b) in f.input_features.iter().zip(&want) {
        let d = f64::from((a - b).abs());
        max_abs = max_abs.max(d);
        max_rel = max_rel.max(d / f64::from(b.abs()).max(1.0));
    }
    eprintln!(
        "log-mel vs transformers (torch f32 path): max abs {max_abs:.2e}, max rel {max_rel:.2e}; \
         transformers' own torch vs numpy paths differ by {}",
        c["torch_vs_numpy_path_max_abs"]
    );
    // Features are O(1): relative error against max(|x|, 1).
    assert!(max_rel <= 1e-4, "max rel {max_rel}");
    assert_eq!(
        audio_output_tokens(f.num_frames) as u64,
        c["audio_tokens"].as_u64().unwrap()
    );
}
