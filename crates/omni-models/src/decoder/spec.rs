//! What the shared decoder is built from: [`DecoderSpec`] (an architecture's config, mapped),
//! [`HeadLayout`] (the heads one tensor-parallel rank owns) and [`TpContext`].

use std::sync::Arc;

use omni_backend::comm::{AllReduce, IdentityAllReduce};
use omni_backend::rope::RopeScaling;

use crate::KvCacheSpec;
use crate::error::ModelError;

/// Mixture-of-experts settings (Qwen3-MoE names).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Renormalise the top-k routing weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Intermediate size of one expert.
    pub moe_intermediate_size: usize,
    /// Every `decoder_sparse_step`-th layer is MoE (1 = all).
    pub decoder_sparse_step: usize,
    /// Layers that keep a dense MLP.
    pub mlp_only_layers: Vec<usize>,
    /// A shared expert every token goes through beside the routed ones, scaled by
    /// `sigmoid(shared_expert_gate(x))` (Qwen3-Omni's Talker), with this intermediate size.
    pub shared_expert_intermediate_size: Option<usize>,
}

/// Multimodal RoPE: three position rows split the rotary frequencies (HF
/// `rope_parameters.mrope_section` and `interleaved`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MropeSpec {
    /// Frequencies per row (temporal, height, width); they sum to `head_dim / 2`.
    pub section: [usize; 3],
    /// Interleaved assignment (Qwen3-Omni) rather than contiguous blocks (Qwen2-VL).
    pub interleaved: bool,
}

/// Everything the shared decoder needs to know, from an architecture's config.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderSpec {
    /// The HF `architectures` string this came from.
    pub architecture: &'static str,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Dense MLP intermediate size.
    pub intermediate_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// `lm_head` shares `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// q/k/v/o projections have biases.
    pub attention_bias: bool,
    /// Per-head RMSNorm on queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Mixture of experts, if any.
    pub moe: Option<MoeSpec>,
    /// M-RoPE, if the network takes three position rows.
    pub mrope: Option<MropeSpec>,
    /// The checkpoint has `model.embed_tokens` and a head (`lm_head`, or the tied embedding).
    /// `false` for a network fed only input embeddings whose heads live outside the decoder (a
    /// Talker's code predictor): it returns no logits, only captured states.
    pub embed_and_head: bool,
}

impl DecoderSpec {
    /// Whether layer `i` uses the MoE block (Qwen3-MoE rule).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        match &self.moe {
            Some(m) => {
                m.num_experts > 0
                    && !m.mlp_only_layers.contains(&i)
                    && m.decoder_sparse_step > 0
                    && (i + 1).is_multiple_of(m.decoder_sparse_step)
            }
            None => false,
        }
    }

    /// How heads split over `tp_size` ranks, for rank `tp_rank`.
    pub fn head_layout(&self, tp_rank: usize, tp_size: usize) -> Result<HeadLayout, ModelError> {
        HeadLayout::new(self.num_heads, self.num_kv_heads, tp_rank, tp_size)
    }

    /// The KV cache one rank needs.
    pub fn kv_cache_spec(&self, tp_rank: usize, tp_size: usize) -> Result<KvCacheSpec, ModelError> {
        let l = self.head_layout(tp_rank, tp_size)?;
        Ok(KvCacheSpec {
            num_layers: self.num_layers,
            num_kv_heads: l.local_kv_heads,
            head_dim: self.head_dim,
        })
    }

    /// Every tensor a checkpoint of this spec holds, with its full (unsharded) HF shape.
    pub fn weight_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let mut v = vec![("model.norm.weight".to_string(), vec![h])];
        if self.embed_and_head {
            v.push(("model.embed_tokens.weight".into(), vec![self.vocab_size, h]));
            if !self.tie_word_embeddings {
                v.push(("lm_head.weight".into(), vec![self.vocab_size, h]));
            }
        }
        for i in 0..self.num_layers {
            let p = format!("model.layers.{i}");
            let attn = [
                ("q_proj", self.num_heads * hd, h),
                ("k_proj", self.num_kv_heads * hd, h),
                ("v_proj", self.num_kv_heads * hd, h),
                ("o_proj", h, self.num_heads * hd),
            ];
            for (n, o, inp) in attn {
                v.push((format!("{p}.self_attn.{n}.weight"), vec![o, inp]));
                if self.attention_bias {
                    v.push((format!("{p}.self_attn.{n}.bias"), vec![o]));
                }
            }
            if self.qk_norm {
                v.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
                v.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
            }
            v.push((format!("{p}.input_layernorm.weight"), vec![h]));
            v.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            match (&self.moe, self.is_moe_layer(i)) {
                (Some(m), true) => {
                    v.push((format!("{p}.mlp.gate.weight"), vec![m.num_experts, h]));
                    for e in 0..m.num_experts {
                        let ep = format!("{p}.mlp.experts.{e}");
                        v.push((
                            format!("{ep}.gate_proj.weight"),
                            vec![m.moe_intermediate_size, h],
                        ));
                        v.push((
                            format!("{ep}.up_proj.weight"),
                            vec![m.moe_intermediate_size, h],
                        ));
                        v.push((
                            format!("{ep}.down_proj.weight"),
                            vec![h, m.moe_intermediate_size],
                        ));
                    }
                    if let Some(si) = m.shared_expert_intermediate_size {
                        let sp = format!("{p}.mlp.shared_expert");
                        v.push((format!("{sp}.gate_proj.weight"), vec![si, h]));
                        v.push((format!("{sp}.up_proj.weight"), vec![si, h]));
                        v.push((format!("{sp}.down_proj.weight"), vec![h, si]));
                        v.push((format!("{p}.mlp.shared_expert_gate.weight"), vec![1, h]));
                    }
                }
                _ => {
                    v.push((
                        format!("{p}.mlp.gate_proj.weight"),
                        vec![self.intermediate_size, h],
                    ));
                    v.push((
                        format!("{p}.mlp.up_proj.weight"),
                        vec![self.intermediate_size, h],
                    ));
                    v.push((
                        format!("{p}.mlp.down_proj.weight"),
                        vec![h, self.intermediate_size],
                    ));
                }
            }
        }
        v
    }
}

/// Which heads one tensor-parallel rank owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadLayout {
    /// Query heads on this rank.
    pub local_heads: usize,
    /// First query head of this rank.
    pub head_start: usize,
    /// KV heads on this rank.
    pub local_kv_heads: usize,
    /// First KV head of this rank.
    pub kv_head_start: usize,
}

impl HeadLayout {
    /// Splits `num_heads` evenly; splits `num_kv_heads` evenly when `tp_size` divides it, else
    /// replicates (each rank keeps the one KV head its query heads use).
    pub fn new(
        num_heads: usize,
        num_kv_heads: usize,
        tp_rank: usize,
        tp_size: usize,
    ) -> Result<Self, ModelError> {
        let err = |m: String| Err(ModelError::TensorParallel(m));
        if tp_size == 0 || tp_rank >= tp_size {
            return err(format!("rank {tp_rank} of {tp_size}"));
        }
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return err(format!("{num_heads} heads over {num_kv_heads} KV heads"));
        }
        if !num_heads.is_multiple_of(tp_size) {
            return err(format!(
                "{num_heads} attention heads do not split over {tp_size} ranks"
            ));
        }
        let local_heads = num_heads / tp_size;
        let (local_kv_heads, kv_head_start) = if num_kv_heads >= tp_size {
            if !num_kv_heads.is_multiple_of(tp_size) {
                return err(format!(
                    "{num_kv_heads} KV heads do not split over {tp_size} ranks"
                ));
            }
            let l = num_kv_heads / tp_size;
            (l, tp_rank * l)
        } else {
            if !tp_size.is_multiple_of(num_kv_heads) {
                return err(format!(
                    "{tp_size} ranks do not replicate {num_kv_heads} KV heads evenly"
                ));
            }
            (1, tp_rank / (tp_size / num_kv_heads))
        };
        Ok(Self {
            local_heads,
            head_start: tp_rank * local_heads,
            local_kv_heads,
            kv_head_start,
        })
    }
}

/// Rank, world size and the all-reduce hook of one tensor-parallel model replica, and the
/// pipeline stage it belongs to.
#[derive(Debug, Clone)]
pub struct TpContext {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
    /// Sums row-parallel partial outputs across ranks.
    pub all_reduce: Arc<dyn AllReduce>,
    /// The pipeline stage of this rank's group (`size` 1: the whole model).
    pub pp: PipelineStage,
}

/// One pipeline stage of a model split by layers (vLLM's `pp_rank` of `pp_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineStage {
    /// This stage.
    pub rank: usize,
    /// Stages.
    pub size: usize,
}

impl Default for PipelineStage {
    fn default() -> Self {
        Self { rank: 0, size: 1 }
    }
}

impl PipelineStage {
    /// Whether this stage embeds the tokens.
    pub fn is_first(&self) -> bool {
        self.rank == 0
    }

    /// Whether this stage runs the final norm and the head.
    pub fn is_last(&self) -> bool {
        self.rank + 1 >= self.size
    }

    /// The decoder layers of this stage out of `num_layers` (vLLM's `get_pp_indices`: an even
    /// split, the remainder going one layer each to the stages before the last, from the
    /// second-to-last backwards, since the last stage also runs the head).
    pub fn layers(&self, num_layers: usize) -> std::ops::Range<usize> {
        let size = self.size.max(1);
        let mut parts = vec![num_layers / size; size];
        for i in 0..num_layers % size {
            parts[size - 2 - i] += 1;
        }
        let start: usize = parts[..self.rank.min(size)].iter().sum();
        start..start + parts.get(self.rank).copied().unwrap_or(0)
    }
}

impl TpContext {
    /// No tensor parallelism.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            all_reduce: Arc::new(IdentityAllReduce),
            pp: PipelineStage::default(),
        }
    }

    /// Rank `rank` of `size`, with its all-reduce handle.
    pub fn new(rank: usize, size: usize, all_reduce: Arc<dyn AllReduce>) -> Self {
        Self {
            rank,
            size,
            all_reduce,
            pp: PipelineStage::default(),
        }
    }

    /// The same rank in pipeline stage `stage`.
    pub fn with_pipeline(mut self, stage: PipelineStage) -> Self {
        self.pp = stage;
        self
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_stages_split_layers_as_vllm_does() {
        let split = |n, size| -> Vec<_> {
            (0..size)
                .map(|rank| PipelineStage { rank, size }.layers(n))
                .collect()
        };
        assert_eq!(split(4, 2), vec![0..2, 2..4]);
        assert_eq!(split(5, 2), vec![0..3, 3..5]);
        assert_eq!(split(7, 3), vec![0..2, 2..5, 5..7]);
        assert_eq!(split(8, 3), vec![0..3, 3..6, 6..8]);
        assert_eq!(split(30, 1), vec![0..30]);
    }

    #[test]
    fn kv_heads_split_or_replicate_with_tp() {
        let l = HeadLayout::new(4, 2, 1, 2).unwrap();
        assert_eq!(
            (
                l.local_heads,
                l.head_start,
                l.local_kv_heads,
                l.kv_head_start
            ),
            (2, 2, 1, 1)
        );
        let l = HeadLayout::new(8, 2, 3, 4).unwrap();
        assert_eq!(
            (
                l.local_heads,
                l.head_start,
                l.local_kv_heads,
                l.kv_head_start
            ),
            (2, 6, 1, 1)
        );
        assert!(HeadLayout::new(9, 3, 0, 2).is_err());
    }
}
