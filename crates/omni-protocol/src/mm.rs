//! Multimodal items on the wire: what each item of a request is ([`MultiModalFeatureSpec`],
//! vLLM's `MultiModalFeatureSpec`), and the out-of-band bytes behind their tensors
//! ([`TensorBuffers`]).
//!
//! An item's preprocessed tensor (an image's pixel patches, an audio clip's log-mel) never goes
//! through serde: the spec names it with a [`TensorRef`] whose `buffer_index` counts the
//! message's out-of-band buffers. Over a `MessageQueue` those are the message's buffers (read
//! in place from the ring slot); in-process they ride beside the header in a
//! [`TensorBuffers`] (`#[serde(skip)]` fields of [`crate::EngineCoreRequest`] and
//! [`crate::SchedulerOutput`]), so one `Bytes` allocation made in the API server is shared, not
//! copied, until the step that broadcasts it.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::{DType, TensorRef};

/// What an item is, with the shape information its encoder needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MmKind {
    /// An image: its tensor is `[t * h * w, C * T * P * P]` pixel patches of the patch grid
    /// `grid_thw` (HF `image_grid_thw`, `t` = 1).
    Image {
        /// `(t, h, w)` in patches.
        grid_thw: [u32; 3],
    },
    /// A video: like an image with `t` temporal patches (HF `video_grid_thw`).
    Video {
        /// `(t, h, w)` in patches.
        grid_thw: [u32; 3],
    },
    /// An audio clip: its tensor is `[num_mel_bins, num_frames]` log-mel features.
    Audio {
        /// Valid feature frames.
        num_frames: u32,
    },
}

impl MmKind {
    /// `"image"`, `"video"` or `"audio"` (vLLM's modality names).
    pub fn modality(&self) -> &'static str {
        match self {
            Self::Image { .. } => "image",
            Self::Video { .. } => "video",
            Self::Audio { .. } => "audio",
        }
    }
}

/// One multimodal item of a request (vLLM's `MultiModalFeatureSpec`): where its placeholder
/// tokens sit in the prompt, its content hash, and its preprocessed tensor.
///
/// The content hash is the encoder-cache key (equal items are encoded once) and enters the
/// prefix-cache hash of every block the placeholder touches, so equal token ids with different
/// media never share KV blocks. A request's items are sorted by `offset` and do not overlap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MultiModalFeatureSpec {
    /// Content hash of the item (omni-mm's BLAKE3 of modality, shape and bytes, first 8 bytes).
    pub mm_hash: u64,
    /// First placeholder token, as an index into the prompt (vLLM's `PlaceholderRange.offset`).
    pub offset: u32,
    /// Placeholder tokens, one per encoder output row (`PlaceholderRange.length`).
    pub length: u32,
    /// What the item is.
    pub kind: MmKind,
    /// The preprocessed tensor: bf16, 2-D, its bytes an out-of-band buffer of the message.
    pub tensor: TensorRef,
}

impl MultiModalFeatureSpec {
    /// `"image"`, `"video"` or `"audio"`.
    pub fn modality(&self) -> &'static str {
        self.kind.modality()
    }

    /// The placeholder's token range in the prompt.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset as usize..self.offset as usize + self.length as usize
    }

    /// Checks the spec against the request's `prompt_len` and its `buffers`: a non-empty
    /// placeholder inside the prompt, a 2-D bf16 tensor whose buffer exists and has exactly the
    /// bytes its shape makes. The error says what is wrong.
    pub fn check(&self, prompt_len: usize, buffers: &TensorBuffers) -> Result<(), String> {
        let what = || format!("{} item {:016x}", self.modality(), self.mm_hash);
        if self.length == 0 || self.range().end > prompt_len {
            return Err(format!(
                "{}: placeholder {:?} outside the prompt of {prompt_len} tokens",
                what(),
                self.range()
            ));
        }
        if self.tensor.dtype != DType::Bf16 || self.tensor.shape.len() != 2 {
            return Err(format!(
                "{}: tensor must be 2-D bf16, is {:?} {:?}",
                what(),
                self.tensor.dtype,
                self.tensor.shape
            ));
        }
        let Some(bytes) = buffers.get(self.tensor.buffer_index as usize) else {
            return Err(format!(
                "{}: names buffer {} of {}",
                what(),
                self.tensor.buffer_index,
                buffers.len()
            ));
        };
        if bytes.len() as u64 != self.tensor.num_bytes() {
            return Err(format!(
                "{}: {} bytes for a tensor of {}",
                what(),
                bytes.len(),
                self.tensor.num_bytes()
            ));
        }
        Ok(())
    }
}

/// Out-of-band buffers that travel beside a message's serde header; `TensorRef::buffer_index`
/// indexes them. Cheap to clone (reference-counted [`Bytes`]); `Debug` shows their sizes only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TensorBuffers(Vec<Bytes>);

impl TensorBuffers {
    /// No buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a buffer and returns its index.
    pub fn push(&mut self, bytes: Bytes) -> u32 {
        self.0.push(bytes);
        (self.0.len() - 1) as u32
    }

    /// Buffer `i`.
    pub fn get(&self, i: usize) -> Option<&Bytes> {
        self.0.get(i)
    }

    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Bytes in all buffers.
    pub fn total_bytes(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    /// Borrowed slices, in order: what `MessageQueue::enqueue` and `Executor::execute_model`
    /// take.
    pub fn as_slices(&self) -> Vec<&[u8]> {
        self.0.iter().map(|b| b.as_ref()).collect()
    }
}

impl From<Vec<Bytes>> for TensorBuffers {
    fn from(v: Vec<Bytes>) -> Self {
        Self(v)
    }
}

impl std::fmt::Debug for TensorBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(Bytes::len))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(offset: u32, length: u32, shape: Vec<u64>) -> MultiModalFeatureSpec {
        MultiModalFeatureSpec {
            mm_hash: 7,
            offset,
            length,
            kind: MmKind::Image {
                grid_thw: [1, 2, 2],
            },
            tensor: TensorRef {
                name: "pixel_values".into(),
                request_id: None,
                dtype: DType::Bf16,
                shape,
                buffer_index: 0,
            },
        }
    }

    #[test]
    fn check_refuses_ranges_outside_the_prompt_and_short_buffers() {
        let mut b = TensorBuffers::new();
        assert_eq!(b.push(Bytes::from(vec![0u8; 16])), 0);
        assert!(spec(2, 1, vec![4, 2]).check(10, &b).is_ok());
        assert!(
            spec(9, 2, vec![4, 2])
                .check(10, &b)
                .unwrap_err()
                .contains("outside")
        );
        assert!(spec(2, 0, vec![4, 2]).check(10, &b).is_err());
        assert!(
            spec(2, 1, vec![4, 3])
                .check(10, &b)
                .unwrap_err()
                .contains("16 bytes")
        );
        assert!(
            spec(2, 1, vec![4, 2])
                .check(10, &TensorBuffers::new())
                .is_err()
        );
        assert_eq!(format!("{b:?}"), "[16]");
    }
}
