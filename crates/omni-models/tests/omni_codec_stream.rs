//! Async-chunk streaming end to end on the CPU: Talker frames cut by the connector's
//! `CodecChunker` (4, then 25 new with 25 context) and each window decoded by Code2Wav with the
//! streaming trim give transformers' Code2Wav over the same windows, without gaps.
#![allow(clippy::unwrap_used)]

mod common;

use common::{dir, reference_json, reference_tensor};
use omni_core::connector::CodecChunker;
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::code2wav::Code2Wav;

const FIXTURE: &str = "qwen3-omni";

#[test]
fn chunked_frames_stream_the_fixtures_windows() {
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    let c2w = Code2Wav::load(&common::config(FIXTURE), &ws).unwrap();
    let (codes, shape) = reference_tensor(FIXTURE, "code2wav.stream.codes");
    let (groups, frames) = (shape[0], shape[1]);
    let want_windows: Vec<[usize; 3]> =
        serde_json::from_value(reference_json(FIXTURE)["code2wav.stream.windows"].clone()).unwrap();
    let mut chunker = CodecChunker::new(groups, 4, 25, 25);
    let mut windows = Vec::new();
    for t in 0..frames {
        let frame: Vec<u32> = (0..groups).map(|q| codes[q * frames + t] as u32).collect();
        windows.extend(chunker.push(&frame));
    }
    windows.extend(chunker.finish());
    let got: Vec<[usize; 3]> = windows
        .iter()
        .map(|w| [w.first_frame, w.first_frame + w.num_frames, w.left_context])
        .collect();
    assert_eq!(got, want_windows);
    let mut stream = Vec::new();
    for (k, w) in windows.iter().enumerate() {
        let audio = c2w
            .decode_window(&w.codes, w.num_frames, w.left_context)
            .unwrap();
        let (want, _) = reference_tensor(FIXTURE, &format!("code2wav.stream.wav.{k}"));
        assert_eq!(audio.len(), want.len(), "window {k}");
        let err = audio
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err <= 1e-4, "window {k}: max abs err {err}");
        stream.extend(audio);
    }
    assert_eq!(stream.len(), 1920 * frames - 555);
}
