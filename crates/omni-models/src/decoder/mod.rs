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
//!   partial sums are combined by [`AllReduce::all_reduce_sum`](crate::AllReduce::all_reduce_sum).
//! - MoE experts are sharded the same way as a dense MLP: every rank holds every expert, with
//!   its slice of `moe_intermediate_size` (gate/up rows, down columns); the router is replicated
//!   and one all-reduce follows the expert sum. (Expert parallelism, experts split over ranks,
//!   is not implemented.)
//! - Embeddings, norms, the router and `lm_head` are replicated.
//!
//! # Pipeline parallelism (as in vLLM)
//! A rank of pipeline stage `p` holds only that stage's layers ([`PipelineStage::layers`]); the
//! first stage embeds the tokens, the last runs the final norm and the head (tied embeddings
//! are loaded there as the head). A stage after the first takes the previous stage's residual
//! stream (`[tokens, hidden]`, f32) as its input embeddings, and a stage before the last
//! returns its residual stream instead of logits ([`CausalLm::forward_stage`]).

use omni_backend::attention::{LayerKvCache, paged_attention, reshape_and_cache};
use omni_backend::linalg::matmul_nt;
use omni_backend::ops;
use omni_backend::quant::WeightMatrix;
use omni_backend::rope::{MropeLayout, Rope};

use crate::batch::ForwardBatch;
use crate::error::ModelError;
use crate::interface::{
    Capture, ModelInputs, ModelOutputs, ModelStage, PositionInputs, StageModel, TokenInputs,
};
use crate::weights::{HostTensor, WeightSource};
use crate::{CausalLm, KvCacheSpec};

mod loader;
mod spec;

pub(crate) use loader::{Loader, load_shaped, load_weight};
pub use spec::{DecoderSpec, HeadLayout, MoeSpec, MropeSpec, PipelineStage, TpContext};

use crate::StageForward;

/// A weight matrix `[out, in]` (HF layout) with an optional bias.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub(crate) w: Vec<f32>,
    pub(crate) out: usize,
    pub(crate) inp: usize,
    pub(crate) bias: Option<Vec<f32>>,
}

impl Linear {
    pub(crate) fn forward(
        &self,
        x: &[f32],
        tokens: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        out.clear();
        out.resize(tokens * self.out, 0.0);
        matmul_nt(x, &self.w, out, tokens, self.inp, self.out)?;
        if let Some(b) = &self.bias {
            ops::add_bias_inplace(out, b)?;
        }
        Ok(())
    }
}

/// A decoder layer's weight `[out, in]` as the checkpoint stores it (f32, or quantized blocks
/// that the CPU backend multiplies without upcasting), with an optional bias.
#[derive(Debug, Clone)]
pub(crate) struct DecoderLinear {
    pub(crate) w: WeightMatrix,
    pub(crate) bias: Option<Vec<f32>>,
}

impl DecoderLinear {
    /// Output features.
    pub(crate) fn out(&self) -> usize {
        self.w.rows()
    }

    pub(crate) fn forward(
        &self,
        x: &[f32],
        tokens: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        out.clear();
        out.resize(tokens * self.out(), 0.0);
        self.w.matmul_nt(x, out, tokens)?;
        if let Some(b) = &self.bias {
            ops::add_bias_inplace(out, b)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub(crate) struct DenseMlp {
    /// `[gate rows | up rows]` of this rank, fused: `[2 * inter, hidden]`.
    pub(crate) gate_up: DecoderLinear,
    pub(crate) down: DecoderLinear,
    pub(crate) inter: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct MoeMlp {
    /// `[num_experts, hidden]`, replicated.
    pub(crate) router: Vec<f32>,
    pub(crate) experts: Vec<DenseMlp>,
    pub(crate) top_k: usize,
    pub(crate) norm_topk_prob: bool,
    /// The shared expert and its gate vector `[hidden]` (output scaled by `sigmoid(gate . x)`).
    pub(crate) shared: Option<(DenseMlp, Vec<f32>)>,
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
    pub(crate) qkv: DecoderLinear,
    pub(crate) o: DecoderLinear,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) mlp: Mlp,
}

/// Rows added to the residual stream after the first decoder layers (Qwen3-VL / Qwen3-Omni
/// deepstack): after layer `i < after_layer.len()`, batch row `rows[j]` gets
/// `after_layer[i][j * hidden..(j + 1) * hidden]`. A capture of [`Capture::AfterLayers`]`(i + 1)`
/// sees the state before the addition (transformers records the layer's output).
#[derive(Debug, Clone, Copy, Default)]
pub struct ResidualAdds<'a> {
    /// Batch rows that receive the additions.
    pub rows: &'a [usize],
    /// Per layer, `[rows.len(), hidden]` values.
    pub after_layer: &'a [Vec<f32>],
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
    /// `[vocab, hidden]`; no rows without `embed_and_head`.
    embed: WeightMatrix,
    lm_head: Option<WeightMatrix>,
    norm: Vec<f32>,
    layers: Vec<DecoderLayer>,
    /// The global index of `layers[0]` (its pipeline stage's first layer).
    layer_start: usize,
    rope: Rope,
    mrope: Option<MropeLayout>,
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
        let pp = tp.pp;
        if pp.size > 1 && !spec.embed_and_head {
            return Err(ModelError::TensorParallel(format!(
                "{} takes input embeddings: pipeline parallelism serves token decoders only",
                spec.architecture
            )));
        }
        // A middle stage has neither table; the last stage keeps a tied table as its head.
        let needs_embed = pp.is_first() || (pp.is_last() && spec.tie_word_embeddings);
        let (embed, lm_head) = if !spec.embed_and_head {
            (WeightMatrix::f32(Vec::new(), 0, h)?, None)
        } else if !needs_embed {
            let head = pp
                .is_last()
                .then(|| load_weight(ws, "lm_head.weight", v, h))
                .transpose()?;
            (WeightMatrix::f32(Vec::new(), 0, h)?, head)
        } else if spec.tie_word_embeddings {
            (load_weight(ws, "model.embed_tokens.weight", v, h)?, None)
        } else {
            (
                load_weight(ws, "model.embed_tokens.weight", v, h)?,
                Some(load_weight(ws, "lm_head.weight", v, h)?),
            )
        };
        let norm = loader.vector("model.norm.weight", h)?;
        let range = pp.layers(spec.num_layers);
        if range.is_empty() {
            return Err(ModelError::TensorParallel(format!(
                "pipeline stage {} of {} gets none of the {} layers",
                pp.rank, pp.size, spec.num_layers
            )));
        }
        let layer_start = range.start;
        let layers = range
            .map(|i| loader.layer(i))
            .collect::<Result<Vec<_>, _>>()?;
        let rope = Rope::new(spec.head_dim, spec.rope_theta, &spec.rope_scaling)?;
        let mrope = spec
            .mrope
            .map(|m| MropeLayout::new(spec.head_dim, m.section, m.interleaved))
            .transpose()?;
        tracing::info!(
            architecture = spec.architecture,
            layers = spec.num_layers,
            tp_rank = tp.rank,
            tp_size = tp.size,
            pp_rank = pp.rank,
            pp_size = pp.size,
            layers_from = layer_start,
            local_layers = layers.len(),
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
            layer_start,
            rope,
            mrope,
            routing_trace: std::sync::Mutex::new(None),
        })
    }

    /// The spec this model was built from.
    pub fn spec(&self) -> &DecoderSpec {
        &self.spec
    }

    /// The token-embedding rows of `ids`, `[ids, hidden]` (what enters layer 0 for text).
    pub fn embed_ids(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        if !self.spec.embed_and_head {
            return Err(ModelError::Batch(format!(
                "{} has no token embedding",
                self.spec.architecture
            )));
        }
        let h = self.spec.hidden_size;
        let mut x = vec![0.0; ids.len() * h];
        self.embed.embedding(ids, &mut x)?;
        Ok(x)
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
        if let Some((shared, gate)) = &m.shared {
            Self::dense_mlp(shared, &s.h, t, &mut s.gate_up, &mut s.act, &mut out)?;
            for ((x, d), y) in
                s.h.chunks_exact(h)
                    .zip(s.proj.chunks_exact_mut(h))
                    .zip(out.chunks_exact(h))
            {
                // The gate reads the replicated input, so with tensor parallelism each rank
                // scales its partial sum by the same factor before the all-reduce.
                let g = ops::sigmoid(x.iter().zip(gate).map(|(a, b)| a * b).sum());
                d.iter_mut().zip(y).for_each(|(d, y)| *d += g * y);
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
            num_layers: self.layers.len(),
            num_kv_heads: self.heads.local_kv_heads,
            head_dim: self.spec.head_dim,
        }
    }

    fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut [LayerKvCache],
    ) -> Result<HostTensor, ModelError> {
        self.run(
            batch,
            None,
            PositionInputs::Batch,
            &[],
            ResidualAdds::default(),
            kv,
        )?
        .logits
        .ok_or_else(|| ModelError::Batch("the decoder produced no logits".into()))
    }

    fn forward_stage(
        &self,
        batch: &ForwardBatch,
        hidden: Option<&[f32]>,
        kv: &mut [LayerKvCache],
    ) -> Result<StageForward, ModelError> {
        let pp = self.tp.pp;
        if hidden.is_some() == pp.is_first() {
            return Err(ModelError::Batch(format!(
                "pipeline stage {} of {} {} a previous stage's hidden states",
                pp.rank,
                pp.size,
                if pp.is_first() { "takes no" } else { "needs" }
            )));
        }
        let mut out = self.run(
            batch,
            hidden,
            PositionInputs::Batch,
            &[],
            ResidualAdds::default(),
            kv,
        )?;
        match (out.logits.take(), out.hidden_states.pop()) {
            (Some(logits), _) => Ok(StageForward::Logits(logits)),
            (None, Some((_, h))) => Ok(StageForward::Hidden(h.data)),
            (None, None) => Err(ModelError::Batch("the stage produced nothing".into())),
        }
    }
}

impl DecoderModel {
    /// One step: embeds the batch's ids (or takes `embeds`, `[tokens, hidden]`), runs every
    /// layer (with `adds` after the first ones), and returns the logits of the output rows and
    /// the `capture`d states.
    fn run(
        &self,
        batch: &ForwardBatch,
        embeds: Option<&[f32]>,
        positions: PositionInputs<'_>,
        capture: &[Capture],
        adds: ResidualAdds<'_>,
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        // On the rayon pool: the step's hundred-odd parallel products then start from a pool
        // thread (measured on the 2-core VM: 16-20 ms per batch-1 step against 23-29 from the
        // worker's own thread). Not with tensor parallelism: ranks that are threads of one
        // process would block in the all-reduce on pool threads, more ranks than threads.
        if self.tp.size > 1 {
            return self.run_here(batch, embeds, positions, capture, adds, kv);
        }
        omni_backend::linalg::on_pool(|| self.run_here(batch, embeds, positions, capture, adds, kv))
    }

    /// [`DecoderModel::run`] on the calling thread.
    fn run_here(
        &self,
        batch: &ForwardBatch,
        embeds: Option<&[f32]>,
        positions: PositionInputs<'_>,
        capture: &[Capture],
        adds: ResidualAdds<'_>,
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        let t = batch.input_ids.len();
        let h = self.spec.hidden_size;
        let pp = self.tp.pp;
        if pp.size > 1 && (!capture.is_empty() || !adds.after_layer.is_empty()) {
            return Err(ModelError::Batch(
                "hidden-state captures and residual additions need the whole model (no \
                 pipeline parallelism)"
                    .into(),
            ));
        }
        if adds.after_layer.len() > self.layers.len()
            || adds.rows.iter().any(|&r| r >= t)
            || adds
                .after_layer
                .iter()
                .any(|a| a.len() != adds.rows.len() * h)
        {
            return Err(ModelError::Batch(format!(
                "residual additions after {} layers at {} rows of {t}",
                adds.after_layer.len(),
                adds.rows.len()
            )));
        }
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
        if let Some(&Capture::AfterLayers(n)) = capture
            .iter()
            .find(|c| matches!(c, Capture::AfterLayers(n) if *n > self.layers.len()))
        {
            return Err(ModelError::Batch(format!(
                "cannot capture the state after {n} layers of {}",
                self.layers.len()
            )));
        }
        if let Ok(mut trace) = self.routing_trace.lock()
            && let Some(trace) = trace.as_mut()
        {
            trace.clear();
            trace.resize(t, f32::INFINITY);
        }
        let mut x = match embeds {
            Some(e) if e.len() == t * h => e.to_vec(),
            Some(e) => {
                return Err(ModelError::Batch(format!(
                    "{} input-embedding values for {t} tokens of width {h}",
                    e.len()
                )));
            }
            None if !self.spec.embed_and_head || !pp.is_first() => {
                return Err(ModelError::Batch(format!(
                    "{} takes input embeddings only (it has no token embedding)",
                    self.spec.architecture
                )));
            }
            None => {
                let mut x = vec![0.0; t * h];
                self.embed.embedding(&batch.input_ids, &mut x)?;
                x
            }
        };
        let mut out = ModelOutputs::default();
        let keep = |out: &mut ModelOutputs, what: Capture, x: &[f32]| {
            for c in capture.iter().filter(|c| **c == what) {
                out.hidden_states.push((
                    *c,
                    HostTensor {
                        shape: vec![t, h],
                        data: x.to_vec(),
                    },
                ));
            }
        };
        keep(&mut out, Capture::Embedding, &x);
        keep(&mut out, Capture::AfterLayers(0), &x);
        let mut s = Scratch::default();
        match (positions, &self.mrope) {
            (PositionInputs::Mrope(m), Some(layout)) => {
                let [a, b, c] = &m.rows;
                self.rope.cos_sin_mrope([a, b, c], layout, &mut s.cos_sin)?;
            }
            _ => self.rope.cos_sin(&batch.positions, &mut s.cos_sin),
        }
        let eps = self.spec.rms_norm_eps;
        for (local, (l, cache)) in self.layers.iter().zip(kv.iter_mut()).enumerate() {
            let i = self.layer_start + local;
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
            keep(&mut out, Capture::AfterLayers(i + 1), &x);
            if let Some(add) = adds.after_layer.get(i) {
                for (&r, a) in adds.rows.iter().zip(add.chunks_exact(h)) {
                    x[r * h..(r + 1) * h]
                        .iter_mut()
                        .zip(a)
                        .for_each(|(x, a)| *x += a);
                }
            }
        }
        if !pp.is_last() {
            // The next stage's input: the residual stream of every token.
            let end = self.layer_start + self.layers.len();
            out.hidden_states.push((
                Capture::AfterLayers(end),
                HostTensor {
                    shape: vec![t, h],
                    data: x,
                },
            ));
            return Ok(out);
        }
        let mut sel = Vec::with_capacity(rows.len() * h);
        for &r in &rows {
            sel.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        ops::rms_norm_inplace(&mut sel, &self.norm, h, eps)?;
        for c in capture.iter().filter(|c| **c == Capture::FinalNorm) {
            out.hidden_states.push((
                *c,
                HostTensor {
                    shape: vec![rows.len(), h],
                    data: sel.clone(),
                },
            ));
        }
        if self.spec.embed_and_head {
            let v = self.spec.vocab_size;
            let mut logits = vec![0.0; rows.len() * v];
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            head.matmul_nt_head(&sel, &mut logits, rows.len())?;
            out.logits = Some(HostTensor {
                shape: vec![rows.len(), v],
                data: logits,
            });
        }
        Ok(out)
    }
}

impl StageModel for DecoderModel {
    fn architecture(&self) -> &str {
        self.spec.architecture
    }

    fn stage(&self) -> ModelStage {
        ModelStage::CausalLm
    }

    fn kv_cache_spec(&self) -> Option<KvCacheSpec> {
        Some(CausalLm::kv_cache_spec(self))
    }

    fn forward(
        &self,
        inputs: &ModelInputs<'_>,
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        self.forward_with_adds(inputs, ResidualAdds::default(), kv)
    }
}

impl DecoderModel {
    /// [`StageModel::forward`] (without multimodal features: the caller merged them into
    /// `inputs.tokens`) with `adds` to the residual stream after the first layers.
    pub fn forward_with_adds(
        &self,
        inputs: &ModelInputs<'_>,
        adds: ResidualAdds<'_>,
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        if let Some(f) = inputs.mm_features.first() {
            return Err(ModelError::Batch(format!(
                "{} has no {} encoder",
                self.spec.architecture, f.modality
            )));
        }
        if let PositionInputs::Mrope(m) = inputs.positions
            && m.rows
                .iter()
                .any(|r| r.len() != inputs.batch.positions.len())
        {
            return Err(ModelError::Batch(format!(
                "M-RoPE rows of {:?} positions for {} tokens",
                m.rows.iter().map(Vec::len).collect::<Vec<_>>(),
                inputs.batch.positions.len()
            )));
        }
        if let PositionInputs::Mrope(m) = inputs.positions
            && self.mrope.is_none()
        {
            // Equal rows are 1-D RoPE; this decoder has no multi-section rotary embedding.
            let same = m.is_text_only()
                && m.rows[0].len() == inputs.batch.positions.len()
                && m.rows[0]
                    .iter()
                    .zip(&inputs.batch.positions)
                    .all(|(a, b)| usize::try_from(*a).ok() == Some(*b));
            if !same {
                return Err(ModelError::Batch(format!(
                    "{} has no M-RoPE: its positions must be one row equal to the batch's",
                    self.spec.architecture
                )));
            }
        }
        let embeds = match inputs.tokens {
            TokenInputs::Ids => None,
            TokenInputs::Embeds(e) => Some(e),
        };
        self.run(
            inputs.batch,
            embeds,
            inputs.positions,
            inputs.capture,
            adds,
            kv,
        )
    }
}
