//! The multimodal fixture `qwen3-omni-mm` as engine requests: its four requests (an image, an
//! audio clip, both with text between, text only) with the fixture's preprocessed tensors as
//! their items' buffers, and transformers' greedy tokens for each.
#![allow(dead_code, clippy::unwrap_used)]

use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use omni_protocol::{
    DType, EngineCoreRequest, MmKind, MultiModalFeatureSpec, SamplingParams, TensorRef,
};
use serde_json::Value;

/// The fixture directory.
pub fn mm_fixture() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../crates/omni-models/tests/fixtures/qwen3-omni-mm");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("crates/omni-models/tests/fixtures/qwen3-omni-mm")
    }
}

/// The fixture's requests and its items' wire bytes.
pub struct MmFixture {
    /// `reference.json`'s requests.
    pub requests: Vec<Value>,
    /// Per image: grid and bf16 pixel rows.
    pub images: Vec<([u32; 3], Vec<u8>)>,
    /// Per audio clip: frames and bf16 `[128, frames]`.
    pub audios: Vec<(u32, Vec<u8>)>,
}

/// A stand-in content hash (the server's is BLAKE3; any hash of the bytes will do here).
pub fn content_hash(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

impl MmFixture {
    /// Reads the fixture.
    pub fn load() -> Self {
        let dir = mm_fixture();
        let r: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let grids: Vec<[u32; 3]> = serde_json::from_value(r["vision.grid_thw"].clone()).unwrap();
        let pixels = st.tensor("vision.pixel_values").unwrap();
        let row = pixels.shape()[1] * 2;
        let mut start = 0;
        let images = grids
            .iter()
            .map(|g| {
                let n = (g[0] * g[1] * g[2]) as usize;
                start += n;
                (*g, pixels.data()[(start - n) * row..start * row].to_vec())
            })
            .collect();
        let frames: Vec<u32> = serde_json::from_value(r["audio.frames"].clone()).unwrap();
        let audios = frames
            .iter()
            .enumerate()
            .map(|(k, &f)| {
                let t = st.tensor(&format!("audio.features.{k}")).unwrap();
                (f, t.data().to_vec())
            })
            .collect();
        Self {
            requests: r["requests"].as_array().unwrap().clone(),
            images,
            audios,
        }
    }

    /// Fixture request `i` as an engine request with id `id`, and its greedy tokens.
    pub fn request(&self, i: usize, id: &str) -> (EngineCoreRequest, Vec<u32>) {
        let req = &self.requests[i];
        let ids: Vec<u32> = serde_json::from_value(req["ids"].clone()).unwrap();
        let greedy: Vec<u32> = serde_json::from_value(req["greedy"].clone()).unwrap();
        let params = SamplingParams::greedy(greedy.len() as u32);
        let mut r = EngineCoreRequest::new(id, ids, params, None);
        for it in req["items"].as_array().unwrap() {
            let k = it["index"].as_u64().unwrap() as usize;
            let (kind, shape, bytes) = match it["modality"].as_str().unwrap() {
                "image" => {
                    let (g, b) = &self.images[k];
                    let rows = u64::from(g[0] * g[1] * g[2]);
                    (MmKind::Image { grid_thw: *g }, [rows, 1536], b)
                }
                _ => {
                    let (f, b) = &self.audios[k];
                    (MmKind::Audio { num_frames: *f }, [128, u64::from(*f)], b)
                }
            };
            let mm_hash = content_hash(bytes);
            let buffer_index = r.mm_buffers.push(bytes.clone().into());
            r.mm_features.push(MultiModalFeatureSpec {
                mm_hash,
                offset: it["offset"].as_u64().unwrap() as u32,
                length: it["len"].as_u64().unwrap() as u32,
                kind,
                tensor: TensorRef {
                    name: kind.modality().into(),
                    request_id: None,
                    dtype: DType::Bf16,
                    shape: shape.to_vec(),
                    buffer_index,
                },
            });
        }
        (r, greedy)
    }
}
