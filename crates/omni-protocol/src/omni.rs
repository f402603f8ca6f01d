//! What an omni request (text + speech, Qwen3-Omni) carries beyond a text request, and the audio
//! that comes back.
//!
//! The API process puts an [`OmniParams`] on the [`crate::EngineCoreRequest`] it hands the
//! omni pipeline; the pipeline's client sends the request's outputs back on one stream:
//! the Thinker's text outputs (their `finish_reason` moved to `text_finish_reason` when audio
//! follows), then [`AudioOutput`]s as Code2Wav produces them, the last one with
//! `finish_reason` set.

use serde::{Deserialize, Serialize};

use crate::SamplingParams;

/// An output modality (OpenAI's `modalities`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Modality {
    /// The Thinker's text.
    Text,
    /// Speech: Talker codes decoded by Code2Wav.
    Audio,
}

impl Modality {
    /// The API's name (`"text"`, `"audio"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Modality::Text => "text",
            Modality::Audio => "audio",
        }
    }
}

/// The omni part of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OmniParams {
    /// Requested output modalities (non-empty, no duplicates). The Thinker always runs; the
    /// Talker and Code2Wav only when `Audio` is asked for.
    pub modalities: Vec<Modality>,
    /// The voice, lower-cased and checked against the model's speakers by the API process.
    pub speaker: String,
    /// Sampling of the stages after the Thinker (index 0 = stage 1, the Talker), from the
    /// request's `sampling_params_list` or the deploy profile's `default_sampling_params`.
    /// Missing entries take the stage's defaults. The Thinker's sampling is the request's own
    /// `sampling_params`.
    pub stage_sampling: Vec<SamplingParams>,
}

impl OmniParams {
    /// Whether audio is requested.
    pub fn wants_audio(&self) -> bool {
        self.modalities.contains(&Modality::Audio)
    }

    /// Whether text is requested.
    pub fn wants_text(&self) -> bool {
        self.modalities.contains(&Modality::Text)
    }
}

/// Mono audio samples produced for one request since its previous output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AudioOutput {
    /// Samples in `[-1, 1]`.
    pub samples: Vec<f32>,
    /// Samples per second (24,000 for Qwen3-Omni).
    pub sample_rate: u32,
    /// Codec frames these samples decode (for the real-time factor).
    pub num_frames: u32,
}

impl AudioOutput {
    /// Seconds of audio.
    pub fn duration_s(&self) -> f64 {
        if self.sample_rate == 0 {
            return 0.0;
        }
        self.samples.len() as f64 / f64::from(self.sample_rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_round_trip_and_answer_what_they_ask_for() {
        let p = OmniParams {
            modalities: vec![Modality::Audio],
            speaker: "ethan".into(),
            stage_sampling: vec![SamplingParams::default()],
        };
        let cfg = bincode::config::standard();
        let bytes = bincode::serde::encode_to_vec(&p, cfg).unwrap();
        let back: OmniParams = bincode::serde::decode_from_slice(&bytes, cfg).unwrap().0;
        assert_eq!(back, p);
        assert!(p.wants_audio() && !p.wants_text());
        let a = AudioOutput {
            samples: vec![0.0; 12_000],
            sample_rate: 24_000,
            num_frames: 6,
        };
        assert!((a.duration_s() - 0.5).abs() < 1e-12);
        assert_eq!(Modality::Text.as_str(), "text");
    }
}
