//! A Qwen3-Omni Thinker's two towers on the device as one encoder ([`DeviceTowers`]): what a
//! CUDA worker's `encode_mm` runs. Outputs come back to the host as [`EncoderOutput`]s (the
//! worker's encoder cache is host memory, shared with the CPU backend); keeping them on the
//! device is later work.

use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{CudaContext, CudaError, bf16};
use serde_json::Value;

use super::{CudaAudioEncoder, CudaVisionEncoder};
use crate::ModelError;
use crate::interface::{EncoderOutput, MultiModalFeature, MultiModalKind};
use crate::qwen3_omni::mm_merge::bf16_le;
use crate::qwen3_omni::thinker_mm::tower_config;
use crate::weights::{HostTensor, SubmodelWeights, WeightSource};

/// The towers a checkpoint has, on one device.
#[derive(Debug)]
pub struct DeviceTowers {
    cx: Arc<CudaContext>,
    vision: Option<CudaVisionEncoder>,
    audio: Option<CudaAudioEncoder>,
}

/// Where the towers' weights come from.
#[derive(Clone, Copy)]
#[allow(missing_debug_implementations)] // a `dyn WeightSource` has no `Debug`
pub enum TowerWeights<'a> {
    /// The whole checkpoint (`thinker.visual.*`, `thinker.audio_tower.*`); a tower whose first
    /// weight is missing is absent.
    Checkpoint(&'a dyn WeightSource),
    /// Random weights of the config's shapes (`--load-format dummy`), both towers.
    Dummy {
        /// Seed of the values.
        seed: u64,
    },
}

impl DeviceTowers {
    /// Loads the towers of a Qwen3-Omni `config_json` onto `cx`'s device.
    pub fn load(
        cx: Arc<CudaContext>,
        config_json: &Value,
        weights: TowerWeights<'_>,
    ) -> Result<Self, ModelError> {
        let (vision, audio) = match weights {
            TowerWeights::Dummy { seed } => (
                Some(CudaVisionEncoder::load_dummy(
                    cx.clone(),
                    tower_config(config_json, "vision_config")?,
                    seed.wrapping_add(1),
                )?),
                Some(CudaAudioEncoder::load_dummy(
                    cx.clone(),
                    tower_config(config_json, "audio_config")?,
                    seed.wrapping_add(2),
                )?),
            ),
            TowerWeights::Checkpoint(ws) => {
                let vws = SubmodelWeights::new(ws, "thinker.visual.", &[]);
                let vision = match vws.shape("patch_embed.proj.weight") {
                    Ok(_) => Some(CudaVisionEncoder::load(
                        cx.clone(),
                        tower_config(config_json, "vision_config")?,
                        &vws,
                    )?),
                    Err(_) => None,
                };
                let aws = SubmodelWeights::new(ws, "thinker.audio_tower.", &[]);
                let audio = match aws.shape("conv2d1.weight") {
                    Ok(_) => Some(CudaAudioEncoder::load(
                        cx.clone(),
                        tower_config(config_json, "audio_config")?,
                        &aws,
                    )?),
                    Err(_) => None,
                };
                (vision, audio)
            }
        };
        Ok(Self { cx, vision, audio })
    }

    /// Whether any tower is loaded.
    pub fn is_empty(&self) -> bool {
        self.vision.is_none() && self.audio.is_none()
    }

    /// Encodes one item (its bf16 wire bytes) on the device; the output on the host.
    pub fn encode(&self, f: &MultiModalFeature<'_>) -> Result<EncoderOutput, ModelError> {
        let values = bf16_le(f.data)?;
        match f.kind {
            MultiModalKind::Audio { num_frames } => {
                let tower = self.audio.as_ref().ok_or_else(|| no_tower("audio"))?;
                let out = tower.encode(&values, num_frames)?;
                let width = tower.config().output_dim;
                Ok(EncoderOutput {
                    embeds: self.to_host(&out, width)?,
                    deepstack: Vec::new(),
                })
            }
            MultiModalKind::Image { grid_thw } | MultiModalKind::Video { grid_thw } => {
                let tower = self.vision.as_ref().ok_or_else(|| no_tower("vision"))?;
                let out = tower.encode(&values, &[grid_thw])?;
                let width = tower.config().out_hidden_size;
                Ok(EncoderOutput {
                    embeds: self.to_host(&out.merged, width)?,
                    deepstack: out
                        .deepstack
                        .iter()
                        .map(|d| self.to_host(d, width))
                        .collect::<Result<_, _>>()?,
                })
            }
        }
    }

    /// `[len / width, width]` bf16 on the device as f32 on the host (synchronizes).
    fn to_host(&self, x: &CudaSlice<bf16>, width: usize) -> Result<HostTensor, ModelError> {
        let mut host = vec![bf16::ZERO; x.len()];
        self.cx
            .stream()
            .memcpy_dtoh(x, &mut host)
            .map_err(CudaError::from)?;
        Ok(HostTensor {
            shape: vec![x.len() / width.max(1), width],
            data: host.into_iter().map(f32::from).collect(),
        })
    }
}

fn no_tower(which: &str) -> ModelError {
    ModelError::Batch(format!("this Qwen3-Omni checkpoint has no {which} tower"))
}
