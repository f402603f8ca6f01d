//! Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): one checkpoint, three stage networks.
//!
//! - [`thinker`]: the MoE text decoder with interleaved M-RoPE that also exports, per computed
//!   position, its layer-0 input embedding and the residual stream after
//!   `accept_hidden_layer` layers (what the Talker reads);
//! - [`talker`]: the projections, the MoE codec decoder with a gated shared expert, the codec
//!   head and the code predictor of the residual codebooks;
//! - `code2wav`: codes to a 24 kHz waveform.
//!
//! [`config`] reads every id and size from `config.json`.

pub mod config;
pub mod talker;
pub mod thinker;

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
/// `--load-format dummy` generates; the audio and vision towers are not read yet).
pub fn weight_shapes(config: &Value) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
    let mut v = thinker::Thinker::weight_shapes(config)?;
    v.extend(talker::Talker::weight_shapes(config)?);
    Ok(v)
}
