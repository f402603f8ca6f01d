//! The Llama-family decoder that Llama, Qwen3 and Qwen3-MoE share: pre-norm blocks of
//! (RMSNorm, attention with RoPE and GQA, residual) and (RMSNorm, SiLU MLP or MoE, residual).
//!
//! Each architecture file maps its HF `Config` into a [`DecoderSpec`]; [`DecoderModel::load`]
//! then walks the checkpoint's tensor names (`model.layers.{i}.self_attn.q_proj.weight`, ...).
//!
//! # Tensor parallelism (as in vLLM)
//! - `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj` are column-parallel: rank `r` keeps its
//!   rows (its query heads; its KV heads, or one replicated KV head when `tp_size >
//!   num_key_value_heads`; its slice of the intermediate size).
//! - `o_proj`, `down_proj` are row-parallel: rank `r` keeps the matching input columns, and the
//!   partial sums are combined by [`AllReduce::all_reduce_sum`].
//! - MoE experts are sharded the same way as a dense MLP: every rank holds every expert, with
//!   its slice of `moe_intermediate_size` (gate/up rows, down columns); the router is replicated
//!   and one all-reduce follows the expert sum. (Expert parallelism, experts split over ranks,
//!   is not implemented.)
//! - Embeddings, norms, the router and `lm_head` are replicated.

use std::sync::Arc;

use omni_backend::attention::{LayerKvCache, paged_attention, reshape_and_cache};
use omni_backend::comm::{AllReduce, IdentityAllReduce};
use omni_backend::linalg::matmul_nt;
use omni_backend::ops;
use omni_backend::rope::{Rope, RopeScaling};

use crate::batch::ForwardBatch;
use crate::error::ModelError;
use crate::weights::{HostTensor, WeightError, WeightSource};
use crate::{CausalLm, KvCacheSpec};

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
        let mut v = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, h],
        )];
        v.push(("model.norm.weight".into(), vec![h]));
        if !self.tie_word_embeddings {
            v.push(("lm_head.weight".into(), vec![self.vocab_size, h]));
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

/// Rank, world size and the all-reduce hook of one tensor-parallel model replica.
#[derive(Debug, Clone)]
pub struct TpContext {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
    /// Sums row-parallel partial outputs across ranks.
    pub all_reduce: Arc<dyn AllReduce>,
}

impl TpContext {
    /// No tensor parallelism.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            all_reduce: Arc::new(IdentityAllReduce),
        }
    }

    /// Rank `rank` of `size`, with its all-reduce handle.
    pub fn new(rank: usize, size: usize, all_reduce: Arc<dyn AllReduce>) -> Self {
        Self {
            rank,
            size,
            all_reduce,
        }
    }
}

/// A weight matrix `[out, in]` (HF layout) with an optional bias.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub(crate) w: Vec<f32>,
    pub(crate) out: usize,
    pub(crate) inp: usize,
    pub(crate) bias: Option<Vec<f32>>,
}

impl Linear {
    fn forward(&self, x: &[f32], tokens: usize, out: &mut Vec<f32>) -> Result<(), ModelError> {
        out.clear();
        out.resize(tokens * self.out, 0.0);
        matmul_nt(x, &self.w, out, tokens, self.inp, self.out)?;
        if let Some(b) = &self.bias {
            ops::add_bias_inplace(out, b)?;
        }
        Ok(())
    }
}

pub(crate) fn load_shaped(
    ws: &dyn WeightSource,
    name: &str,
    shape: &[usize],
) -> Result<HostTensor, ModelError> {
    let t = ws.load(name)?;
    if t.shape != shape {
        return Err(WeightError::Invalid {
            name: name.into(),
            reason: format!("shape {:?}, expected {:?}", t.shape, shape),
        }
        .into());
    }
    Ok(t)
}

/// Rows `start..start + len` of a 2-D (or 1-D, as a column) tensor.
fn take_rows(t: &HostTensor, start: usize, len: usize) -> Vec<f32> {
    let cols: usize = t.shape.iter().skip(1).product();
    t.data[start * cols..(start + len) * cols].to_vec()
}

/// Columns `start..start + len` of a 2-D tensor.
fn take_cols(t: &HostTensor, start: usize, len: usize) -> Vec<f32> {
    let cols = t.shape[1];
    t.data
        .chunks_exact(cols)
        .flat_map(|r| r[start..start + len].iter().copied())
        .collect()
}

pub(crate) struct Loader<'a> {
    ws: &'a dyn WeightSource,
    spec: &'a DecoderSpec,
    rank: usize,
    size: usize,
    heads: HeadLayout,
}

impl<'a> Loader<'a> {
    /// Reads rank `rank` of `size`'s shard of each layer from `ws` (host f32).
    pub(crate) fn new(
        ws: &'a dyn WeightSource,
        spec: &'a DecoderSpec,
        rank: usize,
        size: usize,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            ws,
            spec,
            rank,
            size,
            heads: spec.head_layout(rank, size)?,
        })
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        Ok(load_shaped(self.ws, name, &[len])?.data)
    }

    /// Column-parallel pieces stacked into one fused matrix: for each `(name, rows per unit,
    /// first unit, units)`, rows `first * per .. (first + units) * per` of `[n, in]`.
    fn fused_rows(
        &self,
        parts: &[(String, usize, usize, usize)],
        full_rows: &[usize],
        inp: usize,
        bias: bool,
    ) -> Result<Linear, ModelError> {
        let mut w = Vec::new();
        let mut b = Vec::new();
        let mut out = 0;
        for ((name, per, first, units), &rows) in parts.iter().zip(full_rows) {
            let t = load_shaped(self.ws, &format!("{name}.weight"), &[rows, inp])?;
            w.extend(take_rows(&t, first * per, units * per));
            if bias {
                let bt = load_shaped(self.ws, &format!("{name}.bias"), &[rows])?;
                b.extend(take_rows(&bt, first * per, units * per));
            }
            out += units * per;
        }
        Ok(Linear {
            w,
            out,
            inp,
            bias: bias.then_some(b),
        })
    }

    /// Row-parallel: columns `start..start + len` of `[out, in_full]`.
    fn row_parallel(
        &self,
        name: &str,
        out: usize,
        in_full: usize,
        start: usize,
        len: usize,
        bias: bool,
    ) -> Result<Linear, ModelError> {
        let t = load_shaped(self.ws, &format!("{name}.weight"), &[out, in_full])?;
        // The partial sums of all ranks are added up: the bias belongs to one of them.
        let bias = if bias && self.rank == 0 {
            Some(self.vector(&format!("{name}.bias"), out)?)
        } else {
            None
        };
        Ok(Linear {
            w: take_cols(&t, start, len),
            out,
            inp: len,
            bias,
        })
    }

    fn split(&self, n: usize, what: &str) -> Result<(usize, usize), ModelError> {
        if !n.is_multiple_of(self.size) {
            return Err(ModelError::TensorParallel(format!(
                "{what} {n} does not split over {} ranks",
                self.size
            )));
        }
        let l = n / self.size;
        Ok((self.rank * l, l))
    }

    fn mlp(&self, prefix: &str, inter: usize) -> Result<DenseMlp, ModelError> {
        let h = self.spec.hidden_size;
        let (start, local) = self.split(inter, "intermediate size")?;
        let gate_up = self.fused_rows(
            &[
                (format!("{prefix}.gate_proj"), local, self.rank, 1),
                (format!("{prefix}.up_proj"), local, self.rank, 1),
            ],
            &[inter, inter],
            h,
            false,
        )?;
        let down = self.row_parallel(
            &format!("{prefix}.down_proj"),
            h,
            inter,
            start,
            local,
            false,
        )?;
        Ok(DenseMlp {
            gate_up,
            down,
            inter: local,
        })
    }

    pub(crate) fn layer(&self, i: usize) -> Result<DecoderLayer, ModelError> {
        let s = self.spec;
        let (h, hd) = (s.hidden_size, s.head_dim);
        let p = format!("model.layers.{i}");
        let hl = self.heads;
        let qkv = self.fused_rows(
            &[
                (
                    format!("{p}.self_attn.q_proj"),
                    hd,
                    hl.head_start,
                    hl.local_heads,
                ),
                (
                    format!("{p}.self_attn.k_proj"),
                    hd,
                    hl.kv_head_start,
                    hl.local_kv_heads,
                ),
                (
                    format!("{p}.self_attn.v_proj"),
                    hd,
                    hl.kv_head_start,
                    hl.local_kv_heads,
                ),
            ],
            &[s.num_heads * hd, s.num_kv_heads * hd, s.num_kv_heads * hd],
            h,
            s.attention_bias,
        )?;
        let o = self.row_parallel(
            &format!("{p}.self_attn.o_proj"),
            h,
            s.num_heads * hd,
            hl.head_start * hd,
            hl.local_heads * hd,
            s.attention_bias,
        )?;
        let (q_norm, k_norm) = if s.qk_norm {
            (
                Some(self.vector(&format!("{p}.self_attn.q_norm.weight"), hd)?),
                Some(self.vector(&format!("{p}.self_attn.k_norm.weight"), hd)?),
            )
        } else {
            (None, None)
        };
        let mlp = match (&s.moe, s.is_moe_layer(i)) {
            (Some(m), true) => {
                let router = load_shaped(
                    self.ws,
                    &format!("{p}.mlp.gate.weight"),
                    &[m.num_experts, h],
                )?
                .data;
                let experts = (0..m.num_experts)
                    .map(|e| self.mlp(&format!("{p}.mlp.experts.{e}"), m.moe_intermediate_size))
                    .collect::<Result<Vec<_>, _>>()?;
                Mlp::Moe(MoeMlp {
                    router,
                    experts,
                    top_k: m.top_k,
                    norm_topk_prob: m.norm_topk_prob,
                })
            }
            _ => Mlp::Dense(self.mlp(&format!("{p}.mlp"), s.intermediate_size)?),
        };
        Ok(DecoderLayer {
            input_norm: self.vector(&format!("{p}.input_layernorm.weight"), h)?,
            post_norm: self.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            qkv,
            o,
            q_norm,
            k_norm,
            mlp,
        })
    }
}

#[derive(Debug, Clone)]
pub(crate) struct DenseMlp {
    /// `[gate rows | up rows]` of this rank, fused: `[2 * inter, hidden]`.
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
    pub(crate) inter: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct MoeMlp {
    /// `[num_experts, hidden]`, replicated.
    pub(crate) router: Vec<f32>,
    pub(crate) experts: Vec<DenseMlp>,
    pub(crate) top_k: usize,
    pub(crate) norm_topk_prob: bool,
}

#[derive(Debug, Clone)]
pub(crate) enum Mlp {
    Dense(DenseMlp),
    Moe(MoeMlp),
}

#[derive(Debug, Clone)]
pub(crate) struct DecoderLayer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    /// Fused `[q rows | k rows | v rows]` of this rank's heads.
    pub(crate) qkv: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) mlp: Mlp,
}

/// Scratch buffers of one forward pass, reused across layers.
#[derive(Debug, Default)]
struct Scratch {
    h: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    cos_sin: Vec<f32>,
    gather: Vec<f32>,
}

/// A loaded Llama-family decoder on one tensor-parallel rank.
#[derive(Debug)]
pub struct DecoderModel {
    spec: DecoderSpec,
    heads: HeadLayout,
    tp: TpContext,
    embed: Vec<f32>,
    lm_head: Option<Vec<f32>>,
    norm: Vec<f32>,
    layers: Vec<DecoderLayer>,
    rope: Rope,
    /// When enabled, each token's smallest MoE routing margin of the last forward.
    routing_trace: std::sync::Mutex<Option<Vec<f32>>>,
}

impl DecoderModel {
    /// Starts recording, for every token of each forward, the smallest routing margin over the
    /// MoE layers: `ln p_k - ln p_(k+1)`, the log-probability gap between the last expert chosen
    /// and the first one left out. A small margin is a near-tie that any rounding (a bf16 device)
    /// may flip; reference tests use it to tell such tokens from errors.
    pub fn enable_routing_trace(&self) {
        if let Ok(mut t) = self.routing_trace.lock() {
            *t = Some(Vec::new());
        }
    }

    /// Per token of the last forward, the smallest MoE routing margin (`f32::INFINITY` for a
    /// dense model); empty unless [`DecoderModel::enable_routing_trace`] was called.
    pub fn routing_margins(&self) -> Vec<f32> {
        self.routing_trace
            .lock()
            .ok()
            .and_then(|t| t.clone())
            .unwrap_or_default()
    }

    /// Loads rank `tp.rank`'s share of the weights in `ws`.
    pub fn load(
        spec: DecoderSpec,
        ws: &dyn WeightSource,
        tp: TpContext,
    ) -> Result<Self, ModelError> {
        let heads = spec.head_layout(tp.rank, tp.size)?;
        if tp.all_reduce.world_size() != tp.size {
            return Err(ModelError::TensorParallel(format!(
                "all-reduce group of {} for tp_size {}",
                tp.all_reduce.world_size(),
                tp.size
            )));
        }
        let loader = Loader::new(ws, &spec, tp.rank, tp.size)?;
        let (v, h) = (spec.vocab_size, spec.hidden_size);
        let embed = load_shaped(ws, "model.embed_tokens.weight", &[v, h])?.data;
        let lm_head = if spec.tie_word_embeddings {
            None
        } else {
            Some(load_shaped(ws, "lm_head.weight", &[v, h])?.data)
        };
        let norm = loader.vector("model.norm.weight", h)?;
        let layers = (0..spec.num_layers)
            .map(|i| loader.layer(i))
            .collect::<Result<Vec<_>, _>>()?;
        let rope = Rope::new(spec.head_dim, spec.rope_theta, &spec.rope_scaling)?;
        tracing::info!(
            architecture = spec.architecture,
            layers = spec.num_layers,
            tp_rank = tp.rank,
            tp_size = tp.size,
            local_heads = heads.local_heads,
            local_kv_heads = heads.local_kv_heads,
            "model loaded"
        );
        Ok(Self {
            spec,
            heads,
            tp,
            embed,
            lm_head,
            norm,
            layers,
            rope,
            routing_trace: std::sync::Mutex::new(None),
        })
    }

    /// The spec this model was built from.
    pub fn spec(&self) -> &DecoderSpec {
        &self.spec
    }

    fn attention(
        &self,
        l: &DecoderLayer,
        t: usize,
        batch: &ForwardBatch,
        cache: &mut LayerKvCache,
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let hd = self.spec.head_dim;
        let (lq, lkv) = (self.heads.local_heads, self.heads.local_kv_heads);
        l.qkv.forward(&s.h, t, &mut s.qkv)?;
        let (qw, kw) = (lq * hd, lkv * hd);
        let row = qw + 2 * kw;
        for buf in [&mut s.q, &mut s.k, &mut s.v] {
            buf.clear();
        }
        for r in s.qkv.chunks_exact(row) {
            s.q.extend_from_slice(&r[..qw]);
            s.k.extend_from_slice(&r[qw..qw + kw]);
            s.v.extend_from_slice(&r[qw + kw..]);
        }
        if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
            ops::rms_norm_inplace(&mut s.q, qn, hd, self.spec.rms_norm_eps)?;
            ops::rms_norm_inplace(&mut s.k, kn, hd, self.spec.rms_norm_eps)?;
        }
        self.rope.apply(&mut s.q, lq, &s.cos_sin)?;
        self.rope.apply(&mut s.k, lkv, &s.cos_sin)?;
        reshape_and_cache(&s.k, &s.v, &batch.attn.slot_mapping, cache)?;
        s.attn.clear();
        s.attn.resize(t * qw, 0.0);
        let scale = 1.0 / (hd as f32).sqrt();
        paged_attention(&s.q, lq, cache, &batch.attn, scale, &mut s.attn)?;
        l.o.forward(&s.attn, t, &mut s.proj)?;
        Ok(())
    }

    fn dense_mlp(
        m: &DenseMlp,
        x: &[f32],
        t: usize,
        gate_up: &mut Vec<f32>,
        act: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        m.gate_up.forward(x, t, gate_up)?;
        act.clear();
        act.resize(t * m.inter, 0.0);
        ops::silu_and_mul(gate_up, act, m.inter)?;
        m.down.forward(act, t, out)
    }

    fn moe(&self, m: &MoeMlp, t: usize, s: &mut Scratch) -> Result<(), ModelError> {
        let h = self.spec.hidden_size;
        let ne = m.experts.len();
        let mut logits = vec![0.0; t * ne];
        matmul_nt(&s.h, &m.router, &mut logits, t, h, ne)?;
        // Per expert: (token row, routing weight).
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); ne];
        let mut order: Vec<usize> = Vec::with_capacity(ne);
        for (tok, row) in logits.chunks_exact_mut(ne).enumerate() {
            ops::softmax_inplace(row);
            order.clear();
            order.extend(0..ne);
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let top = &order[..m.top_k.min(ne)];
            if let Some(&next) = order.get(m.top_k)
                && let Ok(mut trace) = self.routing_trace.lock()
                && let Some(trace) = trace.as_mut()
                && let Some(slot) = trace.get_mut(tok)
            {
                let margin = row[top[top.len() - 1]].ln() - row[next].ln();
                *slot = slot.min(margin);
            }
            let sum: f32 = top.iter().map(|&e| row[e]).sum();
            for &e in top {
                let w = if m.norm_topk_prob {
                    row[e] / sum
                } else {
                    row[e]
                };
                routed[e].push((tok, w));
            }
        }
        s.proj.clear();
        s.proj.resize(t * h, 0.0);
        let mut out = Vec::new();
        for (e, toks) in routed.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            s.gather.clear();
            for &(tok, _) in toks {
                s.gather.extend_from_slice(&s.h[tok * h..(tok + 1) * h]);
            }
            Self::dense_mlp(
                &m.experts[e],
                &s.gather,
                toks.len(),
                &mut s.gate_up,
                &mut s.act,
                &mut out,
            )?;
            for (i, &(tok, w)) in toks.iter().enumerate() {
                for (d, y) in s.proj[tok * h..(tok + 1) * h]
                    .iter_mut()
                    .zip(&out[i * h..(i + 1) * h])
                {
                    *d += w * y;
                }
            }
        }
        Ok(())
    }
}

impl CausalLm for DecoderModel {
    fn architecture(&self) -> &str {
        self.spec.architecture
    }

    fn vocab_size(&self) -> usize {
        self.spec.vocab_size
    }

    fn kv_cache_spec(&self) -> KvCacheSpec {
        KvCacheSpec {
            num_layers: self.spec.num_layers,
            num_kv_heads: self.heads.local_kv_heads,
            head_dim: self.spec.head_dim,
        }
    }

    fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut [LayerKvCache],
    ) -> Result<HostTensor, ModelError> {
        let t = batch.input_ids.len();
        let h = self.spec.hidden_size;
        if batch.positions.len() != t || batch.attn.num_tokens() != t {
            return Err(ModelError::Batch(format!(
                "{t} tokens, {} positions, query_start_loc ends at {}",
                batch.positions.len(),
                batch.attn.num_tokens()
            )));
        }
        if kv.len() != self.layers.len() {
            return Err(ModelError::Batch(format!(
                "{} KV caches for {} layers",
                kv.len(),
                self.layers.len()
            )));
        }
        let rows = batch.output_rows();
        if let Some(&bad) = rows.iter().find(|&&r| r >= t) {
            return Err(ModelError::Batch(format!(
                "logits index {bad} out of {t} tokens"
            )));
        }
        if let Ok(mut trace) = self.routing_trace.lock()
            && let Some(trace) = trace.as_mut()
        {
            trace.clear();
            trace.resize(t, f32::INFINITY);
        }
        let mut x = vec![0.0; t * h];
        ops::embedding(&self.embed, h, &batch.input_ids, &mut x)?;
        let mut s = Scratch::default();
        self.rope.cos_sin(&batch.positions, &mut s.cos_sin);
        let eps = self.spec.rms_norm_eps;
        for (l, cache) in self.layers.iter().zip(kv.iter_mut()) {
            s.h.clear();
            s.h.extend_from_slice(&x);
            ops::rms_norm_inplace(&mut s.h, &l.input_norm, h, eps)?;
            self.attention(l, t, batch, cache, &mut s)?;
            self.tp.all_reduce.all_reduce_sum(&mut s.proj)?;
            ops::add_inplace(&mut x, &s.proj)?;

            s.h.clear();
            s.h.extend_from_slice(&x);
            ops::rms_norm_inplace(&mut s.h, &l.post_norm, h, eps)?;
            match &l.mlp {
                Mlp::Dense(m) => {
                    Self::dense_mlp(m, &s.h, t, &mut s.gate_up, &mut s.act, &mut s.proj)?
                }
                Mlp::Moe(m) => self.moe(m, t, &mut s)?,
            }
            self.tp.all_reduce.all_reduce_sum(&mut s.proj)?;
            ops::add_inplace(&mut x, &s.proj)?;
        }
        let mut sel = Vec::with_capacity(rows.len() * h);
        for &r in &rows {
            sel.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        ops::rms_norm_inplace(&mut sel, &self.norm, h, eps)?;
        let v = self.spec.vocab_size;
        let mut logits = vec![0.0; rows.len() * v];
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        matmul_nt(&sel, head, &mut logits, rows.len(), h, v)?;
        Ok(HostTensor {
            shape: vec![rows.len(), v],
            data: logits,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
