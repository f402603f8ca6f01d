//! `Qwen3OmniMoeForConditionalGeneration`'s `config.json`: the top-level token ids, the
//! Thinker's text decoder (`thinker_config.text_config`), the Talker (`talker_config`, with its
//! `text_config` and `code_predictor_config`). Code2Wav reads `code2wav_config` itself.
//!
//! Every id and size comes from the file: transformers' config defaults differ from the real
//! checkpoint (`accept_hidden_layer` 18 vs 24, `codec_eos_token_id` 4198 vs 2150,
//! `num_code_groups` 32 vs 16, ...), so a missing key is an error, never a default.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use crate::decoder::{DecoderSpec, MoeSpec, MropeSpec};
use crate::error::ModelError;
use crate::hf_config::{require_silu, rope_settings};

/// The registry key.
pub const ARCHITECTURE: &str = "Qwen3OmniMoeForConditionalGeneration";

/// Top-level token ids (the chat markers and the three TTS tokens the Talker is fed).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct OmniTokenIds {
    /// `<|im_start|>`.
    pub im_start_token_id: u32,
    /// `<|im_end|>`.
    pub im_end_token_id: u32,
    /// `system` (the role token after `<|im_start|>`).
    pub system_token_id: u32,
    /// `user`.
    pub user_token_id: u32,
    /// `assistant`.
    pub assistant_token_id: u32,
    /// `<tts_pad>`.
    pub tts_pad_token_id: u32,
    /// `<tts_text_bos>`.
    pub tts_bos_token_id: u32,
    /// `<tts_text_eod>`.
    pub tts_eos_token_id: u32,
}

/// A text decoder's fields as transformers writes them for Qwen3-Omni (every one required).
#[derive(Debug, Clone, Deserialize)]
pub struct OmniTextConfig {
    /// Vocabulary (codec ids for the Talker and the code predictor).
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// Dense MLP width (the code predictor's MLP; the Talker's projection MLPs).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads.
    pub num_key_value_heads: usize,
    /// Head size; transformers' fallback when absent is `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Activation (silu).
    pub hidden_act: String,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (transformers 4 form).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE scaling with `mrope_section` (transformers 4 form).
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// RoPE settings with `mrope_section` / `interleaved` (transformers 5 form).
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// Biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Experts per MoE layer (absent: a dense decoder).
    #[serde(default, alias = "num_local_experts")]
    pub num_experts: Option<usize>,
    /// Experts per token.
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    /// Renormalise the top-k routing weights.
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// One expert's width.
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    /// The shared expert's width (the Talker).
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    /// Every n-th layer is sparse.
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    /// Layers with a dense MLP.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
}

impl OmniTextConfig {
    /// Head size as transformers computes it.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The M-RoPE sections, when the RoPE settings name them.
    pub fn mrope(&self) -> Result<Option<MropeSpec>, ModelError> {
        let p = self
            .rope_parameters
            .as_ref()
            .or(self.rope_scaling.as_ref())
            .filter(|v| !v.is_null());
        let Some(sec) = p.and_then(|p| p.get("mrope_section")) else {
            return Ok(None);
        };
        let sec: Vec<usize> = serde_json::from_value(sec.clone())?;
        let section: [usize; 3] = sec.as_slice().try_into().map_err(|_| {
            ModelError::Config(format!("mrope_section {sec:?}: three entries expected"))
        })?;
        let interleaved = p
            .and_then(|p| p.get("interleaved"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(Some(MropeSpec {
            section,
            interleaved,
        }))
    }

    /// The shared decoder's view; `embed_and_head` says whether the decoder owns its token
    /// embedding and head (`model.embed_tokens` / `lm_head` after renaming).
    pub fn spec(&self, embed_and_head: bool) -> Result<DecoderSpec, ModelError> {
        require_silu(&self.hidden_act)?;
        let (rope_theta, rope_scaling) = rope_settings(
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
            f64::NAN,
        )?;
        if rope_theta.is_nan() {
            return Err(ModelError::Config("no rope_theta".into()));
        }
        let moe = match self.num_experts {
            Some(n) if n > 0 => {
                let need = |v: Option<usize>, k: &str| {
                    v.ok_or_else(|| ModelError::Config(format!("MoE config without `{k}`")))
                };
                let top_k = need(self.num_experts_per_tok, "num_experts_per_tok")?;
                if top_k == 0 || top_k > n {
                    return Err(ModelError::Config(format!(
                        "num_experts_per_tok {top_k} with {n} experts"
                    )));
                }
                Some(MoeSpec {
                    num_experts: n,
                    top_k,
                    norm_topk_prob: self.norm_topk_prob.ok_or_else(|| {
                        ModelError::Config("MoE config without `norm_topk_prob`".into())
                    })?,
                    moe_intermediate_size: need(
                        self.moe_intermediate_size,
                        "moe_intermediate_size",
                    )?,
                    decoder_sparse_step: self.decoder_sparse_step.unwrap_or(1),
                    mlp_only_layers: self.mlp_only_layers.clone(),
                    shared_expert_intermediate_size: self.shared_expert_intermediate_size,
                })
            }
            _ => None,
        };
        Ok(DecoderSpec {
            architecture: ARCHITECTURE,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim(),
            intermediate_size: self.intermediate_size,
            rms_norm_eps: self.rms_norm_eps as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: false,
            attention_bias: self.attention_bias,
            qk_norm: true,
            moe,
            mrope: self.mrope()?,
            embed_and_head,
        })
    }
}

/// `thinker_config` (the text decoder; the audio and vision towers are read by their encoders).
#[derive(Debug, Clone, Deserialize)]
pub struct ThinkerConfig {
    /// The MoE text decoder.
    pub text_config: OmniTextConfig,
    /// Audio placeholder id.
    pub audio_token_id: u32,
    /// Image placeholder id.
    pub image_token_id: u32,
    /// Video placeholder id.
    pub video_token_id: u32,
}

/// `talker_config`.
#[derive(Debug, Clone, Deserialize)]
pub struct TalkerConfig {
    /// The Talker's MoE decoder (vocab: codec ids).
    pub text_config: OmniTextConfig,
    /// The dense code predictor of residual codebooks 1..`num_code_groups`.
    pub code_predictor_config: OmniTextConfig,
    /// Thinker layers whose output the Talker reads at multimodal positions.
    pub accept_hidden_layer: usize,
    /// The Thinker's width (the projections' input).
    pub thinker_hidden_size: usize,
    /// Codebooks per frame (layer 0 from the Talker, the rest from the code predictor).
    pub num_code_groups: usize,
    /// `codec_pad`.
    pub codec_pad_id: u32,
    /// `codec_bos`.
    pub codec_bos_id: u32,
    /// `codec_eos` (the Talker's stop id).
    pub codec_eos_token_id: u32,
    /// `codec_nothink`.
    pub codec_nothink_id: u32,
    /// `codec_think_bos`.
    pub codec_think_bos_id: u32,
    /// `codec_think_eos`.
    pub codec_think_eos_id: u32,
    /// Voice name (lower case) to its codec id.
    pub speaker_id: BTreeMap<String, u32>,
    /// Audio placeholder id (the Thinker's).
    pub audio_token_id: u32,
    /// Image placeholder id.
    pub image_token_id: u32,
    /// Video placeholder id.
    pub video_token_id: u32,
}

impl TalkerConfig {
    /// The codec id of `voice` (case-insensitive), or an error listing the voices.
    pub fn speaker(&self, voice: &str) -> Result<u32, ModelError> {
        self.speaker_id
            .get(&voice.to_lowercase())
            .copied()
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "Invalid speaker '{voice}'. Supported: {}",
                    self.speaker_id
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    }
}

/// The parts of `config.json` the Thinker and the Talker read.
#[derive(Debug, Clone, Deserialize)]
pub struct OmniConfig {
    /// Top-level ids.
    #[serde(flatten)]
    pub ids: OmniTokenIds,
    /// The Thinker.
    pub thinker_config: ThinkerConfig,
    /// The Talker.
    pub talker_config: TalkerConfig,
}

impl OmniConfig {
    /// Parses `config.json`; a missing key is an error naming it.
    pub fn from_json(config: &Value) -> Result<Self, ModelError> {
        let c = Self::deserialize(config)?;
        let t = &c.talker_config;
        let layers = c.thinker_config.text_config.num_hidden_layers;
        if t.accept_hidden_layer > layers {
            return Err(ModelError::Config(format!(
                "talker_config.accept_hidden_layer {} > the Thinker's {layers} layers",
                t.accept_hidden_layer
            )));
        }
        if t.thinker_hidden_size != c.thinker_config.text_config.hidden_size {
            return Err(ModelError::Config(format!(
                "talker_config.thinker_hidden_size {} != the Thinker's hidden_size {}",
                t.thinker_hidden_size, c.thinker_config.text_config.hidden_size
            )));
        }
        if t.num_code_groups < 2 {
            return Err(ModelError::Config(format!(
                "num_code_groups {}: at least 2 expected",
                t.num_code_groups
            )));
        }
        Ok(c)
    }
}
