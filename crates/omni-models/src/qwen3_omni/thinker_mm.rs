//! The Thinker's multimodal side, whatever runs its decoder: the audio and vision towers
//! (`thinker.audio_tower.*`, `thinker.visual.*`, when the checkpoint has them), the placeholder
//! ids, and the prompt's special ids for the M-RoPE positions. The CPU [`crate::qwen3_omni::
//! thinker::Thinker`] and a worker's device Thinker share it.

use serde_json::Value;

use crate::error::ModelError;
use crate::interface::{EncoderOutput, MropePositions, MultiModalFeature, MultiModalKind};
use crate::qwen3_omni::audio_encoder::AudioEncoder;
use crate::qwen3_omni::config::OmniConfig;
use crate::qwen3_omni::mm_merge::{MergePlan, PlaceholderIds, bf16_values, plan};
use crate::qwen3_omni::vision_encoder::VisionEncoder;
use crate::weights::{HostTensor, SubmodelWeights, WeightSource};

/// The towers, placeholders and M-RoPE prompt settings of a Qwen3-Omni Thinker.
#[derive(Debug)]
pub struct ThinkerMm {
    audio: Option<AudioEncoder>,
    vision: Option<VisionEncoder>,
    placeholders: PlaceholderIds,
    /// The prompt's special ids and merge size, for M-RoPE positions.
    prompt: omni_mm::MmPromptConfig,
}

impl ThinkerMm {
    /// Reads the towers a whole Qwen3-Omni checkpoint `ws` has (none is an error only when an
    /// item of its modality arrives); without `ws`, no host towers (a device Thinker's, whose
    /// towers run elsewhere).
    pub fn load(config_json: &Value, ws: Option<&dyn WeightSource>) -> Result<Self, ModelError> {
        let config = OmniConfig::from_json(config_json)?;
        let Some(ws) = ws else {
            return Self::assemble(&config, config_json, None, None);
        };
        let audio_ws = SubmodelWeights::new(ws, "thinker.audio_tower.", &[]);
        let audio = match audio_ws.shape("conv2d1.weight") {
            Ok(_) => Some(AudioEncoder::load(
                tower_config(config_json, "audio_config")?,
                &audio_ws,
            )?),
            Err(_) => None,
        };
        let vision_ws = SubmodelWeights::new(ws, "thinker.visual.", &[]);
        let vision = match vision_ws.shape("patch_embed.proj.weight") {
            Ok(_) => Some(VisionEncoder::load(
                tower_config(config_json, "vision_config")?,
                &vision_ws,
            )?),
            Err(_) => None,
        };
        Self::assemble(&config, config_json, audio, vision)
    }

    fn assemble(
        config: &OmniConfig,
        config_json: &Value,
        audio: Option<AudioEncoder>,
        vision: Option<VisionEncoder>,
    ) -> Result<Self, ModelError> {
        let t = &config.thinker_config;
        let placeholders = PlaceholderIds {
            image: t.image_token_id,
            video: t.video_token_id,
            audio: t.audio_token_id,
        };
        let prompt = omni_mm::MmPromptConfig::from_thinker_config(config_json)
            .map_err(|e| ModelError::Config(e.to_string()))?;
        Ok(Self {
            audio,
            vision,
            placeholders,
            prompt,
        })
    }

    /// The audio tower, when the checkpoint has one.
    pub fn audio_encoder(&self) -> Option<&AudioEncoder> {
        self.audio.as_ref()
    }

    /// The vision tower, when the checkpoint has one.
    pub fn vision_encoder(&self) -> Option<&VisionEncoder> {
        self.vision.as_ref()
    }

    /// Encodes several items: the images and videos in one vision-tower call, each audio clip
    /// on its own; one output per feature, in order.
    pub fn encode_batch(
        &self,
        features: &[&MultiModalFeature<'_>],
    ) -> Result<Vec<EncoderOutput>, ModelError> {
        let mut out: Vec<Option<EncoderOutput>> = vec![None; features.len()];
        let mut grids = Vec::new();
        let mut pixels = Vec::new();
        let mut visual = Vec::new();
        for (i, f) in features.iter().enumerate() {
            let values = bf16_values(f.data)?;
            match f.kind {
                MultiModalKind::Audio { num_frames } => {
                    let tower = self.audio.as_ref().ok_or_else(|| no_tower("audio"))?;
                    out[i] = Some(EncoderOutput {
                        embeds: tower.encode(&values, num_frames)?,
                        deepstack: Vec::new(),
                    });
                }
                MultiModalKind::Image { grid_thw } | MultiModalKind::Video { grid_thw } => {
                    grids.push(grid_thw);
                    pixels.extend(values);
                    visual.push(i);
                }
            }
        }
        if !visual.is_empty() {
            let tower = self.vision.as_ref().ok_or_else(|| no_tower("vision"))?;
            let v = tower.encode(&pixels, &grids)?;
            let unit = tower.config().merge_unit();
            let h = v.merged.shape[1];
            let mut start = 0;
            for (&i, g) in visual.iter().zip(&grids) {
                let n = g[0] * g[1] * g[2] / unit;
                let rows = |t: &HostTensor| HostTensor {
                    shape: vec![n, h],
                    data: t.data[start * h..(start + n) * h].to_vec(),
                };
                out[i] = Some(EncoderOutput {
                    embeds: rows(&v.merged),
                    deepstack: v.deepstack.iter().map(rows).collect(),
                });
                start += n;
            }
        }
        out.into_iter()
            .map(|o| o.ok_or_else(|| ModelError::Batch("an item was not encoded".into())))
            .collect()
    }

    /// Encodes one item.
    pub fn encode(&self, feature: &MultiModalFeature<'_>) -> Result<EncoderOutput, ModelError> {
        self.encode_batch(&[feature])?
            .pop()
            .ok_or_else(|| ModelError::Batch("an item was not encoded".into()))
    }

    /// The three M-RoPE rows of a whole prompt with its items, and the decode delta.
    pub fn mrope_positions(
        &self,
        ids: &[u32],
        items: &[MultiModalKind],
    ) -> Result<(MropePositions, i64), ModelError> {
        let items: Vec<omni_mm::MmItem> = items
            .iter()
            .map(|k| match *k {
                MultiModalKind::Image { grid_thw } => Ok(omni_mm::MmItem::Image {
                    grid_thw: grid_thw.map(|d| d as u32),
                }),
                MultiModalKind::Audio { num_frames } => Ok(omni_mm::MmItem::Audio { num_frames }),
                MultiModalKind::Video { .. } => Err(ModelError::Batch(
                    "video items are not supported yet (no seconds per grid)".into(),
                )),
            })
            .collect::<Result<_, _>>()?;
        let (rows, delta) = omni_mm::mrope_positions(ids, &items, &self.prompt)
            .map_err(|e| ModelError::Batch(format!("M-RoPE positions: {e}")))?;
        Ok((
            MropePositions {
                rows: [rows.t, rows.h, rows.w],
            },
            delta,
        ))
    }

    /// Where a step's encoder outputs go ([`plan`] with this Thinker's placeholders).
    pub fn plan<'a>(
        &self,
        tokens: usize,
        hidden: usize,
        input_ids: Option<&[u32]>,
        features: &[MultiModalFeature<'_>],
        encoded: &[&'a EncoderOutput],
    ) -> Result<MergePlan<'a>, ModelError> {
        plan(
            tokens,
            hidden,
            input_ids,
            self.placeholders,
            features,
            encoded,
        )
    }
}

/// `thinker_config.{key}` (a tower's config).
pub(crate) fn tower_config<T: serde::de::DeserializeOwned>(
    config: &Value,
    key: &str,
) -> Result<T, ModelError> {
    let c = config
        .get("thinker_config")
        .and_then(|t| t.get(key))
        .ok_or_else(|| ModelError::Config(format!("no thinker_config.{key}")))?;
    Ok(T::deserialize(c)?)
}

fn no_tower(which: &str) -> ModelError {
    ModelError::Batch(format!("this Qwen3-Omni checkpoint has no {which} tower"))
}
