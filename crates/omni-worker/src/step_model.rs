//! [`StepModel`]: what the [`crate::ModelRunner`] needs of a backend — a model together with its
//! KV cache that runs one [`ForwardBatch`] and hands back logits (or samples on its device).
//!
//! - [`CpuStepModel`]: an [`omni_models::CausalLm`] with host KV caches (f32), or a
//!   [`StageModel`] (Qwen3-Omni's Thinker with its encoder towers, text out): then steps take
//!   M-RoPE positions and multimodal items.
//! - `CudaStepModel` (feature `cuda`, [`crate::cuda_model`]): the decoder on one GPU.

use std::time::Duration;

use omni_models::{
    CausalLm, EncoderOutput, ForwardBatch, KvCacheSpec, LayerKvCache, ModelInputs, MropePositions,
    MultiModalFeature, MultiModalKind, PositionInputs, StageForward, StageModel, TokenInputs,
};

use crate::WorkerError;
use crate::peers::PipelineLink;

/// Longest wait for the previous pipeline stage's activations (a dead stage fails sooner,
/// through the queue's liveness checks).
pub(crate) const STAGE_INPUT_TIMEOUT: Duration = Duration::from_secs(300);

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
    /// Whether this rank's steps end in logits to sample (false on a pipeline stage before
    /// the last, which passes its activations on instead).
    fn samples(&self) -> bool {
        true
    }
    /// Samples one token per row of the last step's logits on the device, or `None` when this
    /// backend has no device sampler.
    fn sample_on_device(
        &mut self,
        _rows: &[DeviceSample],
    ) -> Result<Option<Vec<u32>>, WorkerError> {
        Ok(None)
    }
    /// The M-RoPE rows of a whole prompt with its items and the decode delta, or `None` when
    /// the model takes 1-D positions.
    fn mrope_positions(
        &self,
        _ids: &[u32],
        _items: &[MultiModalKind],
    ) -> Result<Option<(MropePositions, i64)>, WorkerError> {
        Ok(None)
    }
    /// Runs the encoder of one item over its whole tensor.
    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, WorkerError> {
        Err(WorkerError::Batch(format!(
            "{} on this backend takes no {} input",
            self.architecture(),
            feature.modality
        )))
    }
    /// [`StepModel::forward`] with M-RoPE `positions` (`None`: the batch's) and the step's
    /// multimodal `features`, whose encoder outputs are `encoded` (one each).
    fn forward_mm(
        &mut self,
        _batch: &ForwardBatch,
        _positions: Option<&MropePositions>,
        _features: &[MultiModalFeature<'_>],
        _encoded: &[&EncoderOutput],
    ) -> Result<usize, WorkerError> {
        Err(WorkerError::Batch(format!(
            "{} on this backend takes no multimodal input",
            self.architecture()
        )))
    }
}

/// The network of a [`CpuStepModel`].
#[derive(Debug)]
enum CpuNet {
    /// A text decoder.
    Lm(Box<dyn CausalLm>),
    /// A stage network served text out (Qwen3-Omni's Thinker).
    Stage(Box<dyn StageModel>),
}

impl CpuNet {
    fn kv_cache_spec(&self) -> Result<KvCacheSpec, WorkerError> {
        match self {
            Self::Lm(m) => Ok(m.kv_cache_spec()),
            Self::Stage(m) => m
                .kv_cache_spec()
                .ok_or_else(|| WorkerError::Load(format!("{} has no KV cache", m.architecture()))),
        }
    }
}

/// The CPU backend: a [`CausalLm`] (or a [`StageModel`] with logits) and its host KV caches.
#[derive(Debug)]
pub struct CpuStepModel {
    model: CpuNet,
    kv: Vec<LayerKvCache>,
    block_size: usize,
    logits: Vec<f32>,
    /// Logits row width of a stage network.
    vocab: usize,
    available: u64,
    pipeline: PipelineLink,
}

impl CpuStepModel {
    /// Wraps a loaded model; `available` is what the KV cache may use (host bytes).
    pub fn new(model: Box<dyn CausalLm>, available: u64) -> Self {
        Self::with_net(CpuNet::Lm(model), available)
    }

    /// Wraps a loaded stage network that has a KV cache and a head of `vocab` logits
    /// (Qwen3-Omni's Thinker); `available` is what the KV cache may use.
    pub fn from_stage_model(
        model: Box<dyn StageModel>,
        vocab: usize,
        available: u64,
    ) -> Result<Self, WorkerError> {
        let net = CpuNet::Stage(model);
        net.kv_cache_spec()?;
        let mut m = Self::with_net(net, available);
        m.vocab = vocab;
        Ok(m)
    }

    fn with_net(model: CpuNet, available: u64) -> Self {
        Self {
            model,
            kv: Vec::new(),
            block_size: 0,
            logits: Vec::new(),
            vocab: 0,
            available,
            pipeline: PipelineLink::default(),
        }
    }

    /// This rank's links to the neighbouring pipeline stages (a text decoder split by layers).
    pub fn with_pipeline(mut self, pipeline: PipelineLink) -> Self {
        self.pipeline = pipeline;
        self
    }
}

impl StepModel for CpuStepModel {
    fn architecture(&self) -> &str {
        match &self.model {
            CpuNet::Lm(m) => m.architecture(),
            CpuNet::Stage(m) => m.architecture(),
        }
    }

    fn vocab_size(&self) -> usize {
        match &self.model {
            CpuNet::Lm(m) => m.vocab_size(),
            CpuNet::Stage(_) => self.vocab,
        }
    }

    fn kv_bytes_per_block(&self, block_size: usize) -> u64 {
        self.model.kv_cache_spec().map_or(0, |spec| {
            (spec.bytes_per_block_per_layer(block_size) * spec.num_layers) as u64
        })
    }

    fn available_kv_bytes(&self) -> Result<u64, WorkerError> {
        Ok(self.available)
    }

    fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), WorkerError> {
        self.kv = self.model.kv_cache_spec()?.allocate(num_blocks, block_size);
        self.block_size = block_size;
        Ok(())
    }

    fn has_cache(&self) -> bool {
        !self.kv.is_empty()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<usize, WorkerError> {
        match &self.model {
            CpuNet::Lm(m) => {
                let t = batch.input_ids.len();
                let hidden = if self.pipeline.has_prev() {
                    Some(self.pipeline.recv(t, STAGE_INPUT_TIMEOUT)?)
                } else {
                    None
                };
                match m.forward_stage(batch, hidden.as_deref(), &mut self.kv)? {
                    StageForward::Logits(logits) => {
                        let rows = logits.shape.first().copied().unwrap_or(0);
                        self.logits = logits.data;
                        Ok(rows)
                    }
                    StageForward::Hidden(x) => {
                        let width = x.len() / t.max(1);
                        self.pipeline.send(&x, t, width)?;
                        self.logits.clear();
                        Ok(0)
                    }
                }
            }
            CpuNet::Stage(_) => self.forward_mm(batch, None, &[], &[]),
        }
    }

    fn mrope_positions(
        &self,
        ids: &[u32],
        items: &[MultiModalKind],
    ) -> Result<Option<(MropePositions, i64)>, WorkerError> {
        match &self.model {
            CpuNet::Lm(_) => Ok(None),
            CpuNet::Stage(m) => Ok(m.mrope_positions(ids, items)?),
        }
    }

    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, WorkerError> {
        match &self.model {
            CpuNet::Lm(m) => Err(WorkerError::Batch(format!(
                "{} takes no {} input",
                m.architecture(),
                feature.modality
            ))),
            CpuNet::Stage(m) => Ok(m.encode_mm(feature)?),
        }
    }

    fn forward_mm(
        &mut self,
        batch: &ForwardBatch,
        positions: Option<&MropePositions>,
        features: &[MultiModalFeature<'_>],
        encoded: &[&EncoderOutput],
    ) -> Result<usize, WorkerError> {
        let CpuNet::Stage(m) = &self.model else {
            return Err(WorkerError::Batch(format!(
                "{} takes no multimodal input",
                self.architecture()
            )));
        };
        let inputs = ModelInputs {
            batch,
            tokens: TokenInputs::Ids,
            positions: positions.map_or(PositionInputs::Batch, PositionInputs::Mrope),
            mm_features: features,
            capture: &[],
        };
        let out = m.forward_encoded(&inputs, encoded, &mut self.kv)?;
        let logits = out
            .logits
            .ok_or_else(|| WorkerError::Batch(format!("{} gave no logits", m.architecture())))?;
        let rows = logits.shape.first().copied().unwrap_or(0);
        self.logits = logits.data;
        Ok(rows)
    }

    fn logits_host(&mut self) -> Result<Vec<f32>, WorkerError> {
        Ok(std::mem::take(&mut self.logits))
    }

    fn samples(&self) -> bool {
        !self.pipeline.has_next()
    }
}
