//! A text LLM as a pipeline's first stage (the built-in SmolLM2 before the TTS stage): any
//! model an engine worker serves, as omni-worker's [`StepModel`] with its KV cache, behind the
//! Thinker stage's [`ThinkerNet`]. It exports no hidden states: what follows it takes text.

use omni_models::{
    EncoderOutput, ForwardBatch, ModelError, MropePositions, MultiModalFeature, MultiModalKind,
    TpContext,
};
use omni_protocol::{Device, LoadFormat, LoadModelSpec, StageSpec};
use omni_worker::{CpuStepModel, DeviceSample, StepModel};

use crate::StageError;
use crate::nets::{StepMm, ThinkerNet, ThinkerStep};

/// See the module docs.
#[derive(Debug)]
pub struct TextNet {
    model: Box<dyn StepModel>,
}

fn model_error(e: omni_worker::WorkerError) -> ModelError {
    ModelError::Batch(e.to_string())
}

impl TextNet {
    /// Loads `spec.model` (a GGUF file or a HF directory of a text decoder) on the CPU with
    /// `spec.num_blocks` KV blocks.
    pub fn load(spec: &StageSpec) -> Result<Self, StageError> {
        if spec.device != Device::Cpu {
            return Err(StageError::Config(format!(
                "a text LLM as an omni stage runs on the CPU only (stage {} asks for {:?})",
                spec.stage_id, spec.device
            )));
        }
        let load = LoadModelSpec {
            model: spec.model.clone(),
            load_format: match spec.load_format {
                LoadFormat::Safetensors => LoadFormat::Auto,
                f => f,
            },
            max_model_len: spec.max_model_len,
            block_size: spec.block_size,
            seed: spec.seed,
            device: Device::Cpu,
            max_num_batched_tokens: spec.max_num_batched_tokens,
            max_num_seqs: spec.max_num_seqs,
            ..LoadModelSpec::default()
        };
        let lm = omni_worker::load_model(&load, TpContext::single())
            .map_err(|e| StageError::Model(format!("loading {}: {e}", spec.model)))?;
        let mut model = CpuStepModel::new(lm, u64::MAX);
        model
            .init_cache(spec.num_blocks as usize, spec.block_size as usize)
            .map_err(|e| StageError::Model(e.to_string()))?;
        Ok(Self {
            model: Box::new(model),
        })
    }
}

impl ThinkerNet for TextNet {
    fn hidden_size(&self) -> usize {
        0
    }

    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn tts_rows(&self) -> &[f32] {
        &[]
    }

    fn exports_states(&self) -> bool {
        false
    }

    fn forward(
        &mut self,
        batch: &ForwardBatch,
        _export: bool,
        mm: StepMm<'_>,
    ) -> Result<ThinkerStep, ModelError> {
        if !mm.features.is_empty() || mm.positions.is_some() {
            return Err(ModelError::Batch(format!(
                "{} takes text only",
                self.model.architecture()
            )));
        }
        self.model.forward(batch).map_err(model_error)?;
        Ok(ThinkerStep::default())
    }

    fn mrope_positions(
        &self,
        _ids: &[u32],
        _items: &[MultiModalKind],
    ) -> Result<(MropePositions, i64), ModelError> {
        Err(ModelError::Batch(format!(
            "{} takes no images or audio",
            self.model.architecture()
        )))
    }

    fn encode_mm(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, ModelError> {
        Err(ModelError::Batch(format!(
            "{} takes no {} input",
            self.model.architecture(),
            feature.modality
        )))
    }

    fn logits_host(&mut self) -> Result<Vec<f32>, ModelError> {
        self.model.logits_host().map_err(model_error)
    }

    fn sample_on_device(&mut self, rows: &[DeviceSample]) -> Result<Option<Vec<u32>>, ModelError> {
        self.model.sample_on_device(rows).map_err(model_error)
    }
}
