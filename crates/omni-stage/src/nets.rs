//! The networks a stage drives, on whichever device its spec names: the CPU reference networks
//! here, the CUDA ones in `crate::cuda` (feature `cuda`).

use omni_models::qwen3_omni::code2wav::Code2Wav;
use omni_models::qwen3_omni::thinker::Thinker;
use omni_models::{
    EncoderOutput, ForwardBatch, LayerKvCache, ModelError, ModelInputs, MropePositions,
    MultiModalFeature, MultiModalKind, PositionInputs, StageModel, TokenInputs,
};

/// What one Thinker step gives back on the host (its logits stay where they were computed
/// until [`ThinkerNet::logits_host`] or [`ThinkerNet::sample_on_device`]).
#[derive(Debug, Default)]
pub struct ThinkerStep {
    /// With exports: layer 0's input and the accept-layer residual of every computed token,
    /// `[tokens, hidden]` each.
    pub exports: Option<(Vec<f32>, Vec<f32>)>,
}

/// A Thinker step's multimodal side: M-RoPE rows (`None`: the batch's 1-D positions) and the
/// items whose placeholder rows the step computes, with their encoder outputs (one each).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepMm<'a> {
    /// The three position rows of the step's tokens.
    pub positions: Option<&'a MropePositions>,
    /// The items, placed at batch rows.
    pub features: &'a [MultiModalFeature<'a>],
    /// Their encoder outputs.
    pub encoded: &'a [&'a EncoderOutput],
}

/// The Thinker on some device, with its KV cache.
pub trait ThinkerNet: Send + std::fmt::Debug {
    /// Width of the exported rows.
    fn hidden_size(&self) -> usize;
    /// Logits row width.
    fn vocab_size(&self) -> usize;
    /// `tts_bos`, `tts_eos`, `tts_pad` embeddings, `[3, hidden]`.
    fn tts_rows(&self) -> &[f32];
    /// Whether it exports the Talker's states (false for a text LLM: a stage after it takes
    /// text).
    fn exports_states(&self) -> bool {
        true
    }
    /// One step over token ids (with `mm`'s positions and encoder rows); `export` asks for the
    /// two Talker states of every token.
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        export: bool,
        mm: StepMm<'_>,
    ) -> Result<ThinkerStep, ModelError>;
    /// The M-RoPE rows of a whole prompt with its items and the decode delta.
    fn mrope_positions(
        &self,
        ids: &[u32],
        items: &[MultiModalKind],
    ) -> Result<(MropePositions, i64), ModelError>;
    /// Runs the encoder tower of one item.
    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, ModelError>;
    /// The last step's logits of its output rows, `[rows, vocab]`, on the host.
    fn logits_host(&mut self) -> Result<Vec<f32>, ModelError>;
    /// One token per output row of the last step, sampled where the logits are (`None`: no
    /// device sampler; the host samples).
    fn sample_on_device(
        &mut self,
        _rows: &[omni_worker::DeviceSample],
    ) -> Result<Option<Vec<u32>>, ModelError> {
        Ok(None)
    }
}

/// The CPU Thinker (f32) and its host KV cache.
#[derive(Debug)]
pub struct CpuThinker {
    thinker: Thinker,
    kv: Vec<LayerKvCache>,
    tts: Vec<f32>,
    logits: Vec<f32>,
}

impl CpuThinker {
    /// Wraps a loaded Thinker with `num_blocks` KV blocks of `block_size`.
    pub fn new(thinker: Thinker, num_blocks: usize, block_size: usize) -> Result<Self, ModelError> {
        let kv = StageModel::kv_cache_spec(&thinker)
            .ok_or_else(|| ModelError::Config("the Thinker has no KV cache".into()))?
            .allocate(num_blocks, block_size);
        let t = thinker.tts_embeddings();
        let tts = [&t.bos, &t.eos, &t.pad]
            .iter()
            .flat_map(|r| r.iter().copied())
            .collect();
        Ok(Self {
            thinker,
            kv,
            tts,
            logits: Vec::new(),
        })
    }
}

impl ThinkerNet for CpuThinker {
    fn hidden_size(&self) -> usize {
        self.thinker.config().thinker_config.text_config.hidden_size
    }

    fn vocab_size(&self) -> usize {
        self.thinker.config().thinker_config.text_config.vocab_size
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
        let capture = self.thinker.exports();
        let inputs = ModelInputs {
            batch,
            tokens: TokenInputs::Ids,
            positions: mm
                .positions
                .map_or(PositionInputs::Batch, PositionInputs::Mrope),
            mm_features: mm.features,
            capture: if export { &capture } else { &[] },
        };
        let out = self
            .thinker
            .forward_encoded(&inputs, mm.encoded, &mut self.kv)?;
        let mut states = out.hidden_states;
        let mut take = |c| {
            states
                .iter()
                .position(|(k, _)| *k == c)
                .map(|i| states.swap_remove(i).1.data)
        };
        let exports = match (take(capture[0]), take(capture[1])) {
            (Some(e), Some(h)) if export => Some((e, h)),
            _ => None,
        };
        self.logits = out.logits.map(|t| t.data).unwrap_or_default();
        Ok(ThinkerStep { exports })
    }

    fn logits_host(&mut self) -> Result<Vec<f32>, ModelError> {
        Ok(std::mem::take(&mut self.logits))
    }

    fn mrope_positions(
        &self,
        ids: &[u32],
        items: &[MultiModalKind],
    ) -> Result<(MropePositions, i64), ModelError> {
        self.thinker.mm().mrope_positions(ids, items)
    }

    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, ModelError> {
        self.thinker.mm().encode(feature)
    }
}

/// Code2Wav on some device.
pub trait Code2WavNet: Send + std::fmt::Debug {
    /// Codebooks per frame.
    fn num_quantizers(&self) -> usize;
    /// Decodes windows `(codes [q, T], T, left_context)` together; each trimmed to its new audio.
    fn decode_windows(
        &mut self,
        windows: &[(&[u32], usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ModelError>;
}

impl Code2WavNet for Code2Wav {
    fn num_quantizers(&self) -> usize {
        self.config().num_quantizers
    }

    fn decode_windows(
        &mut self,
        windows: &[(&[u32], usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        Code2Wav::decode_windows(self, windows)
    }
}

/// How one row's residual codes are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CodeDraw {
    /// Argmax (a greedy Talker makes the code predictor greedy, as transformers does).
    pub greedy: bool,
    /// The request's stream.
    pub seed: u64,
    /// Frames done (the draw's counter).
    pub frame: u64,
}

/// The Talker (decoder and code predictor) on some device, with its KV cache.
pub trait TalkerNet: Send + std::fmt::Debug {
    /// Its config.
    fn config(&self) -> &omni_models::qwen3_omni::config::OmniConfig;
    /// The Talker's width.
    fn hidden_size(&self) -> usize;
    /// Builds prompts (on the host).
    fn prompts(&self) -> &omni_models::qwen3_omni::talker::PromptBuilder;
    /// Runs a projection of Thinker states (`[rows, thinker_hidden]`): on the host unless the
    /// network has a device copy.
    fn project(
        &mut self,
        which: omni_models::qwen3_omni::talker::Projection,
        x: &[f32],
    ) -> Result<Vec<f32>, ModelError> {
        self.prompts().projection(which).forward(x)
    }
    /// Builds a request's prompt, its projections through [`TalkerNet::project`].
    fn build_prompt(
        &mut self,
        ex: &omni_models::qwen3_omni::talker::ThinkerExports<'_>,
        speaker: u32,
    ) -> Result<omni_models::qwen3_omni::talker::TalkerPrompt, ModelError> {
        self.prompts().build(ex, speaker)
    }
    /// One Talker step over input embeddings `[tokens, hidden]`: the codec logits of the
    /// batch's output rows, `[rows, vocab]`.
    fn forward(&mut self, batch: &ForwardBatch, embeds: &[f32]) -> Result<Vec<f32>, ModelError>;
    /// Completes one frame for every output row of the last step, in order, from its layer-0
    /// code `c0[r]`: the frames `[rows, groups]` and the sums of their codec embeddings
    /// `[rows, hidden]` (the next step's input before its text vector).
    fn predict(
        &mut self,
        c0: &[u32],
        draws: &[CodeDraw],
    ) -> Result<(Vec<u32>, Vec<f32>), ModelError>;
}

/// The code predictor's own sampling when the Talker samples (transformers' defaults).
pub const CP_TOP_K: usize = 50;
/// See [`CP_TOP_K`].
pub const CP_TOP_P: f32 = 0.8;

/// The CPU Talker (f32) and its host KV cache.
#[derive(Debug)]
pub struct CpuTalker {
    talker: omni_models::qwen3_omni::talker::Talker,
    kv: Vec<LayerKvCache>,
    /// Final-norm states of the last step's output rows.
    last: Vec<f32>,
}

impl CpuTalker {
    /// Wraps a loaded Talker with `num_blocks` KV blocks of `block_size`.
    pub fn new(
        talker: omni_models::qwen3_omni::talker::Talker,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, ModelError> {
        let kv = StageModel::kv_cache_spec(&talker)
            .ok_or_else(|| ModelError::Config("the Talker has no KV cache".into()))?
            .allocate(num_blocks, block_size);
        Ok(Self {
            talker,
            kv,
            last: Vec::new(),
        })
    }
}

impl TalkerNet for CpuTalker {
    fn config(&self) -> &omni_models::qwen3_omni::config::OmniConfig {
        self.talker.config()
    }

    fn hidden_size(&self) -> usize {
        self.talker.hidden_size()
    }

    fn prompts(&self) -> &omni_models::qwen3_omni::talker::PromptBuilder {
        self.talker.prompt_builder()
    }

    fn forward(&mut self, batch: &ForwardBatch, embeds: &[f32]) -> Result<Vec<f32>, ModelError> {
        let inputs = ModelInputs {
            batch,
            tokens: TokenInputs::Embeds(embeds),
            positions: PositionInputs::Batch,
            mm_features: &[],
            capture: &[omni_models::Capture::FinalNorm],
        };
        let out = StageModel::forward(&self.talker, &inputs, &mut self.kv)?;
        let h = self.talker.hidden_size();
        let rows = batch.output_rows();
        let states = out
            .hidden_states
            .into_iter()
            .find(|(k, _)| *k == omni_models::Capture::FinalNorm)
            .map(|(_, t)| t.data)
            .ok_or_else(|| ModelError::Batch("the Talker returned no final-norm state".into()))?;
        // The capture holds the output rows, or every row of the batch.
        self.last = if states.len() == rows.len() * h {
            states
        } else {
            rows.iter()
                .flat_map(|&r| states[r * h..(r + 1) * h].iter().copied())
                .collect()
        };
        Ok(out.logits.map(|t| t.data).unwrap_or_default())
    }

    fn predict(
        &mut self,
        c0: &[u32],
        draws: &[CodeDraw],
    ) -> Result<(Vec<u32>, Vec<f32>), ModelError> {
        use omni_models::qwen3_omni::talker::sampling::{argmax, talker_uniform, top_k_top_p};
        if c0.len() * self.talker.hidden_size() != self.last.len() || draws.len() != c0.len() {
            return Err(ModelError::Batch(format!(
                "{} layer-0 codes and {} draws for {} output rows",
                c0.len(),
                draws.len(),
                self.last.len() / self.talker.hidden_size().max(1)
            )));
        }
        let embed = self.talker.embed_codec(c0)?;
        let groups = self.talker.config().talker_config.num_code_groups as u64;
        let mut choose = |row: usize, group: usize, l: &mut [f32]| {
            let d = draws[row];
            if d.greedy {
                argmax(l)
            } else {
                let u = talker_uniform(d.seed, d.frame * groups + group as u64);
                top_k_top_p(l, CP_TOP_K, CP_TOP_P, u)
            }
        };
        let f = self
            .talker
            .code_predictor()
            .predict(&self.last, c0, &embed, &mut choose)?;
        Ok((f.codes, f.codec_sum))
    }
}
