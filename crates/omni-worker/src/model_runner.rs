//! [`ModelRunner`]: one rank's model, its KV cache, and the per-request state that turns a
//! [`SchedulerOutput`] into a [`ForwardBatch`] (vLLM's `GPUModelRunner`), on any
//! [`StepModel`] backend. Sampling runs on the device when the backend has a sampler and every
//! sampled request only needs temperature / top-k / top-p / min-p; otherwise (penalties,
//! logprobs, `min_tokens` still pending) the logits come to the host and the CPU sampler runs.
//!
//! Multimodal requests ([`crate::mm_inputs`]): each step first drops the encoder outputs the
//! scheduler freed, then runs the encoder of every scheduled item into the encoder cache, then
//! gives the model the features whose placeholders overlap the step's positions, with M-RoPE
//! positions for the whole batch when any request has them.

use std::collections::HashMap;

use omni_models::{EncoderOutput, ForwardBatch, MropePositions, MultiModalKind, SeqChunk};
use omni_protocol::{
    BlockId, ModelRunnerOutput, RequestId, SamplingParams, SchedulerOutput, TensorView, TokenId,
};

use crate::WorkerError;
use crate::mm_inputs::{EncoderCache, RequestMm};
use crate::sampler::{SampledToken, Sampler, SamplingSeq};
use crate::step_model::{DeviceSample, StepModel};

/// What the runner remembers of one live request between steps.
#[derive(Debug, Clone)]
struct CachedRequestState {
    /// Prompt, then outputs (the sampled token is appended as soon as it is sampled).
    tokens: Vec<TokenId>,
    num_prompt_tokens: usize,
    block_ids: Vec<BlockId>,
    params: SamplingParams,
    eos_token_id: Option<TokenId>,
    /// Seed of the request's device sampling stream: its own, or one derived once from the
    /// worker seed and the prompt (the same on every rank).
    sampling_seed: u64,
    /// Its multimodal items and M-RoPE positions.
    mm: RequestMm,
}

/// What a worker's encoders have done (a test hook, and the worker's logs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncoderStats {
    /// Items encoded since start-up (one encoder call each).
    pub items_encoded: u64,
    /// Encoder outputs held now.
    pub cached: usize,
}

/// A loaded model with its KV cache and the requests it is serving.
#[derive(Debug)]
pub struct ModelRunner {
    model: Box<dyn StepModel>,
    block_size: usize,
    seed: u64,
    num_blocks: usize,
    requests: HashMap<RequestId, CachedRequestState>,
    sampler: Sampler,
    encoder_cache: EncoderCache,
}

impl ModelRunner {
    /// A runner over a loaded model with no KV cache yet; `seed` seeds the global sampling stream
    /// (the same on every rank, so every rank samples the same tokens).
    pub fn new(model: Box<dyn StepModel>, seed: u64) -> Self {
        Self {
            model,
            block_size: 0,
            seed,
            num_blocks: 0,
            requests: HashMap::new(),
            sampler: Sampler::new(Some(seed)),
            encoder_cache: EncoderCache::default(),
        }
    }

    /// The model and its KV cache.
    pub fn model(&self) -> &dyn StepModel {
        self.model.as_ref()
    }

    /// KV cache bytes of one block of `block_size` tokens on this rank (all layers, K and V).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> u64 {
        self.model.kv_bytes_per_block(block_size)
    }

    /// Memory the KV cache may use on this rank.
    pub fn available_kv_bytes(&self) -> Result<u64, WorkerError> {
        self.model.available_kv_bytes()
    }

    /// Allocates `num_blocks` zeroed KV blocks of `block_size` tokens per layer.
    pub fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), WorkerError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(WorkerError::Cache(format!(
                "num_blocks {num_blocks} and block_size {block_size} must be positive"
            )));
        }
        self.model.init_cache(num_blocks, block_size)?;
        self.block_size = block_size;
        self.num_blocks = num_blocks;
        Ok(())
    }

    /// Items encoded so far and outputs held.
    pub fn encoder_stats(&self) -> EncoderStats {
        EncoderStats {
            items_encoded: self.encoder_cache.num_encoded(),
            cached: self.encoder_cache.len(),
        }
    }

    /// Live requests (tests and health output).
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Applies the step's request bookkeeping, runs the model over the scheduled tokens and
    /// samples one token for every request whose scheduled tokens reach its end.
    ///
    /// `buffers` are the message's out-of-band buffers (in place in the ring slot in a worker
    /// process); every [`omni_protocol::TensorRef`] of the batch is checked against them and
    /// viewed in place (size, element alignment); a new request's item tensors are copied out
    /// once and kept for its life.
    pub fn execute_model(
        &mut self,
        so: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> Result<ModelRunnerOutput, WorkerError> {
        if !self.model.has_cache() {
            return Err(WorkerError::Cache(
                "ExecuteModel before InitCache".to_string(),
            ));
        }
        let views = so.tensor_views(buffers)?;
        self.encoder_cache.free(&so.free_encoder_mm_hashes);
        self.update_states(so, &views)?;
        if so.is_empty() {
            return Ok(ModelRunnerOutput::default());
        }
        self.run_encoders(so)?;

        // Batch order: new requests, then cached ones (the scheduler's order).
        let scheduled: Vec<(&RequestId, usize)> = so
            .scheduled_new_reqs
            .iter()
            .map(|r| (&r.req_id, r.num_computed_tokens as usize))
            .chain(
                so.scheduled_cached_reqs
                    .iter()
                    .map(|r| (&r.req_id, r.num_computed_tokens as usize)),
            )
            .collect();
        let req_ids: Vec<&RequestId> = scheduled.iter().map(|(id, _)| *id).collect();
        let mut chunks = Vec::with_capacity(req_ids.len());
        let mut samples = Vec::with_capacity(req_ids.len());
        let mut rows = Vec::new();
        let mut row = 0usize;
        let mut features = Vec::new();
        let mut mrope: [Vec<i64>; 3] = Default::default();
        let mut any_mrope = false;
        for &(id, start) in &scheduled {
            let state = self
                .requests
                .get(id)
                .ok_or_else(|| WorkerError::UnknownRequest(id.clone()))?;
            let n = so.num_scheduled_tokens.get(id).copied().unwrap_or(0) as usize;
            let end = start + n;
            if end > state.tokens.len() {
                return Err(WorkerError::Batch(format!(
                    "request {id}: scheduled up to position {end}, but it has only {} tokens",
                    state.tokens.len()
                )));
            }
            let samples_now = n > 0 && end == state.tokens.len();
            features.extend(state.mm.step_features(start, end, row));
            state.mm.push_positions(start, end, &mut mrope);
            any_mrope |= state.mm.mrope.is_some();
            row += n;
            if samples_now {
                rows.push(row - 1);
            }
            samples.push(samples_now);
            chunks.push(SeqChunk {
                tokens: &state.tokens[start..end],
                start_pos: start,
                block_table: &state.block_ids,
            });
        }
        let mut batch = ForwardBatch::from_chunks(&chunks, self.block_size)?;
        let num_sampled = rows.len();
        batch.logits_indices = Some(rows);
        if features.is_empty() && !any_mrope {
            self.model.forward(&batch)?;
        } else {
            let encoded: Vec<&EncoderOutput> = features
                .iter()
                .map(|f| self.encoder_cache.get(f.mm_hash))
                .collect::<Result<_, _>>()?;
            let positions = any_mrope.then_some(MropePositions { rows: mrope });
            self.model
                .forward_mm(&batch, positions.as_ref(), &features, &encoded)?;
        }
        if !self.model.samples() {
            // A pipeline stage before the last: its activations went on; nothing to sample.
            return Ok(ModelRunnerOutput {
                req_ids: req_ids.into_iter().cloned().collect(),
                sampled_token_ids: vec![Vec::new(); samples.len()],
                logprobs: vec![Vec::new(); samples.len()],
                ..ModelRunnerOutput::default()
            });
        }
        let sampled = if num_sampled == 0 {
            Vec::new()
        } else {
            self.sample(&req_ids, &samples)?
        };

        let mut out = ModelRunnerOutput {
            req_ids: Vec::with_capacity(req_ids.len()),
            sampled_token_ids: Vec::with_capacity(req_ids.len()),
            logprobs: Vec::with_capacity(req_ids.len()),
            ..ModelRunnerOutput::default()
        };
        let mut sampled = sampled.into_iter();
        for (id, samples_now) in req_ids.into_iter().zip(samples) {
            out.req_ids.push(id.clone());
            if !samples_now {
                out.sampled_token_ids.push(Vec::new());
                out.logprobs.push(Vec::new());
                continue;
            }
            let tok = sampled
                .next()
                .ok_or_else(|| WorkerError::Batch("sampler returned too few tokens".into()))?;
            if let Some(state) = self.requests.get_mut(id) {
                state.tokens.push(tok.token_id);
            }
            out.sampled_token_ids.push(vec![tok.token_id]);
            out.logprobs.push(tok.logprobs.into_iter().collect());
        }
        Ok(out)
    }

    /// One token per sampled request, on the device when every row allows it.
    fn sample(
        &mut self,
        req_ids: &[&RequestId],
        samples: &[bool],
    ) -> Result<Vec<SampledToken>, WorkerError> {
        let states: Vec<&CachedRequestState> = req_ids
            .iter()
            .zip(samples)
            .filter(|(_, s)| **s)
            .filter_map(|(id, _)| self.requests.get(*id))
            .collect();
        let device_rows: Option<Vec<DeviceSample>> =
            states.iter().map(|st| device_sample(st)).collect();
        if let Some(rows) = device_rows
            && let Some(tokens) = self.model.sample_on_device(&rows)?
        {
            return Ok(tokens
                .into_iter()
                .map(|token_id| SampledToken {
                    token_id,
                    logprobs: None,
                })
                .collect());
        }
        let logits = self.model.logits_host()?;
        let vocab = self.model.vocab_size();
        let seqs: Vec<SamplingSeq<'_>> = states
            .iter()
            .map(|st| SamplingSeq {
                params: &st.params,
                prompt_token_ids: &st.tokens[..st.num_prompt_tokens],
                output_token_ids: &st.tokens[st.num_prompt_tokens..],
                eos_token_id: st.eos_token_id,
            })
            .collect();
        Ok(self.sampler.sample(&logits, vocab, &seqs)?)
    }

    /// Runs the encoder of every item the scheduler listed for this step into the cache.
    fn run_encoders(&mut self, so: &SchedulerOutput) -> Result<(), WorkerError> {
        let (requests, model) = (&self.requests, &self.model);
        self.encoder_cache.encode_scheduled(
            &so.scheduled_encoder_inputs,
            |id| requests.get(id).map(|st| &st.mm),
            |item| model.encode_mm(&item.feature()),
            WorkerError::Batch,
        )
    }

    /// Drops finished requests, forgets preempted requests' blocks, learns new requests (with
    /// their items, copied out of `views`, the batch's tensors) and applies cached requests'
    /// new tokens and blocks.
    fn update_states(
        &mut self,
        so: &SchedulerOutput,
        views: &[TensorView<'_>],
    ) -> Result<(), WorkerError> {
        for id in &so.finished_req_ids {
            self.requests.remove(id);
        }
        for id in &so.preempted_req_ids {
            if let Some(state) = self.requests.get_mut(id) {
                state.block_ids.clear();
            }
        }
        let mut at = 0;
        for new in &so.scheduled_new_reqs {
            self.check_blocks(&new.req_id, &new.block_ids)?;
            let n = new.mm_features.len();
            let mut mm = RequestMm::from_new(new, views.get(at..at + n).unwrap_or_default());
            at += n;
            if !mm.items.is_empty() {
                let kinds: Vec<MultiModalKind> = mm.items.iter().map(|it| it.kind).collect();
                mm.mrope = self.model.mrope_positions(&new.prompt_token_ids, &kinds)?;
            }
            self.requests.insert(
                new.req_id.clone(),
                CachedRequestState {
                    tokens: new.prompt_token_ids.clone(),
                    num_prompt_tokens: new.prompt_token_ids.len(),
                    block_ids: new.block_ids.clone(),
                    params: new.sampling_params.clone(),
                    eos_token_id: new.eos_token_id,
                    sampling_seed: new
                        .sampling_params
                        .seed
                        .unwrap_or_else(|| prompt_seed(self.seed, &new.prompt_token_ids)),
                    mm,
                },
            );
        }
        for cached in &so.scheduled_cached_reqs {
            self.check_blocks(&cached.req_id, &cached.new_block_ids)?;
            let state = self
                .requests
                .get_mut(&cached.req_id)
                .ok_or_else(|| WorkerError::UnknownRequest(cached.req_id.clone()))?;
            if cached.resumed_from_preemption {
                state.block_ids = cached.new_block_ids.clone();
            } else {
                state.block_ids.extend_from_slice(&cached.new_block_ids);
            }
            let start = cached.num_computed_tokens as usize;
            for (i, &tok) in cached.new_token_ids.iter().enumerate() {
                let pos = start + i;
                match pos.cmp(&state.tokens.len()) {
                    std::cmp::Ordering::Less => state.tokens[pos] = tok,
                    std::cmp::Ordering::Equal => state.tokens.push(tok),
                    std::cmp::Ordering::Greater => {
                        return Err(WorkerError::Batch(format!(
                            "request {}: token for position {pos} but only {} known",
                            cached.req_id,
                            state.tokens.len()
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    fn check_blocks(&self, id: &str, blocks: &[BlockId]) -> Result<(), WorkerError> {
        match blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
            Some(b) => Err(WorkerError::Batch(format!(
                "request {id}: block {b} out of {} blocks",
                self.num_blocks
            ))),
            None => Ok(()),
        }
    }
}

/// The device sampler's settings for a request, or `None` when it needs the CPU sampler
/// (penalties, logprobs, or EOS still masked by `min_tokens`).
fn device_sample(st: &CachedRequestState) -> Option<DeviceSample> {
    let outputs = st.tokens.len() - st.num_prompt_tokens;
    device_sample_for(&st.params, outputs, st.sampling_seed)
}

/// The device sampler's settings for a request with `outputs` tokens so far and sampling
/// stream `seed`, or `None` when it needs the CPU sampler (penalties, logprobs, or EOS still
/// masked by `min_tokens`). Also what an omni stage samples its Thinker with.
pub fn device_sample_for(p: &SamplingParams, outputs: usize, seed: u64) -> Option<DeviceSample> {
    let plain = p.presence_penalty == 0.0
        && p.frequency_penalty == 0.0
        && p.repetition_penalty == 1.0
        && p.logprobs.is_none()
        && (outputs as u64) >= u64::from(p.min_tokens);
    if !plain {
        return None;
    }
    Some(DeviceSample {
        temperature: p.temperature,
        top_k: p.top_k.map_or(0, |k| k.min(i32::MAX as u32) as i32),
        top_p: p.top_p,
        min_p: p.min_p,
        seed,
        offset: outputs as u64,
    })
}

/// The sampling stream of an unseeded request: the worker seed and the prompt, hashed once when
/// the request arrives (an omni Thinker stage seeds its requests the same way).
pub fn prompt_seed(worker_seed: u64, prompt: &[TokenId]) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    worker_seed.hash(&mut h);
    prompt.hash(&mut h);
    h.finish()
}
