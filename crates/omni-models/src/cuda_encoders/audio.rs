//! The audio tower on the device: the twin of [`crate::qwen3_omni::audio_encoder::AudioEncoder`]
//! (see its module doc for the forward).
//!
//! The convolution stem runs all chunks of a clip at once (in groups of [`CONV_GROUP`]), each
//! chunk an image stored `[time, freq, channels]`: im2col + one GEMM + bias + GELU per
//! convolution, so a GEMM's output rows are the next convolution's input as is, and after the
//! third one every output frame is a contiguous `[freq, channels]` row for `conv_out` (whose
//! columns are reordered to that order at load). Chunks are padded to one length, so the valid
//! rows of the clip are a prefix of the `[chunks, frames per chunk]` rows.

use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::encoder::{
    ConvImages, EncoderAct, Rows, conv3x3_weight_gemm, freq_major_columns,
};
use omni_backend::cuda::{CudaContext, bf16};

use super::block::{BlockDims, BlockNames, DBlock, Work, act_of};
use super::{Source, Up, zeros_f32};
use crate::ModelError;
use crate::qwen3_omni::audio_encoder::{AudioEncoderConfig, LN_EPS, sinusoids};
use crate::qwen3_omni::encoder_block::Activation;
use crate::weights::WeightSource;

/// Chunks per pass of the convolution stem (bounds its scratch: about 450 MB of im2col at the
/// real sizes).
pub const CONV_GROUP: usize = 64;

/// The audio tower on one device. See the module doc.
pub struct CudaAudioEncoder {
    cx: Arc<CudaContext>,
    cfg: AudioEncoderConfig,
    dims: BlockDims,
    act: EncoderAct,
    /// Per convolution: `[channels, 9 * in]` ([`conv3x3_weight_gemm`]) and the bias.
    convs: Vec<(CudaSlice<bf16>, CudaSlice<f32>)>,
    /// `[d_model, freq * channels]` ([`freq_major_columns`]).
    conv_out: CudaSlice<bf16>,
    /// `[max_source_positions, d_model]`.
    positions: CudaSlice<f32>,
    layers: Vec<DBlock>,
    ln_post: (CudaSlice<f32>, CudaSlice<f32>),
    proj1: (CudaSlice<bf16>, CudaSlice<f32>),
    proj2: (CudaSlice<bf16>, CudaSlice<f32>),
}

impl std::fmt::Debug for CudaAudioEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaAudioEncoder")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl CudaAudioEncoder {
    /// Reads the tower from `ws` under the names inside `thinker.audio_tower.` (as the host
    /// tower).
    pub fn load(
        cx: Arc<CudaContext>,
        cfg: AudioEncoderConfig,
        ws: &dyn WeightSource,
    ) -> Result<Self, ModelError> {
        Self::build(cx, cfg, Source::Host(ws))
    }

    /// Random weights of the config's shapes made from `seed` (see the module doc).
    pub fn load_dummy(
        cx: Arc<CudaContext>,
        cfg: AudioEncoderConfig,
        seed: u64,
    ) -> Result<Self, ModelError> {
        Self::build(cx, cfg, Source::Dummy(seed))
    }

    fn build(
        cx: Arc<CudaContext>,
        cfg: AudioEncoderConfig,
        src: Source<'_>,
    ) -> Result<Self, ModelError> {
        let act = act_of(Activation::from_name(&cfg.activation_function)?);
        let (d, c, heads) = (
            cfg.d_model,
            cfg.downsample_hidden_size,
            cfg.encoder_attention_heads,
        );
        if heads == 0 || !d.is_multiple_of(heads) || !d.is_multiple_of(2) || cfg.n_window == 0 {
            return Err(ModelError::Config(format!(
                "audio_config: d_model {d}, {heads} heads, n_window {}",
                cfg.n_window
            )));
        }
        let dims = BlockDims {
            dim: d,
            heads,
            inter: cfg.encoder_ffn_dim,
            act,
            eps: LN_EPS,
        };
        let u = Up { cx: &cx, src };
        let mut convs = Vec::new();
        for (i, inp) in [(1, 1), (2, c), (3, c)] {
            let w = u.mat(&[format!("conv2d{i}.weight")], &[c, inp, 3, 3], |w| {
                conv3x3_weight_gemm(&w, c, inp)
            })?;
            convs.push((w, u.vec(&[format!("conv2d{i}.bias")], c)?));
        }
        let freq = cfg.freq_out();
        let conv_out = u.mat(&["conv_out.weight".into()], &[d, c * freq], |w| {
            freq_major_columns(&w, d, c, freq)
        })?;
        let layers = (0..cfg.encoder_layers)
            .map(|i| {
                let p = format!("layers.{i}");
                let names = BlockNames {
                    norm1: format!("{p}.self_attn_layer_norm"),
                    qkv: ["q_proj", "k_proj", "v_proj"]
                        .iter()
                        .map(|n| format!("{p}.self_attn.{n}"))
                        .collect(),
                    proj: format!("{p}.self_attn.out_proj"),
                    norm2: format!("{p}.final_layer_norm"),
                    fc1: format!("{p}.fc1"),
                    fc2: format!("{p}.fc2"),
                };
                DBlock::load(&u, &names, dims)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let out = cfg.output_dim;
        Ok(Self {
            positions: u.f32(&sinusoids(cfg.max_source_positions, d))?,
            ln_post: u.norm("ln_post", d)?,
            proj1: (
                u.mat(&["proj1.weight".into()], &[d, d], |v| v)?,
                u.vec(&["proj1.bias".into()], d)?,
            ),
            proj2: (
                u.mat(&["proj2.weight".into()], &[out, d], |v| v)?,
                u.vec(&["proj2.bias".into()], out)?,
            ),
            convs,
            conv_out,
            layers,
            act,
            dims,
            cfg,
            cx,
        })
    }

    /// The config it was built from.
    pub fn config(&self) -> &AudioEncoderConfig {
        &self.cfg
    }

    /// Encodes one clip: `features` is `[num_mel_bins, frames]` row-major bf16 (as on the
    /// wire); the result is `[`[`AudioEncoderConfig::output_len`]`(frames), output_dim]` bf16 on
    /// the device, queued on the context's stream.
    pub fn encode(&self, features: &[bf16], frames: usize) -> Result<CudaSlice<bf16>, ModelError> {
        let cx = &*self.cx;
        let (mels, d, c) = (
            self.cfg.num_mel_bins,
            self.cfg.d_model,
            self.cfg.downsample_hidden_size,
        );
        if features.len() != mels * frames || frames == 0 {
            return Err(ModelError::Batch(format!(
                "audio features: {} values for {mels} mels x {frames} frames",
                features.len()
            )));
        }
        let chunk = 2 * self.cfg.n_window;
        let starts: Vec<usize> = (0..frames).step_by(chunk).collect();
        let n = starts.len();
        let padded = if n > 1 { chunk } else { frames };
        let per = AudioEncoderConfig::conv_out_len(padded);
        if per > self.cfg.max_source_positions {
            return Err(ModelError::Batch(format!(
                "{per} audio frames in a chunk, {} positions",
                self.cfg.max_source_positions
            )));
        }
        let freq = self.cfg.freq_out();
        let mut x = zeros_f32(cx, n * per * d)?;
        for g0 in (0..n).step_by(CONV_GROUP) {
            let g = CONV_GROUP.min(n - g0);
            let inp = stem_input(features, frames, mels, &starts[g0..g0 + g], chunk, padded);
            let mut a = cx.upload_bf16(&inp)?;
            let mut img = ConvImages {
                images: g,
                width: padded,
                height: mels,
                channels: 1,
            };
            for (w, b) in &self.convs {
                let px = img.out_pixels();
                let depth = 9 * img.channels;
                let mut col = cx.zeros_bf16(px * depth)?;
                cx.enc_im2col_s2(&a, &mut col, img)?;
                let mut y = zeros_f32(cx, px * c)?;
                cx.matmul_nt_bf16_f32(&col, w, &mut y, px, depth, c)?;
                a = cx.zeros_bf16(px * c)?;
                let rows = Rows { rows: px, cols: c };
                cx.enc_bias_act(&y, b, &mut a, rows, self.act)?;
                let (ow, oh) = img.out_size();
                img = ConvImages {
                    images: g,
                    width: ow,
                    height: oh,
                    channels: c,
                };
            }
            debug_assert_eq!((img.width, img.height), (per, freq));
            let mut dst = x.slice_mut(g0 * per * d..(g0 + g) * per * d);
            cx.matmul_nt_bf16_f32(&a, &self.conv_out, &mut dst, g * per, freq * c, d)?;
        }
        let all = Rows {
            rows: n * per,
            cols: d,
        };
        cx.enc_add_rows(&mut x, None, &self.positions, all, per)?;
        let tokens = self.cfg.output_len(frames);
        let window = (per * (self.cfg.n_window_infer / chunk)).max(1);
        let mut cu: Vec<usize> = (0..tokens).step_by(window).collect();
        cu.push(tokens);
        let out = self.cfg.output_dim;
        let mut w = Work::new(cx, &cu, self.dims, tokens * out)?;
        for l in &self.layers {
            l.forward(cx, &mut x, &cu, None, self.dims, &mut w)?;
        }
        let rows = Rows {
            rows: tokens,
            cols: d,
        };
        cx.enc_layer_norm(
            &x,
            (&self.ln_post.0, &self.ln_post.1),
            &mut w.h,
            rows,
            LN_EPS,
        )?;
        cx.matmul_nt_bf16_f32(&w.h, &self.proj1.0, &mut w.y, tokens, d, d)?;
        cx.enc_bias_act(&w.y, &self.proj1.1, &mut w.a, rows, self.act)?;
        cx.matmul_nt_bf16_f32(&w.a, &self.proj2.0, &mut w.y, tokens, d, out)?;
        let mut o = cx.zeros_bf16(tokens * out)?;
        let rows = Rows {
            rows: tokens,
            cols: out,
        };
        cx.enc_bias_act(&w.y, &self.proj2.1, &mut o, rows, EncoderAct::Identity)?;
        Ok(o)
    }
}

/// The convolution stem's input for the chunks starting at `starts`: `[chunks, padded (time),
/// mels, 1]`, each chunk's `min(chunk, frames - start)` frames of `features` (`[mels, frames]`)
/// and zeros after them.
fn stem_input(
    features: &[bf16],
    frames: usize,
    mels: usize,
    starts: &[usize],
    chunk: usize,
    padded: usize,
) -> Vec<bf16> {
    let mut inp = vec![bf16::ZERO; starts.len() * padded * mels];
    for (b, &s) in starts.iter().enumerate() {
        for t in 0..(frames - s).min(chunk) {
            let row = &mut inp[(b * padded + t) * mels..][..mels];
            for (m, v) in row.iter_mut().enumerate() {
                *v = features[m * frames + s + t];
            }
        }
    }
    inp
}

#[cfg(test)]
mod tests;
