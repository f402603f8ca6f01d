//! The Talker: Thinker states in, codec frames out (`talker.*` in the checkpoint).
//!
//! - [`prompt`]: the prefill input built from the Thinker's exports (user segments, the
//!   9-position assistant bootstrap with the speaker's codec id) and the trailing text fed one
//!   vector per decode step;
//! - the decoder: the Qwen3-MoE layers with a sigmoid-gated shared expert over input
//!   embeddings (`talker.model.*`; `codec_embedding` is its token table, `codec_head` its head),
//!   run as [`ModelStage::Talker`] through [`StageModel`];
//! - [`code_predictor`]: the dense decoder that writes residual codebooks 1..15 of a frame, one
//!   after another, from the Talker's final-norm state and its layer-0 code;
//! - [`sampling`]: layer-0 constraints (the suppressed control range, the repetition penalty)
//!   and the code predictor's top-k / top-p.
//!
//! One frame per decode step: the step's input is the sum of the previous frame's 16 codec
//! embeddings (layer 0 from `codec_embedding`, groups 1..15 from the code predictor's tables)
//! plus one trailing-text vector ([`prompt::TalkerPrompt::text_for_step`]).

pub mod code_predictor;
pub mod prompt;
pub mod sampling;

use serde_json::Value;

use crate::decoder::{DecoderModel, Linear, TpContext, load_shaped};
use crate::error::ModelError;
use crate::interface::{ModelInputs, ModelOutputs, ModelStage, StageModel};
use crate::qwen3_omni::config::{ARCHITECTURE, OmniConfig};
use crate::weights::{SubmodelWeights, WeightSource};
use crate::{KvCacheSpec, LayerKvCache};

pub use code_predictor::CodePredictor;
pub use prompt::{Projection, PromptBuilder, TalkerPrompt, ThinkerExports};

/// The Talker decoder's names as a single-model loader asks for them.
pub(crate) const TALKER_RENAMES: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "model.codec_embedding.weight"),
    ("lm_head.weight", "codec_head.weight"),
];

/// `fc2(silu(fc1(x)))` with biases: the Talker's `text_projection` and `hidden_projection`
/// (Thinker width -> Talker width).
#[derive(Debug, Clone)]
pub struct ResizeMlp {
    fc1: Linear,
    fc2: Linear,
}

impl ResizeMlp {
    fn load(
        ws: &dyn WeightSource,
        name: &str,
        inp: usize,
        mid: usize,
        out: usize,
    ) -> Result<Self, ModelError> {
        let linear = |n: &str, o: usize, i: usize| -> Result<Linear, ModelError> {
            Ok(Linear {
                w: load_shaped(ws, &format!("{name}.{n}.weight"), &[o, i])?.data,
                out: o,
                inp: i,
                bias: Some(load_shaped(ws, &format!("{name}.{n}.bias"), &[o])?.data),
            })
        };
        Ok(Self {
            fc1: linear("linear_fc1", mid, inp)?,
            fc2: linear("linear_fc2", out, mid)?,
        })
    }

    fn shapes(name: &str, inp: usize, mid: usize, out: usize) -> Vec<(String, Vec<usize>)> {
        vec![
            (format!("{name}.linear_fc1.weight"), vec![mid, inp]),
            (format!("{name}.linear_fc1.bias"), vec![mid]),
            (format!("{name}.linear_fc2.weight"), vec![out, mid]),
            (format!("{name}.linear_fc2.bias"), vec![out]),
        ]
    }

    /// The two layers as `(weight [out, in] row-major, bias [out], out, in)`: fc1, then fc2
    /// (what a device copy of the projection uploads).
    pub fn layers(&self) -> [(&[f32], &[f32], usize, usize); 2] {
        fn part(l: &Linear) -> (&[f32], &[f32], usize, usize) {
            (
                l.w.as_slice(),
                l.bias.as_deref().unwrap_or(&[]),
                l.out,
                l.inp,
            )
        }
        [part(&self.fc1), part(&self.fc2)]
    }

    /// Projects `[rows, in]` to `[rows, out]`.
    pub fn forward(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        let rows = x.len() / self.fc1.inp.max(1);
        if rows * self.fc1.inp != x.len() {
            return Err(ModelError::Batch(format!(
                "{} values are not rows of width {}",
                x.len(),
                self.fc1.inp
            )));
        }
        let (mut mid, mut out) = (Vec::new(), Vec::new());
        self.fc1.forward(x, rows, &mut mid)?;
        mid.iter_mut()
            .for_each(|v| *v = omni_backend::ops::silu(*v));
        self.fc2.forward(&mid, rows, &mut out)?;
        Ok(out)
    }
}

/// The Talker on one tensor-parallel rank: projections, decoder, code predictor.
#[derive(Debug)]
pub struct Talker {
    decoder: DecoderModel,
    code_predictor: CodePredictor,
    prompt: PromptBuilder,
    config: OmniConfig,
}

impl Talker {
    /// Loads rank `tp.rank`'s Talker from a whole Qwen3-Omni checkpoint's weights (the
    /// projections and the code predictor are replicated; the decoder splits as any decoder).
    pub fn load(config: &Value, ws: &dyn WeightSource, tp: TpContext) -> Result<Self, ModelError> {
        let config = OmniConfig::from_json(config)?;
        let t = &config.talker_config;
        let spec = t.text_config.spec(true)?;
        let decoder = DecoderModel::load(
            spec,
            &SubmodelWeights::new(ws, "talker.", TALKER_RENAMES),
            tp,
        )?;
        let h = t.text_config.hidden_size;
        let prompt = PromptBuilder::load(&config, ws, &|ids| decoder.embed_ids(ids))?;
        let code_predictor = CodePredictor::load(t, ws)?;
        if t.code_predictor_config.hidden_size != h {
            return Err(ModelError::Config(format!(
                "code predictor width {} != the Talker's {h}",
                t.code_predictor_config.hidden_size
            )));
        }
        Ok(Self {
            decoder,
            code_predictor,
            prompt,
            config,
        })
    }

    /// Every tensor the Talker reads, with its checkpoint name and full shape.
    pub fn weight_shapes(config: &Value) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
        let c = OmniConfig::from_json(config)?;
        let t = &c.talker_config;
        let mut v: Vec<(String, Vec<usize>)> = t
            .text_config
            .spec(true)?
            .weight_shapes()
            .into_iter()
            .map(|(n, s)| {
                let saved = TALKER_RENAMES
                    .iter()
                    .find(|(asked, _)| *asked == n)
                    .map_or(n.as_str(), |(_, saved)| saved);
                (format!("talker.{saved}"), s)
            })
            .collect();
        let (th, mid, h) = (
            t.thinker_hidden_size,
            t.text_config.intermediate_size,
            t.text_config.hidden_size,
        );
        v.extend(ResizeMlp::shapes("talker.text_projection", th, mid, h));
        v.extend(ResizeMlp::shapes("talker.hidden_projection", th, mid, h));
        v.extend(CodePredictor::weight_shapes(t)?);
        Ok(v)
    }

    /// The parsed config.
    pub fn config(&self) -> &OmniConfig {
        &self.config
    }

    /// The Talker's width.
    pub fn hidden_size(&self) -> usize {
        self.decoder.spec().hidden_size
    }

    /// `text_projection` of `[rows, thinker_hidden]`.
    pub fn project_text(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        self.prompt.project_text(x)
    }

    /// `hidden_projection` of `[rows, thinker_hidden]`.
    pub fn project_hidden(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        self.prompt.project_hidden(x)
    }

    /// What builds its prompts.
    pub fn prompt_builder(&self) -> &PromptBuilder {
        &self.prompt
    }

    /// `codec_embedding` rows of layer-0 codes, `[codes, hidden]`.
    pub fn embed_codec(&self, codes: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.decoder.embed_ids(codes)
    }

    /// The code predictor.
    pub fn code_predictor(&self) -> &CodePredictor {
        &self.code_predictor
    }
}

impl StageModel for Talker {
    fn architecture(&self) -> &str {
        ARCHITECTURE
    }

    fn stage(&self) -> ModelStage {
        ModelStage::Talker
    }

    fn kv_cache_spec(&self) -> Option<KvCacheSpec> {
        StageModel::kv_cache_spec(&self.decoder)
    }

    /// One decoder step over input embeddings: codec logits of the output rows (raw; apply
    /// [`sampling::suppress_control_codes`] before choosing) and any captured states
    /// ([`crate::Capture::FinalNorm`] is what [`CodePredictor::predict`] starts from).
    fn forward(
        &self,
        inputs: &ModelInputs<'_>,
        kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        StageModel::forward(&self.decoder, inputs, kv)
    }
}
