//! Roofline bounds for `omni-engine bench latency`: the fewest seconds a decode step or a
//! prefill can take on a device of given bandwidth and GEMM rate, from the model's shapes alone.
//!
//! * **Decode** is bandwidth bound: a step reads every weight it touches once, plus the KV cache
//!   of every sequence. Weights touched: attention, norms and dense MLPs of every layer; the
//!   router and, in MoE layers, the experts some token of the batch is routed to (the expected
//!   number of distinct experts, `E × (1 − (1 − k/E)^B)` for `B` tokens routed uniformly); the
//!   final norm and `lm_head` in full. The input embedding is not counted (a step reads `B`
//!   rows of it). KV read per step: `B × context × layers × 2 × kv_heads × head_dim` elements.
//!   Per rank with `-tp N`: weights / N (the ideal split; vLLM also shards `lm_head`) and the
//!   rank's KV heads (`kv_heads / N`, at least 1 when KV heads are replicated). Ranks run in
//!   parallel, so a step takes at least `bytes per rank / bandwidth per rank`.
//! * **Prefill** is compute bound: `2 × active params × T` FLOPs for the linear layers (MoE
//!   layers count the `k` routed experts per token; `lm_head` runs for the last token only, as
//!   the engine computes logits of the sampled position alone) plus causal attention,
//!   `4 × T²/2 × heads × head_dim × layers` (QKᵀ and PV, half the matrix). Per rank: / N.
//!
//! Everything here is pure arithmetic on [`ModelShape`]; the numbers are checked by hand in
//! the tests.

use omni_models::DecoderSpec;
use serde::Serialize;

/// The mixture-of-experts part of a [`ModelShape`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoeShape {
    /// Experts per MoE layer (`E`).
    pub num_experts: usize,
    /// Experts each token is routed to (`k`).
    pub top_k: usize,
    /// Intermediate size of one expert.
    pub moe_intermediate_size: usize,
    /// How many layers use the MoE block (the others keep a dense MLP).
    pub num_moe_layers: usize,
}

/// The shapes of a decoder that the roofline needs (from a [`DecoderSpec`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelShape {
    /// HF `architectures` entry.
    pub architecture: String,
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
    /// q/k/v/o projections have biases.
    pub attention_bias: bool,
    /// Per-head RMSNorm on queries and keys.
    pub qk_norm: bool,
    /// `lm_head` shares the input embedding.
    pub tie_word_embeddings: bool,
    /// Experts, if any.
    pub moe: Option<MoeShape>,
}

impl ModelShape {
    /// The shapes of `spec`.
    pub fn from_spec(spec: &DecoderSpec) -> Self {
        let moe = spec.moe.as_ref().map(|m| MoeShape {
            num_experts: m.num_experts,
            top_k: m.top_k,
            moe_intermediate_size: m.moe_intermediate_size,
            num_moe_layers: (0..spec.num_layers)
                .filter(|&i| spec.is_moe_layer(i))
                .count(),
        });
        Self {
            architecture: spec.architecture.to_string(),
            vocab_size: spec.vocab_size,
            hidden_size: spec.hidden_size,
            num_layers: spec.num_layers,
            num_heads: spec.num_heads,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            intermediate_size: spec.intermediate_size,
            attention_bias: spec.attention_bias,
            qk_norm: spec.qk_norm,
            tie_word_embeddings: spec.tie_word_embeddings,
            moe,
        }
    }

    /// Layers with the MoE block.
    pub fn num_moe_layers(&self) -> usize {
        self.moe.as_ref().map_or(0, |m| m.num_moe_layers)
    }

    /// Layers with a dense MLP.
    pub fn num_dense_layers(&self) -> usize {
        self.num_layers - self.num_moe_layers()
    }

    /// Parameters of one layer's attention block, with its two RMSNorms (and q/k norms).
    pub fn attention_params_per_layer(&self) -> usize {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let q = self.num_heads * hd;
        let kv = self.num_kv_heads * hd;
        let mut p = 2 * q * h + 2 * kv * h;
        if self.attention_bias {
            p += q + 2 * kv + h;
        }
        if self.qk_norm {
            p += 2 * hd;
        }
        p + 2 * h
    }

    /// Parameters of one dense MLP (gate, up, down).
    pub fn dense_mlp_params(&self) -> usize {
        3 * self.hidden_size * self.intermediate_size
    }

    /// Parameters of one expert (gate, up, down); 0 without experts.
    pub fn expert_params(&self) -> usize {
        self.moe
            .as_ref()
            .map_or(0, |m| 3 * self.hidden_size * m.moe_intermediate_size)
    }

    /// Parameters of one MoE layer's router; 0 without experts.
    pub fn router_params(&self) -> usize {
        self.moe
            .as_ref()
            .map_or(0, |m| m.num_experts * self.hidden_size)
    }

    /// Parameters of `lm_head` (the embedding matrix when tied).
    pub fn lm_head_params(&self) -> usize {
        self.vocab_size * self.hidden_size
    }

    /// Every parameter of a checkpoint: the input embedding, `lm_head` unless tied, all experts.
    pub fn total_params(&self) -> usize {
        let e = self.moe.as_ref().map_or(0, |m| m.num_experts);
        self.vocab_size * self.hidden_size
            + if self.tie_word_embeddings {
                0
            } else {
                self.lm_head_params()
            }
            + self.hidden_size
            + self.num_layers * self.attention_params_per_layer()
            + self.num_dense_layers() * self.dense_mlp_params()
            + self.num_moe_layers() * (self.router_params() + e * self.expert_params())
    }

    /// Parameters a decode step of `batch` sequences reads (expected value for MoE): every
    /// layer's attention and dense MLPs, routers and the expected distinct experts, the final
    /// norm and `lm_head`; not the input embedding.
    pub fn decode_params(&self, batch: usize) -> f64 {
        let experts = self.moe.as_ref().map_or(0.0, |m| {
            expected_distinct_experts(m.num_experts, m.top_k, batch)
        });
        (self.num_layers * self.attention_params_per_layer()
            + self.num_dense_layers() * self.dense_mlp_params()
            + self.num_moe_layers() * self.router_params()
            + self.hidden_size
            + self.lm_head_params()) as f64
            + self.num_moe_layers() as f64 * experts * self.expert_params() as f64
    }

    /// Parameters one prompt token passes through (its `k` experts in MoE layers), without
    /// the embedding and `lm_head`.
    pub fn active_params_per_token(&self) -> usize {
        let k = self.moe.as_ref().map_or(0, |m| m.top_k);
        self.num_layers * self.attention_params_per_layer()
            + self.num_dense_layers() * self.dense_mlp_params()
            + self.num_moe_layers() * (self.router_params() + k * self.expert_params())
            + self.hidden_size
    }

    /// KV cache elements one token holds over all layers (K and V).
    pub fn kv_elems_per_token(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.head_dim
    }

    /// KV heads one of `tp` ranks holds: `kv_heads / tp`, or 1 when ranks replicate them.
    pub fn kv_heads_per_rank(&self, tp: usize) -> f64 {
        (self.num_kv_heads as f64 / tp.max(1) as f64).max(1.0)
    }
}

/// Expected distinct experts `B` tokens touch when each picks `k` of `E` uniformly:
/// `E × (1 − (1 − k/E)^B)` (`k` for one token, approaching `E` for large batches).
pub fn expected_distinct_experts(num_experts: usize, top_k: usize, batch: usize) -> f64 {
    if num_experts == 0 {
        return 0.0;
    }
    let e = num_experts as f64;
    let miss = 1.0 - (top_k.min(num_experts) as f64) / e;
    e * (1.0 - miss.powi(i32::try_from(batch).unwrap_or(i32::MAX)))
}

/// The device side of a roofline: what one rank can stream and compute.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RankCeilings {
    /// Bytes per second one rank reads (for a GPU: its own HBM; on the CPU, ranks share the
    /// machine's bandwidth, so pass it divided by the ranks).
    pub bandwidth_bytes_per_s: Option<f64>,
    /// Dense GEMM FLOP/s of one rank.
    pub gemm_flops_per_s: Option<f64>,
}

/// The decode bound of one batch size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DecodeRoofline {
    /// Weight bytes one step reads, all ranks together.
    pub weight_bytes: f64,
    /// KV bytes one step reads, all ranks together (replicated heads counted once).
    pub kv_bytes: f64,
    /// Bytes one rank reads per step: `weight_bytes / tp` plus its KV heads' share.
    pub bytes_per_rank: f64,
    /// Fewest seconds per step (`None` without a bandwidth).
    pub step_s: Option<f64>,
    /// Most tokens per second, `batch / step_s`.
    pub tok_per_s: Option<f64>,
}

/// Decode bound for `batch` sequences of `context` tokens each (the mean over the measured
/// steps: `input_len + output_len / 2`), `elem_bytes` per weight and KV element (2 for bf16),
/// over `tp` ranks.
pub fn decode_roofline(
    shape: &ModelShape,
    batch: usize,
    context: f64,
    tp: usize,
    elem_bytes: usize,
    ceilings: RankCeilings,
) -> DecodeRoofline {
    let tp = tp.max(1);
    let eb = elem_bytes as f64;
    let weight_bytes = shape.decode_params(batch) * eb;
    let kv_per_head = batch as f64 * context * (shape.num_layers * 2 * shape.head_dim) as f64 * eb;
    let kv_bytes = kv_per_head * shape.num_kv_heads as f64;
    let bytes_per_rank = weight_bytes / tp as f64 + kv_per_head * shape.kv_heads_per_rank(tp);
    let step_s = ceilings
        .bandwidth_bytes_per_s
        .filter(|bw| *bw > 0.0)
        .map(|bw| bytes_per_rank / bw);
    DecodeRoofline {
        weight_bytes,
        kv_bytes,
        bytes_per_rank,
        step_s,
        tok_per_s: step_s.map(|s| batch as f64 / s),
    }
}

/// The prefill bound of one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PrefillRoofline {
    /// FLOPs of the prompt, all ranks together.
    pub flops: f64,
    /// Of those, causal attention's.
    pub attention_flops: f64,
    /// FLOPs one rank does (`flops / tp`).
    pub flops_per_rank: f64,
    /// Fewest seconds (`None` without a GEMM rate).
    pub time_s: Option<f64>,
    /// Most prompt tokens per second, `tokens / time_s`.
    pub tok_per_s: Option<f64>,
}

/// FLOPs of a `tokens`-long prompt: linear layers `2 × active params × T`, `lm_head` for the
/// last token, causal attention `4 × T²/2 × heads × head_dim × layers`. Returns (all, attention).
pub fn prefill_flops(shape: &ModelShape, tokens: usize) -> (f64, f64) {
    let t = tokens as f64;
    let linear = 2.0 * shape.active_params_per_token() as f64 * t
        + 2.0 * shape.lm_head_params() as f64 * t.min(1.0);
    let attention =
        4.0 * t * t / 2.0 * (shape.num_heads * shape.head_dim * shape.num_layers) as f64;
    (linear + attention, attention)
}

/// Prefill bound of one `tokens`-long prompt over `tp` ranks.
pub fn prefill_roofline(
    shape: &ModelShape,
    tokens: usize,
    tp: usize,
    ceilings: RankCeilings,
) -> PrefillRoofline {
    let (flops, attention_flops) = prefill_flops(shape, tokens);
    let flops_per_rank = flops / tp.max(1) as f64;
    let time_s = ceilings
        .gemm_flops_per_s
        .filter(|r| *r > 0.0)
        .map(|r| flops_per_rank / r);
    PrefillRoofline {
        flops,
        attention_flops,
        flops_per_rank,
        time_s,
        tok_per_s: time_s.map(|s| tokens as f64 / s),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Qwen3-8B's config.json shapes.
    fn qwen3_8b() -> ModelShape {
        ModelShape {
            architecture: "Qwen3ForCausalLM".into(),
            vocab_size: 151_936,
            hidden_size: 4096,
            num_layers: 36,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            intermediate_size: 12_288,
            attention_bias: false,
            qk_norm: true,
            tie_word_embeddings: false,
            moe: None,
        }
    }

    fn close(got: f64, want: f64, rel: f64) -> bool {
        (got - want).abs() <= rel * want.abs()
    }

    #[test]
    fn qwen3_8b_decode_bytes_by_hand() {
        let s = qwen3_8b();
        // Per layer: q 4096·4096 = 16_777_216, k and v 1024·4096 = 4_194_304 each, o 16_777_216
        // (41_943_040); MLP 3·12288·4096 = 150_994_944; norms 2·4096 + q/k norms 2·128 = 8448.
        assert_eq!(s.attention_params_per_layer(), 41_943_040 + 8448);
        assert_eq!(s.dense_mlp_params(), 150_994_944);
        // 36 · 192_946_432 = 6_946_071_552, + final norm 4096, + lm_head 151936·4096 =
        // 622_329_856 → 7_568_405_504 parameters, 15_136_811_008 bf16 bytes (15.1e9).
        let want_params = 36.0 * 192_946_432.0 + 4096.0 + 622_329_856.0;
        assert_eq!(want_params, 7_568_405_504.0);
        assert_eq!(s.decode_params(1), want_params);
        assert_eq!(
            s.decode_params(64),
            want_params,
            "dense: batch does not matter"
        );
        // With the input embedding too, 8_190_735_360 parameters = 16.38e9 bytes: the whole
        // checkpoint, which is where "about 16.4e9" comes from.
        assert_eq!(s.total_params(), 8_190_735_360);

        // B = 1, input 1024, output 64: context 1056; KV 1056·36·2·8·128·2 = 155_713_536 B.
        let r = decode_roofline(
            &s,
            1,
            1056.0,
            1,
            2,
            RankCeilings {
                bandwidth_bytes_per_s: Some(4.2e12),
                gemm_flops_per_s: None,
            },
        );
        assert_eq!(r.weight_bytes, 15_136_811_008.0);
        assert_eq!(r.kv_bytes, 155_713_536.0);
        assert_eq!(r.bytes_per_rank, 15_136_811_008.0 + 155_713_536.0);
        // 15_292_524_544 B / 4.2e12 B/s = 3.641 ms per step → 274.6 tok/s.
        assert!(close(r.step_s.unwrap(), 3.641_077e-3, 1e-5));
        assert!(close(r.tok_per_s.unwrap(), 274.64, 1e-4));

        // B = 64: KV 64× (9.966e9 B); still bandwidth bound on weights + KV.
        let r64 = decode_roofline(
            &s,
            64,
            1056.0,
            1,
            2,
            RankCeilings {
                bandwidth_bytes_per_s: Some(4.2e12),
                gemm_flops_per_s: None,
            },
        );
        assert_eq!(r64.kv_bytes, 64.0 * 155_713_536.0);
        assert!(close(
            r64.tok_per_s.unwrap(),
            64.0 / ((15_136_811_008.0 + 64.0 * 155_713_536.0) / 4.2e12),
            1e-12
        ));
    }

    #[test]
    fn tensor_parallel_splits_weights_and_kv_heads() {
        let s = qwen3_8b();
        let c = RankCeilings {
            bandwidth_bytes_per_s: Some(1e12),
            gemm_flops_per_s: Some(1e15),
        };
        let r1 = decode_roofline(&s, 8, 100.0, 1, 2, c);
        let r2 = decode_roofline(&s, 8, 100.0, 2, 2, c);
        assert_eq!(r2.weight_bytes, r1.weight_bytes);
        assert!(close(r2.bytes_per_rank, r1.bytes_per_rank / 2.0, 1e-12));
        assert!(close(
            r2.tok_per_s.unwrap(),
            2.0 * r1.tok_per_s.unwrap(),
            1e-12
        ));
        // 16 ranks over 8 KV heads: each rank keeps (and reads) one whole head.
        let r16 = decode_roofline(&s, 8, 100.0, 16, 2, c);
        assert!(close(
            r16.bytes_per_rank,
            r1.weight_bytes / 16.0 + r1.kv_bytes / 8.0,
            1e-12
        ));
        let p1 = prefill_roofline(&s, 2048, 1, c);
        let p4 = prefill_roofline(&s, 2048, 4, c);
        assert!(close(
            p4.tok_per_s.unwrap(),
            4.0 * p1.tok_per_s.unwrap(),
            1e-12
        ));
    }

    #[test]
    fn prefill_flops_by_hand() {
        let s = qwen3_8b();
        // Linear: 2 · (36 · 192_946_432 + 4096) · 2048 = 2 · 6_946_075_648 · 2048
        // = 28_451_125_854_208; lm_head for one token: 2 · 622_329_856 = 1_244_659_712.
        // Attention: 4 · 2048²/2 · 32 · 128 · 36 = 2 · 4_194_304 · 147_456 = 1_236_950_581_248.
        let (all, attn) = prefill_flops(&s, 2048);
        assert_eq!(attn, 1_236_950_581_248.0);
        assert_eq!(
            all,
            28_451_125_854_208.0 + 1_244_659_712.0 + 1_236_950_581_248.0
        );
        // At 800 TFLOP/s: 29.689e12 / 8e14 = 37.1 ms → 55.2k tok/s.
        let r = prefill_roofline(
            &s,
            2048,
            1,
            RankCeilings {
                bandwidth_bytes_per_s: None,
                gemm_flops_per_s: Some(8e14),
            },
        );
        assert!(close(r.time_s.unwrap(), all / 8e14, 1e-12));
        assert!(close(r.tok_per_s.unwrap(), 55_181.0, 1e-3));
        // No rate: FLOPs still reported, no bound.
        let none = prefill_roofline(
            &s,
            2048,
            1,
            RankCeilings {
                bandwidth_bytes_per_s: None,
                gemm_flops_per_s: None,
            },
        );
        assert_eq!(none.flops, all);
        assert!(none.tok_per_s.is_none());
    }

    #[test]
    fn distinct_experts_grow_from_k_to_e() {
        assert_eq!(expected_distinct_experts(128, 8, 0), 0.0);
        assert!(close(expected_distinct_experts(128, 8, 1), 8.0, 1e-12));
        // 128 · (1 − (120/128)²) = 128 · 0.12109375 = 15.5
        assert!(close(expected_distinct_experts(128, 8, 2), 15.5, 1e-12));
        assert!(expected_distinct_experts(128, 8, 4096) > 127.999);
        assert!(close(expected_distinct_experts(4, 4, 3), 4.0, 1e-12));
        assert_eq!(expected_distinct_experts(0, 0, 3), 0.0);
    }

    /// A Qwen3-30B-A3B-like MoE: 48 layers, all MoE, 128 experts, top 8.
    fn qwen3_30b_a3b() -> ModelShape {
        ModelShape {
            architecture: "Qwen3MoeForCausalLM".into(),
            vocab_size: 151_936,
            hidden_size: 2048,
            num_layers: 48,
            num_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            intermediate_size: 6144,
            attention_bias: false,
            qk_norm: true,
            tie_word_embeddings: false,
            moe: Some(MoeShape {
                num_experts: 128,
                top_k: 8,
                moe_intermediate_size: 768,
                num_moe_layers: 48,
            }),
        }
    }

    #[test]
    fn moe_decode_counts_touched_experts_only() {
        let s = qwen3_30b_a3b();
        // Attention per layer: 2·4096·2048 + 2·512·2048 = 18_874_368, + norms 2·2048 + 2·128
        // = 4352; router 128·2048 = 262_144; one expert 3·2048·768 = 4_718_592.
        assert_eq!(s.attention_params_per_layer(), 18_874_368 + 4352);
        assert_eq!(s.router_params(), 262_144);
        assert_eq!(s.expert_params(), 4_718_592);
        let base = 48.0 * (18_878_720.0 + 262_144.0) + 2048.0 + 151_936.0 * 2048.0;
        // B = 1: 8 experts per layer → 48 · 8 · 4_718_592 = 1_811_939_328 expert params.
        assert_eq!(s.decode_params(1), base + 1_811_939_328.0);
        // B = 2: 15.5 experts per layer.
        assert!(close(
            s.decode_params(2),
            base + 48.0 * 15.5 * 4_718_592.0,
            1e-12
        ));
        // Large batch: every expert, i.e. the whole checkpoint less the input embedding.
        let all = (s.total_params() - 151_936 * 2048) as f64;
        assert!(close(s.decode_params(100_000), all, 1e-12));
        // Prefill: k experts per token. Active ≈ 3.3e9 (the "A3B"), with embeddings.
        let active = s.active_params_per_token() + 2 * 151_936 * 2048;
        assert!((3.0e9..3.6e9).contains(&(active as f64)), "{active}");
    }

    fn fixture_spec(name: &str) -> DecoderSpec {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../crates/omni-models/tests/fixtures")
            .join(name);
        let config = omni_models::registry::read_config(&dir).unwrap();
        omni_models::registry::decoder_spec(&config).unwrap()
    }

    /// The analytic parameter count agrees with the tensors a checkpoint of the spec holds.
    #[test]
    fn total_params_match_the_checkpoint_tensor_list() {
        for name in ["qwen3", "qwen3-moe", "llama"] {
            let spec = fixture_spec(name);
            let from_shapes: usize = spec
                .weight_shapes()
                .iter()
                .map(|(_, dims)| dims.iter().product::<usize>())
                .sum();
            let shape = ModelShape::from_spec(&spec);
            assert_eq!(shape.total_params(), from_shapes, "{name}");
            // At a huge batch a decode step touches every tensor but the input embedding.
            let embed = shape.vocab_size * shape.hidden_size;
            let lm_head_extra = if shape.tie_word_embeddings { embed } else { 0 };
            assert!(
                close(
                    shape.decode_params(1 << 20),
                    (from_shapes - embed + lm_head_extra) as f64,
                    1e-12
                ),
                "{name}"
            );
        }
        assert!(
            ModelShape::from_spec(&fixture_spec("qwen3-moe"))
                .moe
                .is_some()
        );
    }
}
