//! Multimodal items in a prompt: the special token ids, and the expansion of one placeholder per
//! item into as many pad tokens as the item has embeddings (the processor's
//! `replace_multimodal_special_tokens`).

use serde_json::Value;

use crate::error::ProcessError;
use crate::mel::audio_output_tokens;
use crate::vision::image_tokens;

/// The Thinker's multimodal token ids and M-RoPE settings. Read them from the checkpoint's
/// `thinker_config` ([`Self::from_thinker_config`]): transformers' class defaults are Qwen2.5-Omni's.
#[derive(Debug, Clone, PartialEq)]
pub struct MmPromptConfig {
    /// `<|image_pad|>`.
    pub image_token_id: u32,
    /// `<|video_pad|>`.
    pub video_token_id: u32,
    /// `<|audio_pad|>`.
    pub audio_token_id: u32,
    /// `<|vision_start|>`.
    pub vision_start_token_id: u32,
    /// `<|vision_end|>`.
    pub vision_end_token_id: u32,
    /// `<|audio_start|>`.
    pub audio_start_token_id: u32,
    /// `<|audio_end|>`.
    pub audio_end_token_id: u32,
    /// Temporal positions per second of video (13).
    pub position_id_per_seconds: f32,
    /// The vision merger's window side (2).
    pub spatial_merge_size: u32,
}

impl MmPromptConfig {
    /// Qwen3-Omni-30B-A3B's ids (`thinker_config` of the released checkpoint).
    pub const QWEN3_OMNI: Self = Self {
        image_token_id: 151_655,
        video_token_id: 151_656,
        audio_token_id: 151_675,
        vision_start_token_id: 151_652,
        vision_end_token_id: 151_653,
        audio_start_token_id: 151_669,
        audio_end_token_id: 151_670,
        position_id_per_seconds: 13.0,
        spatial_merge_size: 2,
    };

    /// Reads the ids from a `config.json` value (its `thinker_config`) or a `thinker_config` value.
    /// Missing keys keep [`Self::QWEN3_OMNI`]'s values.
    pub fn from_thinker_config(v: &Value) -> Result<Self, ProcessError> {
        let t = v.get("thinker_config").unwrap_or(v);
        let mut c = Self::QWEN3_OMNI;
        let id = |key: &str, dst: &mut u32| -> Result<(), ProcessError> {
            if let Some(x) = t.get(key) {
                *dst = x
                    .as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| ProcessError::Config(format!("`{key}` must be a token id")))?;
            }
            Ok(())
        };
        id("image_token_id", &mut c.image_token_id)?;
        id("video_token_id", &mut c.video_token_id)?;
        id("audio_token_id", &mut c.audio_token_id)?;
        id("vision_start_token_id", &mut c.vision_start_token_id)?;
        id("vision_end_token_id", &mut c.vision_end_token_id)?;
        id("audio_start_token_id", &mut c.audio_start_token_id)?;
        id("audio_end_token_id", &mut c.audio_end_token_id)?;
        if let Some(x) = t.get("position_id_per_seconds").and_then(Value::as_f64) {
            c.position_id_per_seconds = x as f32;
        }
        if let Some(x) = t
            .get("vision_config")
            .and_then(|vc| vc.get("spatial_merge_size"))
            .and_then(Value::as_u64)
        {
            c.spatial_merge_size = u32::try_from(x).ok().filter(|&m| m > 0).ok_or_else(|| {
                ProcessError::Config("`spatial_merge_size` is out of range".into())
            })?;
        }
        Ok(c)
    }
}

/// The modality of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Modality {
    /// A still image.
    Image,
    /// Audio.
    Audio,
    /// Video frames (with or without its audio track).
    Video,
}

/// One multimodal item as the prompt sees it: what decides its token count and positions.
#[derive(Debug, Clone, PartialEq)]
pub enum MmItem {
    /// An image with its `image_grid_thw`.
    Image {
        /// `(t, h, w)` in patches.
        grid_thw: [u32; 3],
    },
    /// An audio clip with its mel frame count (`feature_attention_mask.sum()`).
    Audio {
        /// Mel frames.
        num_frames: usize,
    },
    /// A video with its `video_grid_thw` and `video_second_per_grid` (`temporal_patch_size / fps`).
    Video {
        /// `(t, h, w)` in patches.
        grid_thw: [u32; 3],
        /// Seconds per temporal patch.
        second_per_grid: f32,
    },
    /// A video whose audio track is interleaved with its frames (`use_audio_in_video`).
    VideoWithAudio {
        /// `(t, h, w)` in patches.
        grid_thw: [u32; 3],
        /// Seconds per temporal patch.
        second_per_grid: f32,
        /// Mel frames of the video's audio.
        audio_frames: usize,
    },
}

impl MmItem {
    /// The item's modality (a video with audio is a video).
    pub fn modality(&self) -> Modality {
        match self {
            Self::Image { .. } => Modality::Image,
            Self::Audio { .. } => Modality::Audio,
            Self::Video { .. } | Self::VideoWithAudio { .. } => Modality::Video,
        }
    }

    /// Pad tokens the item expands to (video and audio pads together for a video with audio).
    pub fn num_tokens(&self, merge_size: u32) -> usize {
        match *self {
            Self::Image { grid_thw } | Self::Video { grid_thw, .. } => {
                image_tokens(grid_thw, merge_size)
            }
            Self::Audio { num_frames } => audio_output_tokens(num_frames),
            Self::VideoWithAudio {
                grid_thw,
                audio_frames,
                ..
            } => image_tokens(grid_thw, merge_size) + audio_output_tokens(audio_frames),
        }
    }
}

/// Where an item's embeddings go in the expanded prompt (vLLM's `PlaceholderRange`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceholderRange {
    /// Index of the item's first pad token.
    pub offset: usize,
    /// Number of pad tokens.
    pub length: usize,
}

/// A prompt with every placeholder expanded.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpandedPrompt {
    /// The token ids.
    pub ids: Vec<u32>,
    /// One range per item, in prompt order.
    pub ranges: Vec<PlaceholderRange>,
}

/// The time order of a video-with-audio block's pads: `true` for a video pad. Video token `k`'s
/// time is `frame_k * second_per_grid * position_id_per_seconds`, audio token `j`'s is `j`; a video
/// token goes first on ties (the processor's `replace_video_with_audio_token`).
pub(crate) fn interleave_video_audio(
    grid_thw: [u32; 3],
    second_per_grid: f32,
    audio_tokens: usize,
    cfg: &MmPromptConfig,
) -> Vec<bool> {
    let m = cfg.spatial_merge_size as usize;
    let per_frame = (grid_thw[1] as usize / m) * (grid_thw[2] as usize / m);
    let video_t: Vec<f32> = (0..grid_thw[0] as usize)
        .flat_map(|k| {
            std::iter::repeat_n(
                k as f32 * second_per_grid * cfg.position_id_per_seconds,
                per_frame,
            )
        })
        .collect();
    let (mut v, mut a) = (0, 0);
    let mut order = Vec::with_capacity(video_t.len() + audio_tokens);
    while v < video_t.len() && a < audio_tokens {
        if video_t[v] <= a as f32 {
            order.push(true);
            v += 1;
        } else {
            order.push(false);
            a += 1;
        }
    }
    order.extend(std::iter::repeat_n(true, video_t.len() - v));
    order.extend(std::iter::repeat_n(false, audio_tokens - a));
    order
}

/// Expands a prompt that has exactly one pad token per item (`<|image_pad|>`, `<|audio_pad|>`,
/// `<|video_pad|>`; `items` in the order their pads appear) into the model's prompt. A video with
/// audio becomes `<|audio_start|>` + its video and audio pads in time order + `<|audio_end|>` (the
/// surrounding `<|vision_start|>` / `<|vision_end|>` stay), and its range covers the pads.
pub fn expand_placeholders(
    ids: &[u32],
    items: &[MmItem],
    cfg: &MmPromptConfig,
) -> Result<ExpandedPrompt, ProcessError> {
    let pad_of = |id: u32| {
        if id == cfg.image_token_id {
            Some(Modality::Image)
        } else if id == cfg.audio_token_id {
            Some(Modality::Audio)
        } else if id == cfg.video_token_id {
            Some(Modality::Video)
        } else {
            None
        }
    };
    let mut out = Vec::with_capacity(ids.len());
    let mut ranges = Vec::with_capacity(items.len());
    let mut next = items.iter();
    for &id in ids {
        let Some(modality) = pad_of(id) else {
            out.push(id);
            continue;
        };
        let item = next.next().ok_or_else(|| {
            ProcessError::Placeholders(format!(
                "the prompt has more placeholders than the {} items",
                items.len()
            ))
        })?;
        if item.modality() != modality {
            return Err(ProcessError::Placeholders(format!(
                "placeholder {} is {modality:?} but item {} is {:?}",
                ranges.len(),
                ranges.len(),
                item.modality()
            )));
        }
        match *item {
            MmItem::VideoWithAudio {
                grid_thw,
                second_per_grid,
                audio_frames,
            } => {
                out.push(cfg.audio_start_token_id);
                let order = interleave_video_audio(
                    grid_thw,
                    second_per_grid,
                    audio_output_tokens(audio_frames),
                    cfg,
                );
                ranges.push(PlaceholderRange {
                    offset: out.len(),
                    length: order.len(),
                });
                out.extend(order.iter().map(|&v| {
                    if v {
                        cfg.video_token_id
                    } else {
                        cfg.audio_token_id
                    }
                }));
                out.push(cfg.audio_end_token_id);
            }
            _ => {
                let n = item.num_tokens(cfg.spatial_merge_size);
                ranges.push(PlaceholderRange {
                    offset: out.len(),
                    length: n,
                });
                out.extend(std::iter::repeat_n(id, n));
            }
        }
    }
    if ranges.len() != items.len() {
        return Err(ProcessError::Placeholders(format!(
            "{} items but {} placeholders in the prompt",
            items.len(),
            ranges.len()
        )));
    }
    Ok(ExpandedPrompt { ids: out, ranges })
}
