//! The stages' networks on a CUDA device (bf16 weights and activations, f32 accumulation):
//! the Thinker as omni-models' `CudaDecoderModel` over the checkpoint's `thinker.` tensors with
//! its accept-layer capture and decode graphs, Code2Wav as `CudaCode2Wav` with its window
//! graphs. Steps are driven from the host: logits and exports come back each step and the
//! Thinker samples on the host.
//!
//! Memory: each stage process takes `gpu_memory_utilization` of the device counted over what
//! it allocates itself (several stages share one GPU), so its KV cache gets that share less its
//! weights and buffers.

use std::path::Path;
use std::sync::Arc;

use omni_backend::cuda::CudaContext;
use omni_models::cuda_code2wav::{CudaCode2Wav, FRAME_BUCKETS};
use omni_models::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, StepLimits};
use omni_models::cuda_encoders::{DeviceTowers, TowerWeights};
use omni_models::qwen3_omni::config::OmniConfig;
use omni_models::qwen3_omni::thinker_mm::ThinkerMm;
use omni_models::registry::{causal_lm_weights, decoder_spec, dummy_weights};
use omni_models::{
    EncoderOutput, ForwardBatch, ModelError, MropePositions, MultiModalFeature, MultiModalKind,
    WeightSource,
};
use omni_protocol::{LoadFormat, StageSpec};
use omni_worker::cuda_model::decode_graph_sizes;
use serde_json::Value;

use crate::StageError;
use crate::nets::{
    CP_TOP_K, CP_TOP_P, Code2WavNet, CodeDraw, StepMm, TalkerNet, ThinkerNet, ThinkerStep,
};

/// Device memory kept free for CUDA graphs and the allocator's slack, per stage process.
const RESERVE_BYTES: u64 = 512 << 20;

fn dev_err(e: impl std::fmt::Display) -> StageError {
    StageError::Model(format!("cuda: {e}"))
}

/// The device's free memory and total (bytes).
fn mem_info(cx: &CudaContext) -> Result<(u64, u64), StageError> {
    cx.synchronize().map_err(dev_err)?;
    let (free, total) = cx.raw().mem_get_info().map_err(dev_err)?;
    Ok((free as u64, total as u64))
}

/// The weights a stage loads: real ones read on the host, or random ones made on the device.
fn weights(
    config: &Value,
    dir: &Path,
    spec: &StageSpec,
) -> Result<(DeviceWeightInit, Box<dyn WeightSource>), StageError> {
    Ok(match spec.load_format {
        LoadFormat::Dummy => (
            DeviceWeightInit::Dummy { seed: spec.seed },
            Box::new(dummy_weights(config, spec.seed)?),
        ),
        _ => (
            DeviceWeightInit::Host,
            Box::new(
                omni_models::hf_dir::SafetensorsDir::open(dir)
                    .map_err(|e| StageError::Model(format!("opening {}: {e}", dir.display())))?,
            ),
        ),
    })
}

/// The KV blocks a stage's share leaves after what it allocated since `free0` (at most
/// `cap`).
fn kv_blocks(
    cx: &CudaContext,
    free0: u64,
    spec: &StageSpec,
    per_block: u64,
    what: &str,
) -> Result<u64, StageError> {
    let (free1, total) = mem_info(cx)?;
    let mine = free0.saturating_sub(free1);
    let budget = (total as f64 * f64::from(spec.gpu_memory_utilization)) as u64;
    let kv = budget.saturating_sub(mine).saturating_sub(RESERVE_BYTES);
    let blocks = (kv / per_block.max(1)).min(u64::from(spec.num_blocks));
    if blocks == 0 {
        return Err(StageError::Config(format!(
            "the {what}'s share {} of {total} bytes leaves no KV cache after its {mine} bytes \
             of weights and buffers",
            spec.gpu_memory_utilization
        )));
    }
    tracing::info!(
        blocks,
        weights_and_buffers = mine,
        "{what} on cuda:{}",
        spec.device_ordinal
    );
    Ok(blocks)
}

/// The Thinker on one GPU.
#[derive(Debug)]
pub struct CudaThinker {
    model: CudaDecoderModel,
    /// Placeholders and M-RoPE prompt settings.
    mm: ThinkerMm,
    /// The encoder towers on this device, when the checkpoint has them.
    towers: Option<DeviceTowers>,
    /// `[max_num_seqs]` the device sampler's tokens.
    sampled: omni_backend::cuda::cudarc::driver::CudaSlice<i32>,
    tts: Vec<f32>,
    hidden: usize,
    vocab: usize,
}

impl CudaThinker {
    /// Loads it on `spec.device_ordinal`, sizes its KV cache from its memory share (at most
    /// `spec.num_blocks`) and captures its decode graphs unless `enforce_eager`. Returns it
    /// with the KV blocks it got.
    pub fn load(config: &Value, dir: &Path, spec: &StageSpec) -> Result<(Self, u32), StageError> {
        let cx = Arc::new(CudaContext::new(spec.device_ordinal as usize).map_err(dev_err)?);
        let (free0, _) = mem_info(&cx)?;
        let omni = OmniConfig::from_json(config)?;
        let dspec = decoder_spec(config)?;
        let (hidden, vocab) = (dspec.hidden_size, dspec.vocab_size);
        let (init, ws) = weights(config, dir, spec)?;
        let view = causal_lm_weights(config, ws.as_ref())?;
        let tower_weights = match init {
            DeviceWeightInit::Dummy { seed } => TowerWeights::Dummy { seed },
            DeviceWeightInit::Host => TowerWeights::Checkpoint(ws.as_ref()),
        };
        let towers = DeviceTowers::load(cx.clone(), config, tower_weights)?;
        let towers = (!towers.is_empty()).then_some(towers);
        let mm = ThinkerMm::load(config, None)?;
        let block = spec.block_size as usize;
        let limits = StepLimits {
            max_tokens: spec.max_num_batched_tokens.max(1) as usize,
            max_seqs: spec.max_num_seqs.max(1) as usize,
            max_model_len: spec.max_model_len.max(1) as usize,
            block_size: block,
        };
        let mut model = CudaDecoderModel::load(
            cx.clone(),
            dspec,
            &view,
            init,
            0,
            1,
            None,
            limits,
            &|_, _| {},
        )?;
        model.set_capture_after_layers(Some(omni.talker_config.accept_hidden_layer))?;
        let blocks = kv_blocks(&cx, free0, spec, model.kv_bytes_per_block(block), "Thinker")?;
        model.init_cache(blocks as usize, block)?;
        if spec.cuda_profile_steps > 0 {
            model.enable_profiler_named(u64::from(spec.cuda_profile_steps), "thinker");
        } else if !spec.enforce_eager {
            model.capture_decode_graphs(&decode_graph_sizes(limits.max_seqs))?;
        }
        let ids = &omni.ids;
        let tts = model.embedding_rows(&[
            ids.tts_bos_token_id,
            ids.tts_eos_token_id,
            ids.tts_pad_token_id,
        ])?;
        let sampled = cx
            .stream()
            .alloc_zeros::<i32>(limits.max_seqs)
            .map_err(dev_err)?;
        Ok((
            Self {
                model,
                mm,
                towers,
                sampled,
                tts,
                hidden,
                vocab,
            },
            blocks as u32,
        ))
    }
}

impl ThinkerNet for CudaThinker {
    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn tts_rows(&self) -> &[f32] {
        &self.tts
    }

    fn forward(
        &mut self,
        batch: &ForwardBatch,
        export: bool,
        mm: StepMm<'_>,
    ) -> Result<ThinkerStep, ModelError> {
        if mm.positions.is_none() && mm.features.is_empty() {
            self.model.forward(batch)?;
        } else {
            let plan = self.mm.plan(
                batch.input_ids.len(),
                self.hidden,
                Some(&batch.input_ids),
                mm.features,
                mm.encoded,
            )?;
            self.model.forward_merged(batch, mm.positions, &plan)?;
        }
        let exports = if export {
            let (embed, after) = self.model.captured_to_host()?;
            let after = after.ok_or_else(|| {
                ModelError::Batch("the Thinker's accept-layer capture is off".into())
            })?;
            Some((embed, after))
        } else {
            None
        };
        Ok(ThinkerStep { exports })
    }

    fn logits_host(&mut self) -> Result<Vec<f32>, ModelError> {
        self.model.logits_to_host()
    }

    fn mrope_positions(
        &self,
        ids: &[u32],
        items: &[MultiModalKind],
    ) -> Result<(MropePositions, i64), ModelError> {
        self.mm.mrope_positions(ids, items)
    }

    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, ModelError> {
        self.towers
            .as_ref()
            .ok_or_else(|| {
                ModelError::Batch(format!(
                    "this Qwen3-Omni checkpoint has no {} tower",
                    feature.modality
                ))
            })?
            .encode(feature)
    }

    /// The text engine's device sampler (omni-worker's `sample_rows`).
    fn sample_on_device(
        &mut self,
        rows: &[omni_worker::DeviceSample],
    ) -> Result<Option<Vec<u32>>, ModelError> {
        omni_worker::cuda_model::sample_rows(&self.model, &mut self.sampled, rows)
            .map(Some)
            .map_err(|e| ModelError::Device(e.to_string()))
    }
}

/// Code2Wav on one GPU.
#[derive(Debug)]
pub struct CudaCode2WavNet {
    model: CudaCode2Wav,
}

impl CudaCode2WavNet {
    /// Loads it with buffers for `spec.max_num_batched_tokens` frames a batch and captures
    /// its window graphs (batches 1, 2, 4, ... up to `max_num_seqs`, vLLM-Omni's frame
    /// buckets) unless `enforce_eager`.
    pub fn load(config: &Value, dir: &Path, spec: &StageSpec) -> Result<Self, StageError> {
        let cx = Arc::new(CudaContext::new(spec.device_ordinal as usize).map_err(dev_err)?);
        let (init, ws) = weights(config, dir, spec)?;
        let dummy = matches!(init, DeviceWeightInit::Dummy { .. });
        // Dummy weights of the real shapes through the same fan-in scaling the bench uses,
        // so the waveform stays finite.
        let ws: Box<dyn WeightSource> = if dummy {
            Box::new(omni_models::qwen3_omni::code2wav::FanInScaled(
                dummy_weights(config, spec.seed)?,
            ))
        } else {
            ws
        };
        let frames = crate::code2wav::frames_per_batch(spec);
        let mut model = CudaCode2Wav::load(cx, config, ws.as_ref(), frames)?;
        tracing::info!(
            frames,
            buffer_bytes = model.buffer_bytes(),
            "Code2Wav on cuda:{}",
            spec.device_ordinal
        );
        if spec.enforce_eager {
            model.set_graphs(false);
        } else {
            let batches = decode_graph_sizes(spec.max_num_seqs.max(1) as usize);
            model.capture_graphs(&batches, &FRAME_BUCKETS)?;
        }
        Ok(Self { model })
    }
}

impl Code2WavNet for CudaCode2WavNet {
    fn num_quantizers(&self) -> usize {
        self.model.config().num_quantizers
    }

    fn decode_windows(
        &mut self,
        windows: &[(&[u32], usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.model.decode_windows(windows)
    }
}

/// The Talker and its code predictor on one GPU (omni-models' `CudaTalker`): each step the
/// host uploads the input embeddings, reads the codec logits back, chooses layer 0 and hands
/// the codes down for the code predictor's frame graph; prompts are assembled on the host
/// from projections run on the device.
#[derive(Debug)]
pub struct CudaTalkerNet {
    talker: omni_models::cuda_talker::CudaTalker,
    prompts: omni_models::qwen3_omni::talker::PromptBuilder,
    config: OmniConfig,
    text_projection: crate::cuda_mlp::DeviceResizeMlp,
    hidden_projection: crate::cuda_mlp::DeviceResizeMlp,
}

impl CudaTalkerNet {
    /// Loads it on `spec.device_ordinal` with the small-batch GEMVs on, sizes its KV cache
    /// from its share and captures its decode and frame graphs unless `enforce_eager`.
    /// Returns it with its KV blocks.
    pub fn load(config: &Value, dir: &Path, spec: &StageSpec) -> Result<(Self, u32), StageError> {
        let cx = Arc::new(CudaContext::new(spec.device_ordinal as usize).map_err(dev_err)?);
        let (free0, _) = mem_info(&cx)?;
        let omni = OmniConfig::from_json(config)?;
        let (init, ws) = weights(config, dir, spec)?;
        let block = spec.block_size as usize;
        let limits = StepLimits {
            max_tokens: spec.max_num_batched_tokens.max(1) as usize,
            max_seqs: spec.max_num_seqs.max(1) as usize,
            max_model_len: spec.max_model_len.max(1) as usize,
            block_size: block,
        };
        let mut talker = omni_models::cuda_talker::CudaTalker::load(
            cx.clone(),
            config,
            ws.as_ref(),
            init,
            limits,
        )?;
        talker.set_small_batch_gemv(true);
        let prompts =
            omni_models::qwen3_omni::talker::PromptBuilder::load(&omni, ws.as_ref(), &|ids| {
                talker.talker().embedding_rows(ids)
            })?;
        let per_block = talker.talker().kv_bytes_per_block(block);
        let blocks = kv_blocks(&cx, free0, spec, per_block, "Talker")?;
        talker.init_cache(blocks as usize, block)?;
        if spec.cuda_profile_steps > 0 {
            talker.enable_profiler(u64::from(spec.cuda_profile_steps));
        } else if !spec.enforce_eager {
            talker.capture_graphs(&decode_graph_sizes(limits.max_seqs))?;
        }
        use omni_models::qwen3_omni::talker::Projection;
        let text_projection = crate::cuda_mlp::DeviceResizeMlp::upload(
            cx.clone(),
            prompts.projection(Projection::Text),
        )?;
        let hidden_projection = crate::cuda_mlp::DeviceResizeMlp::upload(
            cx.clone(),
            prompts.projection(Projection::Hidden),
        )?;
        let rel = [
            (&text_projection, Projection::Text),
            (&hidden_projection, Projection::Hidden),
        ]
        .into_iter()
        .map(|(d, w)| d.check_against(prompts.projection(w), 5e-2))
        .try_fold(0f32, |m, r| r.map(|r| m.max(r)))?;
        tracing::info!(
            rel_err = rel,
            "Talker projections on the device, checked against the host"
        );
        Ok((
            Self {
                talker,
                prompts,
                config: omni,
                text_projection,
                hidden_projection,
            },
            blocks as u32,
        ))
    }
}

impl CudaTalkerNet {
    /// The device copy of projection `which`.
    fn device_projection(
        &self,
        which: omni_models::qwen3_omni::talker::Projection,
    ) -> &crate::cuda_mlp::DeviceResizeMlp {
        use omni_models::qwen3_omni::talker::Projection;
        match which {
            Projection::Text => &self.text_projection,
            Projection::Hidden => &self.hidden_projection,
        }
    }
}

impl TalkerNet for CudaTalkerNet {
    fn config(&self) -> &OmniConfig {
        &self.config
    }

    fn hidden_size(&self) -> usize {
        self.talker.hidden_size()
    }

    fn prompts(&self) -> &omni_models::qwen3_omni::talker::PromptBuilder {
        &self.prompts
    }

    fn project(
        &mut self,
        which: omni_models::qwen3_omni::talker::Projection,
        x: &[f32],
    ) -> Result<Vec<f32>, ModelError> {
        self.device_projection(which).forward(x)
    }

    fn build_prompt(
        &mut self,
        ex: &omni_models::qwen3_omni::talker::ThinkerExports<'_>,
        speaker: u32,
    ) -> Result<omni_models::qwen3_omni::talker::TalkerPrompt, ModelError> {
        let this = &*self;
        this.prompts.build_with(ex, speaker, &mut |which, x| {
            this.device_projection(which).forward(x)
        })
    }

    fn forward(&mut self, batch: &ForwardBatch, embeds: &[f32]) -> Result<Vec<f32>, ModelError> {
        self.talker.talker_mut().forward_embeds(batch, embeds)?;
        self.talker.talker().logits_to_host()
    }

    fn predict(
        &mut self,
        c0: &[u32],
        draws: &[CodeDraw],
    ) -> Result<(Vec<u32>, Vec<f32>), ModelError> {
        use omni_backend::cuda::CodeSampling;
        let sampling: Vec<CodeSampling> = draws
            .iter()
            .map(|d| {
                if d.greedy {
                    CodeSampling::greedy()
                } else {
                    CodeSampling {
                        temperature: 1.0,
                        top_k: CP_TOP_K as i32,
                        top_p: CP_TOP_P,
                        seed: d.seed,
                    }
                }
            })
            .collect();
        let frames: Vec<u64> = draws.iter().map(|d| d.frame).collect();
        self.talker.predict_frames(c0, &sampling, &frames)
    }
}
