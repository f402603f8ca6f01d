//! A request as the scheduler tracks it (vLLM's `Request`).

use omni_protocol::{
    EngineCoreRequest, FinishReason, MultiModalFeatureSpec, RequestId, SamplingParams, StopReason,
    TensorBuffers, TokenId,
};

use crate::block_pool::BlockHash;

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// Queued, never scheduled.
    Waiting,
    /// In the running set.
    Running,
    /// Preempted: blocks freed, queued again, tokens kept.
    Preempted,
    /// Done.
    Finished(FinishReason),
}

impl RequestStatus {
    /// Whether the request has ended.
    pub fn is_finished(self) -> bool {
        matches!(self, RequestStatus::Finished(_))
    }
}

/// One request's tokens and progress.
#[derive(Debug, Clone)]
pub struct Request {
    /// Request id.
    pub request_id: RequestId,
    /// Sampling parameters (stop conditions included).
    pub sampling_params: SamplingParams,
    /// The model's EOS token.
    pub eos_token_id: Option<TokenId>,
    /// Arrival, seconds since the Unix epoch.
    pub arrival_time: f64,
    /// The prompt's multimodal items (placeholder range, content hash, kind, tensor), sorted
    /// by offset.
    pub mm_features: Vec<MultiModalFeatureSpec>,
    /// Their tensors' bytes until the first scheduling sends them to the workers (then empty:
    /// the workers keep them).
    pub mm_buffers: TensorBuffers,
    /// Lifecycle state.
    pub status: RequestStatus,
    /// Tokens whose KV is in the cache (or scheduled to be, once the steps in flight return).
    /// Under async scheduling it may pass [`Request::num_tokens`] by the tokens still being
    /// sampled ([`Request::num_output_placeholders`]).
    pub num_computed_tokens: usize,
    /// Output tokens that steps in flight will sample and the scheduler does not know yet
    /// (vLLM's `num_output_placeholders`): always 0 without async scheduling.
    pub num_output_placeholders: usize,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub num_cached_tokens: usize,
    /// How often this request was preempted.
    pub num_preemptions: u32,
    /// What matched when it stopped.
    pub stop_reason: Option<StopReason>,
    /// When the scheduler first put it in a batch, seconds since the Unix epoch (vLLM's
    /// `scheduled_ts`); a preemption does not reset it.
    pub first_scheduled_time: Option<f64>,
    /// Whether an output already carried the queue time.
    queue_time_reported: bool,
    /// Chained hashes of the full blocks of `all_token_ids`, in order (filled lazily by the
    /// KV cache manager).
    pub(crate) block_hashes: Vec<BlockHash>,
    /// Admission order: ties of `arrival_time` break by it.
    pub(crate) seq_no: u64,
    all_token_ids: Vec<TokenId>,
    num_prompt_tokens: usize,
}

impl Request {
    /// A waiting request from what the API sent.
    pub fn new(req: EngineCoreRequest, seq_no: u64) -> Self {
        let num_prompt_tokens = req.prompt_token_ids.len();
        Self {
            request_id: req.request_id,
            sampling_params: req.sampling_params,
            eos_token_id: req.eos_token_id,
            arrival_time: req.arrival_time,
            mm_features: req.mm_features,
            mm_buffers: req.mm_buffers,
            status: RequestStatus::Waiting,
            num_computed_tokens: 0,
            num_output_placeholders: 0,
            num_cached_tokens: 0,
            num_preemptions: 0,
            stop_reason: None,
            first_scheduled_time: None,
            queue_time_reported: false,
            block_hashes: Vec::new(),
            seq_no,
            all_token_ids: req.prompt_token_ids,
            num_prompt_tokens,
        }
    }

    /// Prompt, then outputs.
    pub fn all_token_ids(&self) -> &[TokenId] {
        &self.all_token_ids
    }

    /// The prompt.
    pub fn prompt_token_ids(&self) -> &[TokenId] {
        &self.all_token_ids[..self.num_prompt_tokens]
    }

    /// Tokens generated so far.
    pub fn output_token_ids(&self) -> &[TokenId] {
        &self.all_token_ids[self.num_prompt_tokens..]
    }

    /// Prompt plus output length.
    pub fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }

    /// Prompt length.
    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    /// Output length.
    pub fn num_output_tokens(&self) -> usize {
        self.all_token_ids.len() - self.num_prompt_tokens
    }

    /// Appends one sampled token.
    pub fn append_output_token(&mut self, token: TokenId) {
        self.all_token_ids.push(token);
    }

    /// Whether this step's positions reach the end of the known tokens (so the model's sample is
    /// the next token rather than the by-product of a partial prefill chunk).
    pub fn is_caught_up(&self) -> bool {
        self.num_computed_tokens >= self.all_token_ids.len()
    }

    /// Tokens known or being sampled: the positions a step may compute.
    pub fn num_tokens_with_placeholders(&self) -> usize {
        self.all_token_ids.len() + self.num_output_placeholders
    }

    /// Whether one more sampled token can still be an output: no stop by length is certain
    /// once the tokens in flight arrive. Only async scheduling asks it of a request with
    /// placeholders; a live request without any always may.
    pub fn may_sample_more(&self, max_model_len: usize) -> bool {
        let outputs = self.num_output_tokens() + self.num_output_placeholders;
        let under_max_tokens = self
            .sampling_params
            .max_tokens
            .is_none_or(|max| outputs < max as usize);
        under_max_tokens && self.num_tokens_with_placeholders() < max_model_len
    }

    /// Records a scheduling at `now` (seconds since the Unix epoch); only the first counts.
    pub fn mark_scheduled(&mut self, now: f64) {
        self.first_scheduled_time.get_or_insert(now);
    }

    /// The queue time (first scheduling minus arrival, never negative) the first time it is
    /// asked for after the request was scheduled; `None` before and after.
    pub fn take_queue_time(&mut self) -> Option<f64> {
        let scheduled = self.first_scheduled_time?;
        if std::mem::replace(&mut self.queue_time_reported, true) {
            return None;
        }
        Some((scheduled - self.arrival_time).max(0.0))
    }

    /// Checks the stop conditions owned by the core after a token was appended: EOS (unless
    /// `ignore_eos`), `stop_token_ids` (both only once `min_tokens` outputs exist), `max_tokens`
    /// and `max_model_len`. A stop token wins over a length cap reached by the same token.
    pub fn check_stop(&mut self, max_model_len: usize) -> Option<FinishReason> {
        let params = &self.sampling_params;
        let last = self.all_token_ids.last().copied();
        if self.num_output_tokens() >= params.min_tokens as usize
            && let Some(last) = last
            && self.num_output_tokens() > 0
        {
            if !params.ignore_eos && Some(last) == self.eos_token_id {
                self.stop_reason = None;
                return Some(FinishReason::Stop);
            }
            if params.stop_token_ids.contains(&last) {
                self.stop_reason = Some(StopReason::TokenId(last));
                return Some(FinishReason::Stop);
            }
        }
        let max_tokens_hit = params
            .max_tokens
            .is_some_and(|max| self.num_output_tokens() >= max as usize);
        if max_tokens_hit || self.num_tokens() >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}

/// Checks a request's multimodal items at admission: each one's placeholder inside the prompt
/// and its tensor matching its buffer, sorted by offset without overlap, none longer than the
/// encoder cache (`cache_size` embeddings) could ever hold.
pub(crate) fn check_mm_features(
    req: &EngineCoreRequest,
    cache_size: usize,
) -> Result<(), omni_protocol::AddRequestError> {
    let bad = |reason: String| omni_protocol::AddRequestError::InvalidMultiModal {
        request_id: req.request_id.clone(),
        reason,
    };
    let mut end = 0;
    for f in &req.mm_features {
        f.check(req.prompt_token_ids.len(), &req.mm_buffers)
            .map_err(bad)?;
        let r = f.range();
        if r.start < end {
            return Err(bad(format!(
                "items overlap or are out of order at token {}",
                r.start
            )));
        }
        if r.len() > cache_size {
            return Err(bad(format!(
                "an item of {} embeddings exceeds the encoder cache of {cache_size}",
                r.len()
            )));
        }
        end = r.end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(params: SamplingParams) -> Request {
        Request::new(
            EngineCoreRequest::new("r", vec![1, 2, 3], params, Some(0)),
            0,
        )
    }

    #[test]
    fn queue_time_is_reported_once_from_the_first_scheduling() {
        let mut r = request(SamplingParams::default());
        r.arrival_time = 100.0;
        assert_eq!(r.take_queue_time(), None, "not scheduled yet");
        r.mark_scheduled(100.5);
        r.mark_scheduled(107.0); // resumed after a preemption
        assert_eq!(r.take_queue_time(), Some(0.5));
        assert_eq!(r.take_queue_time(), None);

        let mut r = request(SamplingParams::default());
        r.arrival_time = 100.0;
        r.mark_scheduled(99.0); // the API host's clock ahead of the core's
        assert_eq!(r.take_queue_time(), Some(0.0));
    }

    #[test]
    fn eos_stops_unless_ignored_or_below_min_tokens() {
        let mut r = request(SamplingParams::default());
        r.append_output_token(0);
        assert_eq!(r.check_stop(100), Some(FinishReason::Stop));
        assert_eq!(r.stop_reason, None);

        let mut r = request(SamplingParams {
            ignore_eos: true,
            ..Default::default()
        });
        r.append_output_token(0);
        assert_eq!(r.check_stop(100), None);

        let mut r = request(SamplingParams {
            min_tokens: 2,
            ..Default::default()
        });
        r.append_output_token(0);
        assert_eq!(r.check_stop(100), None);
        r.append_output_token(0);
        assert_eq!(r.check_stop(100), Some(FinishReason::Stop));
    }

    #[test]
    fn stop_token_sets_stop_reason() {
        let mut r = request(SamplingParams {
            stop_token_ids: vec![9],
            ..Default::default()
        });
        r.append_output_token(9);
        assert_eq!(r.check_stop(100), Some(FinishReason::Stop));
        assert_eq!(r.stop_reason, Some(StopReason::TokenId(9)));
    }

    #[test]
    fn length_caps_at_max_tokens_and_max_model_len() {
        let mut r = request(SamplingParams::greedy(2));
        r.append_output_token(5);
        assert_eq!(r.check_stop(100), None);
        r.append_output_token(5);
        assert_eq!(r.check_stop(100), Some(FinishReason::Length));

        let mut r = request(SamplingParams::default());
        r.append_output_token(5);
        assert_eq!(r.check_stop(4), Some(FinishReason::Length));
    }
}
