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

/// What a multimodal item is, with the shape of its preprocessed tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MultiModalKind {
    /// An image: `data` is `[t * h * w, C * T * P * P]` pixel patches (Qwen: `[patches, 1536]`)
    /// of the patch grid `grid_thw` (`t` = 1 for an image).
    Image {
        /// `(t, h, w)` in patches (HF `image_grid_thw`).
        grid_thw: [usize; 3],
    },
    /// A video: like an image, with `t` temporal patches (HF `video_grid_thw`).
    Video {
        /// `(t, h, w)` in patches.
        grid_thw: [usize; 3],
    },
    /// An audio clip: `data` is `[num_mel_bins, num_frames]` log-mel features (HF
    /// `input_features` of one clip, its `feature_attention_mask` all ones).
    Audio {
        /// Valid feature frames.
        num_frames: usize,
    },
}

impl MultiModalKind {
    /// `"image"`, `"video"` or `"audio"`.
    pub fn modality(&self) -> &'static str {
        match self {
            Self::Image { .. } => "image",
            Self::Video { .. } => "video",
            Self::Audio { .. } => "audio",
        }
    }
}

/// One multimodal item of a request in this step: what the encoders consume, and where their
/// output rows go.
///
/// Chunked prefill may split an item's placeholder over several steps: a step carries the
/// item with `placeholder` narrowed to the rows that fall in the step and `item_offset` the
/// index, in the item's encoder output, of the row for `placeholder.start` (0 in the step that
/// starts the item). Encoder output rows `item_offset..item_offset + placeholder.len()` replace
/// the embeddings of batch rows `placeholder`.
#[derive(Debug, Clone)]
pub struct MultiModalFeature<'a> {
    /// `"image"`, `"audio"`, `"video"` (the same as `kind.modality()`).
    pub modality: &'a str,
    /// Content hash (the encoder cache key; it also enters the prefix-cache block hash).
    pub mm_hash: u64,
    /// The placeholder tokens this item replaces in this step, as indices into the batch's
    /// tokens.
    pub placeholder: Range<usize>,
    /// The encoder output row of `placeholder.start`.
    pub item_offset: usize,
    /// What the item is and its tensor's shape.
    pub kind: MultiModalKind,
    /// The preprocessed tensor (pixel patches, log-mel frames) as broadcast: bf16,
    /// little-endian, row-major in the shape `kind` gives.
    pub data: &'a [u8],
}

/// What the encoders make of one multimodal item (what a worker's encoder cache keeps per
/// `mm_hash`).
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderOutput {
    /// `[tokens, hidden]`: one row per placeholder token of the item.
    pub embeds: HostTensor,
    /// Deepstack features (images and videos of Qwen3-VL / Qwen3-Omni), `[tokens, hidden]` each:
    /// level `i` is added to the residual stream after decoder layer `i` at the item's rows.
    pub deepstack: Vec<HostTensor>,
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

    /// Runs the encoder of one multimodal item over its whole tensor (the worker caches the
    /// result by `mm_hash`, then passes it to [`StageModel::forward_encoded`] in each step that
    /// covers part of the item's placeholder).
    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, ModelError> {
        Err(ModelError::Batch(format!(
            "{} has no {} encoder",
            self.architecture(),
            feature.modality
        )))
    }

    /// The M-RoPE positions of a whole prompt whose multimodal items are `items` (in prompt
    /// order), and the decode delta: decode position `p` has `p + delta` in all three rows
    /// (transformers' `get_rope_index`, vLLM's `get_mrope_input_positions`). `None`: this
    /// network takes 1-D positions.
    fn mrope_positions(
        &self,
        _ids: &[u32],
        _items: &[MultiModalKind],
    ) -> Result<Option<(MropePositions, i64)>, ModelError> {
        Ok(None)
    }

    /// [`StageModel::forward`] with the encoder outputs of `inputs.mm_features` given, one per
    /// feature in the same order (their rows are not recomputed).
    fn forward_encoded(
        &self,
        inputs: &ModelInputs<'_>,
        encoded: &[&EncoderOutput],
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        if encoded.is_empty() {
            self.forward(inputs, kv)
        } else {
            Err(ModelError::Batch(format!(
                "{} takes no encoder outputs",
                self.architecture()
            )))
        }
    }
}
