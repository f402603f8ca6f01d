//! The model's encoders as the server sees them ([`MultimodalModel`]: placeholder token ids and
//! preprocessing settings), and one fetched item decoded and preprocessed with omni-mm into an
//! [`MmInput`] (on a blocking thread).

use omni_config::MediaConfig;
use omni_mm::{
    ImageProcessorConfig, MediaLimits, MmPromptConfig, Modality, TensorData, WhisperFeatureConfig,
};
use serde_json::Value;

use super::fetch::Fetched;
use super::parts::MediaPart;
use super::{MmInput, ModalityName};

/// The encoders a model has, as far as the API server needs them: their placeholder token ids
/// and preprocessing settings. A text-only model has none (`ServerConfig::multimodal` is
/// `None`) and refuses every media part.
#[derive(Debug, Clone, PartialEq)]
pub struct MultimodalModel {
    /// The placeholder token ids (`<|image_pad|>`, `<|vision_start|>`, ...).
    pub prompt: MmPromptConfig,
    /// The image processor, when the model has a vision encoder.
    pub image: Option<ImageProcessorConfig>,
    /// The Whisper feature extractor, when the model has an audio encoder.
    pub audio: Option<WhisperFeatureConfig>,
}

impl MultimodalModel {
    /// Reads `config.json` (the `thinker_config` of an omni model, else the top level): a
    /// `vision_config` means a vision encoder and an `audio_config` an audio encoder; the token
    /// ids are the config's. `preprocessor` is `preprocessor_config.json`, when the model has
    /// one (else Qwen3-Omni's settings). `Ok(None)`: no encoder.
    pub fn from_hf_config(
        config: &Value,
        preprocessor: Option<&Value>,
    ) -> Result<Option<Self>, String> {
        let c = config.get("thinker_config").unwrap_or(config);
        let has = |key: &str| c.get(key).is_some_and(Value::is_object);
        let (vision, audio) = (has("vision_config"), has("audio_config"));
        if !vision && !audio {
            return Ok(None);
        }
        let prompt = MmPromptConfig::from_thinker_config(c).map_err(|e| e.to_string())?;
        let image = match (vision, preprocessor) {
            (false, _) => None,
            (true, None) => Some(ImageProcessorConfig::default()),
            (true, Some(p)) => Some(
                ImageProcessorConfig::from_preprocessor_config(p)
                    .map_err(|e| format!("preprocessor_config.json: {e}"))?,
            ),
        };
        let audio = audio.then(|| {
            let mut f = WhisperFeatureConfig::default();
            let n = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64);
            if let Some(p) = preprocessor {
                f.feature_size = n(p, "feature_size").map_or(f.feature_size, |x| x as usize);
                f.hop_length = n(p, "hop_length").map_or(f.hop_length, |x| x as usize);
                f.n_fft = n(p, "n_fft").map_or(f.n_fft, |x| x as usize);
                f.sampling_rate = n(p, "sampling_rate").map_or(f.sampling_rate, |x| x as u32);
            }
            if let Some(bins) = c.get("audio_config").and_then(|a| n(a, "num_mel_bins")) {
                f.feature_size = bins as usize;
            }
            f
        });
        Ok(Some(Self {
            prompt,
            image,
            audio,
        }))
    }

    /// Whether the model takes `modality` (video: never yet).
    pub fn supports(&self, modality: Modality) -> bool {
        match modality {
            Modality::Image => self.image.is_some(),
            Modality::Audio => self.audio.is_some(),
            Modality::Video => false,
        }
    }

    /// The start, pad and end tokens of `modality`'s placeholder.
    pub(crate) fn placeholder_ids(&self, modality: Modality) -> Option<[u32; 3]> {
        let p = &self.prompt;
        match modality {
            Modality::Image => Some([
                p.vision_start_token_id,
                p.image_token_id,
                p.vision_end_token_id,
            ]),
            Modality::Audio => Some([
                p.audio_start_token_id,
                p.audio_token_id,
                p.audio_end_token_id,
            ]),
            Modality::Video => None,
        }
    }

    /// Both encoders with Qwen3-Omni's settings and small token ids (unit tests).
    #[cfg(test)]
    pub(crate) fn test_model() -> Self {
        Self {
            prompt: MmPromptConfig {
                image_token_id: 10,
                vision_start_token_id: 11,
                vision_end_token_id: 12,
                audio_token_id: 20,
                audio_start_token_id: 21,
                audio_end_token_id: 22,
                video_token_id: 30,
                ..MmPromptConfig::QWEN3_OMNI
            },
            image: Some(ImageProcessorConfig::default()),
            audio: Some(WhisperFeatureConfig::default()),
        }
    }
}

/// omni-mm's decoding limits from the server's flags.
pub(crate) fn decode_limits(cfg: &MediaConfig) -> MediaLimits {
    MediaLimits {
        max_image_pixels: cfg.max_image_pixels,
        max_audio_bytes: usize::try_from(cfg.max_audio_clip_filesize_mb.saturating_mul(1 << 20))
            .unwrap_or(usize::MAX),
        max_audio_duration_s: cfg.max_audio_decode_duration_s,
    }
}

/// Decodes and preprocesses one fetched item; the error is the client's message.
pub(crate) fn process(
    model: &MultimodalModel,
    part: &MediaPart,
    fetched: Fetched,
    limits: &MediaLimits,
) -> Result<MmInput, String> {
    let modality = part.modality;
    let (features, shape, grid_thw, num_frames, num_tokens) = match modality {
        Modality::Image => {
            let cfg = model
                .image
                .as_ref()
                .ok_or("this model takes no image input")?;
            let img = omni_mm::decode_image(&fetched.bytes, limits).map_err(|e| e.to_string())?;
            let f = omni_mm::process_image(&img, cfg).map_err(|e| e.to_string())?;
            let tokens = omni_mm::image_tokens(f.grid_thw, cfg.merge_size);
            let shape = [f.num_patches(), cfg.row_len()];
            (f.pixel_values, shape, Some(f.grid_thw), None, tokens)
        }
        Modality::Audio => {
            let cfg = model
                .audio
                .as_ref()
                .ok_or("this model takes no audio input")?;
            // A declared `audio/*` type is omni-mm's hint (it refuses bytes of another format).
            let hint = fetched
                .media_type
                .as_deref()
                .filter(|t| t.starts_with("audio/"));
            let audio =
                omni_mm::decode_audio(&fetched.bytes, hint, limits).map_err(|e| e.to_string())?;
            let samples = if audio.sample_rate == cfg.sampling_rate {
                audio.samples
            } else {
                omni_mm::resample(&audio.samples, audio.sample_rate, cfg.sampling_rate)
            };
            let f = omni_mm::log_mel(&samples, cfg).map_err(|e| e.to_string())?;
            let tokens = omni_mm::audio_output_tokens(f.num_frames);
            let frames = u32::try_from(f.num_frames).map_err(|_| "the audio clip is too long")?;
            let shape = [cfg.feature_size, f.num_frames];
            (f.input_features, shape, None, Some(frames), tokens)
        }
        Modality::Video => return Err("video input is not supported yet".into()),
    };
    if num_tokens == 0 {
        return Err(format!(
            "the {} is too small to give any tokens",
            modality.name()
        ));
    }
    let data = omni_mm::to_bf16_bytes(&features);
    let dims = shape.map(|d| d as u64);
    let content_hash = omni_mm::content_hash(modality, &dims, TensorData::Bytes(&data));
    Ok(MmInput {
        modality,
        data: data.into(),
        shape,
        grid_thw,
        num_frames,
        num_tokens: u32::try_from(num_tokens).map_err(|_| "too many tokens")?,
        content_hash,
        offset: 0,
        uuid: part.uuid.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_qwen3_omni_fixture_has_both_towers_with_its_own_ids() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../omni-models/tests/fixtures/qwen3-omni/config.json"
        );
        let config: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let m = MultimodalModel::from_hf_config(&config, None)
            .unwrap()
            .unwrap();
        assert!(m.supports(Modality::Image) && m.supports(Modality::Audio));
        assert_eq!(
            m.placeholder_ids(Modality::Image),
            Some([151_652, 151_655, 151_653])
        );
        assert_eq!(
            m.placeholder_ids(Modality::Audio),
            Some([151_669, 151_675, 151_670])
        );
        assert_eq!(m.audio.unwrap().feature_size, 128);
        let text_only = serde_json::json!({"architectures": ["LlamaForCausalLM"]});
        assert_eq!(MultimodalModel::from_hf_config(&text_only, None), Ok(None));
    }
}
