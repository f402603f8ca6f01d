//! The audio side of an omni response (vLLM-Omni's `chat_completion_full_generator` and
//! `chat_completion_stream_generator`, omni.md 8.2-8.3).
//!
//! - Non-streaming: every audio output is kept, and the response gets an audio choice
//!   `{index: 0, message: {role, content: null, audio: {id, data, expires_at, transcript}},
//!   finish_reason}` after the text choice (both `index: 0`), or alone for `["audio"]`. `data`
//!   is base64 of one file of the whole waveform in the requested format.
//! - Streaming: one `modality: "audio"` chunk per audio output, its `delta.content` base64 of
//!   that output alone as a complete file (a WAV chunk carries its own RIFF header, as
//!   vLLM-Omni's clients expect; `pcm` is raw s16le), `usage` always attached with
//!   `completion_tokens: 0`. Only the request's last chunk carries `finish_reason`; when the
//!   last output has no audio, an empty-delta chunk does.
//!
//! Metrics: time to first audio packet (arrival to first audio output), the audio generated
//! and, at the end, the real-time factor (arrival to last audio output over audio seconds).

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use omni_protocol::AudioOutput;
use serde_json::{Value, json};

use crate::audio::{AudioFormat, encode};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::omni::OmniRequest;

/// vLLM-Omni's error when a request that wants audio ends without any.
pub const NO_AUDIO_PRODUCED: &str = "Audio generation completed but no audio was produced.";

/// How long a non-streaming response says its audio stays available (OpenAI's 24 hours).
const AUDIO_EXPIRES_S: u64 = 24 * 60 * 60;

/// One request's audio as it arrives.
#[derive(Debug)]
pub(crate) struct AudioStream {
    format: AudioFormat,
    /// Used until an output reports its own rate.
    sample_rate: u32,
    /// Every sample so far (kept for a non-streaming response only).
    samples: Option<Vec<f32>>,
    /// Samples seen.
    num_samples: u64,
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    /// Whether a chunk carried the request's `finish_reason`.
    finish_sent: bool,
}

impl AudioStream {
    /// `keep`: hold every sample (for the non-streaming response).
    pub fn new(req: &OmniRequest, keep: bool) -> Self {
        Self {
            format: req.format,
            sample_rate: req.sample_rate,
            samples: keep.then(Vec::new),
            num_samples: 0,
            first_at: None,
            last_at: None,
            finish_sent: false,
        }
    }

    /// Records one audio output of a request that arrived at `arrived`.
    pub fn push(&mut self, a: &AudioOutput, arrived: Instant, metrics: &Metrics) {
        let now = Instant::now();
        if a.sample_rate > 0 {
            self.sample_rate = a.sample_rate;
        }
        if a.samples.is_empty() {
            return;
        }
        if self.first_at.is_none() {
            metrics.observe_audio_first_packet((now - arrived).as_secs_f64());
            self.first_at = Some(now);
        }
        self.last_at = Some(now);
        self.num_samples += a.samples.len() as u64;
        metrics.observe_audio_samples(a.samples.len());
        if let Some(all) = &mut self.samples {
            all.extend_from_slice(&a.samples);
        }
    }

    fn seconds(&self) -> f64 {
        if self.sample_rate == 0 {
            return 0.0;
        }
        self.num_samples as f64 / f64::from(self.sample_rate)
    }

    /// The request ended: its audio duration and real-time factor.
    pub fn finished(&self, arrived: Instant, metrics: &Metrics) {
        let seconds = self.seconds();
        if let Some(last) = self.last_at
            && seconds > 0.0
        {
            metrics.observe_audio_finished(seconds, (last - arrived).as_secs_f64() / seconds);
        }
    }

    fn file(&self, samples: &[f32]) -> Vec<u8> {
        encode(samples, self.sample_rate, self.format)
    }

    /// The SSE chunk of one audio output, `base` being an empty chunk of the request.
    pub fn sse_chunk(
        &mut self,
        mut base: Value,
        index: usize,
        a: &AudioOutput,
        prompt_tokens: usize,
        finish: Option<&str>,
    ) -> Value {
        self.finish_sent |= finish.is_some();
        let data = base64(&self.file(&a.samples));
        base["modality"] = json!("audio");
        base["choices"] = json!([{
            "index": index,
            "delta": {"role": "assistant", "content": data},
            "logprobs": null,
            "finish_reason": finish,
        }]);
        base["usage"] = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
        });
        base
    }

    /// The empty closing chunk once the request ended (`finish`), unless a chunk already carried
    /// the finish reason.
    pub fn closing_chunk(
        &mut self,
        mut base: Value,
        index: usize,
        finish: Option<&str>,
    ) -> Option<Value> {
        if self.finish_sent || finish.is_none() {
            return None;
        }
        self.finish_sent = true;
        base["modality"] = json!("audio");
        base["choices"] = json!([{
            "index": index,
            "delta": {},
            "logprobs": null,
            "finish_reason": finish,
        }]);
        Some(base)
    }

    /// The non-streaming choices: `text` (the text choice; dropped for `["audio"]`, when
    /// `with_text` is false) and the audio choice with `transcript`.
    pub fn response_choices(
        &self,
        text: Value,
        with_text: bool,
        transcript: &str,
        finish: Option<&str>,
    ) -> Result<Vec<Value>, ApiError> {
        let samples = self.samples.as_deref().unwrap_or_default();
        if samples.is_empty() {
            return Err(ApiError::internal(NO_AUDIO_PRODUCED));
        }
        let expires_at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
            + AUDIO_EXPIRES_S;
        let audio = json!({
            "index": 0,
            "message": {
                "role": "assistant",
                "content": null,
                "audio": {
                    "id": format!("audio-{:016x}", rand::random::<u64>()),
                    "data": base64(&self.file(samples)),
                    "expires_at": expires_at,
                    "transcript": transcript,
                },
            },
            "logprobs": null,
            "finish_reason": finish,
        });
        Ok(if with_text {
            vec![text, audio]
        } else {
            vec![audio]
        })
    }
}

/// Standard base64 (RFC 4648, padded).
pub(crate) fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let b = [
            group[0],
            group.get(1).copied().unwrap_or(0),
            group.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            if k <= group.len() {
                out.push(char::from(TABLE[(n >> (18 - 6 * k)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want, "{input}");
        }
        assert_eq!(base64(&[0xff, 0xfe, 0xfd]), "//79");
    }
}
