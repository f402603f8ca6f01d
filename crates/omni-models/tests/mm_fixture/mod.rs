//! The `qwen3-omni-mm` fixture's items and requests (`reference.json`, `reference.safetensors`),
//! shared by the CPU and CUDA multimodal tests.
#![allow(dead_code)]

use omni_models::{MultiModalFeature, MultiModalKind};
use serde_json::Value;

use crate::common::dir;

/// The fixture: a tiny random Thinker with both towers and the real token ids.
pub const FIXTURE: &str = "qwen3-omni-mm";

/// A bf16 tensor of `reference.safetensors` as its raw little-endian bytes, and its shape.
pub fn bf16_tensor(key: &str) -> (Vec<u8>, Vec<usize>) {
    let bytes = std::fs::read(dir(FIXTURE).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(key).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::BF16, "{key}");
    (t.data().to_vec(), t.shape().to_vec())
}

pub fn bf16_to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

/// The fixture's multimodal items as wire bytes: images (rows of `vision.pixel_values`) and
/// audio clips.
pub struct Items {
    pub grids: Vec<[usize; 3]>,
    pub pixels: Vec<u8>,
    pub image_bytes: Vec<Vec<u8>>,
    pub frames: Vec<usize>,
    pub audio_bytes: Vec<Vec<u8>>,
}

pub fn items(r: &Value) -> Items {
    let grids: Vec<[usize; 3]> = serde_json::from_value(r["vision.grid_thw"].clone()).unwrap();
    let (pixels, shape) = bf16_tensor("vision.pixel_values");
    let row = shape[1] * 2;
    let mut start = 0;
    let image_bytes = grids
        .iter()
        .map(|g| {
            let n = g[0] * g[1] * g[2];
            start += n;
            pixels[(start - n) * row..start * row].to_vec()
        })
        .collect();
    let frames: Vec<usize> = serde_json::from_value(r["audio.frames"].clone()).unwrap();
    let audio_bytes = (0..frames.len())
        .map(|k| bf16_tensor(&format!("audio.features.{k}")).0)
        .collect();
    Items {
        grids,
        pixels,
        image_bytes,
        frames,
        audio_bytes,
    }
}

/// Request `req`'s items as features whose placeholders start `shift` rows into the batch.
pub fn features<'a>(req: &Value, it: &'a Items, shift: usize) -> Vec<MultiModalFeature<'a>> {
    req["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| {
            let (off, len) = (
                item["offset"].as_u64().unwrap() as usize,
                item["len"].as_u64().unwrap() as usize,
            );
            let i = item["index"].as_u64().unwrap() as usize;
            let (kind, data) = match item["modality"].as_str().unwrap() {
                "image" => (
                    MultiModalKind::Image {
                        grid_thw: it.grids[i],
                    },
                    &it.image_bytes[i],
                ),
                "audio" => (
                    MultiModalKind::Audio {
                        num_frames: it.frames[i],
                    },
                    &it.audio_bytes[i],
                ),
                m => panic!("{m}"),
            };
            MultiModalFeature {
                modality: kind.modality(),
                mm_hash: (i as u64) << 8 | len as u64,
                placeholder: shift + off..shift + off + len,
                item_offset: 0,
                kind,
                data,
            }
        })
        .collect()
}

pub fn request_ids(req: &Value) -> Vec<u32> {
    serde_json::from_value(req["ids"].clone()).unwrap()
}

pub fn request_positions(req: &Value) -> [Vec<i64>; 3] {
    serde_json::from_value(req["positions"].clone()).unwrap()
}

/// Our logits at the reference's columns.
pub fn columns(logits: &[f32], vocab: usize, cols: &[usize]) -> Vec<f32> {
    logits
        .chunks_exact(vocab)
        .flat_map(|row| cols.iter().map(|&c| row[c]))
        .collect()
}
