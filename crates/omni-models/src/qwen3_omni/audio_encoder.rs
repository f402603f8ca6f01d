//! Qwen3-Omni's audio encoder (AuT, `thinker.audio_tower.*`): log-mel frames `[num_mel_bins,
//! frames]` to Thinker-width embeddings, one per 8 frames of each 100-frame chunk.
//!
//! As transformers' `Qwen3OmniMoeAudioEncoder` runs one clip:
//! 1. The frames are cut into chunks of `2 * n_window` (the last one shorter). When there is more
//!    than one chunk, the short tail is zero-padded to the full chunk length before the
//!    convolutions (the padding reaches the tail's last outputs through the second and third
//!    convolutions, so it is part of the result).
//! 2. Per chunk: three `Conv2d(3x3, stride 2, padding 1)` + GELU over `[1, mels, frames]`, the
//!    `[channels, mels / 8]` of each output frame flattened channel-major into `conv_out`
//!    (no bias), plus the sinusoidal position embedding of the frame's index *within the chunk*;
//!    only the chunk's valid outputs are kept.
//! 3. The clip's tokens attend in windows of `max tokens per chunk * (n_window_infer / (2 *
//!    n_window))` (transformers' `cu_seqlens`), through `encoder_layers` pre-norm blocks.
//! 4. `ln_post`, `proj1`, GELU, `proj2` (to `output_dim`, the Thinker's width).

use omni_backend::conv2d::{Conv2dSpec, conv2d};
use rayon::prelude::*;
use serde::Deserialize;

use crate::decoder::{Linear, load_shaped};
use crate::error::ModelError;
use crate::qwen3_omni::encoder_block::{Activation, EncoderBlock, LayerNorm, linear, stacked};
use crate::weights::{HostTensor, WeightSource};

/// `thinker_config.audio_config` (every field the forward reads; no defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct AudioEncoderConfig {
    /// Mel bins per frame (128).
    pub num_mel_bins: usize,
    /// Transformer layers.
    pub encoder_layers: usize,
    /// Attention heads.
    pub encoder_attention_heads: usize,
    /// MLP width.
    pub encoder_ffn_dim: usize,
    /// Width.
    pub d_model: usize,
    /// Activation of the MLPs and between `proj1` and `proj2` (`gelu`).
    pub activation_function: String,
    /// Half the convolution chunk, in frames (chunks of `2 * n_window`).
    pub n_window: usize,
    /// Attention window, in frames.
    pub n_window_infer: usize,
    /// Output width (the Thinker's hidden size).
    pub output_dim: usize,
    /// Channels of the three convolutions.
    pub downsample_hidden_size: usize,
    /// Rows of the sinusoidal position table.
    pub max_source_positions: usize,
}

impl AudioEncoderConfig {
    /// The output frames of the three stride-2 convolutions over `frames`.
    pub fn conv_out_len(frames: usize) -> usize {
        (0..3).fold(frames, |l, _| if l == 0 { 0 } else { (l - 1) / 2 + 1 })
    }

    /// Embeddings for a clip of `frames` (transformers' `_get_feat_extract_output_lengths`):
    /// every full chunk gives [`Self::conv_out_len`]`(2 * n_window)`, the tail its own.
    pub fn output_len(&self, frames: usize) -> usize {
        let chunk = 2 * self.n_window;
        (frames / chunk) * Self::conv_out_len(chunk) + Self::conv_out_len(frames % chunk)
    }

    /// Mel bins after the three convolutions.
    pub(crate) fn freq_out(&self) -> usize {
        Self::conv_out_len(self.num_mel_bins)
    }
}

/// The loaded audio tower.
#[derive(Debug)]
pub struct AudioEncoder {
    cfg: AudioEncoderConfig,
    convs: [(Vec<f32>, Vec<f32>, Conv2dSpec); 3],
    conv_out: Linear,
    /// `[max_source_positions, d_model]`: `sin` of the first half of the timescales, then `cos`.
    positions: Vec<f32>,
    layers: Vec<EncoderBlock>,
    ln_post: LayerNorm,
    proj1: Linear,
    proj2: Linear,
    act: Activation,
}

/// PyTorch `nn.LayerNorm`'s default epsilon (the audio tower's norms).
pub(crate) const LN_EPS: f32 = 1e-5;

impl AudioEncoder {
    /// Reads the tower from `ws` under the names inside `thinker.audio_tower.`.
    pub fn load(cfg: AudioEncoderConfig, ws: &dyn WeightSource) -> Result<Self, ModelError> {
        let act = Activation::from_name(&cfg.activation_function)?;
        let (d, c) = (cfg.d_model, cfg.downsample_hidden_size);
        if cfg.encoder_attention_heads == 0
            || !d.is_multiple_of(cfg.encoder_attention_heads)
            || !d.is_multiple_of(2)
            || cfg.n_window == 0
        {
            return Err(ModelError::Config(format!(
                "audio_config: d_model {d}, {} heads, n_window {}",
                cfg.encoder_attention_heads, cfg.n_window
            )));
        }
        let conv = |i: usize, inp: usize| -> Result<_, ModelError> {
            let spec = Conv2dSpec {
                in_channels: inp,
                out_channels: c,
                kernel: (3, 3),
                stride: (2, 2),
                padding: (1, 1),
            };
            let w = load_shaped(ws, &format!("conv2d{i}.weight"), &[c, inp, 3, 3])?.data;
            let b = load_shaped(ws, &format!("conv2d{i}.bias"), &[c])?.data;
            Ok((w, b, spec))
        };
        let convs = [conv(1, 1)?, conv(2, c)?, conv(3, c)?];
        let conv_out = linear(ws, "conv_out", d, c * cfg.freq_out(), false)?;
        let layers = (0..cfg.encoder_layers)
            .map(|i| {
                let p = format!("layers.{i}");
                let qkv = ["q_proj", "k_proj", "v_proj"]
                    .iter()
                    .map(|n| linear(ws, &format!("{p}.self_attn.{n}"), d, d, true))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(EncoderBlock {
                    norm1: LayerNorm::load(ws, &format!("{p}.self_attn_layer_norm"), d, LN_EPS)?,
                    qkv: stacked(qkv),
                    proj: linear(ws, &format!("{p}.self_attn.out_proj"), d, d, true)?,
                    norm2: LayerNorm::load(ws, &format!("{p}.final_layer_norm"), d, LN_EPS)?,
                    fc1: linear(ws, &format!("{p}.fc1"), cfg.encoder_ffn_dim, d, true)?,
                    fc2: linear(ws, &format!("{p}.fc2"), d, cfg.encoder_ffn_dim, true)?,
                    act,
                    heads: cfg.encoder_attention_heads,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Self {
            positions: sinusoids(cfg.max_source_positions, d),
            convs,
            conv_out,
            layers,
            ln_post: LayerNorm::load(ws, "ln_post", d, LN_EPS)?,
            proj1: linear(ws, "proj1", d, d, true)?,
            proj2: linear(ws, "proj2", cfg.output_dim, d, true)?,
            act,
            cfg,
        })
    }

    /// The config it was built from.
    pub fn config(&self) -> &AudioEncoderConfig {
        &self.cfg
    }

    /// Encodes one clip: `features` is `[num_mel_bins, frames]` row-major; the result is
    /// `[`[`AudioEncoderConfig::output_len`]`(frames), output_dim]`.
    pub fn encode(&self, features: &[f32], frames: usize) -> Result<HostTensor, ModelError> {
        let (mels, d) = (self.cfg.num_mel_bins, self.cfg.d_model);
        if features.len() != mels * frames || frames == 0 {
            return Err(ModelError::Batch(format!(
                "audio features: {} values for {mels} mels x {frames} frames",
                features.len()
            )));
        }
        let chunk = 2 * self.cfg.n_window;
        let starts: Vec<usize> = (0..frames).step_by(chunk).collect();
        let padded = if starts.len() > 1 { chunk } else { frames };
        let per_chunk: Vec<Result<Vec<f32>, ModelError>> = starts
            .par_iter()
            .map(|&s| self.chunk(features, frames, s, (frames - s).min(chunk), padded))
            .collect();
        let mut x = Vec::with_capacity(self.cfg.output_len(frames) * d);
        let mut max_chunk_tokens = 0;
        for c in per_chunk {
            let c = c?;
            max_chunk_tokens = max_chunk_tokens.max(c.len() / d);
            x.extend(c);
        }
        let tokens = x.len() / d;
        let window = (max_chunk_tokens * (self.cfg.n_window_infer / chunk)).max(1);
        let mut cu: Vec<usize> = (0..tokens).step_by(window).collect();
        cu.push(tokens);
        for l in &self.layers {
            l.forward(&mut x, &cu, None)?;
        }
        self.ln_post.apply(&mut x)?;
        let mut h = Vec::new();
        self.proj1.forward(&x, tokens, &mut h)?;
        self.act.apply(&mut h);
        self.proj2.forward(&h, tokens, &mut x)?;
        Ok(HostTensor {
            shape: vec![tokens, self.cfg.output_dim],
            data: x,
        })
    }

    /// The convolution stem of the chunk of `len` frames at `start`, zero-padded to `padded`
    /// frames: its valid output rows `[conv_out_len(len), d_model]`, positions added.
    fn chunk(
        &self,
        features: &[f32],
        frames: usize,
        start: usize,
        len: usize,
        padded: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let mels = self.cfg.num_mel_bins;
        let mut x = vec![0.0f32; mels * padded];
        for (m, row) in x.chunks_exact_mut(padded).enumerate() {
            row[..len].copy_from_slice(&features[m * frames + start..m * frames + start + len]);
        }
        let (mut h, mut w) = (mels, padded);
        let mut y = Vec::new();
        for (wt, b, spec) in &self.convs {
            (h, w) = conv2d(&x, h, w, wt, Some(b), spec, &mut y)?;
            self.act.apply(&mut y);
            std::mem::swap(&mut x, &mut y);
        }
        // x: [channels, freq, time] -> rows [time, channels * freq].
        let (c, keep) = (
            self.cfg.downsample_hidden_size,
            AudioEncoderConfig::conv_out_len(len),
        );
        let mut rows = vec![0.0f32; keep * c * h];
        for t in 0..keep {
            for ch in 0..c {
                for f in 0..h {
                    rows[(t * c + ch) * h + f] = x[(ch * h + f) * w + t];
                }
            }
        }
        let d = self.cfg.d_model;
        if keep > self.cfg.max_source_positions {
            return Err(ModelError::Batch(format!(
                "{keep} audio frames in a chunk, {} positions",
                self.cfg.max_source_positions
            )));
        }
        let mut out = Vec::new();
        self.conv_out.forward(&rows, keep, &mut out)?;
        for (o, p) in out.iter_mut().zip(&self.positions[..keep * d]) {
            *o += p;
        }
        Ok(out)
    }
}

/// transformers' `SinusoidsPositionEmbedding(length, channels)`: row `t` is `sin(t * s_i)` then
/// `cos(t * s_i)` for the timescales `s_i = exp(-i * ln(10000) / (channels / 2 - 1))`.
pub(crate) fn sinusoids(length: usize, channels: usize) -> Vec<f32> {
    let half = channels / 2;
    let inc = (10000f64.ln() / (half.max(2) - 1) as f64) as f32;
    let inv: Vec<f32> = (0..half).map(|i| (-inc * i as f32).exp()).collect();
    let mut out = Vec::with_capacity(length * channels);
    for t in 0..length {
        out.extend(inv.iter().map(|s| (t as f32 * s).sin()));
        out.extend(inv.iter().map(|s| (t as f32 * s).cos()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::AudioEncoderConfig;

    /// transformers' `_get_feat_extract_output_lengths` at the real `n_window` 50.
    #[test]
    fn token_count_is_thirteen_per_second() {
        let c: AudioEncoderConfig = serde_json::from_value(serde_json::json!({
            "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2,
            "encoder_ffn_dim": 8, "d_model": 4, "activation_function": "gelu", "n_window": 50,
            "n_window_infer": 800, "output_dim": 4, "downsample_hidden_size": 2,
            "max_source_positions": 1500
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        for (frames, want) in [
            (3000, 390),
            (1000, 130),
            (100, 13),
            (537, 70),
            (73, 10),
            (1, 1),
        ] {
            assert_eq!(c.output_len(frames), want, "{frames}");
            let leave = frames % 100;
            let f = (leave as i64 - 1).div_euclid(2) + 1;
            let hf = ((f - 1).div_euclid(2) + 1 - 1).div_euclid(2) + 1 + (frames as i64 / 100) * 13;
            assert_eq!(want as i64, hf);
        }
    }
}
