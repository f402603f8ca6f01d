//! The SSE side of a [`Generation`]: chunk shapes, the opening chunks, text deltas, audio
//! chunks, and the stream that ends with `data: [DONE]`.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::Event;
use futures::stream::{self, Stream};
use omni_protocol::{AudioOutput, FinishReason};
use serde_json::{Value, json};

use super::Generation;
use crate::logprobs::{chat_logprobs, completion_logprobs};
use crate::prepare::Endpoint;

impl Generation {
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
        if self.prep.omni.is_some() {
            v["modality"] = json!("text");
        }
        v
    }

    /// Whether the stream has text chunks (not for an omni request of `["audio"]`).
    pub(super) fn streams_text(&self) -> bool {
        self.prep.omni.as_ref().is_none_or(|o| o.wants_text())
    }

    /// The audio chunk of `audio` for choice `i`, and the empty closing chunk when the request
    /// ended without one carrying its `finish_reason`.
    fn audio_chunks(&mut self, i: usize, audio: Option<AudioOutput>) -> Vec<Value> {
        let base = self.chunk(Vec::new());
        let prompt = self.prompt_tokens();
        let end = self.choices[i].end.map(FinishReason::as_str);
        let Some(st) = &mut self.audio else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if let Some(a) = audio {
            out.push(st.sse_chunk(base.clone(), i, &a, prompt, end));
        }
        out.extend(st.closing_chunk(base, i, end));
        out
    }

    /// First chunks: the assistant role (chat) or the echoed prompt (completions).
    fn opening_chunks(&self) -> Vec<Value> {
        let mut out = Vec::new();
        if !self.streams_text() {
            return out;
        }
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
        // With audio, the finish reason goes on the last audio chunk (the last modality).
        let finish = c
            .finish
            .filter(|_| self.audio.is_none())
            .map(FinishReason::as_str);
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
                    Ok(Some((i, audio))) => {
                        let g = &mut st.generation;
                        let text = if g.streams_text() {
                            g.delta_chunk(i)
                        } else {
                            None
                        };
                        for v in text.into_iter().chain(g.audio_chunks(i, audio)) {
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
