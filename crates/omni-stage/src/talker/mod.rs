//! The Talker stage: omni-core's scheduler over the Talker and its code predictor. One step
//! gives every scheduled request one frame (the layer-0 code from the Talker's logits, then
//! the code predictor's 15 residual codes); frames go out in Code2Wav windows.
//!
//! A request is registered by its `Add` (voice, sampling) and enters the scheduler when the
//! Thinker's first chunk arrives (its prompt length is known only then): until that it holds no
//! batch slot and no KV block. Its decode step `k` is fed `codec_sum(frame k) + text(k)`,
//! where `text(k)` is the trailing text row `k` (a fed-back Thinker token, then `tts_eos`) or
//! `tts_pad` once the Thinker ended; a request whose row `k` has not arrived yet is held out of
//! the batch (`Scheduler::set_blocked`) and keeps its KV blocks.

use std::collections::HashMap;

use omni_core::connector::CodecChunker;
use omni_core::{Scheduler, SchedulerConfig};
use omni_models::qwen3_omni::talker::prompt::TalkerPrompt;
use omni_models::qwen3_omni::talker::sampling::{
    argmax, repetition_penalty, suppress_control_codes, talker_uniform, top_k_top_p,
};
use omni_models::{ForwardBatch, SeqChunk};
use omni_protocol::{
    BlockId, CodecChunk, CodecWindowing, EngineCoreRequest, ModelRunnerOutput, RequestId,
    SamplingParams, SchedulerOutput, StageInput, StageOutputs, StageSpec, ThinkerChunk,
};

use crate::StageError;
use crate::nets::{CodeDraw, TalkerNet};
use crate::profile::StepClock;
use crate::stage::{
    HasBlocks, Stage, StepResult, scheduled, scheduler_config, update_block_tables,
};

mod inputs;

/// One live request.
#[derive(Debug)]
struct TalkerReq {
    params: SamplingParams,
    /// The prefill and the text rows (the trailing text grows as the Thinker feeds back).
    prompt: TalkerPrompt,
    /// `text_projection(tts_eos)`, appended when the Thinker ends.
    tts_eos: Vec<f32>,
    /// The Thinker ended: rows past the trailing text are `tts_pad`.
    ended: bool,
    block_ids: Vec<BlockId>,
    /// Layer-0 codes so far (the repetition penalty's history).
    layer0: Vec<u32>,
    /// `codec_sum` of the last frame: the next decode input before its text row.
    next_input: Vec<f32>,
    chunker: CodecChunker,
    next_chunk: u32,
    /// Frames done (the draws' counter).
    frames: u64,
    seed: u64,
}

impl HasBlocks for TalkerReq {
    fn blocks(&mut self) -> &mut Vec<BlockId> {
        &mut self.block_ids
    }
}

/// A registered request still waiting for its first Thinker chunk.
#[derive(Debug)]
struct Pending {
    request: EngineCoreRequest,
    speaker: u32,
}

/// See the module docs.
#[derive(Debug)]
pub struct TalkerStage {
    talker: Box<dyn TalkerNet>,
    scheduler: Scheduler,
    config: SchedulerConfig,
    pending: HashMap<RequestId, Pending>,
    reqs: HashMap<RequestId, TalkerReq>,
    windowing: CodecWindowing,
    async_chunk: bool,
    seed: u64,
    /// Fed-back Thinker rows (`[thinker_hidden]` each) not yet through `text_projection`:
    /// projected together before the next step or the next non-decode chunk (one GEMM over
    /// a step's rows instead of one GEMV, with the whole weight read, per row).
    unprojected: Vec<(RequestId, Vec<f32>)>,
}

impl TalkerStage {
    /// A stage over a loaded Talker (its KV cache of `spec.num_blocks` blocks).
    pub fn new(talker: Box<dyn TalkerNet>, spec: &StageSpec) -> Result<Self, StageError> {
        let config = scheduler_config(spec, false);
        Ok(Self {
            scheduler: Scheduler::new(config.clone())
                .map_err(|e| StageError::Config(e.to_string()))?,
            config,
            talker,
            pending: HashMap::new(),
            reqs: HashMap::new(),
            windowing: spec.windowing,
            async_chunk: spec.async_chunk,
            seed: spec.seed,
            unprojected: Vec::new(),
        })
    }

    fn update_states(&mut self, so: &SchedulerOutput) {
        update_block_tables(so, &mut self.reqs);
    }

    /// Holds out of the batch the requests whose next text row has not arrived.
    fn gate(&mut self) {
        for (id, r) in &self.reqs {
            let h = r.prompt.hidden;
            let k = (r.frames as usize).saturating_sub(1);
            let ready = r.frames == 0 || r.ended || (k + 1) * h <= r.prompt.trailing_text.len();
            self.scheduler.set_blocked(id, !ready);
        }
    }

    /// The input rows of a scheduled chunk: prefill rows, or the decode input.
    fn inputs_of(&self, id: &RequestId, start: usize, n: usize) -> Result<Vec<f32>, StageError> {
        let r = self
            .reqs
            .get(id)
            .ok_or_else(|| StageError::Model(format!("scheduled unknown request {id}")))?;
        let h = r.prompt.hidden;
        let p = r.prompt.prefill_len();
        if start + n <= p {
            return Ok(r.prompt.prefill[start * h..(start + n) * h].to_vec());
        }
        if n != 1 || r.next_input.len() != h {
            return Err(StageError::Model(format!(
                "request {id}: {n} positions from {start} past a prefill of {p}"
            )));
        }
        let k = r.frames as usize - 1;
        let text = r.prompt.text_for_step(k);
        Ok(r.next_input.iter().zip(text).map(|(a, b)| a + b).collect())
    }

    fn emit(
        &mut self,
        id: &RequestId,
        window: Option<omni_core::connector::CodecWindow>,
        out: &mut StageOutputs,
    ) {
        let Some(w) = window else { return };
        let Some(r) = self.reqs.get_mut(id) else {
            return;
        };
        out.codec_chunks.push(CodecChunk {
            request_id: id.clone(),
            chunk_id: r.next_chunk,
            codes: w.codes,
            num_frames: w.num_frames as u32,
            left_context: w.left_context as u32,
            finished: w.finished,
        });
        r.next_chunk += 1;
    }
}

impl Stage for TalkerStage {
    fn input(&mut self, input: StageInput, buffers: &[&[u8]], out: &mut StageOutputs) {
        match input {
            StageInput::Add(req) => {
                let id = req.request_id.clone();
                let voice = req.omni.as_ref().map(|o| o.speaker.as_str()).unwrap_or("");
                match self.talker.config().talker_config.speaker(voice) {
                    Ok(speaker) => {
                        if let Err(e) = req.sampling_params.validate() {
                            out.failed.push((id, format!("talker sampling: {e}")));
                        } else {
                            self.pending.insert(
                                id,
                                Pending {
                                    request: *req,
                                    speaker,
                                },
                            );
                        }
                    }
                    Err(e) => out.failed.push((id, e.to_string())),
                }
            }
            StageInput::Thinker(chunks) => {
                for m in chunks {
                    // Rows fed back earlier come before a request's prompt or end.
                    if !matches!(m.chunk, ThinkerChunk::Decode { .. }) {
                        self.project_fed_back(out);
                    }
                    let id = m.request_id.clone();
                    if let Err(e) = self.thinker_chunk(m, buffers) {
                        self.drop_request(&id);
                        out.failed.push((id, e.to_string()));
                    }
                }
            }
            StageInput::Abort(ids) => {
                for id in &ids {
                    self.drop_request(id);
                }
            }
            StageInput::Codec(_) | StageInput::Text(_) | StageInput::Shutdown => {}
        }
    }

    fn has_work(&self) -> bool {
        self.scheduler.has_unfinished_requests() || self.scheduler.has_finished_requests()
    }

    fn stats(&self) -> Option<omni_protocol::SchedulerStats> {
        Some(self.scheduler.stats())
    }

    fn step(&mut self, clock: &mut StepClock) -> Result<StepResult, StageError> {
        let mut out = StageOutputs::default();
        self.project_fed_back(&mut out);
        self.gate();
        let so = self.scheduler.schedule();
        self.update_states(&so);
        if so.is_empty() {
            return Ok((out, Vec::new()));
        }
        let scheduled = scheduled(&so);
        clock.set_rows(scheduled.len());
        clock.lap("schedule");
        let mut embeds = Vec::new();
        let mut sampled = Vec::new();
        let mut rows = Vec::new();
        let mut row = 0;
        let placeholders: Vec<Vec<u32>> = scheduled.iter().map(|(_, _, n)| vec![0; *n]).collect();
        let mut chunks = Vec::with_capacity(scheduled.len());
        for ((id, start, n), tokens) in scheduled.iter().zip(&placeholders) {
            embeds.extend(self.inputs_of(id, *start, *n)?);
            let r = &self.reqs[id];
            row += n;
            let samples = start + n >= r.prompt.prefill_len();
            if samples {
                rows.push(row - 1);
            }
            sampled.push(samples);
            chunks.push(SeqChunk {
                tokens,
                start_pos: *start,
                block_table: &r.block_ids,
            });
        }
        let mut batch = ForwardBatch::from_chunks(&chunks, self.config.block_size)?;
        batch.logits_indices = Some(rows.clone());
        clock.lap("inputs");
        let mut logits = self.talker.forward(&batch, &embeds)?;
        clock.lap("forward");
        let tc = &self.talker.config().talker_config;
        let eos = tc.codec_eos_token_id;
        let v = logits.len().checked_div(rows.len()).unwrap_or(0);
        // Layer 0 per sampled row.
        let ids: Vec<&RequestId> = scheduled
            .iter()
            .zip(&sampled)
            .filter(|(_, s)| **s)
            .map(|((id, _, _), _)| id)
            .collect();
        let mut c0 = Vec::with_capacity(ids.len());
        let mut draws = Vec::with_capacity(ids.len());
        for (k, id) in ids.iter().enumerate() {
            let r = &self.reqs[*id];
            let l = &mut logits[k * v..(k + 1) * v];
            repetition_penalty(l, &r.layer0, r.params.repetition_penalty);
            suppress_control_codes(l, eos);
            let greedy = r.params.temperature <= 0.0;
            let code = if greedy {
                argmax(l)
            } else {
                l.iter_mut().for_each(|x| *x /= r.params.temperature);
                let k = r.params.top_k.map_or(v, |k| k as usize);
                // Layer 0 is group 0 of the frame's draws (the kernels' offsets).
                let groups = tc.num_code_groups as u64;
                top_k_top_p(
                    l,
                    k,
                    r.params.top_p,
                    talker_uniform(r.seed, r.frames * groups),
                )
            };
            c0.push(code);
            draws.push(CodeDraw {
                greedy,
                seed: r.seed,
                frame: r.frames,
            });
        }
        clock.lap("layer0");
        // The code predictor over every output row; an EOS row's frame is dropped.
        let mut frames: HashMap<&RequestId, (Vec<u32>, Vec<f32>)> = HashMap::new();
        if !c0.is_empty() {
            let h = self.talker.hidden_size();
            let (codes, sums) = self.talker.predict(&c0, &draws)?;
            let g = codes.len() / c0.len();
            for (k, id) in ids.iter().enumerate() {
                if c0[k] != eos {
                    frames.insert(
                        *id,
                        (
                            codes[k * g..(k + 1) * g].to_vec(),
                            sums[k * h..(k + 1) * h].to_vec(),
                        ),
                    );
                }
            }
        }
        clock.lap("predict");
        let mut mro = ModelRunnerOutput::default();
        let mut c0s = c0.iter();
        for ((id, _, _), s) in scheduled.iter().zip(&sampled) {
            mro.req_ids.push(id.clone());
            mro.logprobs.push(Vec::new());
            if *s {
                let code = c0s.next().copied().unwrap_or(eos);
                mro.sampled_token_ids.push(vec![code]);
            } else {
                mro.sampled_token_ids.push(Vec::new());
            }
        }
        let mut windows = Vec::new();
        for (id, (codes, sum)) in frames {
            if let Some(r) = self.reqs.get_mut(id) {
                r.layer0.push(codes[0]);
                r.next_input = sum;
                r.frames += 1;
                windows.push((id.clone(), r.chunker.push(&codes)));
            }
        }
        for (id, w) in windows {
            self.emit(&id, w, &mut out);
        }
        let outputs = self.scheduler.update_from_output(&so, &mro);
        for o in outputs.iter().filter(|o| o.finished()) {
            let last = self
                .reqs
                .get_mut(&o.request_id)
                .and_then(|r| r.chunker.finish());
            let id = o.request_id.clone();
            match last {
                Some(w) => self.emit(&id, Some(w), &mut out),
                None => {
                    // No frame left to send: an empty last window ends the stream.
                    let n = self.reqs.get(&id).map_or(0, |r| r.next_chunk);
                    out.codec_chunks.push(CodecChunk {
                        request_id: id.clone(),
                        chunk_id: n,
                        codes: Vec::new(),
                        num_frames: 0,
                        left_context: 0,
                        finished: true,
                    });
                }
            }
            self.reqs.remove(&id);
        }
        out.outputs = outputs;
        out.scheduler_stats = Some(self.scheduler.stats());
        clock.lap("outputs");
        Ok((out, Vec::new()))
    }
}
