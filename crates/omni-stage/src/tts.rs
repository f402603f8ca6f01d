//! The TTS stage: text in, 24 kHz speech out, behind a text stage (the built-in voice,
//! omni-tts's hibari, after the built-in SmolLM2).
//!
//! A request is registered by its `Add` (prompt ids for detokenizing in context, the noise
//! seed of its sampling); then [`StageInput::Text`] deltas bring the text stage's new token ids
//! as they are generated. The stage detokenizes them (the text model's tokenizer, special tokens
//! skipped), cuts the text into sentences as it streams (`SentenceStream`, with long sentences
//! also cut at clause breaks so the first audio comes early), and each step speaks at most one
//! ready sentence per request, in admission order, so one long answer does not hold the others
//! back. Each sentence goes out as the request's next `AudioOutput`; the output after the last
//! sentence of a finished text carries `finish_reason`, which ends the request.

use std::collections::{HashMap, VecDeque};

use omni_protocol::{
    AudioOutput, EngineCoreOutput, EngineCoreRequest, FinishReason, RequestId, SchedulerStats,
    StageInput, StageOutputs, StageSpec, TextDelta,
};
use omni_tokenizer::{IncrementalDetokenizer, Tokenizer};
use omni_tts::{NumpyRng, SentenceStream, Voice};

use crate::StageError;
use crate::profile::StepClock;
use crate::stage::{Stage, StepResult};

/// An unfinished sentence longer than this (characters) is also cut at its last clause break.
const CLAUSE_FLUSH_CHARS: usize = 120;
/// The same for a request's first piece of speech: short, so the first audio comes early.
const FIRST_CLAUSE_FLUSH_CHARS: usize = 40;
/// Samples per acoustic-model frame (the iSTFT hop), for `AudioOutput::num_frames`.
const HOP: usize = 300;

/// One live request.
#[derive(Debug)]
struct TtsReq {
    detok: IncrementalDetokenizer,
    text: SentenceStream,
    /// Sentences ready to speak, in order.
    ready: VecDeque<String>,
    rng: NumpyRng,
    speed: f32,
    /// The next `TextDelta::chunk_id` expected.
    next_chunk: u32,
    /// The text stage finished: `ready` holds the rest of the text.
    text_done: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct TtsStage {
    voice: Voice,
    tokenizer: Tokenizer,
    reqs: HashMap<RequestId, TtsReq>,
    /// Live requests in admission order.
    order: Vec<RequestId>,
    seed: u64,
    max_num_seqs: usize,
}

impl TtsStage {
    /// Loads the voice in `spec.model` and the text model's tokenizer `spec.tokenizer`.
    pub fn load(spec: &StageSpec) -> Result<Self, StageError> {
        let voice = Voice::load(&spec.model)
            .map_err(|e| StageError::Model(format!("loading the voice {}: {e}", spec.model)))?;
        if spec.tokenizer.is_empty() {
            return Err(StageError::Config(format!(
                "stage {}: a TTS stage needs the text model's tokenizer",
                spec.stage_id
            )));
        }
        let path = std::path::Path::new(&spec.tokenizer);
        let tokenizer = if path.is_dir() {
            Tokenizer::from_hf_dir(path)
        } else {
            Tokenizer::from_gguf_path(path)
        }
        .map_err(|e| StageError::Model(format!("loading the tokenizer {}: {e}", spec.tokenizer)))?;
        Ok(Self::new(voice, tokenizer, spec))
    }

    /// A stage over a loaded voice and tokenizer.
    pub fn new(voice: Voice, tokenizer: Tokenizer, spec: &StageSpec) -> Self {
        Self {
            voice,
            tokenizer,
            reqs: HashMap::new(),
            order: Vec::new(),
            seed: spec.seed,
            max_num_seqs: (spec.max_num_seqs as usize).max(1),
        }
    }

    fn add(&mut self, req: &EngineCoreRequest, out: &mut StageOutputs) {
        let id = req.request_id.clone();
        if self.reqs.contains_key(&id) {
            out.failed
                .push((id, "a request with this id is already live".into()));
            return;
        }
        let text = self
            .voice
            .sentence_stream()
            .flush_clauses_after(FIRST_CLAUSE_FLUSH_CHARS);
        let seed = req.sampling_params.seed.unwrap_or(self.seed);
        self.reqs.insert(
            id.clone(),
            TtsReq {
                detok: IncrementalDetokenizer::new(&req.prompt_token_ids, true),
                text,
                ready: VecDeque::new(),
                rng: NumpyRng::from_seed(seed),
                speed: 1.0,
                next_chunk: 0,
                text_done: false,
            },
        );
        self.order.push(id);
    }

    fn drop_request(&mut self, id: &str) {
        self.reqs.remove(id);
        self.order.retain(|r| r != id);
    }

    /// Applies one delta: its text into the request's sentence stream.
    fn text(&mut self, d: TextDelta) -> Result<(), String> {
        let r = self
            .reqs
            .get_mut(&d.request_id)
            .ok_or_else(|| format!("text for an unknown request (delta {})", d.chunk_id))?;
        if d.chunk_id != r.next_chunk || r.text_done {
            return Err(format!(
                "text delta {} out of order (expected {}{})",
                d.chunk_id,
                r.next_chunk,
                if r.text_done { ", after the end" } else { "" }
            ));
        }
        r.next_chunk += 1;
        let mut new = String::new();
        for &id in &d.token_ids {
            new.push_str(
                &r.detok
                    .push(&self.tokenizer, id)
                    .map_err(|e| e.to_string())?,
            );
        }
        if d.finished {
            new.push_str(&r.detok.finish(&self.tokenizer).map_err(|e| e.to_string())?);
        }
        r.ready.extend(r.text.push(&new));
        if !r.ready.is_empty() {
            r.text.set_clause_flush(Some(CLAUSE_FLUSH_CHARS));
        }
        if d.finished {
            r.ready.extend(r.text.finish());
            r.text_done = true;
        }
        Ok(())
    }

    /// Audio of one sentence (empty when it has nothing to say, e.g. only punctuation).
    fn speak(voice: &Voice, r: &mut TtsReq, sentence: &str) -> Result<Vec<f32>, String> {
        let mut audio = Vec::new();
        for ids in voice.phonemize(sentence).map_err(|e| e.to_string())? {
            let a = voice
                .synthesize_ids(&ids, r.speed, &mut r.rng)
                .map_err(|e| e.to_string())?;
            audio.extend(a);
        }
        Ok(audio)
    }
}

impl Stage for TtsStage {
    fn input(&mut self, input: StageInput, _buffers: &[&[u8]], out: &mut StageOutputs) {
        match input {
            StageInput::Add(req) => self.add(&req, out),
            StageInput::Text(deltas) => {
                for d in deltas {
                    let id = d.request_id.clone();
                    if let Err(e) = self.text(d) {
                        self.drop_request(&id);
                        out.failed.push((id, e));
                    }
                }
            }
            StageInput::Abort(ids) => {
                for id in &ids {
                    self.drop_request(id);
                }
            }
            StageInput::Thinker(_) | StageInput::Codec(_) | StageInput::Shutdown => {}
        }
    }

    fn has_work(&self) -> bool {
        self.reqs
            .values()
            .any(|r| !r.ready.is_empty() || r.text_done)
    }

    /// Requests with a sentence to speak count as running, the others (waiting for text) as
    /// waiting; no KV cache.
    fn stats(&self) -> Option<SchedulerStats> {
        let running = self
            .reqs
            .values()
            .filter(|r| !r.ready.is_empty() || r.text_done)
            .count();
        Some(SchedulerStats {
            num_running_reqs: running as u32,
            num_waiting_reqs: (self.reqs.len() - running) as u32,
            ..SchedulerStats::default()
        })
    }

    fn step(&mut self, clock: &mut StepClock) -> Result<StepResult, StageError> {
        let mut out = StageOutputs::default();
        let picked: Vec<RequestId> = self
            .order
            .iter()
            .filter(|id| {
                self.reqs
                    .get(*id)
                    .is_some_and(|r| !r.ready.is_empty() || r.text_done)
            })
            .take(self.max_num_seqs)
            .cloned()
            .collect();
        clock.set_rows(picked.len());
        clock.lap("batch");
        let rate = self.voice.sample_rate();
        let mut done = Vec::new();
        for id in picked {
            let Some(r) = self.reqs.get_mut(&id) else {
                continue;
            };
            let audio = match r.ready.pop_front() {
                Some(s) => match Self::speak(&self.voice, r, &s) {
                    Ok(a) => a,
                    Err(e) => {
                        out.failed
                            .push((id.clone(), format!("speaking {s:?}: {e}")));
                        done.push(id);
                        continue;
                    }
                },
                None => Vec::new(),
            };
            let finished = r.text_done && r.ready.is_empty();
            let audio = (!audio.is_empty()).then(|| AudioOutput {
                num_frames: audio.len().div_ceil(HOP) as u32,
                samples: audio,
                sample_rate: rate,
            });
            if audio.is_some() || finished {
                out.outputs.push(EngineCoreOutput::bare(
                    id.as_str(),
                    finished.then_some(FinishReason::Stop),
                    audio,
                ));
            }
            if finished {
                done.push(id);
            }
        }
        clock.lap("speak");
        for id in done {
            self.drop_request(&id);
        }
        out.scheduler_stats = self.stats();
        Ok((out, Vec::new()))
    }
}
