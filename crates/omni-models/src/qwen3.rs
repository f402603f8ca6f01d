//! `Qwen3ForCausalLM`: Llama-style decoder with per-head RMSNorm on queries and keys, and
//! `head_dim` taken from the config.

use serde::Deserialize;
use serde_json::Value;

use crate::decoder::DecoderSpec;
use crate::error::ModelError;
use crate::hf_config::{default_act, default_eps, require_silu, rope_settings};

/// The registry key.
pub const ARCHITECTURE: &str = "Qwen3ForCausalLM";

fn default_head_dim() -> usize {
    128
}

/// HF `Qwen3Config` (the fields inference needs; others are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP intermediate size.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads.
    pub num_key_value_heads: usize,
    /// Head size (independent of `hidden_size / num_attention_heads`).
    #[serde(default = "default_head_dim")]
    pub head_dim: usize,
    /// Activation; only `silu` is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base (transformers 4 form).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE scaling (transformers 4 form).
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// RoPE base and scaling (transformers 5 form).
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// `lm_head` shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Sliding-window attention (not supported; must be off).
    #[serde(default)]
    pub use_sliding_window: bool,
}

impl Config {
    /// The shared decoder's view of this config.
    pub fn spec(&self) -> Result<DecoderSpec, ModelError> {
        require_silu(&self.hidden_act)?;
        if self.use_sliding_window {
            return Err(ModelError::Config(
                "use_sliding_window is not supported".into(),
            ));
        }
        let (rope_theta, rope_scaling) = rope_settings(
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
            10000.0,
        )?;
        Ok(DecoderSpec {
            architecture: ARCHITECTURE,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            intermediate_size: self.intermediate_size,
            rms_norm_eps: self.rms_norm_eps as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias,
            qk_norm: true,
            moe: None,
            mrope: None,
            embed_and_head: true,
        })
    }
}

/// Registry entry: `config.json` value to decoder spec.
pub fn spec_from_json(config: &Value) -> Result<DecoderSpec, ModelError> {
    Config::deserialize(config)?.spec()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn head_dim_comes_from_config_not_hidden_size() {
        let c = serde_json::json!({"vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "rope_theta": 1000000.0});
        let s = spec_from_json(&c).unwrap();
        assert_eq!(s.head_dim, 32);
        assert!(s.qk_norm);
        assert_eq!(s.rope_theta, 1e6);
    }
}
