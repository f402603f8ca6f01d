//! Model architectures (one file each) and weight loading (safetensors, GGUF, dummy).
//!
//! Layer L2: depends on `omni-backend` for tensors and ops; knows nothing of processes or IPC.
//!
//! - [`registry`]: architectures keyed by the HF `architectures` string (`LlamaForCausalLM`,
//!   `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`), and the entry points
//!   [`registry::load_model_dir`], [`registry::build_model`], [`registry::dummy_weights`],
//!   [`registry::kv_cache_bytes_per_block_per_layer`].
//! - [`llama`], [`qwen3`], [`qwen3_moe`]: each a serde `Config` mirroring HF `config.json`,
//!   mapped into the shared Llama-family [`decoder`] (which walks the checkpoint's tensor names
//!   and documents the tensor-parallel split).
//! - [`weights`]: the [`weights::WeightSource`] trait; [`hf_dir::SafetensorsDir`] and
//!   [`dummy::DummyWeights`] implement it.
//! - [`batch`]: [`ForwardBatch`], one step's flat batch with vLLM's attention metadata.
//! - [`interface`]: [`StageModel`], the interface beyond "logits of a Llama": token ids or
//!   input embeddings, 1-D or M-RoPE positions, multimodal features, captured hidden states of
//!   named layers, codes; [`registry::build_stage_model`] builds one by (architecture, stage).
//!
//! ```no_run
//! use omni_models::registry::{LoadFormat, load_model_dir};
//! use omni_models::{ForwardBatch, SeqChunk, TpContext};
//! # fn main() -> Result<(), omni_models::ModelError> {
//! let model = load_model_dir("path/to/SmolLM2-135M".as_ref(), LoadFormat::Safetensors, TpContext::single())?;
//! let block_size = 16;
//! let mut kv = model.kv_cache_spec().allocate(64, block_size);
//! let batch = ForwardBatch::from_chunks(
//!     &[SeqChunk { tokens: &[1, 2, 3], start_pos: 0, block_table: &[0] }],
//!     block_size,
//! )?;
//! let logits = model.forward(&batch, &mut kv)?; // [1, vocab]: the last token's
//! # Ok(()) }
//! ```

pub mod batch;
#[cfg(feature = "cuda")]
pub mod cuda_code2wav;
#[cfg(feature = "cuda")]
pub mod cuda_decoder;
#[cfg(feature = "cuda")]
pub mod cuda_encoders;
#[cfg(feature = "cuda")]
pub mod cuda_talker;
pub mod decoder;
pub mod dummy;
pub mod error;
pub mod gguf;
pub mod hf_config;
pub mod hf_dir;
pub mod interface;
pub mod llama;
pub mod qwen3;
pub mod qwen3_moe;
pub mod qwen3_omni;
pub mod registry;
pub mod weights;

pub use batch::{ForwardBatch, SeqChunk};
pub use decoder::{DecoderModel, DecoderSpec, PipelineStage, ResidualAdds, TpContext};
pub use error::ModelError;
pub use interface::{
    Capture, EncoderOutput, ModelInputs, ModelOutputs, ModelStage, MropePositions,
    MultiModalFeature, MultiModalKind, PositionInputs, StageModel, TokenInputs,
};
pub use omni_backend::attention::LayerKvCache;
pub use omni_backend::comm::{AllReduce, IdentityAllReduce, InProcessAllReduce};
pub use weights::{HostTensor, SubmodelWeights, WeightSource};

/// The KV cache geometry of one rank's model: per layer, its local KV heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheSpec {
    /// Layers (one [`LayerKvCache`] each).
    pub num_layers: usize,
    /// KV heads held on this rank.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvCacheSpec {
    /// Bytes of K and V (f32) for one block of `block_size` tokens in one layer.
    pub fn bytes_per_block_per_layer(&self, block_size: usize) -> usize {
        LayerKvCache::bytes_per_block(block_size, self.num_kv_heads, self.head_dim)
    }

    /// Zeroed caches for every layer.
    pub fn allocate(&self, num_blocks: usize, block_size: usize) -> Vec<LayerKvCache> {
        (0..self.num_layers)
            .map(|_| LayerKvCache::new(num_blocks, block_size, self.num_kv_heads, self.head_dim))
            .collect()
    }
}

/// A causal language model on one tensor-parallel rank.
pub trait CausalLm: Send + Sync + std::fmt::Debug {
    /// The HF `architectures` string.
    fn architecture(&self) -> &str;
    /// Vocabulary size (logit row width).
    fn vocab_size(&self) -> usize;
    /// The KV cache this rank needs.
    fn kv_cache_spec(&self) -> KvCacheSpec;
    /// Runs one step: writes the new tokens' K/V into `kv` (one cache per layer) and returns
    /// `[rows, vocab]` logits for [`ForwardBatch::output_rows`] (by default the last token of
    /// each sequence). With tensor parallelism every rank must call this with the same batch.
    fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut [LayerKvCache],
    ) -> Result<HostTensor, ModelError>;

    /// Runs this rank's pipeline stage of one step: `hidden` is the previous stage's residual
    /// stream (`[tokens, hidden]`; `None` on the first stage, which embeds the tokens). The last
    /// stage returns the logits, the others their residual stream for the next stage. Without
    /// pipeline parallelism this is [`CausalLm::forward`].
    fn forward_stage(
        &self,
        batch: &ForwardBatch,
        hidden: Option<&[f32]>,
        kv: &mut [LayerKvCache],
    ) -> Result<StageForward, ModelError> {
        match hidden {
            None => Ok(StageForward::Logits(self.forward(batch, kv)?)),
            Some(_) => Err(ModelError::Batch(format!(
                "{} has no pipeline stages",
                self.architecture()
            ))),
        }
    }
}

/// What one pipeline stage of a step produces.
#[derive(Debug, Clone, PartialEq)]
pub enum StageForward {
    /// The residual stream of every token, `[tokens, hidden]`, for the next stage.
    Hidden(Vec<f32>),
    /// The last stage's logits of the output rows, `[rows, vocab]`.
    Logits(HostTensor),
}
