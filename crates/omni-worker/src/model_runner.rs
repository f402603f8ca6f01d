//! [`ModelRunner`]: one rank's model, its KV cache, and the per-request state that turns a
//! [`SchedulerOutput`] into a [`ForwardBatch`] (vLLM's `GPUModelRunner`, on the CPU backend).

use std::collections::HashMap;

use omni_models::sampler::{Sampler, SamplingSeq};
use omni_models::{CausalLm, ForwardBatch, LayerKvCache, SeqChunk};
use omni_protocol::{
    BlockId, ModelRunnerOutput, RequestId, SamplingParams, SchedulerOutput, TokenId,
};

use crate::WorkerError;

/// What the runner remembers of one live request between steps.
#[derive(Debug, Clone)]
struct CachedRequestState {
    /// Prompt, then outputs (the sampled token is appended as soon as it is sampled).
    tokens: Vec<TokenId>,
    num_prompt_tokens: usize,
    block_ids: Vec<BlockId>,
    params: SamplingParams,
    eos_token_id: Option<TokenId>,
}

/// A loaded model with its KV cache and the requests it is serving.
#[derive(Debug)]
pub struct ModelRunner {
    model: Box<dyn CausalLm>,
    kv: Vec<LayerKvCache>,
    block_size: usize,
    num_blocks: usize,
    requests: HashMap<RequestId, CachedRequestState>,
    sampler: Sampler,
}

impl ModelRunner {
    /// A runner over a loaded model with no KV cache yet; `seed` seeds the global sampling stream
    /// (the same on every rank, so every rank samples the same tokens).
    pub fn new(model: Box<dyn CausalLm>, seed: u64) -> Self {
        Self {
            model,
            kv: Vec::new(),
            block_size: 0,
            num_blocks: 0,
            requests: HashMap::new(),
            sampler: Sampler::new(Some(seed)),
        }
    }

    /// The model.
    pub fn model(&self) -> &dyn CausalLm {
        self.model.as_ref()
    }

    /// KV cache bytes of one block of `block_size` tokens on this rank (all layers, K and V).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> u64 {
        let spec = self.model.kv_cache_spec();
        (spec.bytes_per_block_per_layer(block_size) * spec.num_layers) as u64
    }

    /// Allocates `num_blocks` zeroed KV blocks of `block_size` tokens per layer.
    pub fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), WorkerError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(WorkerError::Cache(format!(
                "num_blocks {num_blocks} and block_size {block_size} must be positive"
            )));
        }
        self.kv = self.model.kv_cache_spec().allocate(num_blocks, block_size);
        self.block_size = block_size;
        self.num_blocks = num_blocks;
        Ok(())
    }

    /// Live requests (tests and health output).
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Applies the step's request bookkeeping, runs the model over the scheduled tokens and
    /// samples one token for every request whose scheduled tokens reach its end.
    pub fn execute_model(
        &mut self,
        so: &SchedulerOutput,
    ) -> Result<ModelRunnerOutput, WorkerError> {
        if self.kv.is_empty() {
            return Err(WorkerError::Cache(
                "ExecuteModel before InitCache".to_string(),
            ));
        }
        self.update_states(so)?;
        if so.is_empty() {
            return Ok(ModelRunnerOutput::default());
        }

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
        let logits = self.model.forward(&batch, &mut self.kv)?;

        let vocab = self.model.vocab_size();
        let seqs: Vec<SamplingSeq<'_>> = req_ids
            .iter()
            .zip(&samples)
            .filter(|(_, s)| **s)
            .filter_map(|(id, _)| self.requests.get(*id))
            .map(|st| SamplingSeq {
                params: &st.params,
                prompt_token_ids: &st.tokens[..st.num_prompt_tokens],
                output_token_ids: &st.tokens[st.num_prompt_tokens..],
                eos_token_id: st.eos_token_id,
            })
            .collect();
        let sampled = if num_sampled == 0 {
            Vec::new()
        } else {
            self.sampler.sample(&logits.data, vocab, &seqs)?
        };

        let mut out = ModelRunnerOutput {
            req_ids: Vec::with_capacity(req_ids.len()),
            sampled_token_ids: Vec::with_capacity(req_ids.len()),
            logprobs: Vec::with_capacity(req_ids.len()),
            tensors: Vec::new(),
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

    /// Drops finished requests, forgets preempted requests' blocks, learns new requests and
    /// applies cached requests' new tokens and blocks.
    fn update_states(&mut self, so: &SchedulerOutput) -> Result<(), WorkerError> {
        for id in &so.finished_req_ids {
            self.requests.remove(id);
        }
        for id in &so.preempted_req_ids {
            if let Some(state) = self.requests.get_mut(id) {
                state.block_ids.clear();
            }
        }
        for new in &so.scheduled_new_reqs {
            self.check_blocks(&new.req_id, &new.block_ids)?;
            self.requests.insert(
                new.req_id.clone(),
                CachedRequestState {
                    tokens: new.prompt_token_ids.clone(),
                    num_prompt_tokens: new.prompt_token_ids.len(),
                    block_ids: new.block_ids.clone(),
                    params: new.sampling_params.clone(),
                    eos_token_id: new.eos_token_id,
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
