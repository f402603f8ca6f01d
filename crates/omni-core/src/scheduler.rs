//! Continuous batching in vLLM v1's style: one token budget per step, spent first on the running
//! requests (a decode token or the next prefill chunk each), then on waiting requests in arrival
//! order while budget, `max_num_seqs` and free blocks allow. When a running request needs a block
//! and none is free, the lowest-priority running request (latest arrival) is preempted by
//! recompute: its blocks are freed, it goes to the front of the waiting queue and its computed
//! tokens are forgotten (its generated tokens are kept, so it resumes where it stopped).

use std::collections::{HashMap, HashSet, VecDeque};

use omni_protocol::{
    CachedRequestData, EngineCoreOutput, EngineCoreRequest, FinishReason, ModelRunnerOutput,
    NewRequestData, RequestId, SchedulerOutput, SchedulerStats,
};

use crate::config::{SchedulerConfig, SchedulerConfigError};
use crate::encoder_cache_manager::EncoderCacheManager;
use crate::kv_cache_manager::{ComputedBlocks, KvCacheManager};
use crate::request::{Request, RequestStatus};

/// Seconds since the Unix epoch, the clock of `EngineCoreRequest::arrival_time`.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

pub use omni_protocol::AddRequestError;

/// The scheduler: request queues, the KV cache manager, and the per-step decisions.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    encoder: EncoderCacheManager,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    /// Running requests that wait for input from outside (an omni stage's upstream rows):
    /// they keep their blocks but get no tokens until unblocked.
    blocked: HashSet<RequestId>,
    /// Requests in batches sent but not yet answered (pipeline parallelism keeps several in
    /// flight), with how many: never chosen for preemption, whose outputs would come back to a
    /// request that started over.
    in_flight: HashMap<RequestId, u32>,
    /// Finished or aborted since the last `schedule()`: told to the workers then.
    finished_req_ids: Vec<RequestId>,
    num_preemptions: u64,
    next_seq_no: u64,
}

impl Scheduler {
    /// A scheduler with an empty KV cache of `config.num_blocks` blocks.
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerConfigError> {
        config.validate()?;
        let kv = KvCacheManager::new(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
        );
        // vLLM's max(max_num_batched_tokens, max_tokens_per_mm_item), with max_model_len as
        // the bound on an item (see `encoder_cache_manager`).
        let encoder_budget = config.max_num_batched_tokens.max(config.max_model_len);
        Ok(Self {
            encoder: EncoderCacheManager::new(encoder_budget, encoder_budget),
            config,
            kv,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            blocked: HashSet::new(),
            in_flight: HashMap::new(),
            finished_req_ids: Vec::new(),
            num_preemptions: 0,
            next_seq_no: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The KV cache manager (block tables, prefix-cache counters).
    pub fn kv_cache_manager(&self) -> &KvCacheManager {
        &self.kv
    }

    /// The encoder-cache bookkeeping.
    pub fn encoder_cache_manager(&self) -> &EncoderCacheManager {
        &self.encoder
    }

    /// Replaces the encoder cache's capacity and per-step compute budget (embeddings); for
    /// tests and tuning, before any request is added.
    pub fn set_encoder_budget(&mut self, cache_size: usize, compute_budget: usize) {
        self.encoder = EncoderCacheManager::new(cache_size, compute_budget);
    }

    /// A live request.
    pub fn request(&self, request_id: &str) -> Option<&Request> {
        self.requests.get(request_id)
    }

    /// Requests in the running set.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting (preempted ones included).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether any request is live.
    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Whether finished request ids wait to be told to the workers.
    pub fn has_finished_requests(&self) -> bool {
        !self.finished_req_ids.is_empty()
    }

    /// Scheduler state for metrics.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running_reqs: self.running.len() as u32,
            num_waiting_reqs: self.waiting.len() as u32,
            kv_cache_usage: self.kv.usage(),
            num_preemptions: self.num_preemptions,
            prefix_cache_queries: self.kv.prefix_cache_queries(),
            prefix_cache_hits: self.kv.prefix_cache_hits(),
            ..SchedulerStats::default()
        }
    }

    /// Queues a new request at the back of the waiting queue.
    pub fn add_request(&mut self, req: EngineCoreRequest) -> Result<(), AddRequestError> {
        if self.requests.contains_key(&req.request_id) {
            return Err(AddRequestError::DuplicateRequestId(req.request_id));
        }
        if req.prompt_token_ids.is_empty() {
            return Err(AddRequestError::EmptyPrompt(req.request_id));
        }
        if req.prompt_token_ids.len() > self.config.max_model_len {
            return Err(AddRequestError::PromptTooLong {
                prompt_len: req.prompt_token_ids.len(),
                max_model_len: self.config.max_model_len,
            });
        }
        req.sampling_params.validate()?;
        crate::request::check_mm_features(&req, self.encoder.cache_size())?;
        let request = Request::new(req, self.next_seq_no);
        self.next_seq_no += 1;
        self.waiting.push_back(request.request_id.clone());
        self.requests.insert(request.request_id.clone(), request);
        Ok(())
    }

    /// Holds a request out of the batch (`true`) or lets it back in. A blocked running
    /// request keeps its KV blocks and takes no batch slot or token budget; unknown ids are
    /// ignored.
    pub fn set_blocked(&mut self, request_id: &str, blocked: bool) {
        if !blocked {
            self.blocked.remove(request_id);
        } else if self.requests.contains_key(request_id) {
            self.blocked.insert(request_id.to_owned());
        }
    }

    /// Whether the request is held out of the batch.
    pub fn is_blocked(&self, request_id: &str) -> bool {
        self.blocked.contains(request_id)
    }

    /// Marks the requests of a batch as sent (`true`) or answered (`false`). With several
    /// batches in flight a request is scheduled again only when it has tokens left to compute
    /// (a decode waits for its token: `num_computed_tokens` already counts the batch); the
    /// workers run batches in order, so KV blocks freed or reused meanwhile are safe.
    pub fn mark_in_flight(&mut self, so: &SchedulerOutput, sent: bool) {
        let ids = so
            .scheduled_new_reqs
            .iter()
            .map(|r| &r.req_id)
            .chain(so.scheduled_cached_reqs.iter().map(|r| &r.req_id));
        for id in ids {
            if sent {
                *self.in_flight.entry(id.clone()).or_insert(0) += 1;
            } else if let Some(n) = self.in_flight.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    self.in_flight.remove(id);
                }
            }
        }
    }

    /// Removes requests at once, freeing their blocks. Unknown or finished ids are ignored.
    /// Returns the ids that were live.
    pub fn abort_requests<'a>(&mut self, ids: impl IntoIterator<Item = &'a str>) -> Vec<RequestId> {
        let mut aborted = Vec::new();
        for id in ids {
            if self.requests.remove(id).is_some() {
                self.blocked.remove(id);
                self.waiting.retain(|w| w != id);
                self.running.retain(|r| r != id);
                self.kv.free(id);
                self.encoder.release_all(id);
                self.finished_req_ids.push(id.to_owned());
                aborted.push(id.to_owned());
            }
        }
        aborted
    }

    /// Ends every live request with `reason` (e.g. [`FinishReason::Error`] when a worker died),
    /// returning one final output for each.
    pub fn finish_all_requests(&mut self, reason: FinishReason) -> Vec<EngineCoreOutput> {
        let mut ids: Vec<RequestId> = self.running.drain(..).collect();
        ids.extend(self.waiting.drain(..));
        let mut outputs = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(mut req) = self.requests.remove(&id) {
                self.blocked.remove(&id);
                self.kv.free(&id);
                self.encoder.release_all(&id);
                self.finished_req_ids.push(id.clone());
                outputs.push(EngineCoreOutput {
                    request_id: id,
                    new_token_ids: Vec::new(),
                    new_logprobs: Vec::new(),
                    finish_reason: Some(reason),
                    stop_reason: None,
                    num_cached_tokens: req.num_cached_tokens as u32,
                    queue_time: req.take_queue_time(),
                    text_finish_reason: None,
                    audio: None,
                });
            }
        }
        outputs
    }

    /// Index in `running[from..]` of the lowest-priority request (latest arrival).
    fn preemption_victim(&self, from: usize) -> Option<usize> {
        let mut victim: Option<usize> = None;
        for j in from..self.running.len() {
            if self.in_flight.contains_key(&self.running[j]) {
                continue;
            }
            let Some(a) = self.requests.get(&self.running[j]) else {
                continue;
            };
            let later = victim
                .and_then(|v| self.requests.get(&self.running[v]))
                .is_none_or(|b| {
                    a.arrival_time
                        .total_cmp(&b.arrival_time)
                        .then(a.seq_no.cmp(&b.seq_no))
                        .is_gt()
                });
            if later {
                victim = Some(j);
            }
        }
        victim
    }

    fn preempt(&mut self, running_index: usize) -> RequestId {
        let id = self.running.remove(running_index);
        self.kv.free(&id);
        self.encoder.release_all(&id);
        if let Some(req) = self.requests.get_mut(&id) {
            req.status = RequestStatus::Preempted;
            req.num_computed_tokens = 0;
            req.num_preemptions += 1;
        }
        self.num_preemptions += 1;
        self.waiting.push_front(id.clone());
        id
    }

    /// Decides this step's batch and advances each scheduled request's `num_computed_tokens` as
    /// if the step will succeed.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut budget = self.config.max_num_batched_tokens;
        let mut encoder_budget = self.encoder.compute_budget();
        let mut out = SchedulerOutput::default();
        let mut scheduled: Vec<(RequestId, usize)> = Vec::new();
        let now = unix_now();

        // 1. Running requests, in order.
        let mut i = 0;
        // A running request found no memory and nothing could be preempted for it.
        let mut starved = false;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i].clone();
            let Some(req) = self.requests.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let known = req.num_tokens_with_placeholders();
            let num_new = known.saturating_sub(req.num_computed_tokens).min(budget);
            // A step that samples while an earlier sample is still in flight (async
            // scheduling) must not run past a stop by length that the earlier one will hit.
            let samples = req.num_computed_tokens + num_new == known;
            let ahead = req.num_output_placeholders > 0;
            if num_new == 0
                || self.blocked.contains(&id)
                || (ahead && samples && !req.may_sample_more(self.config.max_model_len))
            {
                i += 1;
                continue;
            }
            let plan = self
                .encoder
                .plan(req, req.num_computed_tokens, num_new, encoder_budget);
            let num_new = plan.num_new;
            if num_new == 0 {
                i += 1; // its next item does not fit this step
                continue;
            }
            let new_blocks = loop {
                let Some(req) = self.requests.get(&id) else {
                    break None;
                };
                if let Some(blocks) =
                    self.kv
                        .allocate_slots(req, num_new, &ComputedBlocks::default())
                {
                    break Some(blocks);
                }
                let Some(victim) = self.preemption_victim(i) else {
                    starved = true;
                    break None; // every candidate is in flight: wait for its batch
                };
                out.preempted_req_ids.push(self.preempt(victim));
                if victim == i {
                    break None;
                }
            };
            let Some(new_blocks) = new_blocks else {
                // The request preempted itself: nothing after it has higher priority.
                break;
            };
            let Some(req) = self.requests.get(&id) else {
                break;
            };
            encoder_budget -= plan.embeds;
            let encode = self.encoder.commit(&id, &plan);
            if !encode.is_empty() {
                out.scheduled_encoder_inputs.insert(id.clone(), encode);
            }
            let start = req.num_computed_tokens;
            // Only the known tokens: a position still being sampled is filled by each worker
            // with the token it sampled there (`CachedRequestData::new_token_ids`).
            let known_end = (start + num_new).min(req.num_tokens());
            out.scheduled_cached_reqs.push(CachedRequestData {
                req_id: id.clone(),
                resumed_from_preemption: false,
                new_token_ids: req.all_token_ids()[start.min(known_end)..known_end].to_vec(),
                new_block_ids: new_blocks,
                num_computed_tokens: start as u32,
            });
            scheduled.push((id, num_new));
            budget -= num_new;
            i += 1;
        }

        // 2. Waiting requests, first come first served, unless this step had to preempt or a
        // running request went without memory.
        while out.preempted_req_ids.is_empty()
            && !starved
            && budget > 0
            && self.running.len() < self.config.max_num_seqs
        {
            let Some(id) = self.waiting.front().cloned() else {
                break;
            };
            let Some(req) = self.requests.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let computed = self.kv.get_computed_blocks(req);
            let remaining = req.num_tokens() - computed.num_tokens;
            if !self.config.enable_chunked_prefill && remaining > budget {
                break;
            }
            let plan = self.encoder.plan(
                req,
                computed.num_tokens,
                remaining.min(budget),
                encoder_budget,
            );
            let num_new = plan.num_new;
            if num_new == 0 {
                break; // its first item does not fit this step
            }
            let Some(new_blocks) = self.kv.allocate_slots(req, num_new, &computed) else {
                break;
            };
            encoder_budget -= plan.embeds;
            let encode = self.encoder.commit(&id, &plan);
            if !encode.is_empty() {
                out.scheduled_encoder_inputs.insert(id.clone(), encode);
            }
            self.waiting.pop_front();
            self.running.push(id.clone());
            let resumed = req.status == RequestStatus::Preempted;
            req.status = RequestStatus::Running;
            req.mark_scheduled(now);
            req.num_computed_tokens = computed.num_tokens;
            let start = computed.num_tokens;
            if resumed {
                out.scheduled_cached_reqs.push(CachedRequestData {
                    req_id: id.clone(),
                    resumed_from_preemption: true,
                    new_token_ids: req.all_token_ids()[start..start + num_new].to_vec(),
                    new_block_ids: new_blocks,
                    num_computed_tokens: start as u32,
                });
            } else {
                req.num_cached_tokens = computed.num_tokens;
                // The items' tensors go once, as buffers of this step's message.
                let buffers = std::mem::take(&mut req.mm_buffers);
                let mm_features = req
                    .mm_features
                    .iter()
                    .map(|f| {
                        let mut f = f.clone();
                        if let Some(b) = buffers.get(f.tensor.buffer_index as usize) {
                            f.tensor.buffer_index = out.buffers.push(b.clone());
                        }
                        f
                    })
                    .collect();
                out.scheduled_new_reqs.push(NewRequestData {
                    req_id: id.clone(),
                    prompt_token_ids: req.prompt_token_ids().to_vec(),
                    sampling_params: req.sampling_params.clone(),
                    eos_token_id: req.eos_token_id,
                    block_ids: new_blocks,
                    num_computed_tokens: start as u32,
                    mm_features,
                });
            }
            scheduled.push((id, num_new));
            budget -= num_new;
        }

        // 3. Advance as if the step succeeds; the next schedule() builds on it. Under async
        // scheduling a step that reaches the end of a request's tokens leaves a placeholder for
        // the token it will sample, so the next schedule() may compute that position.
        let async_scheduling = self.config.async_scheduling;
        for (id, n) in scheduled {
            if let Some(req) = self.requests.get_mut(&id) {
                req.num_computed_tokens += n;
                if async_scheduling && req.num_computed_tokens == req.num_tokens_with_placeholders()
                {
                    req.num_output_placeholders += 1;
                }
            }
            out.total_num_scheduled_tokens += n as u32;
            out.num_scheduled_tokens.insert(id, n as u32);
        }
        out.finished_req_ids = std::mem::take(&mut self.finished_req_ids);
        out.free_encoder_mm_hashes = self.encoder.take_freed();
        out
    }

    /// Applies one step's model output: registers newly computed full blocks in the prefix cache,
    /// appends sampled tokens, checks stop conditions and frees finished requests. Returns one
    /// output per request that got tokens or finished, in batch order.
    pub fn update_from_output(
        &mut self,
        scheduler_output: &SchedulerOutput,
        model_output: &ModelRunnerOutput,
    ) -> Vec<EngineCoreOutput> {
        let index: HashMap<&str, usize> = model_output
            .req_ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i))
            .collect();
        let batch = scheduler_output
            .scheduled_new_reqs
            .iter()
            .map(|r| &r.req_id)
            .chain(
                scheduler_output
                    .scheduled_cached_reqs
                    .iter()
                    .map(|r| &r.req_id),
            );

        let mut outputs = Vec::new();
        let mut finished = Vec::new();
        for id in batch {
            let Some(req) = self.requests.get_mut(id) else {
                continue; // aborted during the step
            };
            if req.status != RequestStatus::Running {
                continue;
            }
            self.kv.cache_blocks(req);
            self.encoder.release_computed(req);
            if !req.is_caught_up() {
                continue; // a partial prefill chunk samples nothing
            }
            let Some(&i) = index.get(id.as_str()) else {
                continue;
            };
            let sampled = model_output
                .sampled_token_ids
                .get(i)
                .map_or(&[][..], Vec::as_slice);
            req.num_output_placeholders = req.num_output_placeholders.saturating_sub(sampled.len());
            let mut new_token_ids = Vec::new();
            let mut finish_reason = None;
            for &token in sampled {
                req.append_output_token(token);
                new_token_ids.push(token);
                finish_reason = req.check_stop(self.config.max_model_len);
                if finish_reason.is_some() {
                    break;
                }
            }
            if new_token_ids.is_empty() {
                continue;
            }
            let new_logprobs = model_output
                .logprobs
                .get(i)
                .map(|l| l.iter().take(new_token_ids.len()).cloned().collect())
                .unwrap_or_default();
            if let Some(reason) = finish_reason {
                req.status = RequestStatus::Finished(reason);
                finished.push(id.clone());
            }
            outputs.push(EngineCoreOutput {
                request_id: id.clone(),
                new_token_ids,
                new_logprobs,
                finish_reason,
                stop_reason: req.stop_reason.clone(),
                num_cached_tokens: req.num_cached_tokens as u32,
                queue_time: req.take_queue_time(),
                text_finish_reason: None,
                audio: None,
            });
        }
        for id in finished {
            self.requests.remove(&id);
            self.blocked.remove(&id);
            self.running.retain(|r| *r != id);
            self.kv.free(&id);
            self.encoder.release_all(&id);
            self.finished_req_ids.push(id);
        }
        outputs
    }
}
