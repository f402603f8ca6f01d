//! `LlamaForCausalLM`: Llama 2/3, SmolLM2 and their kin.

use serde::Deserialize;
use serde_json::Value;

use crate::decoder::DecoderSpec;
use crate::error::ModelError;
use crate::hf_config::{default_act, default_eps, default_theta, require_silu, rope_settings};

/// The registry key.
pub const ARCHITECTURE: &str = "LlamaForCausalLM";

/// HF `LlamaConfig` (the fields inference needs; others are ignored).
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
    /// KV heads (defaults to `num_attention_heads`).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head size (defaults to `hidden_size / num_attention_heads`).
    #[serde(default)]
    pub head_dim: Option<usize>,
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
    /// Biases on the MLP (not supported).
    #[serde(default)]
    pub mlp_bias: bool,
    /// Longest context the model was trained for.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
}

impl Config {
    /// The shared decoder's view of this config.
    pub fn spec(&self) -> Result<DecoderSpec, ModelError> {
        require_silu(&self.hidden_act)?;
        if self.mlp_bias {
            return Err(ModelError::Config("mlp_bias is not supported".into()));
        }
        let (rope_theta, rope_scaling) = rope_settings(
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
            default_theta(),
        )?;
        if self.num_attention_heads == 0 {
            return Err(ModelError::Config("num_attention_heads is 0".into()));
        }
        Ok(DecoderSpec {
            architecture: ARCHITECTURE,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads),
            intermediate_size: self.intermediate_size,
            rms_norm_eps: self.rms_norm_eps as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias,
            qk_norm: false,
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
    fn smollm2_config_defaults_head_dim_and_keeps_tied_embeddings() {
        let c = serde_json::json!({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
            "rope_theta": 100000, "tie_word_embeddings": true, "hidden_act": "silu"});
        let s = spec_from_json(&c).unwrap();
        assert_eq!(
            (s.head_dim, s.num_kv_heads, s.rope_theta),
            (64, 3, 100000.0)
        );
        assert!(s.tie_word_embeddings && !s.qk_norm);
    }
}
