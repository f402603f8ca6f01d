//! [`StepModel`]: what the [`crate::ModelRunner`] needs of a backend — a model together with its
//! KV cache that runs one [`ForwardBatch`] and hands back logits (or samples on its device).
//!
//! - [`CpuStepModel`]: an [`omni_models::CausalLm`] with host KV caches (f32).
//! - `CudaStepModel` (feature `cuda`, [`crate::cuda_model`]): the decoder on one GPU.

use omni_models::{CausalLm, ForwardBatch, LayerKvCache};

use crate::WorkerError;

/// Per-row sampling settings a device sampler handles (no penalties, no logprobs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSample {
    /// 0 = greedy.
    pub temperature: f32,
    /// `<= 0` = off.
    pub top_k: i32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// Stream seed of this row.
    pub seed: u64,
    /// Which draw of the stream (tokens generated so far).
    pub offset: u64,
}

/// A model and its KV cache on some backend.
pub trait StepModel: Send + std::fmt::Debug {
    /// The HF `architectures` string.
    fn architecture(&self) -> &str;
    /// Vocabulary size (logits row width).
    fn vocab_size(&self) -> usize;
    /// KV cache bytes of one block of `block_size` tokens on this rank (all layers, K and V).
    fn kv_bytes_per_block(&self, block_size: usize) -> u64;
    /// Memory the KV cache may use on this rank, in bytes.
    fn available_kv_bytes(&self) -> Result<u64, WorkerError>;
    /// Allocates `num_blocks` zeroed KV blocks of `block_size` tokens.
    fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), WorkerError>;
    /// Whether [`StepModel::init_cache`] ran.
    fn has_cache(&self) -> bool;
    /// Runs one step; keeps the logits of `batch.output_rows()` and returns how many rows.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<usize, WorkerError>;
    /// The last step's logits, `[rows, vocab]`, on the host.
    fn logits_host(&mut self) -> Result<Vec<f32>, WorkerError>;
    /// Samples one token per row of the last step's logits on the device, or `None` when this
    /// backend has no device sampler.
    fn sample_on_device(
        &mut self,
        _rows: &[DeviceSample],
    ) -> Result<Option<Vec<u32>>, WorkerError> {
        Ok(None)
    }
}

/// The CPU backend: a [`CausalLm`] and its host KV caches.
#[derive(Debug)]
pub struct CpuStepModel {
    model: Box<dyn CausalLm>,
    kv: Vec<LayerKvCache>,
    block_size: usize,
    logits: Vec<f32>,
    available: u64,
}

impl CpuStepModel {
    /// Wraps a loaded model; `available` is what the KV cache may use (host bytes).
    pub fn new(model: Box<dyn CausalLm>, available: u64) -> Self {
        Self {
            model,
            kv: Vec::new(),
            block_size: 0,
            logits: Vec::new(),
            available,
        }
    }
}

impl StepModel for CpuStepModel {
    fn architecture(&self) -> &str {
        self.model.architecture()
    }

    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn kv_bytes_per_block(&self, block_size: usize) -> u64 {
        let spec = self.model.kv_cache_spec();
        (spec.bytes_per_block_per_layer(block_size) * spec.num_layers) as u64
    }

    fn available_kv_bytes(&self) -> Result<u64, WorkerError> {
        Ok(self.available)
    }

    fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), WorkerError> {
        self.kv = self.model.kv_cache_spec().allocate(num_blocks, block_size);
        self.block_size = block_size;
        Ok(())
    }

    fn has_cache(&self) -> bool {
        !self.kv.is_empty()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<usize, WorkerError> {
        let logits = self.model.forward(batch, &mut self.kv)?;
        let rows = logits.shape.first().copied().unwrap_or(0);
        self.logits = logits.data;
        Ok(rows)
    }

    fn logits_host(&mut self) -> Result<Vec<f32>, WorkerError> {
        Ok(std::mem::take(&mut self.logits))
    }
}
