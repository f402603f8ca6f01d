//! The request side of omni (text + speech) chat requests, as vLLM-Omni's `serving_chat.py`
//! reads them: `modalities`, `audio.format`, `speaker` / `voice`, `language` and
//! `sampling_params_list`, checked against the model's [`OmniServerInfo`] and turned into the
//! [`OmniParams`] the engine receives.
//!
//! Sampling: the standard fields (`temperature`, `max_tokens`, ...) apply to the Thinker on top of
//! its deploy-profile defaults. `sampling_params_list` has one object per stage; when present it
//! replaces the stage defaults: element 0's keys apply to the Thinker on top of the request's
//! standard fields (no Thinker profile defaults), elements 1.. become
//! [`OmniParams::stage_sampling`] (each on top of [`SamplingParams::default`]), and stages the
//! list does not reach keep their profile defaults (vLLM-Omni's `to_sampling_params_list`).

use omni_protocol::{Modality, OmniParams, SamplingParams, SamplingParamsError};
use serde::Deserialize;
use serde_json::Value;

use crate::audio::AudioFormat;
use crate::error::ApiError;
use crate::openai::{ChatCompletionRequest, CommonParams, StopSpec};

/// What the server knows about an omni model (Thinker -> Talker -> Code2Wav); `None` in
/// [`crate::ServerConfig::omni`] for a text-only model.
///
/// A request's standard sampling fields apply to the Thinker over [`thinker_sampling`]. A
/// request's `sampling_params_list` replaces the stage defaults: element 0's keys go over the
/// standard fields (without `thinker_sampling`), elements 1.. become the later stages' sampling
/// (each over [`SamplingParams::default`]), and stages it does not reach keep
/// [`stage_sampling`].
///
/// [`thinker_sampling`]: OmniServerInfo::thinker_sampling
/// [`stage_sampling`]: OmniServerInfo::stage_sampling
#[derive(Debug, Clone, PartialEq)]
pub struct OmniServerInfo {
    /// The Talker's speaker names, lower-case (`talker_config.speaker_id` keys). Empty: any
    /// name is accepted.
    pub speakers: Vec<String>,
    /// The speaker of a request that names none (lower-case).
    pub default_speaker: String,
    /// Modalities of a request that names none (vLLM-Omni: the engine's output modalities,
    /// `["text", "audio"]`).
    pub default_modalities: Vec<Modality>,
    /// Samples per second of the audio (used when an output does not say; 24,000 for
    /// Qwen3-Omni).
    pub sample_rate: u32,
    /// The Thinker's defaults (stage 0's `default_sampling_params`), under the request's
    /// standard fields.
    pub thinker_sampling: SamplingParams,
    /// Defaults of the stages after the Thinker (index 0 = stage 1, the Talker), from the deploy
    /// profile's `default_sampling_params` (see [`sampling_params_from_json`]). Empty: the
    /// pipeline's own defaults, and a `sampling_params_list` of any length is accepted.
    pub stage_sampling: Vec<SamplingParams>,
}

impl Default for OmniServerInfo {
    /// Qwen3-Omni's: speaker `ethan`, `["text", "audio"]`, 24 kHz, default sampling.
    fn default() -> Self {
        Self {
            speakers: Vec::new(),
            default_speaker: "ethan".into(),
            default_modalities: vec![Modality::Text, Modality::Audio],
            sample_rate: 24_000,
            thinker_sampling: SamplingParams::default(),
            stage_sampling: Vec::new(),
        }
    }
}

/// One stage's sampling object (an element of `sampling_params_list`, or a deploy profile's
/// `default_sampling_params`): the keys of vLLM's `SamplingParams` that the engine implements.
/// An unknown key is an error (vLLM's `SamplingParams(**d)` raises too).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SamplingOverrides {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    max_tokens: Option<u32>,
    min_tokens: Option<u32>,
    stop: Option<StopSpec>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    logprobs: Option<u32>,
    /// Accepted and ignored (vLLM-Omni's profiles set it on the Talker; it detokenizes nothing
    /// there).
    #[serde(default, rename = "detokenize")]
    _detokenize: Option<bool>,
}

/// A stage's sampling object that does not parse or is out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingParamsParseError {
    /// Not an object of the known keys with the right types (serde's message).
    #[error("{0}")]
    Shape(String),
    /// `top_k` other than -1, 0 or positive.
    #[error("top_k must be -1 (disabled) or at least 1, got {0}")]
    TopK(i64),
    /// A value out of its range.
    #[error(transparent)]
    Range(#[from] SamplingParamsError),
}

/// A deploy profile's (or a request's) per-stage sampling object as [`SamplingParams`]: its
/// keys on top of [`SamplingParams::default`]. The binary uses it to fill
/// [`OmniServerInfo::stage_sampling`] from `default_sampling_params`.
pub fn sampling_params_from_json(v: &Value) -> Result<SamplingParams, SamplingParamsParseError> {
    SamplingOverrides::parse(v)?.to_params()
}

impl SamplingOverrides {
    fn parse(v: &Value) -> Result<Self, SamplingParamsParseError> {
        Self::deserialize(v).map_err(|e| SamplingParamsParseError::Shape(e.to_string()))
    }

    fn to_params(&self) -> Result<SamplingParams, SamplingParamsParseError> {
        let d = SamplingParams::default();
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => None,
            Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
            Some(k) => return Err(SamplingParamsParseError::TopK(k)),
        };
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k,
            min_p: self.min_p.unwrap_or(d.min_p),
            seed: self.seed.map(|s| s as u64),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            max_tokens: self.max_tokens,
            min_tokens: self.min_tokens.unwrap_or(0),
            stop: self
                .stop
                .clone()
                .map(StopSpec::into_vec)
                .unwrap_or_default(),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs: self.logprobs,
        };
        p.validate()?;
        Ok(p)
    }

    /// Element 0: the Thinker's keys, over the request's standard fields.
    fn apply_to(&self, c: &mut CommonParams, max_tokens: &mut Option<u32>) {
        fn set<T: Clone>(dst: &mut Option<T>, src: &Option<T>) {
            if src.is_some() {
                dst.clone_from(src);
            }
        }
        set(&mut c.temperature, &self.temperature);
        set(&mut c.top_p, &self.top_p);
        set(&mut c.top_k, &self.top_k);
        set(&mut c.min_p, &self.min_p);
        set(&mut c.seed, &self.seed);
        set(&mut c.presence_penalty, &self.presence_penalty);
        set(&mut c.frequency_penalty, &self.frequency_penalty);
        set(&mut c.repetition_penalty, &self.repetition_penalty);
        set(max_tokens, &self.max_tokens);
        set(&mut c.min_tokens, &self.min_tokens);
        set(&mut c.stop, &self.stop);
        set(&mut c.stop_token_ids, &self.stop_token_ids);
        set(&mut c.ignore_eos, &self.ignore_eos);
    }
}

/// The omni part of a validated chat request.
#[derive(Debug, Clone)]
pub struct OmniRequest {
    /// What the engine receives.
    pub params: OmniParams,
    /// The audio file format of the response.
    pub format: AudioFormat,
    /// Fallback sample rate ([`OmniServerInfo::sample_rate`]).
    pub sample_rate: u32,
}

impl OmniRequest {
    /// Whether the response has audio.
    pub fn wants_audio(&self) -> bool {
        self.params.wants_audio()
    }

    /// Whether the response has text.
    pub fn wants_text(&self) -> bool {
        self.params.wants_text()
    }
}

/// What [`prepare_omni`] gives the chat preparation.
#[derive(Debug)]
pub(crate) struct OmniPrepared {
    /// The omni part; `None` on a server without omni.
    pub request: Option<OmniRequest>,
    /// The Thinker's sampling defaults under the standard fields.
    pub thinker_defaults: SamplingParams,
}

/// Checks the omni fields of `req` against `info` (a server without omni: `None`), and applies
/// `sampling_params_list[0]` to the request's standard fields (`common`, `max_tokens`).
pub(crate) fn prepare_omni(
    info: Option<&OmniServerInfo>,
    req: &ChatCompletionRequest,
    common: &mut CommonParams,
    max_tokens: &mut Option<u32>,
) -> Result<OmniPrepared, ApiError> {
    let Some(info) = info else {
        check_text_only(req)?;
        return Ok(OmniPrepared {
            request: None,
            thinker_defaults: SamplingParams::default(),
        });
    };
    let modalities = match &req.modalities {
        None | Some(Value::Null) => info.default_modalities.clone(),
        Some(v) => parse_modalities(v, &[Modality::Text, Modality::Audio])?,
    };
    let wants_audio = modalities.contains(&Modality::Audio);
    let format = match req.audio.as_ref().and_then(|a| a.format.as_deref()) {
        Some(f) if wants_audio => parse_format(f)?,
        _ => AudioFormat::Wav,
    };
    let speaker = resolve_speaker(info, req)?;
    let mut thinker_defaults = info.thinker_sampling.clone();
    let mut stage_sampling = info.stage_sampling.clone();
    if let Some(list) = &req.sampling_params_list {
        let stages = 1 + info.stage_sampling.len();
        if !info.stage_sampling.is_empty() && list.len() > stages {
            return Err(ApiError::bad_param(
                "sampling_params_list",
                format!(
                    "sampling_params_list has {} entries; this pipeline has {stages} stages",
                    list.len()
                ),
            ));
        }
        for (k, v) in list.iter().enumerate() {
            let param = format!("sampling_params_list[{k}]");
            let bad =
                |e: SamplingParamsParseError| ApiError::bad_param(param.clone(), e.to_string());
            let o = SamplingOverrides::parse(v).map_err(bad)?;
            if k == 0 {
                o.apply_to(common, max_tokens);
                thinker_defaults = SamplingParams::default();
            } else {
                let p = o.to_params().map_err(bad)?;
                match stage_sampling.get_mut(k - 1) {
                    Some(slot) => *slot = p,
                    None => stage_sampling.push(p),
                }
            }
        }
    }
    if wants_audio {
        if common.n.unwrap_or(1) != 1 {
            return Err(ApiError::bad_param(
                "n",
                "n must be 1 when the response has audio",
            ));
        }
        if common
            .stop
            .as_ref()
            .is_some_and(|s| !s.as_slice().is_empty())
        {
            return Err(ApiError::bad_param(
                "stop",
                "stop strings are not supported when the response has audio (the Talker \
                 speaks every Thinker token); use stop_token_ids",
            ));
        }
    }
    Ok(OmniPrepared {
        request: Some(OmniRequest {
            params: OmniParams {
                modalities,
                speaker,
                stage_sampling,
            },
            format,
            sample_rate: info.sample_rate,
        }),
        thinker_defaults,
    })
}

/// A server without omni: audio fields are a 400.
fn check_text_only(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    if let Some(v) = &req.modalities
        && !v.is_null()
    {
        parse_modalities(v, &[Modality::Text])?;
    }
    let no_audio = |param: &str| {
        ApiError::bad_param(
            param,
            format!("`{param}` needs a model with an audio output stage; this one has none"),
        )
    };
    if req.audio.is_some() {
        return Err(no_audio("audio"));
    }
    if req.speaker.is_some() {
        return Err(no_audio("speaker"));
    }
    if req.voice.is_some() {
        return Err(no_audio("voice"));
    }
    if req.sampling_params_list.is_some() {
        return Err(no_audio("sampling_params_list"));
    }
    Ok(())
}

/// `modalities` as vLLM-Omni checks it: a list of strings, each one the model supports.
fn parse_modalities(v: &Value, supported: &[Modality]) -> Result<Vec<Modality>, ApiError> {
    let bad = |m: String| ApiError::bad_param("modalities", m);
    let Some(list) = v.as_array() else {
        return Err(bad("'modalities' must be a list of strings.".into()));
    };
    let mut names = Vec::with_capacity(list.len());
    for item in list {
        match item.as_str() {
            Some(s) => names.push(s),
            None => return Err(bad("'modalities' must be a list of strings.".into())),
        }
    }
    let mut unsupported: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| !supported.iter().any(|m| m.as_str() == *n))
        .collect();
    if !unsupported.is_empty() {
        unsupported.sort_unstable();
        unsupported.dedup();
        let mut allowed: Vec<&str> = supported.iter().map(|m| m.as_str()).collect();
        allowed.sort_unstable();
        return Err(bad(format!(
            "Unsupported output modalities {} for this model. Supported modalities: {}",
            unsupported.join(", "),
            allowed.join(", ")
        )));
    }
    let mut out = Vec::new();
    for m in [Modality::Text, Modality::Audio] {
        if names.contains(&m.as_str()) {
            out.push(m);
        }
    }
    if out.is_empty() {
        return Err(bad("'modalities' must not be empty".into()));
    }
    Ok(out)
}

fn parse_format(f: &str) -> Result<AudioFormat, ApiError> {
    AudioFormat::parse(f).map_err(|m| ApiError::bad_param("audio.format", m))
}

/// `speaker`, else `voice`, lower-cased and checked; else the default.
fn resolve_speaker(info: &OmniServerInfo, req: &ChatCompletionRequest) -> Result<String, ApiError> {
    let (param, given) = match (&req.speaker, &req.voice) {
        (Some(s), _) => ("speaker", s),
        (None, Some(v)) => ("voice", v),
        (None, None) => return Ok(info.default_speaker.clone()),
    };
    let name = given.trim().to_lowercase();
    if info.speakers.is_empty() || info.speakers.contains(&name) {
        return Ok(name);
    }
    let mut allowed = info.speakers.clone();
    allowed.sort_unstable();
    Err(ApiError::bad_param(
        param,
        format!(
            "Invalid speaker '{given}'. Supported: {}",
            allowed.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stage_objects_parse_over_defaults_and_reject_unknown_keys() {
        let p = sampling_params_from_json(&json!({"temperature": 0.9, "top_k": 50,
            "max_tokens": 4096, "repetition_penalty": 1.05, "detokenize": false}))
        .unwrap();
        assert_eq!(
            (p.temperature, p.top_k, p.max_tokens),
            (0.9, Some(50), Some(4096))
        );
        assert_eq!(p.repetition_penalty, 1.05);
        assert_eq!(
            sampling_params_from_json(&json!({"top_k": -1}))
                .unwrap()
                .top_k,
            None
        );
        let e = sampling_params_from_json(&json!({"temprature": 0.0})).unwrap_err();
        assert!(e.to_string().contains("temprature"), "{e}");
        assert!(matches!(
            sampling_params_from_json(&json!({"top_p": 0.0})),
            Err(SamplingParamsParseError::Range(_))
        ));
    }

    #[test]
    fn modalities_keep_a_fixed_order_and_name_the_unsupported() {
        let both = [Modality::Text, Modality::Audio];
        assert_eq!(
            parse_modalities(&json!(["audio", "text", "audio"]), &both).unwrap(),
            both
        );
        let e = parse_modalities(&json!(["smell", "audio"]), &[Modality::Text]).unwrap_err();
        assert_eq!(
            e.message,
            "Unsupported output modalities audio, smell for this model. Supported modalities: text"
        );
        let e = parse_modalities(&json!("audio"), &both).unwrap_err();
        assert_eq!(e.message, "'modalities' must be a list of strings.");
    }
}
