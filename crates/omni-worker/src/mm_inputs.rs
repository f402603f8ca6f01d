//! A worker's multimodal state (vLLM's `GPUModelRunner` encoder cache, `_execute_mm_encoder`
//! and `_gather_mm_embeddings`): each live request's items with their tensor bytes and M-RoPE
//! positions, the encoder cache keyed by content hash, and the per-step features that say which
//! encoder output rows replace which batch rows.
//!
//! The bytes arrive once, in the step that schedules the request first, as buffers of the
//! broadcast message (read in place from the ring slot); the worker copies each item once into
//! its own memory, because the slot is reused after the step and a preempted request may need
//! its items encoded again. With tensor parallelism every rank receives the same buffers and
//! runs the whole encoder tower on every item (replicated towers, no sharding: neither vLLM's
//! `mm_encoder_tp_mode` "weights", which shards the tower, nor "data", which splits the items
//! across ranks; both are later work), so every rank merges the same rows.

use std::collections::HashMap;
use std::ops::Range;

use bytes::Bytes;
use omni_models::{EncoderOutput, MropePositions, MultiModalFeature, MultiModalKind};
use omni_protocol::{EngineCoreRequest, MmKind, MultiModalFeatureSpec, NewRequestData, TensorView};

use crate::WorkerError;

/// One item of a live request.
#[derive(Debug, Clone)]
pub struct MmItem {
    /// Content hash (the encoder cache key).
    pub mm_hash: u64,
    /// Placeholder tokens in the prompt.
    pub range: Range<usize>,
    /// What it is.
    pub kind: MultiModalKind,
    /// Its preprocessed tensor (bf16, as broadcast): copied out of the ring slot, or shared
    /// with the request that brought it (an omni Thinker stage's).
    pub data: Bytes,
}

impl MmItem {
    /// The item as an encoder input (the placeholder fields are unused by the encoders).
    pub fn feature(&self) -> MultiModalFeature<'_> {
        MultiModalFeature {
            modality: self.kind.modality(),
            mm_hash: self.mm_hash,
            placeholder: self.range.clone(),
            item_offset: 0,
            kind: self.kind,
            data: &self.data,
        }
    }
}

/// A request's multimodal part.
#[derive(Debug, Clone, Default)]
pub struct RequestMm {
    /// Its items, in prompt order.
    pub items: Vec<MmItem>,
    /// The prompt's M-RoPE rows and the decode delta, for a model that takes M-RoPE and a
    /// request with items.
    pub mrope: Option<(MropePositions, i64)>,
}

impl RequestMm {
    /// The items of a new request, their bytes copied out of the step's `views` (the batch's
    /// tensors in [`omni_protocol::SchedulerOutput::tensor_views`] order, starting at this
    /// request's first item).
    pub fn from_new(new: &NewRequestData, views: &[TensorView<'_>]) -> Self {
        Self::from_items(
            new.mm_features
                .iter()
                .zip(views.iter().map(|v| Bytes::copy_from_slice(v.bytes))),
        )
    }

    /// The items of a request held whole (an omni Thinker stage's), their bytes shared with its
    /// buffers (checked at admission: every feature names one of the right size).
    pub fn from_request(req: &EngineCoreRequest) -> Self {
        Self::from_items(req.mm_features.iter().filter_map(|f| {
            let bytes = req.mm_buffers.get(f.tensor.buffer_index as usize)?;
            Some((f, bytes.clone()))
        }))
    }

    fn from_items<'a>(items: impl Iterator<Item = (&'a MultiModalFeatureSpec, Bytes)>) -> Self {
        let items = items
            .map(|(f, bytes)| MmItem {
                mm_hash: f.mm_hash,
                range: f.range(),
                kind: match f.kind {
                    MmKind::Image { grid_thw } => MultiModalKind::Image {
                        grid_thw: grid_thw.map(|d| d as usize),
                    },
                    MmKind::Video { grid_thw } => MultiModalKind::Video {
                        grid_thw: grid_thw.map(|d| d as usize),
                    },
                    MmKind::Audio { num_frames } => MultiModalKind::Audio {
                        num_frames: num_frames as usize,
                    },
                },
                data: bytes,
            })
            .collect();
        Self { items, mrope: None }
    }

    /// The three M-RoPE rows of positions `start..end` (1-D positions without items; past the
    /// prompt, the position plus the decode delta in every row), appended to `rows`.
    pub fn push_positions(&self, start: usize, end: usize, rows: &mut [Vec<i64>; 3]) {
        for p in start..end {
            let q = match &self.mrope {
                Some((m, _)) if p < m.rows[0].len() => {
                    for (dst, src) in rows.iter_mut().zip(&m.rows) {
                        dst.push(src[p]);
                    }
                    continue;
                }
                Some((_, delta)) => p as i64 + delta,
                None => p as i64,
            };
            rows.iter_mut().for_each(|r| r.push(q));
        }
    }

    /// The step's features of the items whose placeholder overlaps positions `start..end`,
    /// placed at batch row `row0` for position `start` (a chunk of a split range gets the
    /// encoder row of its first position as `item_offset`).
    pub fn step_features(
        &self,
        start: usize,
        end: usize,
        row0: usize,
    ) -> impl Iterator<Item = MultiModalFeature<'_>> {
        self.items.iter().filter_map(move |it| {
            let (a, b) = (it.range.start.max(start), it.range.end.min(end));
            (a < b).then(|| MultiModalFeature {
                placeholder: row0 + a - start..row0 + b - start,
                item_offset: a - it.range.start,
                ..it.feature()
            })
        })
    }
}

/// Encoder outputs by content hash, and how many items the encoders have run on.
#[derive(Debug, Default)]
pub struct EncoderCache {
    entries: HashMap<u64, EncoderOutput>,
    num_encoded: u64,
}

impl EncoderCache {
    /// Drops the outputs the scheduler freed.
    pub fn free(&mut self, hashes: &[u64]) {
        for h in hashes {
            self.entries.remove(h);
        }
    }

    /// Keeps an encoder output.
    pub fn insert(&mut self, mm_hash: u64, out: EncoderOutput) {
        self.entries.insert(mm_hash, out);
        self.num_encoded += 1;
    }

    /// The output of an item the step needs.
    pub fn get(&self, mm_hash: u64) -> Result<&EncoderOutput, WorkerError> {
        self.entries.get(&mm_hash).ok_or_else(|| {
            WorkerError::Batch(format!(
                "multimodal item {mm_hash:016x} is needed but not in the encoder cache"
            ))
        })
    }

    /// Runs the encoder of every item the scheduler listed for this step
    /// (`SchedulerOutput::scheduled_encoder_inputs`: request id -> item indices) and keeps the
    /// outputs. `items(id)` gives a request's items, `encode` runs one item, `error` builds
    /// the caller's error for an unknown request or item. The worker's runner and an omni
    /// Thinker stage both encode this way.
    pub fn encode_scheduled<'a, E>(
        &mut self,
        scheduled: &HashMap<String, Vec<u32>>,
        items: impl Fn(&str) -> Option<&'a RequestMm>,
        mut encode: impl FnMut(&MmItem) -> Result<EncoderOutput, E>,
        error: impl Fn(String) -> E,
    ) -> Result<(), E> {
        for (id, inputs) in scheduled {
            let mm = items(id).ok_or_else(|| error(format!("encoder input of unknown {id}")))?;
            for &i in inputs {
                let item = mm
                    .items
                    .get(i as usize)
                    .ok_or_else(|| error(format!("request {id} has no multimodal item {i}")))?;
                let t = std::time::Instant::now();
                let out = encode(item)?;
                tracing::debug!(
                    request = %id,
                    item = i,
                    modality = item.kind.modality(),
                    mm_hash = %format_args!("{:016x}", item.mm_hash),
                    rows = out.embeds.shape.first().copied().unwrap_or(0),
                    elapsed = ?t.elapsed(),
                    "encoded a multimodal item"
                );
                self.insert(item.mm_hash, out);
            }
        }
        Ok(())
    }

    /// Items encoded since start-up.
    pub fn num_encoded(&self) -> u64 {
        self.num_encoded
    }

    /// Outputs held now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
