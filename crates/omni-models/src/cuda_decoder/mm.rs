//! Multimodal steps on the device ([`CudaDecoderModel::forward_mm`]): the token embeddings with
//! the placeholder rows of each item replaced by its encoder output, the three M-RoPE position
//! rows, and the deepstack features added to the residual stream after the first layers (what
//! the CPU Thinker's `forward_encoded` does, in the same order).
//!
//! A step with any of them runs eagerly (no graph): only prefill steps carry items, and a
//! decode step's M-RoPE rows are equal, so the caller passes its one row as plain positions.

use std::ops::Range;

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{CudaError, bf16};

use super::{CudaDecoderModel, StepInput};
use crate::ModelError;
use crate::batch::ForwardBatch;
use crate::interface::MropePositions;
use crate::qwen3_omni::mm_merge::MergePlan;

/// One step's multimodal inputs, on the host.
#[derive(Debug, Clone, Copy, Default)]
pub struct MmStep<'a> {
    /// The temporal, height and width position of each of the step's tokens (`None`: the
    /// batch's positions, as 1-D RoPE).
    pub mrope: Option<[&'a [i64]; 3]>,
    /// Batch rows whose input embedding is an encoder output instead of the token's row, with
    /// those rows (`[range.len(), hidden]`).
    pub embed_rows: &'a [(Range<usize>, &'a [f32])],
    /// Batch rows that get the deepstack features (distinct).
    pub visual_rows: &'a [usize],
    /// Per level (added after decoder layer `level`), `[visual_rows.len(), hidden]`.
    pub deepstack: &'a [Vec<f32>],
}

/// A step's deepstack additions on the device.
#[derive(Debug)]
pub(super) struct DeviceResidualAdds {
    /// `[rows_len]` batch rows.
    pub(super) rows: CudaSlice<i32>,
    pub(super) rows_len: usize,
    /// `[levels, rows_len, hidden]`.
    pub(super) data: CudaSlice<f32>,
    pub(super) levels: usize,
}

impl CudaDecoderModel {
    /// A Thinker step with its M-RoPE `positions` (`None`: the batch's) and `plan`'s encoder
    /// rows: rows that are all equal (text, every decode step) run as 1-D RoPE on the plain
    /// path (graphs included) when there are no encoder rows either; otherwise
    /// [`CudaDecoderModel::forward_mm`].
    pub fn forward_merged(
        &mut self,
        batch: &ForwardBatch,
        positions: Option<&MropePositions>,
        plan: &MergePlan<'_>,
    ) -> Result<usize, ModelError> {
        let t = batch.input_ids.len();
        let mut one_d = None;
        let mut mrope = None;
        if let Some(p) = positions {
            let [a, b, c] = &p.rows;
            if a.len() != t || b.len() != t || c.len() != t {
                return Err(ModelError::Batch(format!(
                    "M-RoPE rows of {} / {} / {} positions for {t} tokens",
                    a.len(),
                    b.len(),
                    c.len()
                )));
            }
            if a == b && b == c {
                let mut b1 = batch.clone();
                b1.positions = a
                    .iter()
                    .map(|&p| {
                        usize::try_from(p)
                            .map_err(|_| ModelError::Batch(format!("negative M-RoPE position {p}")))
                    })
                    .collect::<Result<_, _>>()?;
                one_d = Some(b1);
            } else {
                mrope = Some([a.as_slice(), b.as_slice(), c.as_slice()]);
            }
        }
        let step = one_d.as_ref().unwrap_or(batch);
        if plan.embed_rows.is_empty() && mrope.is_none() {
            return self.forward(step);
        }
        let mm = MmStep {
            mrope,
            embed_rows: &plan.embed_rows,
            visual_rows: &plan.visual_rows,
            deepstack: &plan.deepstack,
        };
        self.forward_mm(step, &mm)
    }

    /// [`CudaDecoderModel::forward`] of a step with multimodal inputs (see the module docs).
    pub fn forward_mm(
        &mut self,
        batch: &ForwardBatch,
        mm: &MmStep<'_>,
    ) -> Result<usize, ModelError> {
        let (t, h, v) = (
            batch.input_ids.len(),
            self.spec.hidden_size,
            self.spec.vocab_size,
        );
        let table = self.embed.as_ref().ok_or_else(|| {
            ModelError::Batch(format!("{} has no token embedding", self.spec.architecture))
        })?;
        if t == 0 || t > self.limits.max_tokens {
            return Err(ModelError::Batch(format!(
                "a multimodal step of {t} tokens (at most {})",
                self.limits.max_tokens
            )));
        }
        if let Some(&id) = batch.input_ids.iter().find(|&&id| id as usize >= v) {
            return Err(ModelError::Batch(format!(
                "token id {id} out of vocabulary ({v})"
            )));
        }
        let s = self.cx.stream().clone();
        let ids: Vec<i32> = batch.input_ids.iter().map(|&x| x as i32).collect();
        s.memcpy_htod(&ids, &mut self.inputs.ids.slice_mut(..t))
            .map_err(CudaError::from)?;
        self.cx
            .embedding_ids_bf16(table, h, &self.inputs.ids, t, &mut self.act.sel_embed)?;
        for (range, rows) in mm.embed_rows {
            if range.end > t || rows.len() != range.len() * h {
                return Err(ModelError::Batch(format!(
                    "encoder rows {range:?} ({} values) for a step of {t} tokens of width {h}",
                    rows.len()
                )));
            }
            let host: Vec<bf16> = rows.iter().map(|&x| bf16::from_f32(x)).collect();
            s.memcpy_htod(
                &host,
                &mut self.act.sel_embed.slice_mut(range.start * h..range.end * h),
            )
            .map_err(CudaError::from)?;
        }
        self.forward_from(batch, StepInput::Embeds, Some(mm))
    }

    /// Uploads `mm`'s M-RoPE rows (after the batch's own inputs) and deepstack additions;
    /// returns whether the step has M-RoPE rows.
    pub(super) fn upload_mm(&mut self, mm: &MmStep<'_>, t: usize) -> Result<bool, ModelError> {
        let h = self.spec.hidden_size;
        let s = self.cx.stream().clone();
        let m = mm.visual_rows.len();
        if !mm.deepstack.is_empty() && m > 0 {
            let levels = mm.deepstack.len();
            if levels > self.layers.len()
                || mm.deepstack.iter().any(|d| d.len() != m * h)
                || mm.visual_rows.iter().any(|&r| r >= t)
            {
                return Err(ModelError::Batch(format!(
                    "{levels} deepstack levels for {m} rows of a step of {t} tokens \
                     ({} layers)",
                    self.layers.len()
                )));
            }
            let mut seen = vec![false; t];
            for &r in mm.visual_rows {
                if std::mem::replace(&mut seen[r], true) {
                    return Err(ModelError::Batch(format!("deepstack row {r} given twice")));
                }
            }
            let rows: Vec<i32> = mm.visual_rows.iter().map(|&r| r as i32).collect();
            let data: Vec<f32> = mm.deepstack.concat();
            self.residual_adds = Some(DeviceResidualAdds {
                rows: s.clone_htod(&rows).map_err(CudaError::from)?,
                rows_len: m,
                data: s.clone_htod(&data).map_err(CudaError::from)?,
                levels,
            });
        }
        let Some(rows) = mm.mrope else {
            return Ok(false);
        };
        if self.mrope_axes.is_none() {
            return Err(ModelError::Batch(format!(
                "{} takes 1-D positions, not M-RoPE rows",
                self.spec.architecture
            )));
        }
        let stride = self.limits.max_tokens.max(1);
        for (i, row) in rows.iter().enumerate() {
            if row.len() != t {
                return Err(ModelError::Batch(format!(
                    "M-RoPE row {i} has {} positions for {t} tokens",
                    row.len()
                )));
            }
            let pos: Vec<i32> = row
                .iter()
                .map(|&p| {
                    i32::try_from(p)
                        .map_err(|_| ModelError::Batch(format!("M-RoPE position {p} out of range")))
                })
                .collect::<Result<_, _>>()?;
            let base = i * stride;
            s.memcpy_htod(&pos, &mut self.inputs.positions.slice_mut(base..base + t))
                .map_err(CudaError::from)?;
        }
        Ok(true)
    }
}
