//! The Thinker: Qwen3-Omni's MoE text decoder (`thinker.model.*`, `thinker.lm_head`) with
//! interleaved M-RoPE, run as [`ModelStage::Thinker`].
//!
//! Besides logits it exports what the Talker reads, per computed position: the layer-0 input
//! embedding ([`Capture::Embedding`]) and the residual stream after `accept_hidden_layer`
//! layers ([`Capture::AfterLayers`]; HF's `hidden_states[accept_hidden_layer]`, no final norm),
//! plus the token embeddings of the three TTS tokens ([`Thinker::tts_embeddings`]).

use serde_json::Value;

use crate::decoder::{DecoderModel, TpContext};
use crate::error::ModelError;
use crate::interface::{Capture, ModelInputs, ModelOutputs, ModelStage, StageModel};
use crate::qwen3_omni::config::OmniConfig;
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
}

impl Thinker {
    /// Loads rank `tp.rank`'s Thinker from a whole Qwen3-Omni checkpoint's weights.
    pub fn load(config: &Value, ws: &dyn WeightSource, tp: TpContext) -> Result<Self, ModelError> {
        let config = OmniConfig::from_json(config)?;
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
        Ok(Self {
            decoder,
            config,
            tts,
        })
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

    fn forward(
        &self,
        inputs: &ModelInputs<'_>,
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        StageModel::forward(&self.decoder, inputs, kv)
    }
}
