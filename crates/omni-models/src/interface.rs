//! The model interface every stage network implements: typed inputs beyond token ids and typed
//! outputs beyond logits, and the stages one HF `architectures` string can stand for.
//!
//! A text LLM is one [`ModelStage::CausalLm`]; Qwen3-Omni's one architecture string
//! (`Qwen3OmniMoeForConditionalGeneration`) gives three stage models (Thinker, Talker,
//! Code2Wav), which is why [`crate::registry::stage_models`] is keyed by (architecture, stage).
//!
//! * Inputs: token ids, or input embeddings (a Talker is fed projected Thinker states, not
//!   ids); positions from the batch (1-D RoPE) or three rows for M-RoPE (temporal, height,
//!   width; equal rows are 1-D RoPE); multimodal features (encoder inputs that ride the
//!   broadcast as out-of-band buffers); which hidden states to capture.
//! * Outputs: logits of the batch's output rows, captured hidden states of named layers (the
//!   Thinker -> Talker hand-off needs the layer-0 input embedding and the residual stream after
//!   a given layer, for every computed position), codes (a Talker's codec frames) and
//!   waveforms (Code2Wav).
//!
//! The CPU [`crate::DecoderModel`] implements it (logits, embeddings in, captures); the CUDA
//! decoder keeps its own step interface until it is migrated.

use std::ops::Range;

use crate::{ForwardBatch, HostTensor, KvCacheSpec, LayerKvCache, ModelError};

/// Which network of a model an engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelStage {
    /// A text decoder: tokens in, logits out.
    CausalLm,
    /// An omni model's text decoder that also exports hidden states (Qwen3-Omni's Thinker).
    Thinker,
    /// The speech decoder that turns Thinker states into codec codes.
    Talker,
    /// The codec decoder that turns codes into a waveform.
    Code2Wav,
}

/// What the model embeds: token ids (looked up in its embedding table), or embeddings given
/// by the caller, `[tokens, hidden]` row-major.
#[derive(Debug, Clone, Copy)]
pub enum TokenInputs<'a> {
    /// The batch's `input_ids`.
    Ids,
    /// Ready-made input embeddings, one row per token of the batch.
    Embeds(&'a [f32]),
}

/// Three position rows (temporal, height, width), one entry per token (M-RoPE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MropePositions {
    /// `rows[0]` temporal, `rows[1]` height, `rows[2]` width.
    pub rows: [Vec<i64>; 3],
}

impl MropePositions {
    /// Whether every token has equal rows: then M-RoPE is plain 1-D RoPE at that position
    /// (text-only input).
    pub fn is_text_only(&self) -> bool {
        let [t, h, w] = &self.rows;
        t == h && h == w
    }
}

/// Where positions come from.
#[derive(Debug, Clone, Copy)]
pub enum PositionInputs<'a> {
    /// The batch's 1-D positions.
    Batch,
    /// Three rows per token (M-RoPE).
    Mrope(&'a MropePositions),
}

/// One multimodal item of a request in this step: what the encoders consume.
#[derive(Debug, Clone)]
pub struct MultiModalFeature<'a> {
    /// `"image"`, `"audio"`, `"video"`.
    pub modality: &'a str,
    /// Content hash (the encoder cache key; it also enters the prefix-cache block hash).
    pub mm_hash: u64,
    /// The placeholder tokens this item replaces, as indices into the batch's tokens.
    pub placeholder: Range<usize>,
    /// The preprocessed tensor (pixel patches, log-mel frames), as broadcast.
    pub data: &'a [u8],
}

/// A hidden state to capture, for every computed position of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capture {
    /// The input embedding (layer 0's input).
    Embedding,
    /// The residual stream after this many decoder layers (1 = after layer 0).
    AfterLayers(usize),
    /// The final norm's output at the batch's output rows, `[rows, hidden]` (what the head
    /// reads; a Talker's code predictor starts from it).
    FinalNorm,
}

/// One step's inputs.
#[derive(Debug, Clone, Copy)]
pub struct ModelInputs<'a> {
    /// Tokens, attention metadata (block tables, query starts) and output rows.
    pub batch: &'a ForwardBatch,
    /// Ids or embeddings.
    pub tokens: TokenInputs<'a>,
    /// 1-D or M-RoPE positions.
    pub positions: PositionInputs<'a>,
    /// Multimodal items whose placeholders fall in this step.
    pub mm_features: &'a [MultiModalFeature<'a>],
    /// Hidden states to return besides the logits.
    pub capture: &'a [Capture],
}

impl<'a> ModelInputs<'a> {
    /// Token ids, batch positions, nothing else: a text LLM's step.
    pub fn text(batch: &'a ForwardBatch) -> Self {
        Self {
            batch,
            tokens: TokenInputs::Ids,
            positions: PositionInputs::Batch,
            mm_features: &[],
            capture: &[],
        }
    }
}

/// One step's outputs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelOutputs {
    /// `[rows, vocab]` for the batch's output rows, when the network has a head.
    pub logits: Option<HostTensor>,
    /// The captured states, `[tokens, hidden]` each, in the order asked.
    pub hidden_states: Vec<(Capture, HostTensor)>,
    /// Codes produced this step (a Talker's codec frames), when the network makes them.
    pub codes: Option<Vec<u32>>,
    /// Waveforms produced this step (Code2Wav), one `[samples]` tensor per request.
    pub audio: Vec<HostTensor>,
}

/// A network that runs one engine stage on one tensor-parallel rank.
pub trait StageModel: Send + Sync + std::fmt::Debug {
    /// The HF `architectures` string.
    fn architecture(&self) -> &str;
    /// Which stage this network is.
    fn stage(&self) -> ModelStage;
    /// The KV cache this rank needs (`None`: a network without attention caches).
    fn kv_cache_spec(&self) -> Option<KvCacheSpec>;
    /// Runs one step. With tensor parallelism every rank calls this with the same inputs.
    fn forward(
        &self,
        inputs: &ModelInputs<'_>,
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError>;
}
