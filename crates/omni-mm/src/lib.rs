//! Multimodal inputs for the API process: media decoding under vLLM's limits, and Qwen3-Omni's
//! preprocessing up to the tensors the encoders take. No model code.
//!
//! * [`decode_image`] (PNG, JPEG, WebP to RGB8; the pixel limit is checked on the header first) and
//!   [`decode_audio`] (WAV, MP3, FLAC to mono f32; size cap before, duration cap while decoding),
//!   [`resample`] (to 16 kHz: scipy `resample_poly`'s filter).
//! * [`process_image`] / [`process_video`]: transformers' PIL-backed `Qwen2VLImageProcessor`
//!   ([`smart_resize`], PIL's bicubic resize, rescale, normalise, patchify) to `[patches, 1536]`.
//! * [`log_mel`]: transformers' `WhisperFeatureExtractor` (128 mels) and [`audio_output_tokens`].
//! * [`expand_placeholders`] and [`mrope_positions`]: the prompt's pad tokens and its M-RoPE rows.
//! * [`content_hash`] (BLAKE3) and [`to_bf16_bytes`] for the wire.
//!
//! It sits at L1 and depends on no workspace crate.
//!
//! ```
//! use omni_mm::{process_image, smart_resize, ImageProcessorConfig, RgbImage};
//!
//! let cfg = ImageProcessorConfig::default();
//! assert_eq!(smart_resize(720, 1280, 32, cfg.min_pixels, cfg.max_pixels).unwrap(), (704, 1280));
//! let img = RgbImage { width: 96, height: 64, data: vec![128; 96 * 64 * 3] };
//! let f = process_image(&img, &cfg).unwrap();
//! assert_eq!(f.grid_thw, [1, 4, 6]);
//! assert_eq!(f.pixel_values.len(), 24 * 1536);
//! ```

mod audio;
mod bf16;
mod error;
mod hash;
mod image;
mod mel;
mod mrope;
mod prompt;
mod resample;
mod resize;
mod vision;

pub use audio::{Audio, decode_audio};
pub use bf16::{f32_to_bf16, to_bf16_bytes};
pub use error::{
    DEFAULT_MAX_AUDIO_CLIP_FILESIZE_MB, DEFAULT_MAX_AUDIO_DECODE_DURATION_S,
    DEFAULT_MAX_IMAGE_PIXELS, MediaError, MediaLimits, ProcessError,
};
pub use hash::{ContentHash, TensorData, content_hash, source_hash};
pub use image::{RgbImage, decode_image, image_dimensions};
pub use mel::{AudioFeatures, LogMel, WhisperFeatureConfig, audio_output_tokens, log_mel};
pub use mrope::{MropeRows, mrope_positions};
pub use prompt::{
    ExpandedPrompt, MmItem, MmPromptConfig, Modality, PlaceholderRange, expand_placeholders,
};
pub use resample::resample;
pub use resize::resize_bicubic;
pub use vision::{
    ImageFeatures, ImageProcessorConfig, QWEN3_OMNI_VIDEO_MAX_PIXELS, QWEN3_OMNI_VIDEO_MIN_PIXELS,
    image_tokens, process_image, process_video, smart_resize,
};
