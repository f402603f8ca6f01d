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
