//! `Qwen3MoeForCausalLM`: Qwen3 attention with a top-k routed mixture of SiLU experts in
//! every `decoder_sparse_step`-th layer except `mlp_only_layers`.

use serde::Deserialize;
use serde_json::Value;

use crate::decoder::{DecoderSpec, MoeSpec};
use crate::error::ModelError;
use crate::hf_config::{default_act, default_eps, require_silu, rope_settings};
use crate::qwen3::default_head_dim;

/// The registry key.
pub const ARCHITECTURE: &str = "Qwen3MoeForCausalLM";

fn one() -> usize {
    1
}

/// HF `Qwen3MoeConfig` (the fields inference needs; others are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Intermediate size of the dense MLP layers (`mlp_only_layers`).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads.
    pub num_key_value_heads: usize,
    /// Head size.
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
    /// Experts per MoE layer (`num_local_experts` in transformers 5 configs).
    #[serde(alias = "num_local_experts")]
    pub num_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Renormalise top-k routing weights.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Intermediate size of one expert.
    pub moe_intermediate_size: usize,
    /// Every n-th layer is sparse.
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    /// Layers with a dense MLP instead.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
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
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(ModelError::Config(format!(
                "num_experts_per_tok {} with {} experts",
                self.num_experts_per_tok, self.num_experts
            )));
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
            moe: Some(MoeSpec {
                num_experts: self.num_experts,
                top_k: self.num_experts_per_tok,
                norm_topk_prob: self.norm_topk_prob,
                moe_intermediate_size: self.moe_intermediate_size,
                decoder_sparse_step: self.decoder_sparse_step,
                mlp_only_layers: self.mlp_only_layers.clone(),
            }),
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
    fn sparse_step_and_mlp_only_layers_pick_moe_layers() {
        let c = serde_json::json!({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
            "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]});
        let s = spec_from_json(&c).unwrap();
        let moe: Vec<bool> = (0..6).map(|i| s.is_moe_layer(i)).collect();
        assert_eq!(moe, vec![false, true, false, false, false, true]);
    }
}
