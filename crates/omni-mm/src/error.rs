//! Decoding limits and the errors of decoding and preprocessing.

use thiserror::Error;

/// vLLM's `VLLM_MAX_IMAGE_PIXELS` default: twice PIL's `MAX_IMAGE_PIXELS` (89,478,485).
pub const DEFAULT_MAX_IMAGE_PIXELS: u64 = 178_956_970;
/// vLLM's `VLLM_MAX_AUDIO_CLIP_FILESIZE_MB` default (25 MB, counted as MiB like vLLM's `* 1024 * 1024`).
pub const DEFAULT_MAX_AUDIO_CLIP_FILESIZE_MB: usize = 25;
/// vLLM's `VLLM_MAX_AUDIO_DECODE_DURATION_S` default.
pub const DEFAULT_MAX_AUDIO_DECODE_DURATION_S: f64 = 600.0;

/// Limits applied while decoding untrusted media (vLLM's security knobs, same defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MediaLimits {
    /// Most pixels (width x height) an image header may declare; checked before the raster is allocated.
    pub max_image_pixels: u64,
    /// Most bytes an encoded audio clip may have; checked before decoding.
    pub max_audio_bytes: usize,
    /// Most seconds of audio decoded; checked against the header and again while decoding.
    pub max_audio_duration_s: f64,
}

impl Default for MediaLimits {
    fn default() -> Self {
        Self {
            max_image_pixels: DEFAULT_MAX_IMAGE_PIXELS,
            max_audio_bytes: DEFAULT_MAX_AUDIO_CLIP_FILESIZE_MB * 1024 * 1024,
            max_audio_duration_s: DEFAULT_MAX_AUDIO_DECODE_DURATION_S,
        }
    }
}

/// Why a media item could not be decoded.
#[derive(Debug, Error)]
pub enum MediaError {
    /// The image header declares more pixels than `VLLM_MAX_IMAGE_PIXELS` allows.
    #[error(
        "image of {width}x{height} = {pixels} pixels exceeds the limit of {limit} pixels (VLLM_MAX_IMAGE_PIXELS)"
    )]
    ImageTooLarge {
        /// Declared width.
        width: u32,
        /// Declared height.
        height: u32,
        /// `width * height`.
        pixels: u64,
        /// The limit.
        limit: u64,
    },
    /// The bytes are not an image in a format this crate decodes (PNG, JPEG, WebP).
    #[error("unsupported or unrecognised image format (supported: PNG, JPEG, WebP)")]
    UnknownImageFormat,
    /// The image is corrupt or truncated.
    #[error("invalid image data: {0}")]
    InvalidImage(String),
    /// The image declares a zero width or height.
    #[error("image has an empty size ({width}x{height})")]
    EmptyImage {
        /// Declared width.
        width: u32,
        /// Declared height.
        height: u32,
    },
    /// The encoded clip is larger than `VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`.
    #[error(
        "audio clip of {bytes} bytes exceeds the limit of {limit} bytes (VLLM_MAX_AUDIO_CLIP_FILESIZE_MB)"
    )]
    AudioFileTooLarge {
        /// Encoded size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// The clip is longer than `VLLM_MAX_AUDIO_DECODE_DURATION_S`.
    #[error(
        "audio clip is longer than the limit of {limit_s} s (VLLM_MAX_AUDIO_DECODE_DURATION_S): {detail}"
    )]
    AudioTooLong {
        /// The limit in seconds.
        limit_s: f64,
        /// How it was found: the header's declared length, or the decoded length when decoding stopped.
        detail: String,
    },
    /// The bytes are not audio in a format this crate decodes, or do not match the format hint.
    #[error("unsupported or unrecognised audio format{hint} (supported: WAV, MP3, FLAC): {detail}")]
    UnknownAudioFormat {
        /// `" (expected <hint>)"` when a format hint was given, else empty.
        hint: String,
        /// What the probe said.
        detail: String,
    },
    /// The clip is corrupt or truncated, or has no audio track.
    #[error("invalid audio data: {0}")]
    InvalidAudio(String),
}

/// Why preprocessing (resizing, patching, features, placeholders, positions) failed.
#[derive(Debug, Error, PartialEq)]
pub enum ProcessError {
    /// `smart_resize` refuses aspect ratios over 200 (as transformers does) and empty images.
    #[error("absolute aspect ratio must be smaller than 200, got {height}x{width}")]
    AspectRatio {
        /// Height.
        height: u32,
        /// Width.
        width: u32,
    },
    /// A video with no frames, or frames of different sizes.
    #[error("invalid video: {0}")]
    InvalidVideo(String),
    /// The clip is too short for the centred STFT (its reflect padding needs more than n_fft / 2 samples).
    #[error(
        "audio clip of {samples} samples is too short: the log-mel needs at least {min} samples"
    )]
    AudioTooShort {
        /// Samples given.
        samples: usize,
        /// Samples needed.
        min: usize,
    },
    /// A preprocessor or model config value is missing or has the wrong type.
    #[error("invalid config: {0}")]
    Config(String),
    /// The prompt's placeholders and the items do not match.
    #[error("prompt and multimodal items do not match: {0}")]
    Placeholders(String),
}
