//! Code2Wav: Qwen3-Omni's codec decoder, codes `[num_quantizers, T]` to a 24 kHz waveform of
//! `1920 * T - 555` samples (real checkpoint), on the CPU (transformers' `Qwen3OmniMoeCode2Wav`;
//! tensors `code2wav.*`).
//!
//! 1. Embedding: the mean over the quantizers `q` of rows `code + codebook_size * q` of one
//!    table.
//! 2. [`transformer`]: the pre-transformer (sliding-window attention, LayerScale).
//! 3. [`vocoder`]: ConvNeXt upsampling, then the SnakeBeta decoder; clamp to `[-1, 1]`.
//!
//! Every convolution is causal, so the first `num_samples(n)` samples of a decode of `T >= n`
//! frames are the decode of the first `n` frames: a batch of requests of different lengths is
//! zero-padded to the longest (as vLLM-Omni does) and each waveform cut to its own length, and a
//! streaming window is trimmed by [`Code2Wav::decode_window`].
//!
//! As a [`StageModel`] (stage [`ModelStage::Code2Wav`], no KV cache) it reads each sequence of
//! the batch's `input_ids` as one request's codes flattened codebook-major (`16 * T` ids, as
//! vLLM-Omni feeds its generation stage) and returns one `[samples]` waveform per sequence in
//! [`ModelOutputs::audio`].

pub mod config;
mod transformer;
mod vocoder;

use serde_json::Value;

pub use config::Code2WavConfig;

use crate::dummy::DummyWeights;
use crate::error::ModelError;
use crate::interface::{ModelInputs, ModelOutputs, ModelStage, StageModel, TokenInputs};
use crate::weights::{HostTensor, WeightError, WeightSource};
use crate::{KvCacheSpec, LayerKvCache};
use transformer::PreTransformer;
use vocoder::Vocoder;

/// Reads a tensor and checks its shape.
fn load_vec(ws: &dyn WeightSource, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
    Ok(crate::decoder::load_shaped(ws, name, shape)?.data)
}

/// The Code2Wav network, loaded.
#[derive(Debug, Clone)]
pub struct Code2Wav {
    config: Code2WavConfig,
    /// `[num_quantizers * codebook_size, hidden]`.
    embedding: Vec<f32>,
    pre_transformer: PreTransformer,
    vocoder: Vocoder,
}

impl Code2Wav {
    /// Loads Code2Wav from the whole `config.json` (its `code2wav_config`) and a source holding
    /// the checkpoint's `code2wav.*` tensors.
    pub fn load(config: &Value, ws: &dyn WeightSource) -> Result<Self, ModelError> {
        let config = Code2WavConfig::from_model_config(config)?;
        let rows = config.num_quantizers * config.codebook_size;
        Ok(Self {
            embedding: load_vec(
                ws,
                "code2wav.code_embedding.weight",
                &[rows, config.hidden_size],
            )?,
            pre_transformer: PreTransformer::load(&config, ws)?,
            vocoder: Vocoder::load(&config, ws)?,
            config,
        })
    }

    /// Every tensor Code2Wav reads from a checkpoint of this `config.json`, with its shape
    /// (what `--load-format dummy` generates).
    pub fn weight_shapes(config: &Value) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
        Ok(Code2WavConfig::from_model_config(config)?.weight_shapes())
    }

    /// The parsed `code2wav_config`.
    pub fn config(&self) -> &Code2WavConfig {
        &self.config
    }

    /// Decodes one request's codes, codebook-major `[num_quantizers, num_frames]`, to its
    /// waveform of [`Code2WavConfig::num_samples`]`(num_frames)` samples in `[-1, 1]`.
    pub fn decode(&self, codes: &[u32], num_frames: usize) -> Result<Vec<f32>, ModelError> {
        let mut out = self.decode_batch(&[(codes, num_frames)])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Decodes several requests `(codes [num_quantizers, T_i], T_i)` together: the codes are
    /// zero-padded to the longest `T` (vLLM-Omni's batching), run as one batch, and each
    /// waveform is cut to its own `num_samples(T_i)` (causality makes the padding invisible).
    /// A request of zero frames gives an empty waveform.
    pub fn decode_batch(&self, requests: &[(&[u32], usize)]) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.config;
        let h = c.hidden_size;
        c.check_requests(requests)?;
        let live: Vec<usize> = (0..requests.len()).filter(|&i| requests[i].1 > 0).collect();
        let frames = requests.iter().map(|r| r.1).max().unwrap_or(0);
        let mut out = vec![Vec::new(); requests.len()];
        if live.is_empty() {
            return Ok(out);
        }
        let batch = live.len();
        let mut hidden = vec![0.0f32; batch * frames * h];
        for (b, &i) in live.iter().enumerate() {
            let (codes, t) = requests[i];
            // Frames past t stay code 0 in every codebook (the zero padding).
            let code = |q: usize, f: usize| if f < t { codes[q * t + f] as usize } else { 0 };
            self.embed(
                &code,
                frames,
                &mut hidden[b * frames * h..(b + 1) * frames * h],
            );
        }
        self.pre_transformer.forward(&mut hidden, batch, frames)?;
        for (b, &i) in live.iter().enumerate() {
            let mut wav = self
                .vocoder
                .forward(&hidden[b * frames * h..(b + 1) * frames * h], frames)?;
            wav.truncate(c.num_samples(requests[i].1));
            out[i] = wav;
        }
        Ok(out)
    }

    /// Row `f` of `out` (`[frames, hidden]`) = mean over `q` of table row `code(q, f) + cb * q`,
    /// summed in quantizer order then divided (as `Tensor.mean` does).
    fn embed(&self, code: &dyn Fn(usize, usize) -> usize, frames: usize, out: &mut [f32]) {
        let c = &self.config;
        let h = c.hidden_size;
        let inv = c.num_quantizers as f32;
        for (f, row) in out.chunks_exact_mut(h).enumerate().take(frames) {
            row.fill(0.0);
            for q in 0..c.num_quantizers {
                let r = code(q, f) + c.codebook_size * q;
                for (o, e) in row.iter_mut().zip(&self.embedding[r * h..(r + 1) * h]) {
                    *o += e;
                }
            }
            row.iter_mut().for_each(|v| *v /= inv);
        }
    }

    /// Decodes one streaming window of `num_frames` frames whose first `left_context_frames`
    /// were already emitted, and returns only its new audio (vLLM-Omni's
    /// `chunked_decode_streaming` trim): `wav[max(0, left * spf - tail) .. T * spf]` with
    /// `spf` samples per frame and `tail = T * spf - wav.len()`. The first window yields
    /// `num_samples(T)` samples, each later one `spf * (T - left)`, so the pieces of a stream
    /// concatenate to `num_samples` of the whole.
    pub fn decode_window(
        &self,
        codes: &[u32],
        num_frames: usize,
        left_context_frames: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let mut out = self.decode_windows(&[(codes, num_frames, left_context_frames)])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// [`Code2Wav::decode_window`] for several windows `(codes, T, left_context)` of any
    /// requests, decoded as one batch ([`Code2Wav::decode_batch`]).
    pub fn decode_windows(
        &self,
        windows: &[(&[u32], usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if let Some((_, t, left)) = windows.iter().find(|(_, t, left)| left > t) {
            return Err(ModelError::Batch(format!(
                "left context of {left} frames in a window of {t}"
            )));
        }
        let requests: Vec<(&[u32], usize)> = windows.iter().map(|&(c, t, _)| (c, t)).collect();
        let wavs = self.decode_batch(&requests)?;
        let spf = self.config.samples_per_frame();
        Ok(wavs
            .into_iter()
            .zip(windows)
            .map(|(wav, &(_, t, left))| window_trim(wav, t, left, spf))
            .collect())
    }
}

/// vLLM-Omni's streaming trim: `wav[max(0, left * spf - tail) .. frames * spf]` with
/// `tail = frames * spf - wav.len()`.
pub(crate) fn window_trim(wav: Vec<f32>, frames: usize, left: usize, spf: usize) -> Vec<f32> {
    let tail = (frames * spf).saturating_sub(wav.len());
    let start = (left * spf).saturating_sub(tail);
    let end = (frames * spf).min(wav.len());
    wav[start.min(end)..end].to_vec()
}

impl StageModel for Code2Wav {
    fn architecture(&self) -> &str {
        crate::qwen3_omni::config::ARCHITECTURE
    }

    fn stage(&self) -> ModelStage {
        ModelStage::Code2Wav
    }

    fn kv_cache_spec(&self) -> Option<KvCacheSpec> {
        None
    }

    /// Each sequence's ids are one request's codes, codebook-major; positions, features and
    /// captures are not used.
    fn forward(
        &self,
        inputs: &ModelInputs<'_>,
        _kv: &mut [LayerKvCache],
    ) -> Result<ModelOutputs, ModelError> {
        if !matches!(inputs.tokens, TokenInputs::Ids) {
            return Err(ModelError::Batch(
                "Code2Wav takes codes as input ids, not embeddings".into(),
            ));
        }
        let batch = inputs.batch;
        let nq = self.config.num_quantizers;
        let starts = &batch.attn.query_start_loc;
        let mut requests = Vec::with_capacity(starts.len().saturating_sub(1));
        for (s, w) in starts.windows(2).enumerate() {
            let ids = batch.input_ids.get(w[0]..w[1]).ok_or_else(|| {
                ModelError::Batch(format!(
                    "sequence {s}: tokens {}..{} out of range",
                    w[0], w[1]
                ))
            })?;
            if !ids.len().is_multiple_of(nq) {
                return Err(ModelError::Batch(format!(
                    "sequence {s}: {} codes are not {nq} codebooks of whole frames",
                    ids.len()
                )));
            }
            requests.push((ids, ids.len() / nq));
        }
        let audio = self
            .decode_batch(&requests)?
            .into_iter()
            .map(|data| HostTensor {
                shape: vec![data.len()],
                data,
            })
            .collect();
        Ok(ModelOutputs {
            audio,
            ..ModelOutputs::default()
        })
    }
}

/// Dummy weights tamed so that activations stay O(1) through the conv stack instead of
/// saturating the clamp (where float rounding differences get amplified): conv kernels
/// scaled to their fan-in (`DummyWeights` divides by the last dimension, the kernel size),
/// small biases, small SnakeBeta magnitudes. For timing and checks at the real shapes
/// (`bench code2wav`, tests) where the output must stay meaningful.
#[derive(Debug)]
pub struct FanInScaled(pub DummyWeights);

impl WeightSource for FanInScaled {
    fn tensor_names(&self) -> Vec<String> {
        self.0.tensor_names()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        self.0.shape(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let mut t = self.0.load(name)?;
        let scale = if t.shape.len() == 3 {
            0.5 / (t.shape[1] as f32).sqrt()
        } else if name.ends_with(".bias") {
            0.1
        } else {
            1.0
        };
        t.data.iter_mut().for_each(|v| *v *= scale);
        if name.ends_with(".beta") {
            // SnakeBeta magnitudes 1 / e^2: its sin^2 term adds a positive offset per call.
            t.data.iter_mut().for_each(|v| *v += 2.0);
        }
        Ok(t)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::weights::ProgressWeights;

    /// A small `code2wav_config` with the real rates.
    fn tiny() -> Value {
        serde_json::json!({"code2wav_config": {
            "codebook_size": 32, "num_quantizers": 4, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "sliding_window": 3, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "decoder_dim": 32, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2]
        }})
    }

    fn model(config: &Value) -> Code2Wav {
        let c = Code2WavConfig::from_model_config(config).unwrap();
        Code2Wav::load(
            config,
            &FanInScaled(DummyWeights::new(c.weight_shapes(), 3)),
        )
        .unwrap()
    }

    #[test]
    fn loads_exactly_the_tensors_of_the_weight_table() {
        let config = tiny();
        let c = Code2WavConfig::from_model_config(&config).unwrap();
        let shapes = c.weight_shapes();
        let dummy = DummyWeights::new(shapes.clone(), 1);
        let counted = ProgressWeights::new(&dummy, shapes.len(), &|_, _| {});
        Code2Wav::load(&config, &counted).unwrap();
        assert_eq!(counted.loaded(), shapes.len());
    }

    #[test]
    fn lengths_padding_and_bad_codes() {
        let m = model(&tiny());
        let codes: Vec<u32> = (0..4 * 7).map(|i| (i * 5 % 32) as u32).collect();
        let wav = m.decode(&codes, 7).unwrap();
        assert_eq!(wav.len(), 1920 * 7 - 555);
        assert!(wav.iter().all(|v| v.abs() <= 1.0));
        let peak = wav.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(peak > 1e-3 && peak < 1.0, "peak {peak}");
        // A 3-frame request batched with the 7-frame one.
        let short: Vec<u32> = (0..4 * 3).map(|i| (i * 7 % 32) as u32).collect();
        let alone = m.decode(&short, 3).unwrap();
        let both = m
            .decode_batch(&[(&short, 3), (&codes, 7), (&[], 0)])
            .unwrap();
        assert_eq!(both[0].len(), alone.len());
        let diff = both[0]
            .iter()
            .zip(&alone)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(diff < 1e-5, "{diff}");
        assert!(both[2].is_empty());
        assert!(m.decode(&[32; 4], 1).is_err());
        assert!(m.decode(&[0; 5], 1).is_err());
    }

    #[test]
    fn window_trim_keeps_a_window_s_new_audio() {
        // First window: all 1920 T - 555 samples; later ones 1920 * new, starting 555 early.
        let spf = 1920;
        let wav = vec![0.0; 1920 * 50 - 555];
        assert_eq!(window_trim(wav.clone(), 50, 0, spf).len(), 1920 * 50 - 555);
        assert_eq!(window_trim(wav, 50, 25, spf).len(), 1920 * 25);
    }
}
