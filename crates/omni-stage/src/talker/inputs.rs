//! The Talker stage's inputs: Thinker chunks (a request's prompt, fed-back rows, its end) and
//! the batched projection of fed-back rows.

use omni_core::connector::CodecChunker;
use omni_models::qwen3_omni::talker::Projection;
use omni_models::qwen3_omni::talker::prompt::ThinkerExports;
use omni_models::qwen3_omni::thinker::TtsEmbeddings;
use omni_protocol::{RequestId, StageOutputs, ThinkerChunk, ThinkerStates, ThinkerToTalker};

use super::{TalkerReq, TalkerStage};
use crate::StageError;
use crate::tensors::read_f32;

impl TalkerStage {
    /// Projects the waiting fed-back rows in one call and appends each to its request's
    /// trailing text, in arrival order. A failure fails the requests whose rows it held.
    pub(super) fn project_fed_back(&mut self, out: &mut StageOutputs) {
        if self.unprojected.is_empty() {
            return;
        }
        let waiting = std::mem::take(&mut self.unprojected);
        let rows: Vec<f32> = waiting
            .iter()
            .flat_map(|(_, r)| r.iter().copied())
            .collect();
        let projected = self.talker.project(Projection::Text, &rows);
        let h = self.talker.config().talker_config.text_config.hidden_size;
        match projected {
            Ok(text) if text.len() == waiting.len() * h => {
                for ((id, _), row) in waiting.iter().zip(text.chunks_exact(h)) {
                    if let Some(r) = self.reqs.get_mut(id) {
                        r.prompt.trailing_text.extend_from_slice(row);
                    }
                }
            }
            other => {
                let why = match other {
                    Err(e) => e.to_string(),
                    Ok(t) => format!("{} projected values for {} rows", t.len(), waiting.len()),
                };
                let mut ids: Vec<RequestId> = waiting.into_iter().map(|(id, _)| id).collect();
                ids.sort();
                ids.dedup();
                for id in ids {
                    self.drop_request(&id);
                    out.failed.push((id, format!("text projection: {why}")));
                }
            }
        }
    }

    /// Forgets a request everywhere (its scheduler entry too).
    pub(super) fn drop_request(&mut self, id: &RequestId) {
        self.pending.remove(id);
        self.reqs.remove(id);
        self.unprojected.retain(|(r, _)| r != id);
        self.scheduler.abort_requests([id.as_str()]);
    }

    pub(super) fn chunker(&self) -> CodecChunker {
        let groups = self.talker.config().talker_config.num_code_groups;
        let w = self.windowing;
        if self.async_chunk {
            CodecChunker::new(
                groups,
                w.initial as usize,
                w.chunk as usize,
                w.left_context as usize,
            )
        } else {
            // One window of every frame, sent when the request finishes.
            CodecChunker::new(groups, usize::MAX, usize::MAX, 0)
        }
    }

    /// The Thinker's first payload: builds the prompt and starts the request.
    pub(super) fn start(
        &mut self,
        id: &RequestId,
        states: &ThinkerStates,
        buffers: &[&[u8]],
        full: bool,
    ) -> Result<(), StageError> {
        let Some(p) = self.pending.remove(id) else {
            return Err(StageError::Input(format!(
                "Thinker states for {id}, which the Talker does not know"
            )));
        };
        let embed = read_f32(&states.embed, buffers)?;
        let hidden = read_f32(&states.hidden, buffers)?;
        let tts = read_f32(&states.tts, buffers)?;
        let th = tts.len() / 3;
        let tts = TtsEmbeddings {
            bos: tts[..th].to_vec(),
            eos: tts[th..2 * th].to_vec(),
            pad: tts[2 * th..].to_vec(),
        };
        let ex = ThinkerExports {
            ids: &states.ids,
            prompt_len: states.prompt_len as usize,
            embed: &embed,
            hidden: &hidden,
            tts: &tts,
        };
        let mut prompt = self.talker.build_prompt(&ex, p.speaker)?;
        let h = prompt.hidden;
        // The trailing text ends with tts_eos: kept aside until the Thinker ends.
        let cut = prompt.trailing_text.len().saturating_sub(h);
        let tts_eos = prompt.trailing_text.split_off(cut);
        let n = prompt.prefill_len();
        let mut req = p.request;
        req.prompt_token_ids = vec![0; n];
        // The Talker's "tokens" are layer-0 codes: it ends at the codec EOS.
        req.eos_token_id = Some(self.talker.config().talker_config.codec_eos_token_id);
        self.scheduler
            .add_request(req.clone())
            .map_err(|e| StageError::Input(e.to_string()))?;
        let seed = req.sampling_params.seed.unwrap_or(self.seed);
        self.reqs.insert(
            id.clone(),
            TalkerReq {
                params: req.sampling_params,
                prompt,
                tts_eos,
                ended: false,
                block_ids: Vec::new(),
                layer0: Vec::new(),
                next_input: Vec::new(),
                chunker: self.chunker(),
                next_chunk: 0,
                frames: 0,
                seed,
            },
        );
        if full {
            self.end_text(id);
        }
        Ok(())
    }

    pub(super) fn end_text(&mut self, id: &RequestId) {
        if let Some(r) = self.reqs.get_mut(id)
            && !r.ended
        {
            let eos = std::mem::take(&mut r.tts_eos);
            r.prompt.trailing_text.extend_from_slice(&eos);
            r.ended = true;
        }
    }

    pub(super) fn thinker_chunk(
        &mut self,
        m: ThinkerToTalker,
        buffers: &[&[u8]],
    ) -> Result<(), StageError> {
        let id = m.request_id;
        match m.chunk {
            ThinkerChunk::Prefill(s) => self.start(&id, &s, buffers, false),
            ThinkerChunk::Full(s) => self.start(&id, &s, buffers, true),
            ThinkerChunk::Decode { embed, .. } => {
                let row = read_f32(&embed, buffers)?;
                let th = self.talker.config().talker_config.thinker_hidden_size;
                if row.len() != th {
                    return Err(StageError::Input(format!(
                        "a fed-back Thinker row of {} values, not {th}",
                        row.len()
                    )));
                }
                self.unprojected.push((id, row));
                Ok(())
            }
            ThinkerChunk::End => {
                self.end_text(&id);
                Ok(())
            }
        }
    }
}
