//! The Thinker stage: omni-core's scheduler over the Thinker network; text out, and for
//! requests that want audio, the layer-0 input and the accept-layer residual of every computed
//! position to the Talker (omni.md 2.5).
//!
//! Async chunks: chunk 0 once the prompt and the first fed-back token are computed (`P + 1`
//! rows, with the TTS embeddings), then one `Decode` row per fed-back token, then `End` when
//! the request finishes (the last generated token is never fed back). Without async chunks one
//! `Full` payload when it finishes.
//!
//! Images and audio: a request's items arrive with its `Add` (their tensors are the message's
//! buffers); the scheduler's encoder cache manager picks the step that encodes each one, the
//! stage keeps the outputs by content hash until the scheduler frees them, and each step
//! merges the placeholder rows it computes (M-RoPE rows per request, from the prompt and its
//! items), as the text engine's worker does.

use std::collections::HashMap;

use omni_core::{Scheduler, SchedulerConfig};
use omni_models::{EncoderOutput, ForwardBatch, MropePositions, MultiModalKind, SeqChunk};
use omni_protocol::{
    BlockId, EngineCoreRequest, ModelRunnerOutput, RequestId, SchedulerOutput, StageInput,
    StageOutputs, StageSpec, TensorBuffers, ThinkerChunk, ThinkerStates, ThinkerToTalker, TokenId,
};
use omni_worker::mm_inputs::{EncoderCache, RequestMm};
use omni_worker::model_runner::{device_sample_for, prompt_seed};
use omni_worker::sampler::{SampledToken, Sampler, SamplingSeq};

use crate::StageError;
use crate::nets::{StepMm, ThinkerNet};
use crate::profile::StepClock;
use crate::stage::{
    HasBlocks, Stage, StepResult, scheduled, scheduler_config, update_block_tables,
};
use crate::tensors::Buffers;

/// One live request.
#[derive(Debug)]
struct ThinkerReq {
    request: EngineCoreRequest,
    /// Prompt, then generated tokens.
    tokens: Vec<TokenId>,
    block_ids: Vec<BlockId>,
    /// Whether its states go to a Talker.
    audio: bool,
    /// Exported rows so far (positions `0..rows`), `[rows, hidden]` each.
    embed: Vec<f32>,
    hidden: Vec<f32>,
    /// Rows already sent (async mode).
    sent_rows: usize,
    /// The request's sampling stream (its seed, else the stage's seed and the prompt).
    seed: u64,
    next_chunk: u32,
    /// Its images and audio clips, with the prompt's M-RoPE rows.
    mm: RequestMm,
}

impl HasBlocks for ThinkerReq {
    fn blocks(&mut self) -> &mut Vec<BlockId> {
        &mut self.block_ids
    }
}

impl ThinkerReq {
    fn rows(&self, width: usize) -> usize {
        self.embed.len() / width.max(1)
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct ThinkerStage {
    net: Box<dyn ThinkerNet>,
    scheduler: Scheduler,
    sampler: Sampler,
    /// The stage's seed (streams of unseeded requests).
    seed: u64,
    reqs: HashMap<RequestId, ThinkerReq>,
    /// Encoder outputs by content hash, until the scheduler frees them.
    encoder_cache: EncoderCache,
    block_size: usize,
    hidden: usize,
    vocab: usize,
    async_chunk: bool,
}

impl ThinkerStage {
    /// A stage over a loaded Thinker (its KV cache of `spec.num_blocks` blocks) with `spec`'s
    /// batch limits.
    pub fn new(net: Box<dyn ThinkerNet>, spec: &StageSpec) -> Result<Self, StageError> {
        // Prefix caching only for a net that exports no states: a cached prompt block is not
        // computed, so its positions would export nothing (the Talker needs every position's).
        let prefix_caching = spec.enable_prefix_caching && !net.exports_states();
        let config: SchedulerConfig = scheduler_config(spec, prefix_caching);
        let (hidden, vocab) = (net.hidden_size(), net.vocab_size());
        Ok(Self {
            net,
            block_size: config.block_size,
            scheduler: Scheduler::new(config).map_err(|e| StageError::Config(e.to_string()))?,
            sampler: Sampler::new(Some(spec.seed)),
            seed: spec.seed,
            reqs: HashMap::new(),
            encoder_cache: EncoderCache::default(),
            hidden,
            vocab,
            async_chunk: spec.async_chunk,
        })
    }

    fn update_states(&mut self, so: &SchedulerOutput) {
        for id in &so.finished_req_ids {
            self.reqs.remove(id);
        }
        self.encoder_cache.free(&so.free_encoder_mm_hashes);
        update_block_tables(so, &mut self.reqs);
    }

    /// Runs the encoder of every item the scheduler listed for this step into the cache.
    fn run_encoders(&mut self, so: &SchedulerOutput) -> Result<(), StageError> {
        let (reqs, net) = (&self.reqs, &self.net);
        self.encoder_cache.encode_scheduled(
            &so.scheduled_encoder_inputs,
            |id| reqs.get(id).map(|r| &r.mm),
            |item| Ok(net.encode_mm(&item.feature())?),
            StageError::Model,
        )
    }

    /// A new request's items (their bytes from the `Add` message's buffers) and M-RoPE rows.
    fn request_mm(
        &self,
        req: &mut EngineCoreRequest,
        buffers: &[&[u8]],
    ) -> Result<RequestMm, String> {
        if req.mm_features.is_empty() {
            return Ok(RequestMm::default());
        }
        let mut b = TensorBuffers::new();
        for bytes in buffers {
            b.push(bytes.to_vec().into());
        }
        req.mm_buffers = b;
        for f in &req.mm_features {
            f.check(req.prompt_token_ids.len(), &req.mm_buffers)?;
        }
        let mut mm = RequestMm::from_request(req);
        let kinds: Vec<MultiModalKind> = mm.items.iter().map(|i| i.kind).collect();
        mm.mrope = Some(
            self.net
                .mrope_positions(&req.prompt_token_ids, &kinds)
                .map_err(|e| e.to_string())?,
        );
        Ok(mm)
    }

    /// The chunks owed to the Talker after this step.
    fn chunks(&mut self, finished: &[RequestId], out: &mut StageOutputs, bufs: &mut Buffers) {
        let h = self.hidden;
        let tts_rows: Vec<f32> = self.net.tts_rows().to_vec();
        for (id, r) in self.reqs.iter_mut().filter(|(_, r)| r.audio) {
            let done = finished.contains(id);
            let prompt_len = r.request.prompt_token_ids.len();
            let rows = r.rows(h);
            let mut send = |chunk: ThinkerChunk, r: &mut ThinkerReq| {
                out.thinker_chunks.push(ThinkerToTalker {
                    request_id: id.clone(),
                    chunk_id: r.next_chunk,
                    chunk,
                });
                r.next_chunk += 1;
            };
            let states = |r: &ThinkerReq, n: usize, bufs: &mut Buffers| ThinkerStates {
                ids: r.tokens.clone(),
                prompt_len: prompt_len as u32,
                embed: bufs.push_f32("thinker.embed", id, &r.embed[..n * h], h),
                hidden: bufs.push_f32("thinker.hidden", id, &r.hidden[..n * h], h),
                tts: bufs.push_f32("thinker.tts", id, &tts_rows, h),
                speaker: r
                    .request
                    .omni
                    .as_ref()
                    .map(|o| o.speaker.clone())
                    .unwrap_or_default(),
            };
            if !self.async_chunk {
                if done {
                    let s = states(r, rows, bufs);
                    send(ThinkerChunk::Full(s), r);
                }
                continue;
            }
            if r.sent_rows == 0 && rows > prompt_len {
                let s = states(r, prompt_len + 1, bufs);
                send(ThinkerChunk::Prefill(s), r);
                r.sent_rows = prompt_len + 1;
            }
            if r.sent_rows > 0 {
                while r.sent_rows < rows {
                    let k = r.sent_rows;
                    let token = r.tokens.get(k).copied().unwrap_or(0);
                    let embed = bufs.push_f32("thinker.embed", id, &r.embed[k * h..(k + 1) * h], h);
                    send(ThinkerChunk::Decode { token, embed }, r);
                    r.sent_rows += 1;
                }
            }
            if done {
                if r.sent_rows == 0 {
                    // Finished before a token was fed back: everything in one payload.
                    let s = states(r, rows, bufs);
                    send(ThinkerChunk::Full(s), r);
                } else {
                    send(ThinkerChunk::End, r);
                }
            }
        }
    }
}

impl Stage for ThinkerStage {
    fn input(&mut self, input: StageInput, buffers: &[&[u8]], out: &mut StageOutputs) {
        match input {
            StageInput::Add(req) => {
                let mut req = *req;
                let id = req.request_id.clone();
                let mm = match self.request_mm(&mut req, buffers) {
                    Ok(mm) => mm,
                    Err(e) => {
                        let err = omni_protocol::AddRequestError::InvalidMultiModal {
                            request_id: id.clone(),
                            reason: e,
                        };
                        out.rejected.push((id, err));
                        return;
                    }
                };
                let audio =
                    self.net.exports_states() && req.omni.as_ref().is_some_and(|o| o.wants_audio());
                let seed = req
                    .sampling_params
                    .seed
                    .unwrap_or_else(|| prompt_seed(self.seed, &req.prompt_token_ids));
                match self.scheduler.add_request(req.clone()) {
                    Ok(()) => {
                        self.reqs.insert(
                            id,
                            ThinkerReq {
                                tokens: req.prompt_token_ids.clone(),
                                request: req,
                                block_ids: Vec::new(),
                                audio,
                                embed: Vec::new(),
                                hidden: Vec::new(),
                                sent_rows: 0,
                                seed,
                                next_chunk: 0,
                                mm,
                            },
                        );
                    }
                    Err(e) => out.rejected.push((id, e)),
                }
            }
            StageInput::Abort(ids) => {
                self.scheduler
                    .abort_requests(ids.iter().map(String::as_str));
                for id in &ids {
                    self.reqs.remove(id);
                }
            }
            StageInput::Thinker(_)
            | StageInput::Codec(_)
            | StageInput::Text(_)
            | StageInput::Shutdown => {}
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
        let mut bufs = Buffers::default();
        let so = self.scheduler.schedule();
        self.update_states(&so);
        if so.is_empty() {
            return Ok((out, bufs.0));
        }
        let scheduled = scheduled(&so);
        clock.set_rows(scheduled.len());
        clock.lap("schedule");
        if !so.scheduled_encoder_inputs.is_empty() {
            self.run_encoders(&so)?;
            clock.lap("encode");
        }
        let mut chunks = Vec::with_capacity(scheduled.len());
        let mut sample_rows = Vec::new();
        let mut samples = Vec::new();
        let mut row = 0;
        let mut any_audio = false;
        let mut features = Vec::new();
        let mut mrope: [Vec<i64>; 3] = Default::default();
        let mut any_mrope = false;
        for (id, start, n) in &scheduled {
            let r = self
                .reqs
                .get(id)
                .ok_or_else(|| StageError::Model(format!("scheduled unknown request {id}")))?;
            any_audio |= r.audio;
            let end = start + n;
            if end > r.tokens.len() {
                return Err(StageError::Model(format!(
                    "request {id}: scheduled to position {end} of {}",
                    r.tokens.len()
                )));
            }
            features.extend(r.mm.step_features(*start, end, row));
            r.mm.push_positions(*start, end, &mut mrope);
            any_mrope |= r.mm.mrope.is_some();
            row += n;
            let sampled = *n > 0 && end == r.tokens.len();
            if sampled {
                sample_rows.push(row - 1);
            }
            samples.push(sampled);
            chunks.push(SeqChunk {
                tokens: &r.tokens[*start..end],
                start_pos: *start,
                block_table: &r.block_ids,
            });
        }
        let mut batch = ForwardBatch::from_chunks(&chunks, self.block_size)?;
        batch.logits_indices = Some(sample_rows);
        let encoded: Vec<&EncoderOutput> = features
            .iter()
            .map(|f| self.encoder_cache.get(f.mm_hash))
            .collect::<Result<_, _>>()
            .map_err(|e| StageError::Model(e.to_string()))?;
        let positions = any_mrope.then_some(MropePositions { rows: mrope });
        let mm = StepMm {
            positions: positions.as_ref(),
            features: &features,
            encoded: &encoded,
        };
        let step = self.net.forward(&batch, any_audio, mm)?;
        clock.lap(if any_audio {
            "forward+export"
        } else {
            "forward"
        });
        // Exports: each request's rows past what it already holds (a recompute after a
        // preemption repeats positions).
        let h = self.hidden;
        if let Some((embed, hidden)) = &step.exports {
            let mut row = 0;
            for (id, start, n) in &scheduled {
                if let Some(r) = self.reqs.get_mut(id)
                    && r.audio
                {
                    for p in *start..start + n {
                        if p == r.rows(h) {
                            let k = row + p - start;
                            r.embed.extend_from_slice(&embed[k * h..(k + 1) * h]);
                            r.hidden.extend_from_slice(&hidden[k * h..(k + 1) * h]);
                        }
                    }
                }
                row += n;
            }
        }
        // Sampling on the host (penalties, seeds, logprobs as a text request).
        let sampled_ids: Vec<&RequestId> = scheduled
            .iter()
            .zip(&samples)
            .filter(|(_, s)| **s)
            .map(|((id, _, _), _)| id)
            .collect();
        let seqs: Vec<SamplingSeq<'_>> = sampled_ids
            .iter()
            .filter_map(|id| self.reqs.get(*id))
            .map(|r| {
                let p = r.request.prompt_token_ids.len();
                SamplingSeq {
                    params: &r.request.sampling_params,
                    prompt_token_ids: &r.tokens[..p],
                    output_token_ids: &r.tokens[p..],
                    eos_token_id: r.request.eos_token_id,
                }
            })
            .collect();
        // On the device when every row allows it (no penalties, logprobs or pending
        // min_tokens), as the text engine does; else the logits come to the host sampler.
        let device_rows: Option<Vec<omni_worker::DeviceSample>> = sampled_ids
            .iter()
            .filter_map(|id| self.reqs.get(*id))
            .map(|r| {
                let outputs = r.tokens.len() - r.request.prompt_token_ids.len();
                device_sample_for(&r.request.sampling_params, outputs, r.seed)
            })
            .collect();
        let on_device = match device_rows {
            Some(rows) if !rows.is_empty() => self.net.sample_on_device(&rows)?,
            _ => None,
        };
        let tokens: Vec<SampledToken> = if seqs.is_empty() {
            Vec::new()
        } else if let Some(t) = on_device {
            t.into_iter()
                .map(|token_id| SampledToken {
                    token_id,
                    logprobs: None,
                })
                .collect()
        } else {
            let logits = self.net.logits_host()?;
            self.sampler
                .sample(&logits, self.vocab, &seqs)
                .map_err(|e| StageError::Model(e.to_string()))?
        };
        clock.lap("sample");
        let mut mro = ModelRunnerOutput::default();
        let mut tokens = tokens.into_iter();
        for ((id, _, _), s) in scheduled.iter().zip(&samples) {
            mro.req_ids.push(id.clone());
            if !s {
                mro.sampled_token_ids.push(Vec::new());
                mro.logprobs.push(Vec::new());
                continue;
            }
            let t = tokens
                .next()
                .ok_or_else(|| StageError::Model("the sampler returned too few tokens".into()))?;
            if let Some(r) = self.reqs.get_mut(id) {
                r.tokens.push(t.token_id);
            }
            mro.sampled_token_ids.push(vec![t.token_id]);
            mro.logprobs.push(t.logprobs.into_iter().collect());
        }
        let outputs = self.scheduler.update_from_output(&so, &mro);
        let finished: Vec<RequestId> = outputs
            .iter()
            .filter(|o| o.finished())
            .map(|o| o.request_id.clone())
            .collect();
        self.chunks(&finished, &mut out, &mut bufs);
        for id in &finished {
            self.reqs.remove(id);
        }
        out.outputs = outputs;
        out.scheduler_stats = Some(self.scheduler.stats());
        clock.lap("outputs");
        Ok((out, bufs.0))
    }
}
