//! Running a [`Prepared`] request on the engine: fan out one engine request per choice,
//! detokenize and match stop strings as outputs arrive, and render either one response body or
//! a stream of SSE chunks. An [`AbortGuard`] aborts every unfinished engine request when the
//! generation is dropped (client gone, error, stop string), so no request outlives its client.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::response::sse::Event;
use futures::stream::{self, BoxStream, SelectAll, Stream, StreamExt};
use omni_protocol::{EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs};
use omni_tokenizer::{IncrementalDetokenizer, StopStrings};
use serde_json::{Value, json};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::AppState;
use crate::engine::EngineError;
use crate::error::ApiError;
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
    finish: Option<FinishReason>,
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
                let req =
                    EngineCoreRequest::new(request_id.clone(), prompt.ids.clone(), params, eos);
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
                    pending_logprobs: Vec::new(),
                    logprobs: Vec::new(),
                    echo: prompt.echo.clone(),
                    last_token_at: None,
                    first_token_at: None,
                    queue_time: None,
                });
            }
        }
        Ok(Self {
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
    /// touched, or `None` once every choice has finished.
    async fn step(&mut self) -> Result<Option<usize>, ApiError> {
        loop {
            if self.choices.iter().all(|c| c.finish.is_some()) {
                return Ok(None);
            }
            let Some((i, item)) = self.outputs.next().await else {
                return Err(self.lost_stream());
            };
            if self.choices[i].finish.is_some() {
                continue; // outputs after a stop string matched
            }
            match item {
                Some(Ok(out)) => {
                    self.apply(i, out)?;
                    return Ok(Some(i));
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

    fn apply(&mut self, i: usize, out: EngineCoreOutput) -> Result<(), ApiError> {
        let now = Instant::now();
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
        for (k, &id) in out.new_token_ids.iter().enumerate() {
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
            self.state.engine.abort(std::slice::from_ref(&c.request_id));
        } else if let Some(reason) = out.finish_reason {
            let tail = c
                .detok
                .finish(tokenizer)
                .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
            push_text(c, &tail);
            c.finish = Some(reason);
        }
        if let Some(reason) = c.finish {
            let rid = c.request_id.clone();
            self.guard.finished(&rid);
            self.state
                .metrics
                .observe_finished(reason.as_str(), self.arrived.elapsed().as_secs_f64());
            if let (Some(first), Some(last)) = (c.first_token_at, c.last_token_at) {
                self.state
                    .metrics
                    .observe_decode_time((last - first).as_secs_f64());
            }
            if reason == FinishReason::Error {
                return Err(ApiError::internal("the engine failed this request"));
            }
        }
        Ok(())
    }

    fn usage(&self) -> Value {
        let prompt: usize = self.prep.prompts.iter().map(|p| p.ids.len()).sum();
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

    fn chunk(&self, choices: Vec<Value>) -> Value {
        let object = match self.prep.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        };
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.prep.model,
            "choices": choices,
        });
        if self.prep.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// First chunks: the assistant role (chat) or the echoed prompt (completions).
    fn opening_chunks(&self) -> Vec<Value> {
        let mut out = Vec::new();
        for (index, c) in self.choices.iter().enumerate() {
            match self.prep.endpoint {
                Endpoint::Chat => out.push(self.chunk(vec![json!({
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                })])),
                Endpoint::Completion => {
                    if let Some(echo) = &c.echo {
                        out.push(self.chunk(vec![json!({
                            "index": index,
                            "text": echo,
                            "logprobs": null,
                            "finish_reason": null,
                        })]));
                    }
                }
            }
        }
        out
    }

    /// The chunk for what choice `i` can stream now, if anything.
    fn delta_chunk(&mut self, i: usize) -> Option<Value> {
        let tokenizer = self.state.tokenizer.clone();
        let endpoint = self.prep.endpoint;
        let want_logprobs = self.prep.logprobs.is_some();
        let c = &mut self.choices[i];
        let end = if c.finish.is_some() {
            c.text.len()
        } else {
            c.stops.safe_len(&c.text).max(c.sent)
        };
        let text = c.text.get(c.sent..end).unwrap_or("").to_string();
        let offset = c.echo.as_ref().map_or(0, String::len) + c.sent;
        c.sent = end.max(c.sent);
        let logprobs = std::mem::take(&mut c.pending_logprobs);
        let finish = c.finish.map(FinishReason::as_str);
        if text.is_empty() && logprobs.is_empty() && finish.is_none() {
            return None;
        }
        let choice = match endpoint {
            Endpoint::Chat => {
                let delta = if text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({ "content": text })
                };
                json!({
                    "index": i,
                    "delta": delta,
                    "logprobs": want_logprobs.then(|| chat_logprobs(&tokenizer, &logprobs)),
                    "finish_reason": finish,
                })
            }
            Endpoint::Completion => json!({
                "index": i,
                "text": text,
                "logprobs": want_logprobs.then(|| completion_logprobs(&tokenizer, &logprobs, offset)),
                "finish_reason": finish,
            }),
        };
        Some(self.chunk(vec![choice]))
    }

    /// The SSE stream: chunks, an optional usage chunk, `data: [DONE]`. An error becomes one
    /// error event before `[DONE]`. Dropping the stream aborts the engine requests.
    pub fn into_sse(self) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
        struct St {
            generation: Generation,
            queue: VecDeque<Event>,
            done: bool,
        }
        let queue = self
            .opening_chunks()
            .into_iter()
            .map(|v| Event::default().data(v.to_string()))
            .collect();
        let st = St {
            generation: self,
            queue,
            done: false,
        };
        stream::unfold(st, |mut st| async move {
            loop {
                if let Some(ev) = st.queue.pop_front() {
                    return Some((Ok(ev), st));
                }
                if st.done {
                    return None;
                }
                match st.generation.step().await {
                    Ok(Some(i)) => {
                        if let Some(v) = st.generation.delta_chunk(i) {
                            st.queue.push_back(Event::default().data(v.to_string()));
                        }
                    }
                    Ok(None) => {
                        if st.generation.prep.include_usage {
                            let mut v = st.generation.chunk(Vec::new());
                            v["usage"] = st.generation.usage();
                            st.queue.push_back(Event::default().data(v.to_string()));
                        }
                        st.queue.push_back(Event::default().data("[DONE]"));
                        st.done = true;
                    }
                    Err(e) => {
                        let mut body = e.body();
                        body["error"]["code"] = json!(e.status.as_u16());
                        st.queue.push_back(Event::default().data(body.to_string()));
                        st.queue.push_back(Event::default().data("[DONE]"));
                        st.done = true;
                    }
                }
            }
        })
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

fn token_text(tokenizer: &omni_tokenizer::Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

/// Chat `logprobs`: `{"content":[{"token","logprob","bytes","top_logprobs":[...]}]}`.
fn chat_logprobs(tokenizer: &omni_tokenizer::Tokenizer, lps: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let token = token_text(tokenizer, id);
        json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(lp.sampled.token_id, lp.sampled.logprob);
            e["top_logprobs"] = lp
                .top
                .iter()
                .map(|t| entry(t.token_id, t.logprob))
                .collect();
            e
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

/// Completions `logprobs`: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (one map
/// per position, sampled token included) and `text_offset`.
fn completion_logprobs(
    tokenizer: &omni_tokenizer::Tokenizer,
    lps: &[TokenLogprobs],
    mut offset: usize,
) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut text_offset = Vec::new();
    for lp in lps {
        let token = token_text(tokenizer, lp.sampled.token_id);
        text_offset.push(offset);
        offset += token.len();
        let mut top = serde_json::Map::new();
        for t in &lp.top {
            top.insert(token_text(tokenizer, t.token_id), json!(t.logprob));
        }
        top.insert(token.clone(), json!(lp.sampled.logprob));
        tokens.push(token);
        token_logprobs.push(lp.sampled.logprob);
        top_logprobs.push(Value::Object(top));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}
