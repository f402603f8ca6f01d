//! The Thinker: Qwen3-Omni's MoE text decoder (`thinker.model.*`, `thinker.lm_head`) with
//! interleaved M-RoPE, run as [`ModelStage::Thinker`].
//!
//! Besides logits it exports what the Talker reads, per computed position: the layer-0 input
//! embedding ([`Capture::Embedding`]) and the residual stream after `accept_hidden_layer`
//! layers ([`Capture::AfterLayers`]; HF's `hidden_states[accept_hidden_layer]`, no final norm),
//! plus the token embeddings of the three TTS tokens ([`Thinker::tts_embeddings`]).
//!
//! # Multimodal inputs
//! When the checkpoint has them, the audio tower (`thinker.audio_tower.*`) and the vision tower
//! (`thinker.visual.*`) are loaded too. A step with [`ModelInputs::mm_features`] embeds the
//! text, replaces each item's placeholder rows by its encoder output, adds the images' and
//! videos' deepstack features to the residual stream after the first decoder layers, and runs
//! the decoder on the M-RoPE positions given. [`StageModel::encode_mm`] and
//! [`StageModel::forward_encoded`] split this in two, so that a worker encodes an item once and
//! keeps the [`EncoderOutput`] by `mm_hash` across the chunked-prefill steps of its placeholder.

use serde_json::Value;

use crate::decoder::{DecoderModel, ResidualAdds, TpContext};
use crate::error::ModelError;
use crate::interface::{
    Capture, EncoderOutput, ModelInputs, ModelOutputs, ModelStage, MropePositions,
    MultiModalFeature, MultiModalKind, StageModel, TokenInputs,
};
use crate::qwen3_omni::audio_encoder::AudioEncoder;
use crate::qwen3_omni::config::OmniConfig;
use crate::qwen3_omni::thinker_mm::ThinkerMm;
use crate::qwen3_omni::vision_encoder::VisionEncoder;
use crate::weights::{SubmodelWeights, WeightSource};
use crate::{KvCacheSpec, LayerKvCache};

/// The Thinker's token embeddings of `<tts_text_bos>`, `<tts_text_eod>` and `<tts_pad>`,
/// `[hidden]` each.
#[derive(Debug, Clone, PartialEq)]
pub struct TtsEmbeddings {
    /// `tts_bos_token_id`'s row.
    pub bos: Vec<f32>,
    /// `tts_eos_token_id`'s row.
    pub eos: Vec<f32>,
    /// `tts_pad_token_id`'s row.
    pub pad: Vec<f32>,
}

/// The Thinker on one tensor-parallel rank.
#[derive(Debug)]
pub struct Thinker {
    decoder: DecoderModel,
    config: OmniConfig,
    tts: TtsEmbeddings,
    mm: ThinkerMm,
}

impl Thinker {
    /// Loads rank `tp.rank`'s Thinker from a whole Qwen3-Omni checkpoint's weights.
    pub fn load(
        config_json: &Value,
        ws: &dyn WeightSource,
        tp: TpContext,
    ) -> Result<Self, ModelError> {
        let config = OmniConfig::from_json(config_json)?;
        let spec = config.thinker_config.text_config.spec(true)?;
        let decoder = DecoderModel::load(spec, &SubmodelWeights::new(ws, "thinker.", &[]), tp)?;
        let ids = &config.ids;
        let rows = decoder.embed_ids(&[
            ids.tts_bos_token_id,
            ids.tts_eos_token_id,
            ids.tts_pad_token_id,
        ])?;
        let h = decoder.spec().hidden_size;
        let tts = TtsEmbeddings {
            bos: rows[..h].to_vec(),
            eos: rows[h..2 * h].to_vec(),
            pad: rows[2 * h..].to_vec(),
        };
        let mm = ThinkerMm::load(config_json, Some(ws))?;
        Ok(Self {
            decoder,
            config,
            tts,
            mm,
        })
    }

    /// The towers and placeholders.
    pub fn mm(&self) -> &ThinkerMm {
        &self.mm
    }

    /// The audio tower, when the checkpoint has one.
    pub fn audio_encoder(&self) -> Option<&AudioEncoder> {
        self.mm.audio_encoder()
    }

    /// The vision tower, when the checkpoint has one.
    pub fn vision_encoder(&self) -> Option<&VisionEncoder> {
        self.mm.vision_encoder()
    }

    /// Encodes several items ([`ThinkerMm::encode_batch`]).
    pub fn encode_mm_batch(
        &self,
        features: &[&MultiModalFeature<'_>],
    ) -> Result<Vec<EncoderOutput>, ModelError> {
        self.mm.encode_batch(features)
    }

    /// Every tensor the Thinker's decoder reads, with its checkpoint name and full shape.
    pub fn weight_shapes(config: &Value) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
        let c = OmniConfig::from_json(config)?;
        Ok(c.thinker_config
            .text_config
            .spec(true)?
            .weight_shapes()
            .into_iter()
            .map(|(n, s)| (format!("thinker.{n}"), s))
            .collect())
    }

    /// The parsed config.
    pub fn config(&self) -> &OmniConfig {
        &self.config
    }

    /// The two states the Talker reads: layer 0's input and the residual stream after
    /// `accept_hidden_layer` layers.
    pub fn exports(&self) -> [Capture; 2] {
        [
            Capture::Embedding,
            Capture::AfterLayers(self.config.talker_config.accept_hidden_layer),
        ]
    }

    /// The TTS tokens' embeddings.
    pub fn tts_embeddings(&self) -> &TtsEmbeddings {
        &self.tts
    }

    /// Token-embedding rows of `ids`, `[ids, hidden]`.
    pub fn embed_ids(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.decoder.embed_ids(ids)
    }
}

impl StageModel for Thinker {
    fn architecture(&self) -> &str {
        crate::qwen3_omni::config::ARCHITECTURE
    }

    fn stage(&self) -> ModelStage {
        ModelStage::Thinker
    }

    fn kv_cache_spec(&self) -> Option<KvCacheSpec> {
        StageModel::kv_cache_spec(&self.decoder)
    }

    /// A step; multimodal items are encoded here in full, every call (a worker with an encoder
    /// cache calls [`StageModel::forward_encoded`] instead).
    fn forward(
        &self,
        inputs: &ModelInputs<'_>,
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        if inputs.mm_features.is_empty() {
            return StageModel::forward(&self.decoder, inputs, kv);
        }
        let features: Vec<&MultiModalFeature<'_>> = inputs.mm_features.iter().collect();
        let encoded = self.encode_mm_batch(&features)?;
        let encoded: Vec<&EncoderOutput> = encoded.iter().collect();
        self.forward_encoded(inputs, &encoded, kv)
    }

    fn mrope_positions(
        &self,
        ids: &[u32],
        items: &[MultiModalKind],
    ) -> Result<Option<(MropePositions, i64)>, ModelError> {
        self.mm.mrope_positions(ids, items).map(Some)
    }

    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, ModelError> {
        self.mm.encode(feature)
    }

    fn forward_encoded(
        &self,
        inputs: &ModelInputs<'_>,
        encoded: &[&EncoderOutput],
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        if inputs.mm_features.is_empty() && encoded.is_empty() {
            return StageModel::forward(&self.decoder, inputs, kv);
        }
        let ids = &inputs.batch.input_ids;
        let (mut embeds, check_ids) = match inputs.tokens {
            TokenInputs::Ids => (self.decoder.embed_ids(ids)?, Some(ids.as_slice())),
            TokenInputs::Embeds(e) => (e.to_vec(), None),
        };
        let h = self.decoder.spec().hidden_size;
        let m = self
            .mm
            .plan(ids.len(), h, check_ids, inputs.mm_features, encoded)?;
        m.apply(&mut embeds, h);
        let step = ModelInputs {
            tokens: TokenInputs::Embeds(&embeds),
            mm_features: &[],
            ..*inputs
        };
        let adds = ResidualAdds {
            rows: &m.visual_rows,
            after_layer: &m.deepstack,
        };
        self.decoder.forward_with_adds(&step, adds, kv)
    }
}
