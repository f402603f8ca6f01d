//! Running a [`Prepared`] request on the engine: fan out one engine request per choice,
//! detokenize and match stop strings as outputs arrive, and render either one response body or
//! a stream of SSE chunks (`generate/sse.rs`). An [`AbortGuard`] aborts every unfinished engine
//! request when the generation is dropped (client gone, error, stop string), so no request
//! outlives its client.
//! An omni request that wants audio also gets its audio outputs rendered by an [`AudioStream`]
//! (`omni_stream.rs`): its text ends at `text_finish_reason`, the request at `finish_reason`.

mod sse;

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures::stream::{self, BoxStream, SelectAll, StreamExt};
use omni_protocol::{
    AudioOutput, EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs,
};
use omni_tokenizer::{IncrementalDetokenizer, StopStrings};
use serde_json::{Value, json};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::AppState;
use crate::engine::EngineError;
use crate::error::ApiError;
use crate::logprobs::{chat_logprobs, completion_logprobs};
use crate::omni_stream::AudioStream;
use crate::prepare::{Endpoint, Prepared};

type Item = (usize, Option<Result<EngineCoreOutput, EngineError>>);

/// Aborts the engine requests still live when dropped.
struct AbortGuard {
    state: Arc<AppState>,
    live: Vec<String>,
}

impl AbortGuard {
    fn finished(&mut self, request_id: &str) {
        self.live.retain(|r| r != request_id);
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.live.is_empty() {
            self.state.engine.abort(&self.live);
            tracing::debug!(requests = ?self.live, "aborted unfinished engine requests");
        }
    }
}

/// One choice (one engine request).
struct Choice {
    request_id: String,
    detok: IncrementalDetokenizer,
    stops: StopStrings,
    /// Generated text so far (echoed prompt excluded), cut at a matched stop string.
    text: String,
    /// Bytes of `text` already streamed.
    sent: usize,
    /// Output tokens generated.
    tokens: usize,
    /// Why the text ended (the text choice's `finish_reason`).
    finish: Option<FinishReason>,
    /// Why the engine request ended (after the audio, for an omni request with audio; else
    /// with the text).
    end: Option<FinishReason>,
    /// Logprobs not yet streamed.
    pending_logprobs: Vec<TokenLogprobs>,
    /// Every logprob (non-streaming).
    logprobs: Vec<TokenLogprobs>,
    echo: Option<String>,
    last_token_at: Option<Instant>,
    first_token_at: Option<Instant>,
    /// What the engine reported on the first output.
    queue_time: Option<f64>,
}

/// A request in flight.
pub struct Generation {
    state: Arc<AppState>,
    prep: Prepared,
    id: String,
    created: u64,
    arrived: Instant,
    choices: Vec<Choice>,
    outputs: SelectAll<BoxStream<'static, Item>>,
    guard: AbortGuard,
    /// The audio of an omni request that wants it (one choice).
    audio: Option<AudioStream>,
}

fn random_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

impl Generation {
    /// Sends every engine request. On failure the ones already sent are aborted.
    pub fn start(state: Arc<AppState>, prep: Prepared) -> Result<Self, ApiError> {
        let id = random_id(match prep.endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        });
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut guard = AbortGuard {
            state: state.clone(),
            live: Vec::new(),
        };
        let mut choices = Vec::new();
        let mut outputs = SelectAll::new();
        let eos = state.tokenizer.eos_token_ids().first().copied();
        for prompt in &prep.prompts {
            for j in 0..prep.n {
                let index = choices.len();
                let request_id = format!("{id}-{index}");
                let mut params = prompt.params.clone();
                params.seed = params.seed.map(|s| s.wrapping_add(u64::from(j)));
                let stops = StopStrings::new(params.stop.clone(), prep.include_stop_str_in_output);
                let mut req =
                    EngineCoreRequest::new(request_id.clone(), prompt.ids.clone(), params, eos);
                req.omni = prep.omni.as_ref().map(|o| o.params.clone());
                prompt.attach_mm_inputs(&mut req);
                let rx = state.engine.add_request(req)?;
                guard.live.push(request_id.clone());
                state.metrics.observe_prompt(prompt.ids.len());
                let s = UnboundedReceiverStream::new(rx)
                    .map(move |r| (index, Some(r)))
                    .chain(stream::once(async move { (index, None) }));
                outputs.push(s.boxed());
                choices.push(Choice {
                    request_id,
                    detok: state
                        .tokenizer
                        .incremental_detokenizer(&prompt.ids, prep.skip_special_tokens),
                    stops,
                    text: String::new(),
                    sent: 0,
                    tokens: 0,
                    finish: None,
                    end: None,
                    pending_logprobs: Vec::new(),
                    logprobs: Vec::new(),
                    echo: prompt.echo.clone(),
                    last_token_at: None,
                    first_token_at: None,
                    queue_time: None,
                });
            }
        }
        let audio = prep
            .omni
            .as_ref()
            .filter(|o| o.wants_audio())
            .map(|o| AudioStream::new(o, !prep.stream));
        Ok(Self {
            audio,
            state,
            prep,
            id,
            created,
            arrived: Instant::now(),
            choices,
            outputs,
            guard,
        })
    }

    /// Waits for the next engine output and applies it; returns the index of the choice it
    /// touched and the audio it carried, or `None` once every choice has ended.
    async fn step(&mut self) -> Result<Option<(usize, Option<AudioOutput>)>, ApiError> {
        loop {
            if self.choices.iter().all(|c| c.end.is_some()) {
                return Ok(None);
            }
            let Some((i, item)) = self.outputs.next().await else {
                return Err(self.lost_stream());
            };
            if self.choices[i].end.is_some() {
                continue; // outputs after a stop string matched
            }
            match item {
                Some(Ok(out)) => {
                    let audio = self.apply(i, out)?;
                    return Ok(Some((i, audio)));
                }
                Some(Err(e)) => return Err(e.into()),
                None => return Err(self.lost_stream()),
            }
        }
    }

    fn lost_stream(&self) -> ApiError {
        match self.state.engine.is_healthy() {
            Err(cause) => EngineError::Dead { cause }.into(),
            Ok(()) => ApiError::internal("the engine ended a request without a final output"),
        }
    }

    fn apply(
        &mut self,
        i: usize,
        mut out: EngineCoreOutput,
    ) -> Result<Option<AudioOutput>, ApiError> {
        let now = Instant::now();
        let audio = out.audio.take();
        if let (Some(a), Some(st)) = (&audio, &mut self.audio) {
            st.push(a, self.arrived, &self.state.metrics);
        }
        let tokenizer = &self.state.tokenizer;
        let want_logprobs = self.prep.logprobs.is_some();
        let c = &mut self.choices[i];
        let metrics = &self.state.metrics;
        if let Some(q) = out.queue_time
            && c.queue_time.is_none()
        {
            metrics.observe_queue_time(q);
            c.queue_time = Some(q);
        }
        if !out.new_token_ids.is_empty() {
            let (ttft, itl) = match c.last_token_at {
                None => (Some((now - self.arrived).as_secs_f64()), None),
                Some(t) => (None, Some((now - t).as_secs_f64())),
            };
            metrics.observe_tokens(out.new_token_ids.len(), ttft, itl);
            if let (Some(ttft), Some(q)) = (ttft, c.queue_time) {
                metrics.observe_prefill_time((ttft - q).max(0.0));
            }
            c.first_token_at.get_or_insert(now);
            c.last_token_at = Some(now);
        }
        let mut stop_hit = false;
        let text_open = c.finish.is_none();
        for (k, &id) in out.new_token_ids.iter().enumerate().filter(|_| text_open) {
            c.tokens += 1;
            if want_logprobs && let Some(lp) = out.new_logprobs.get(k) {
                c.pending_logprobs.push(lp.clone());
                c.logprobs.push(lp.clone());
            }
            let delta = c
                .detok
                .push(tokenizer, id)
                .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
            if push_text(c, &delta) {
                stop_hit = true;
                break;
            }
        }
        if stop_hit {
            c.finish = Some(FinishReason::Stop);
            c.end = c.finish;
            self.state.engine.abort(std::slice::from_ref(&c.request_id));
        } else if let Some(reason) = out.text_finish_reason.or(out.finish_reason)
            && text_open
        {
            let tail = c
                .detok
                .finish(tokenizer)
                .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
            push_text(c, &tail);
            c.finish = Some(reason);
        }
        if c.end.is_none() {
            c.end = out.finish_reason;
        }
        if let Some(reason) = c.end {
            let rid = c.request_id.clone();
            self.guard.finished(&rid);
            self.state
                .metrics
                .observe_finished(reason.as_str(), self.arrived.elapsed().as_secs_f64());
            if let (Some(first), Some(last)) = (c.first_token_at, c.last_token_at) {
                self.state
                    .metrics
                    .observe_decode_time((last - first).as_secs_f64(), c.tokens);
            }
            if let Some(st) = &self.audio {
                st.finished(self.arrived, &self.state.metrics);
            }
            if reason == FinishReason::Error {
                return Err(ApiError::internal("the engine failed this request"));
            }
        }
        Ok(audio)
    }

    fn prompt_tokens(&self) -> usize {
        self.prep.prompts.iter().map(|p| p.ids.len()).sum()
    }

    fn usage(&self) -> Value {
        let prompt = self.prompt_tokens();
        let completion: usize = self.choices.iter().map(|c| c.tokens).sum();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        })
    }

    /// Waits for every choice and renders the response body.
    pub async fn collect(mut self) -> Result<Value, ApiError> {
        while self.step().await?.is_some() {}
        let tokenizer = &self.state.tokenizer;
        let mut choices = Vec::with_capacity(self.choices.len());
        for (index, c) in self.choices.iter().enumerate() {
            let finish = c.finish.map(FinishReason::as_str);
            choices.push(match self.prep.endpoint {
                Endpoint::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.prep.logprobs.map(|_| chat_logprobs(tokenizer, &c.logprobs)),
                    "finish_reason": finish,
                }),
                Endpoint::Completion => {
                    let echo = c.echo.as_deref().unwrap_or("");
                    json!({
                        "index": index,
                        "text": format!("{echo}{}", c.text),
                        "logprobs": self.prep.logprobs.map(|_| completion_logprobs(tokenizer, &c.logprobs, echo.len())),
                        "finish_reason": finish,
                    })
                }
            });
        }
        if let (Some(st), Some(c)) = (&self.audio, self.choices.first()) {
            let text = choices.pop().unwrap_or(Value::Null);
            let end = c.end.map(FinishReason::as_str);
            choices = st.response_choices(text, self.streams_text(), &c.text, end)?;
        }
        let object = match self.prep.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        };
        Ok(json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.prep.model,
            "choices": choices,
            "usage": self.usage(),
        }))
    }
}

/// Appends `delta` to the choice's text, looks for a stop string overlapping it, truncates the
/// text at a match and says whether one matched.
fn push_text(c: &mut Choice, delta: &str) -> bool {
    c.text.push_str(delta);
    if c.stops.is_empty() || delta.is_empty() {
        return false;
    }
    match c.stops.find(&c.text, delta.len()) {
        Some(m) => {
            c.text.truncate(m.truncate_to);
            true
        }
        None => false,
    }
}
