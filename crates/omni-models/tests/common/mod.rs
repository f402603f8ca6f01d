//! Shared helpers for the fixture tests: loading fixtures and references, a toy block allocator,
//! and the error metric.
#![allow(dead_code)]
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use omni_models::registry::{LoadFormat, load_model_dir, read_config};
use omni_models::weights::{HostTensor, WeightError, WeightSource};
use omni_models::{CausalLm, ForwardBatch, LayerKvCache, SeqChunk, TpContext};

pub const ARCHS: &[&str] = &["llama", "llama3-rope-bf16", "qwen3", "qwen3-moe"];
pub const BLOCK_SIZE: usize = 4;
pub const NUM_BLOCKS: usize = 128;

/// A fixture directory. Test binaries built here and run elsewhere (the GPU machine runs them
/// from a copy of the repository) fall back to the path relative to the working directory.
pub fn dir(name: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let base = if built.is_dir() {
        built
    } else {
        PathBuf::from("crates/omni-models/tests/fixtures")
    };
    base.join(name)
}

#[derive(Debug, serde::Deserialize)]
pub struct Reference {
    pub input_ids: Vec<Vec<u32>>,
    pub greedy: Vec<Vec<u32>>,
}

pub fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(dir(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Reference logits `[T, vocab]` for prompt `i`, row-major.
pub fn reference_logits(name: &str, i: usize) -> (Vec<f32>, usize) {
    let bytes = std::fs::read(dir(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(&format!("logits.{i}")).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    let data = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (data, t.shape()[1])
}

pub fn load(name: &str, tp: TpContext) -> Box<dyn CausalLm> {
    load_model_dir(&dir(name), LoadFormat::Safetensors, tp).unwrap()
}

pub fn config(name: &str) -> serde_json::Value {
    read_config(&dir(name)).unwrap()
}

/// max|a - b| / max|b|.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let den = b.iter().map(|y| y.abs()).fold(0.0, f32::max);
    num / den
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Hands out blocks round-robin from the back of the pool, so sequences interleave and no table
/// is contiguous or in order.
#[derive(Debug)]
pub struct Blocks {
    next: usize,
}

impl Blocks {
    pub fn new() -> Self {
        Self { next: NUM_BLOCKS }
    }

    pub fn table(&mut self, tokens: usize) -> Vec<u32> {
        (0..tokens.div_ceil(BLOCK_SIZE))
            .map(|_| {
                self.next -= 1;
                self.next as u32
            })
            .collect()
    }
}

pub fn fresh_cache(model: &dyn CausalLm) -> Vec<LayerKvCache> {
    model.kv_cache_spec().allocate(NUM_BLOCKS, BLOCK_SIZE)
}

/// Runs each `(tokens, start_pos, table)` chunk as one batch and returns all-position logits.
pub fn run_all(
    model: &dyn CausalLm,
    kv: &mut [LayerKvCache],
    chunks: &[(&[u32], usize, &[u32])],
) -> Vec<f32> {
    let chunks: Vec<SeqChunk<'_>> = chunks
        .iter()
        .map(|&(tokens, start_pos, block_table)| SeqChunk {
            tokens,
            start_pos,
            block_table,
        })
        .collect();
    let batch = ForwardBatch::from_chunks(&chunks, BLOCK_SIZE)
        .unwrap()
        .with_all_logits();
    model.forward(&batch, kv).unwrap().data
}

/// A named f32 tensor of a fixture's `reference.safetensors`: (data, shape).
pub fn reference_tensor(name: &str, key: &str) -> (Vec<f32>, Vec<usize>) {
    let bytes = std::fs::read(dir(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st
        .tensor(key)
        .unwrap_or_else(|e| panic!("{name}: {key}: {e}"));
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{key}");
    let data = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (data, t.shape().to_vec())
}

/// A fixture's `reference.json`, untyped.
pub fn reference_json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(dir(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The GPU's context, or `None` after printing why the test SKIPs (no NVIDIA driver here).
#[cfg(feature = "cuda")]
pub fn gpu_or_skip(test: &str) -> Option<std::sync::Arc<omni_backend::cuda::CudaContext>> {
    match omni_backend::cuda::driver_status() {
        Err(e) => {
            println!("SKIP {test}: {e}");
            None
        }
        Ok(_) => Some(std::sync::Arc::new(
            omni_backend::cuda::CudaContext::new(0).unwrap(),
        )),
    }
}

/// ||a - b|| / ||b|| over the whole tensor (the usual relative error of a tensor).
pub fn fro_err(a: &[f32], b: &[f32]) -> f32 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += f64::from(x - y).powi(2);
        den += f64::from(*y).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt() as f32
}

/// Weights as f32 only (`load_quantized` left at its default): the dequantized reference of a
/// source that keeps quantized blocks.
pub struct F32View<'a>(pub &'a dyn WeightSource);

impl WeightSource for F32View<'_> {
    fn tensor_names(&self) -> Vec<String> {
        self.0.tensor_names()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        self.0.shape(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        self.0.load(name)
    }
}
