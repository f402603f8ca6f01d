//! Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): one checkpoint, three stage networks.
//!
//! - [`thinker`]: the MoE text decoder with interleaved M-RoPE that also exports, per computed
//!   position, its layer-0 input embedding and the residual stream after
//!   `accept_hidden_layer` layers (what the Talker reads);
//! - [`talker`]: the projections, the MoE codec decoder with a gated shared expert, the codec
//!   head and the code predictor of the residual codebooks;
//! - [`code2wav`]: codes to a 24 kHz waveform;
//! - [`audio_encoder`] and [`vision_encoder`]: the Thinker's towers, whose outputs
//!   [`mm_merge`] writes over the placeholder rows.
//!
//! [`config`] reads every id and size from `config.json`.

pub mod audio_encoder;
pub mod code2wav;
pub mod config;
pub(crate) mod encoder_block;
pub mod mm_merge;
pub mod talker;
pub mod thinker;
pub mod thinker_mm;
pub mod vision_encoder;

use serde_json::Value;

use crate::decoder::DecoderSpec;
use crate::error::ModelError;

/// The Thinker's decoder spec (the registry's text-LLM view of the checkpoint).
pub fn thinker_spec_from_json(config: &Value) -> Result<DecoderSpec, ModelError> {
    config::OmniConfig::from_json(config)?
        .thinker_config
        .text_config
        .spec(true)
}

/// Every tensor the three stage networks read, with checkpoint names and full shapes (what
/// `--load-format dummy` generates). The audio and vision towers are not listed: the Thinker
/// loads them only when the checkpoint has them, so dummy weights give a text-only Thinker.
pub fn weight_shapes(config: &Value) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
    let mut v = thinker::Thinker::weight_shapes(config)?;
    v.extend(talker::Talker::weight_shapes(config)?);
    v.extend(code2wav::Code2Wav::weight_shapes(config)?);
    Ok(v)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn params(shapes: &[(String, Vec<usize>)]) -> usize {
        shapes
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// The real checkpoint's sizes (bench/models/qwen3-omni-30b-a3b, written and counted by
    /// scripts/make_omni_bench_config.py with transformers): the tensors we read have the
    /// parameter counts transformers builds.
    #[test]
    fn real_config_shapes_match_transformers_parameter_counts() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../bench/models/qwen3-omni-30b-a3b/config.json"
        );
        let c: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(
            params(&thinker::Thinker::weight_shapes(&c).unwrap()),
            30_532_646_912
        );
        assert_eq!(
            params(&talker::Talker::weight_shapes(&c).unwrap()),
            3_324_596_480
        );
        assert_eq!(
            params(&code2wav::Code2Wav::weight_shapes(&c).unwrap()),
            216_016_577
        );
        let cfg = config::OmniConfig::from_json(&c).unwrap();
        assert_eq!(cfg.talker_config.accept_hidden_layer, 24);
        assert_eq!(cfg.talker_config.codec_eos_token_id, 2150);
        assert_eq!(cfg.talker_config.speaker("Ethan").unwrap(), 2302);
        let spec = thinker_spec_from_json(&c).unwrap();
        assert_eq!((spec.head_dim, spec.moe.as_ref().unwrap().top_k), (128, 8));
        assert_eq!(
            spec.mrope,
            Some(crate::decoder::MropeSpec {
                section: [24, 20, 20],
                interleaved: true
            })
        );
    }
}
