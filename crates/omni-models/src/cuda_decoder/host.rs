//! Copies of a [`CudaDecoderModel`]'s last step to the host (each synchronizes the stream):
//! the stage output of a pipeline stage before the last, the Thinker's exports, final-norm rows,
//! logits, and rows of the embedding table.

use omni_backend::cuda::{CudaError, bf16};

use super::CudaDecoderModel;
use crate::ModelError;

impl CudaDecoderModel {
    /// The residual stream a stage before the last leaves for the next, `[tokens, hidden]` of
    /// the last forward, on the host (synchronizes).
    pub fn stage_output_to_host(&self) -> Result<Vec<f32>, ModelError> {
        if self.stage.is_last() {
            return Err(ModelError::Batch(
                "the last pipeline stage ends in logits, not hidden states".into(),
            ));
        }
        let n = self.last_tokens * self.spec.hidden_size;
        let mut host = vec![0f32; n];
        self.cx
            .stream()
            .memcpy_dtoh(&self.act.x.slice(..n), &mut host)
            .map_err(CudaError::from)?;
        Ok(host)
    }

    /// The last forward's exports for every computed token, on the host (synchronizes): the
    /// input embeddings `[tokens, hidden]` (layer 0's input) and, when a capture is set, the
    /// residual stream after that many layers.
    pub fn captured_to_host(&self) -> Result<(Vec<f32>, Option<Vec<f32>>), ModelError> {
        let n = self.last_tokens * self.spec.hidden_size;
        let s = self.cx.stream();
        let mut embed = vec![bf16::ZERO; n];
        s.memcpy_dtoh(&self.act.sel_embed.slice(..n), &mut embed)
            .map_err(CudaError::from)?;
        let after = match &self.capture {
            None => None,
            Some((_, buf)) => {
                let mut host = vec![0f32; n];
                s.memcpy_dtoh(&buf.slice(..n), &mut host)
                    .map_err(CudaError::from)?;
                Some(host)
            }
        };
        Ok((embed.into_iter().map(f32::from).collect(), after))
    }

    /// Final-norm rows of the last forward copied to the host as f32 (synchronizes).
    pub fn final_norm_to_host(&self) -> Result<Vec<f32>, ModelError> {
        let view = self.final_norm();
        let mut host = vec![bf16::ZERO; view.len()];
        self.cx
            .stream()
            .memcpy_dtoh(&view, &mut host)
            .map_err(CudaError::from)?;
        Ok(host.into_iter().map(f32::from).collect())
    }

    /// Rows `ids` of the token embedding table, as f32 on the host (synchronizes): e.g. the
    /// Thinker's TTS-token embeddings, which must be the ones the device holds (random ones
    /// under `--load-format dummy` are made on the device).
    pub fn embedding_rows(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        let h = self.spec.hidden_size;
        let table = self.embed.as_ref().ok_or_else(|| {
            ModelError::Batch(format!("{} has no token embedding", self.spec.architecture))
        })?;
        let mut out = Vec::with_capacity(ids.len() * h);
        let mut row = vec![bf16::ZERO; h];
        for &id in ids {
            let id = id as usize;
            if (id + 1) * h > table.len() {
                return Err(ModelError::Batch(format!(
                    "token {id} is outside the embedding table of {} rows",
                    table.len() / h
                )));
            }
            self.cx
                .stream()
                .memcpy_dtoh(&table.slice(id * h..(id + 1) * h), &mut row)
                .map_err(CudaError::from)?;
            out.extend(row.iter().map(|&x| f32::from(x)));
        }
        Ok(out)
    }

    /// Copies the last forward's logits to the host (synchronizes).
    pub fn logits_to_host(&self) -> Result<Vec<f32>, ModelError> {
        let view = self.logits();
        let mut host = vec![0f32; view.len()];
        self.cx
            .stream()
            .memcpy_dtoh(&view, &mut host)
            .map_err(CudaError::from)?;
        Ok(host)
    }
}
