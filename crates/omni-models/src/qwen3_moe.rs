//! `Qwen3MoeForCausalLM`: Qwen3 attention with a top-k routed mixture of SiLU experts in
//! every `decoder_sparse_step`-th layer except `mlp_only_layers`.

use serde::Deserialize;
use serde_json::Value;

use crate::decoder::{DecoderSpec, MoeSpec};
use crate::error::ModelError;

/// The registry key.
pub const ARCHITECTURE: &str = "Qwen3MoeForCausalLM";

fn one() -> usize {
    1
}

/// HF `Qwen3MoeConfig` (the fields inference needs; others are ignored): Qwen3's attention
/// and dense-MLP fields (`intermediate_size` sizes the `mlp_only_layers`), plus the experts.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// Everything a dense Qwen3 layer needs.
    #[serde(flatten)]
    pub base: crate::qwen3::Config,
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
}

impl Config {
    /// The shared decoder's view of this config: Qwen3's, with routed experts.
    pub fn spec(&self) -> Result<DecoderSpec, ModelError> {
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(ModelError::Config(format!(
                "num_experts_per_tok {} with {} experts",
                self.num_experts_per_tok, self.num_experts
            )));
        }
        Ok(DecoderSpec {
            architecture: ARCHITECTURE,
            moe: Some(MoeSpec {
                num_experts: self.num_experts,
                top_k: self.num_experts_per_tok,
                norm_topk_prob: self.norm_topk_prob,
                moe_intermediate_size: self.moe_intermediate_size,
                decoder_sparse_step: self.decoder_sparse_step,
                mlp_only_layers: self.mlp_only_layers.clone(),
                shared_expert_intermediate_size: None,
            }),
            ..self.base.spec()?
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
