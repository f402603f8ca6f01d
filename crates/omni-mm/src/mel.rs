//! Whisper log-mel features as transformers' `WhisperFeatureExtractor` computes them for Qwen3-Omni
//! (one clip, `padding=True` so no padding, `truncation=False`), and the audio token count.
//!
//! Steps: periodic Hann window of `n_fft`, centred STFT with reflect padding of `n_fft / 2`, power
//! spectrum, Slaney-scale / Slaney-normalised mel filters over 0..8000 Hz, `log10(max(mel, 1e-10))`,
//! the last frame dropped (so `floor(n / hop)` frames), floor at `max - 8`, then `(x + 4) / 4`.
//! Computed in f64 (transformers' torch path is f32, its numpy path f64); the result is f32 and
//! within 2.6e-5 of the torch path on a 160037-sample clip (the torch and numpy paths differ from
//! each other by the same amount). One clip at a time: when transformers pads a batch to its
//! longest clip, a shorter clip's last frames see zeros instead of reflect padding; its valid
//! frames (the mask) are otherwise the same.

use std::sync::Arc;

use realfft::{RealFftPlanner, RealToComplex};

use crate::error::ProcessError;

/// Whisper feature settings; the default is Qwen3-Omni's `preprocessor_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct WhisperFeatureConfig {
    /// Mel bins (128).
    pub feature_size: usize,
    /// Input rate in Hz (16000).
    pub sampling_rate: u32,
    /// STFT hop in samples (160).
    pub hop_length: usize,
    /// STFT window and FFT size (400).
    pub n_fft: usize,
    /// Seconds per chunk (300 for Qwen3-Omni: `n_samples` 4800000). Only sets [`Self::max_frames`]:
    /// Qwen's processor pads to the longest clip and does not truncate.
    pub chunk_length: usize,
}

impl Default for WhisperFeatureConfig {
    fn default() -> Self {
        Self {
            feature_size: 128,
            sampling_rate: 16_000,
            hop_length: 160,
            n_fft: 400,
            chunk_length: 300,
        }
    }
}

impl WhisperFeatureConfig {
    /// `nb_max_frames` (30000): the frames of one full chunk.
    pub fn max_frames(&self) -> usize {
        self.chunk_length * self.sampling_rate as usize / self.hop_length
    }
}

/// A clip's log-mel features.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioFeatures {
    /// `[feature_size, num_frames]` row-major (mel bin major), as `input_features[0]`.
    pub input_features: Vec<f32>,
    /// Frames: `floor(samples / hop_length)`; the `feature_attention_mask` is all ones over them.
    pub num_frames: usize,
}

fn hz_to_mel(f: f64) -> f64 {
    let logstep = 27.0 / 6.4f64.ln();
    if f >= 1000.0 {
        15.0 + (f / 1000.0).ln() * logstep
    } else {
        3.0 * f / 200.0
    }
}

fn mel_to_hz(m: f64) -> f64 {
    let logstep = 6.4f64.ln() / 27.0;
    if m >= 15.0 {
        1000.0 * (logstep * (m - 15.0)).exp()
    } else {
        200.0 * m / 3.0
    }
}

fn linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    let step = (stop - start) / (n - 1) as f64;
    let mut v: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
    if let Some(last) = v.last_mut() {
        *last = stop;
    }
    v
}

/// One mel filter: the first FFT bin with a non-zero weight and the weights from there.
struct MelFilter {
    start: usize,
    weights: Vec<f64>,
}

/// transformers' `mel_filter_bank(n_fft/2+1, mels, 0, 8000, rate, norm="slaney", mel_scale="slaney")`.
fn mel_filters(cfg: &WhisperFeatureConfig) -> Vec<MelFilter> {
    let bins = cfg.n_fft / 2 + 1;
    let mels = cfg.feature_size;
    let mel_freqs = linspace(hz_to_mel(0.0), hz_to_mel(8000.0), mels + 2);
    let filter_freqs: Vec<f64> = mel_freqs.iter().map(|&m| mel_to_hz(m)).collect();
    let fft_freqs = linspace(0.0, f64::from(cfg.sampling_rate / 2), bins);
    (0..mels)
        .map(|m| {
            let (lo, mid, hi) = (filter_freqs[m], filter_freqs[m + 1], filter_freqs[m + 2]);
            let enorm = 2.0 / (hi - lo);
            let w: Vec<f64> = fft_freqs
                .iter()
                .map(|&f| {
                    let down = -(lo - f) / (mid - lo);
                    let up = (hi - f) / (hi - mid);
                    down.min(up).max(0.0) * enorm
                })
                .collect();
            let start = w.iter().position(|&x| x != 0.0).unwrap_or(0);
            let end = w.iter().rposition(|&x| x != 0.0).map_or(start, |e| e + 1);
            MelFilter {
                start,
                weights: w[start..end].to_vec(),
            }
        })
        .collect()
}

/// A reusable log-mel extractor (the FFT plan, window and filters are built once).
pub struct LogMel {
    cfg: WhisperFeatureConfig,
    fft: Arc<dyn RealToComplex<f64>>,
    window: Vec<f64>,
    filters: Vec<MelFilter>,
}

impl std::fmt::Debug for LogMel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogMel")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl LogMel {
    /// Builds the FFT plan, the periodic Hann window and the mel filters for `cfg`.
    pub fn new(cfg: &WhisperFeatureConfig) -> Self {
        let n = cfg.n_fft;
        let window = (0..n)
            .map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n as f64).cos())
            .collect();
        Self {
            cfg: cfg.clone(),
            fft: RealFftPlanner::<f64>::new().plan_fft_forward(n),
            window,
            filters: mel_filters(cfg),
        }
    }

    /// The features of one 16 kHz mono clip.
    pub fn compute(&self, samples: &[f32]) -> Result<AudioFeatures, ProcessError> {
        let (n_fft, hop) = (self.cfg.n_fft, self.cfg.hop_length);
        let pad = n_fft / 2;
        if samples.len() <= pad {
            return Err(ProcessError::AudioTooShort {
                samples: samples.len(),
                min: pad + 1,
            });
        }
        let len = samples.len();
        // Reflect padding (numpy / torch "reflect": the edge sample is not repeated).
        let at = |i: isize| -> f64 {
            let j = if i < 0 {
                (-i) as usize
            } else if i as usize >= len {
                2 * (len - 1) - i as usize
            } else {
                i as usize
            };
            f64::from(samples[j])
        };
        let num_frames = len / hop;
        let mels = self.cfg.feature_size;
        let mut log_spec = vec![0f64; mels * num_frames];
        let mut input = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut power = vec![0f64; spectrum.len()];
        for t in 0..num_frames {
            let start = (t * hop) as isize - pad as isize;
            for (k, x) in input.iter_mut().enumerate() {
                *x = at(start + k as isize) * self.window[k];
            }
            self.fft
                .process(&mut input, &mut spectrum)
                .map_err(|e| ProcessError::Config(format!("FFT: {e}")))?;
            for (p, c) in power.iter_mut().zip(&spectrum) {
                *p = c.re * c.re + c.im * c.im;
            }
            for (m, f) in self.filters.iter().enumerate() {
                let e: f64 = f
                    .weights
                    .iter()
                    .zip(&power[f.start..])
                    .map(|(w, p)| w * p)
                    .sum();
                log_spec[m * num_frames + t] = e.max(1e-10).log10();
            }
        }
        let max = log_spec.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let input_features = log_spec
            .iter()
            .map(|&x| ((x.max(max - 8.0) + 4.0) / 4.0) as f32)
            .collect();
        Ok(AudioFeatures {
            input_features,
            num_frames,
        })
    }
}

/// Log-mel features of one 16 kHz mono clip (builds a [`LogMel`]; keep one to reuse the plan).
pub fn log_mel(
    samples_16k: &[f32],
    cfg: &WhisperFeatureConfig,
) -> Result<AudioFeatures, ProcessError> {
    LogMel::new(cfg).compute(samples_16k)
}

/// Qwen3-Omni's `_get_feat_extract_output_lengths` (n_window 50): audio encoder outputs, i.e. LLM
/// tokens, for `num_frames` mel frames. 13 tokens per full 100 frames.
pub fn audio_output_tokens(num_frames: usize) -> usize {
    let l = num_frames as i64;
    let leave = l % 100;
    let f = (leave - 1).div_euclid(2) + 1;
    let out = ((f - 1).div_euclid(2) + 1 - 1).div_euclid(2) + 1 + (l / 100) * 13;
    out.max(0) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audio_tokens_formula() {
        assert_eq!(audio_output_tokens(3000), 390);
        assert_eq!(audio_output_tokens(1000), 130);
        assert_eq!(audio_output_tokens(100), 13);
        assert_eq!(audio_output_tokens(0), 0);
        // 1000 + 37 frames: 130 + tokens(37) = 130 + 5.
        assert_eq!(audio_output_tokens(1037), 135);
    }

    #[test]
    fn frames_are_floor_of_len_over_hop() {
        let cfg = WhisperFeatureConfig::default();
        let x: Vec<f32> = (0..16_037).map(|i| (i as f32 * 0.01).sin()).collect();
        let f = log_mel(&x, &cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.num_frames, 100);
        assert_eq!(f.input_features.len(), 128 * 100);
        assert!(log_mel(&x[..200], &cfg).is_err());
    }
}
