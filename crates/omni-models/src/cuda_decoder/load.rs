//! Building a [`CudaDecoderModel`]: its rank's shard (and pipeline stage) from a weight source
//! on the host or as dummy weights made on the device, and the step buffers.

use std::collections::BTreeMap;
use std::sync::Arc;

use omni_backend::cuda::{CudaContext, DeviceAllReduce};
use omni_backend::rope::{MropeLayout, Rope};

use super::weights::{DummyMaker, Uploader};
use super::{CudaDecoderModel, DeviceWeightInit, StepLimits};
use crate::ModelError;
use crate::decoder::{DecoderSpec, Loader, PipelineStage, load_shaped};
use crate::weights::WeightSource;

impl CudaDecoderModel {
    /// Loads rank `rank` of `tp_size`'s shard onto `cx`'s device and allocates the step buffers
    /// for `limits`. `all_reduce` must be given (with `world_size() == tp_size`) when
    /// `tp_size > 1`. `on_layer(done, total)` is called after each layer.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        cx: Arc<CudaContext>,
        spec: DecoderSpec,
        ws: &dyn WeightSource,
        init: DeviceWeightInit,
        rank: usize,
        tp_size: usize,
        all_reduce: Option<Arc<dyn DeviceAllReduce>>,
        limits: StepLimits,
        on_layer: &dyn Fn(usize, usize),
    ) -> Result<Self, ModelError> {
        let whole = PipelineStage::default();
        Self::load_stage(
            cx, spec, ws, init, rank, tp_size, all_reduce, limits, whole, on_layer,
        )
    }

    /// [`CudaDecoderModel::load`] of one pipeline stage: only the layers of `stage` (vLLM's
    /// split, [`PipelineStage::layers`]), the embedding on the first stage, the final norm and
    /// the head on the last. A stage after the first starts from the previous stage's residual
    /// stream and a stage before the last ends with its own
    /// ([`CudaDecoderModel::forward_stage`]).
    #[allow(clippy::too_many_arguments)]
    pub fn load_stage(
        cx: Arc<CudaContext>,
        spec: DecoderSpec,
        ws: &dyn WeightSource,
        init: DeviceWeightInit,
        rank: usize,
        tp_size: usize,
        all_reduce: Option<Arc<dyn DeviceAllReduce>>,
        limits: StepLimits,
        stage: PipelineStage,
        on_layer: &dyn Fn(usize, usize),
    ) -> Result<Self, ModelError> {
        let heads = spec.head_layout(rank, tp_size)?;
        match (&all_reduce, tp_size) {
            (_, 1) => {}
            (Some(ar), n) if ar.world_size() == n => {}
            (ar, n) => {
                return Err(ModelError::TensorParallel(format!(
                    "tp_size {n} needs an all-reduce group of {n} ranks, got {:?}",
                    ar.as_ref().map(|a| a.world_size())
                )));
            }
        }
        let (v, h) = (spec.vocab_size, spec.hidden_size);
        let range = stage.layers(spec.num_layers);
        if range.is_empty() {
            return Err(ModelError::TensorParallel(format!(
                "pipeline stage {} of {} gets none of the {} layers",
                stage.rank, stage.size, spec.num_layers
            )));
        }
        let total = range.len();
        // The first stage embeds; the last runs the head, from the embedding table when tied.
        let tied = spec.tie_word_embeddings;
        let want_embed = spec.embed_and_head && (stage.is_first() || (stage.is_last() && tied));
        let want_head = spec.embed_and_head && stage.is_last() && !tied;
        let (embed, lm_head, norm, layers) = match init {
            DeviceWeightInit::Host => {
                let up = Uploader { cx: &cx };
                let embed = if want_embed {
                    Some(up.upload(&load_shaped(ws, "model.embed_tokens.weight", &[v, h])?.data)?)
                } else {
                    None
                };
                let lm_head = if want_head {
                    Some(up.upload(&load_shaped(ws, "lm_head.weight", &[v, h])?.data)?)
                } else {
                    None
                };
                let loader = Loader::new(ws, &spec, rank, tp_size)?;
                let norm = up.upload(&loader.vector("model.norm.weight", h)?)?;
                let mut layers = Vec::with_capacity(total);
                for (done, i) in range.clone().enumerate() {
                    layers.push(up.layer(&loader.layer(i)?)?);
                    on_layer(done + 1, total);
                }
                (embed, lm_head, norm, layers)
            }
            DeviceWeightInit::Dummy { seed } => {
                // Each tensor's seed depends on its place in the whole model, not in the stage,
                // so a split model holds the same dummy weights as a whole one.
                let mut mk = DummyMaker {
                    cx: &cx,
                    seed,
                    next: 0,
                };
                let embed = if want_embed {
                    mk.at(DummyMaker::EMBED);
                    Some(mk.weight(v * h)?)
                } else {
                    None
                };
                let lm_head = if want_head {
                    mk.at(DummyMaker::LM_HEAD);
                    Some(mk.weight(v * h)?)
                } else {
                    None
                };
                mk.at(DummyMaker::NORM);
                let norm = mk.ones(h)?;
                let mut layers = Vec::with_capacity(total);
                for (done, i) in range.clone().enumerate() {
                    mk.at(DummyMaker::layer_base(i));
                    layers.push(mk.layer(&spec, &heads, tp_size, i)?);
                    on_layer(done + 1, total);
                }
                (embed, lm_head, norm, layers)
            }
        };
        let rope = Rope::new(spec.head_dim, spec.rope_theta, &spec.rope_scaling)?;
        let inv_freq = cx.stream().clone_htod(rope.inv_freq())?;
        let mrope_axes = match spec.mrope {
            Some(m) => {
                let layout = MropeLayout::new(spec.head_dim, m.section, m.interleaved)?;
                Some(cx.stream().clone_htod(layout.axes())?)
            }
            None => None,
        };
        let (inputs, act) = Self::alloc_step_buffers(&cx, &spec, &heads, &layers, limits)?;
        let profiler = None;
        cx.synchronize()?;
        tracing::info!(
            architecture = spec.architecture,
            layers = spec.num_layers,
            tp_rank = rank,
            tp_size,
            pp_rank = stage.rank,
            pp_size = stage.size,
            first_layer = range.start,
            stage_layers = total,
            device = %cx.info().name,
            "model loaded on the GPU"
        );
        Ok(Self {
            cx,
            spec,
            heads,
            rank,
            all_reduce,
            stage,
            embed,
            lm_head,
            norm,
            layers,
            first_layer: range.start,
            inv_freq,
            mrope_axes,
            residual_adds: None,
            limits,
            inputs,
            act,
            kv: Vec::new(),
            num_blocks: 0,
            graphs: BTreeMap::new(),
            embed_graphs: BTreeMap::new(),
            last_rows: 0,
            last_tokens: 0,
            capture: None,
            profiler,
            small_batch_gemv: false,
            fused_small_batch: true,
            small_moe_tokens: super::DEFAULT_SMALL_MOE_TOKENS,
            l2_prefetch_tokens: super::DEFAULT_L2_PREFETCH_TOKENS,
            l2_prefetch_qkv_early: false,
            moe_w2_prefetch: false,
            moe_one_launch: super::DEFAULT_MOE_ONE_LAUNCH,
        })
    }
}
