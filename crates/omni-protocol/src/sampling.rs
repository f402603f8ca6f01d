//! Per-request sampling parameters (vLLM's `SamplingParams`, minus `n`: the API layer fans a
//! request with `n > 1` out into `n` engine requests).

use serde::{Deserialize, Serialize};

use crate::TokenId;

/// How to pick each next token of one request, and when the request stops.
///
/// Defaults follow vLLM: temperature 1, no truncation, no penalties, no token limit beyond the
/// model's context (`max_tokens: None`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `0.0` means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability sums to at
    /// least `top_p`. `1.0` disables it.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens. `None` (or `Some(0)`) disables it.
    pub top_k: Option<u32>,
    /// Drop tokens whose probability is below `min_p` times the most likely token's. `0.0`
    /// disables it.
    pub min_p: f32,
    /// Seed of this request's own random stream; `None` uses the worker's global stream.
    pub seed: Option<u64>,
    /// Subtracted from the logit of every token that already appears in the output.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the output.
    pub frequency_penalty: f32,
    /// Divides positive / multiplies negative logits of tokens in prompt or output. `1.0` is off.
    pub repetition_penalty: f32,
    /// Most output tokens to generate; `None` means until `max_model_len`.
    pub max_tokens: Option<u32>,
    /// Fewest output tokens before EOS or a stop token may end the request.
    pub min_tokens: u32,
    /// Stop strings; matched on detokenized text above the engine core (the API process).
    pub stop: Vec<String>,
    /// Token ids that end the request (the token is kept in the output).
    pub stop_token_ids: Vec<TokenId>,
    /// Keep generating after the EOS token.
    pub ignore_eos: bool,
    /// Return the log-probability of each sampled token plus this many most likely alternatives.
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            max_tokens: None,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

/// A sampling parameter out of its range (the API maps it to HTTP 400). Serde: it crosses from
/// an engine-core process to the API process inside an [`crate::AddRequestError`].
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize)]
pub enum SamplingParamsError {
    /// `temperature` is negative or not finite.
    #[error("temperature must be >= 0, got {0}")]
    Temperature(f32),
    /// `top_p` is outside `(0, 1]`.
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    /// `min_p` is outside `[0, 1]`.
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    /// `presence_penalty` or `frequency_penalty` is outside `[-2, 2]`.
    #[error("{name} must be in [-2, 2], got {value}")]
    Penalty {
        /// Which penalty.
        name: &'static str,
        /// Its value.
        value: f32,
    },
    /// `repetition_penalty` is not positive.
    #[error("repetition_penalty must be > 0, got {0}")]
    RepetitionPenalty(f32),
    /// `max_tokens` is zero.
    #[error("max_tokens must be at least 1")]
    MaxTokens,
    /// `min_tokens` is larger than `max_tokens`.
    #[error("min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")]
    MinTokens {
        /// Requested minimum.
        min_tokens: u32,
        /// Requested maximum.
        max_tokens: u32,
    },
}

/// [`SamplingParamsError`] as it is read back: the same shape with the penalty's name owned,
/// then matched to one of the `'static` names.
#[derive(Deserialize)]
enum SamplingParamsErrorWire {
    Temperature(f32),
    TopP(f32),
    MinP(f32),
    Penalty { name: String, value: f32 },
    RepetitionPenalty(f32),
    MaxTokens,
    MinTokens { min_tokens: u32, max_tokens: u32 },
}

impl<'de> Deserialize<'de> for SamplingParamsError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        SamplingParamsErrorWire::deserialize(d)?
            .try_into()
            .map_err(serde::de::Error::custom)
    }
}

impl TryFrom<SamplingParamsErrorWire> for SamplingParamsError {
    type Error = String;

    fn try_from(w: SamplingParamsErrorWire) -> Result<Self, String> {
        use SamplingParamsErrorWire as W;
        Ok(match w {
            W::Temperature(v) => Self::Temperature(v),
            W::TopP(v) => Self::TopP(v),
            W::MinP(v) => Self::MinP(v),
            W::Penalty { name, value } => Self::Penalty {
                name: ["presence_penalty", "frequency_penalty"]
                    .into_iter()
                    .find(|n| *n == name)
                    .ok_or_else(|| format!("unknown penalty {name:?}"))?,
                value,
            },
            W::RepetitionPenalty(v) => Self::RepetitionPenalty(v),
            W::MaxTokens => Self::MaxTokens,
            W::MinTokens {
                min_tokens,
                max_tokens,
            } => Self::MinTokens {
                min_tokens,
                max_tokens,
            },
        })
    }
}

impl SamplingParams {
    /// Greedy decoding with at most `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self {
            temperature: 0.0,
            max_tokens: Some(max_tokens),
            ..Self::default()
        }
    }

    /// Whether the token is chosen by argmax rather than drawn at random.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5
    }

    /// Checks every range, reporting the first violation.
    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingParamsError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingParamsError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingParamsError::MinP(self.min_p));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(SamplingParamsError::Penalty { name, value });
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplingParamsError::RepetitionPenalty(
                self.repetition_penalty,
            ));
        }
        if let Some(max_tokens) = self.max_tokens {
            if max_tokens == 0 {
                return Err(SamplingParamsError::MaxTokens);
            }
            if self.min_tokens > max_tokens {
                return Err(SamplingParamsError::MinTokens {
                    min_tokens: self.min_tokens,
                    max_tokens,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_not_greedy() {
        let p = SamplingParams::default();
        assert!(p.validate().is_ok());
        assert!(!p.is_greedy());
        assert!(SamplingParams::greedy(4).is_greedy());
    }

    #[test]
    fn validate_rejects_out_of_range_values() {
        let bad = [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: 3.0,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                max_tokens: Some(0),
                ..Default::default()
            },
            SamplingParams {
                max_tokens: Some(2),
                min_tokens: 3,
                ..Default::default()
            },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?} should be rejected");
        }
    }
}
