//! The Thinker's multimodal merge: text embeddings everywhere, the rows of each item's
//! placeholder replaced by its encoder output (transformers' `masked_scatter` of
//! `get_placeholder_mask`), and the visual rows' deepstack features gathered for the residual
//! additions after the first decoder layers (`_deepstack_process`).
//!
//! The plan serves the CPU decoder (written over its embeddings) and a device decoder (rows
//! uploaded over the device's). Items may be cut by chunked prefill: a feature brings only the placeholder rows of this step
//! and the encoder row of its first one (`item_offset`).

use std::ops::Range;

use half::bf16;

use crate::error::ModelError;
use crate::interface::{EncoderOutput, MultiModalFeature, MultiModalKind};

/// The placeholder token of each kind (`thinker_config.{image,video,audio}_token_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceholderIds {
    /// `<|image_pad|>`.
    pub image: u32,
    /// `<|video_pad|>`.
    pub video: u32,
    /// `<|audio_pad|>`.
    pub audio: u32,
}

impl PlaceholderIds {
    fn of(&self, kind: &MultiModalKind) -> u32 {
        match kind {
            MultiModalKind::Image { .. } => self.image,
            MultiModalKind::Video { .. } => self.video,
            MultiModalKind::Audio { .. } => self.audio,
        }
    }
}

/// Where a step's encoder outputs go: the placeholder rows each item's encoder rows replace,
/// and the visual rows' deepstack features.
#[derive(Debug, Default)]
pub struct MergePlan<'a> {
    /// Batch rows and the encoder rows (`[range.len(), hidden]`) that replace their embeddings.
    pub embed_rows: Vec<(Range<usize>, &'a [f32])>,
    /// Batch rows of image and video tokens (those with deepstack features).
    pub visual_rows: Vec<usize>,
    /// Per deepstack level, `[visual_rows.len(), hidden]`.
    pub deepstack: Vec<Vec<f32>>,
}

impl MergePlan<'_> {
    /// Writes the encoder rows over `embeds` (`[tokens, hidden]`).
    pub fn apply(&self, embeds: &mut [f32], hidden: usize) {
        for (rows, src) in &self.embed_rows {
            embeds[rows.start * hidden..rows.end * hidden].copy_from_slice(src);
        }
    }
}

/// Checks each feature against its encoder output and the step (`tokens` rows of width
/// `hidden`) and says where its rows go. With `input_ids` given, every placeholder row must
/// hold its kind's placeholder token.
pub fn plan<'a>(
    tokens: usize,
    hidden: usize,
    input_ids: Option<&[u32]>,
    ids: PlaceholderIds,
    features: &[MultiModalFeature<'_>],
    encoded: &[&'a EncoderOutput],
) -> Result<MergePlan<'a>, ModelError> {
    if features.len() != encoded.len() {
        return Err(ModelError::Batch(format!(
            "{} multimodal features with {} encoder outputs",
            features.len(),
            encoded.len()
        )));
    }
    let levels = encoded.iter().map(|e| e.deepstack.len()).max().unwrap_or(0);
    let mut merged = MergePlan {
        deepstack: vec![Vec::new(); levels],
        ..MergePlan::default()
    };
    let mut taken = vec![false; tokens];
    for (f, e) in features.iter().zip(encoded) {
        let rows = f.placeholder.clone();
        let n = rows.len();
        let have = e.embeds.shape.first().copied().unwrap_or(0);
        let bad = |why: String| {
            Err(ModelError::Batch(format!(
                "{} item {:x} at rows {rows:?} (item offset {}): {why}",
                f.kind.modality(),
                f.mm_hash,
                f.item_offset
            )))
        };
        if f.modality != f.kind.modality() {
            return bad(format!("modality `{}` for a {:?}", f.modality, f.kind));
        }
        if rows.end > tokens {
            return bad(format!("the batch has {tokens} tokens"));
        }
        if e.embeds.shape != [have, hidden] || f.item_offset + n > have {
            return bad(format!("encoder output of shape {:?}", e.embeds.shape));
        }
        if !e.deepstack.is_empty()
            && (e.deepstack.len() != levels
                || e.deepstack.iter().any(|d| d.shape != e.embeds.shape))
        {
            return bad(format!(
                "{} deepstack levels of {levels}",
                e.deepstack.len()
            ));
        }
        let want = ids.of(&f.kind);
        if let Some(ids) = input_ids
            && let Some(r) = rows.clone().find(|&r| ids[r] != want)
        {
            return bad(format!("row {r} holds token {}, not {want}", ids[r]));
        }
        if let Some(r) = rows.clone().find(|&r| taken[r]) {
            return bad(format!("row {r} belongs to two items"));
        }
        rows.clone().for_each(|r| taken[r] = true);
        let src = &e.embeds.data[f.item_offset * hidden..(f.item_offset + n) * hidden];
        merged.embed_rows.push((rows.clone(), src));
        if !e.deepstack.is_empty() {
            merged.visual_rows.extend(rows.clone());
            for (dst, d) in merged.deepstack.iter_mut().zip(&e.deepstack) {
                dst.extend_from_slice(
                    &d.data[f.item_offset * hidden..(f.item_offset + n) * hidden],
                );
            }
        }
    }
    Ok(merged)
}

/// The values of little-endian bf16 bytes, widened.
pub(crate) fn bf16_values(data: &[u8]) -> Result<Vec<f32>, ModelError> {
    Ok(bf16_le(data)?.into_iter().map(bf16::to_f32).collect())
}

/// Little-endian bf16 bytes as bf16 values.
pub(crate) fn bf16_le(data: &[u8]) -> Result<Vec<bf16>, ModelError> {
    if !data.len().is_multiple_of(2) {
        return Err(ModelError::Batch(format!(
            "{} bytes of bf16 multimodal data",
            data.len()
        )));
    }
    Ok(data
        .chunks_exact(2)
        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
        .collect())
}
