//! A CPU emulation of the device stem's layouts (runs without a GPU): [`stem_input`], im2col as
//! `enc_im2col_s2` indexes it, the reordered GEMM weights, the `[chunks, frames per chunk]` rows
//! with positions added cyclically, and the valid prefix, against the host tower's per-chunk
//! `conv2d` path.

#![allow(clippy::unwrap_used)]

use half::bf16;
use omni_backend::activation::gelu;
use omni_backend::conv2d::{Conv2dSpec, conv2d};
use omni_backend::cuda::encoder::{ConvImages, conv3x3_weight_gemm, freq_major_columns};

use super::stem_input;
use crate::qwen3_omni::audio_encoder::{AudioEncoderConfig, sinusoids};

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0).to_f32()
        })
        .collect()
}

/// `out[r, o] = sum_k a[r, k] w[o, k] (+ b[o])`.
fn linear(a: &[f32], w: &[f32], b: Option<&[f32]>, k: usize, n: usize) -> Vec<f32> {
    a.chunks_exact(k)
        .flat_map(|row| {
            (0..n).map(move |o| {
                let dot: f32 = row
                    .iter()
                    .zip(&w[o * k..(o + 1) * k])
                    .map(|(x, y)| x * y)
                    .sum();
                dot + b.map_or(0.0, |b| b[o])
            })
        })
        .collect()
}

/// `enc_im2col_s2`'s index math.
fn im2col(x: &[f32], img: ConvImages) -> Vec<f32> {
    let (ow, oh) = img.out_size();
    let c = img.channels;
    let mut col = vec![0.0; img.out_pixels() * 9 * c];
    for (i, v) in col.iter_mut().enumerate() {
        let (p, d) = (i / (9 * c), i % (9 * c));
        let (tap, ch) = (d / c, d % c);
        let (oy, q) = (p % oh, p / oh);
        let (ox, b) = (q % ow, q / ow);
        let iy = (2 * oy + tap / 3) as isize - 1;
        let ix = (2 * ox + tap % 3) as isize - 1;
        if iy >= 0 && (iy as usize) < img.height && ix >= 0 && (ix as usize) < img.width {
            *v = x[((b * img.width + ix as usize) * img.height + iy as usize) * c + ch];
        }
    }
    col
}

#[test]
fn emulated_device_stem_matches_the_host_chunks() {
    let (mels, ch, d, n_window) = (20, 3, 8, 8);
    let chunk = 2 * n_window;
    let freq = AudioEncoderConfig::conv_out_len(mels);
    let ws: Vec<(Vec<f32>, Vec<f32>, usize)> = [1, ch, ch]
        .iter()
        .enumerate()
        .map(|(i, &inp)| {
            (
                rand(ch * inp * 9, 10 + i as u64),
                rand(ch, 20 + i as u64),
                inp,
            )
        })
        .collect();
    let conv_out = rand(d * ch * freq, 30);
    let positions = sinusoids(64, d);
    for frames in [37usize, 11, 48] {
        let feat = rand(mels * frames, frames as u64);
        let starts: Vec<usize> = (0..frames).step_by(chunk).collect();
        let padded = if starts.len() > 1 { chunk } else { frames };
        // The host tower's path, chunk by chunk.
        let mut want = Vec::new();
        for &s in &starts {
            let len = (frames - s).min(chunk);
            let mut x = vec![0.0f32; mels * padded];
            for m in 0..mels {
                x[m * padded..m * padded + len]
                    .copy_from_slice(&feat[m * frames + s..m * frames + s + len]);
            }
            let (mut h, mut w) = (mels, padded);
            for (wt, b, inp) in &ws {
                let spec = Conv2dSpec {
                    in_channels: *inp,
                    out_channels: ch,
                    kernel: (3, 3),
                    stride: (2, 2),
                    padding: (1, 1),
                };
                let mut y = Vec::new();
                (h, w) = conv2d(&x, h, w, wt, Some(b), &spec, &mut y).unwrap();
                x = y.iter().map(|&v| gelu(v)).collect();
            }
            let keep = AudioEncoderConfig::conv_out_len(len);
            let mut rows = vec![0.0; keep * ch * h];
            for t in 0..keep {
                for c in 0..ch {
                    for f in 0..h {
                        rows[(t * ch + c) * h + f] = x[(c * h + f) * w + t];
                    }
                }
            }
            let mut out = linear(&rows, &conv_out, None, ch * freq, d);
            out.iter_mut().zip(&positions).for_each(|(o, p)| *o += p);
            want.extend(out);
        }
        // The device path's layouts.
        let inp = stem_input(
            &feat.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
            frames,
            mels,
            &starts,
            chunk,
            padded,
        );
        let mut a: Vec<f32> = inp.iter().map(|v| v.to_f32()).collect();
        let mut img = ConvImages {
            images: starts.len(),
            width: padded,
            height: mels,
            channels: 1,
        };
        for (wt, b, i) in &ws {
            let g = conv3x3_weight_gemm(wt, ch, *i);
            let y = linear(&im2col(&a, img), &g, Some(b), 9 * i, ch);
            a = y.iter().map(|&v| gelu(v)).collect();
            let (ow, oh) = img.out_size();
            img = ConvImages {
                images: starts.len(),
                width: ow,
                height: oh,
                channels: ch,
            };
        }
        let per = AudioEncoderConfig::conv_out_len(padded);
        assert_eq!((img.width, img.height), (per, freq));
        let fm = freq_major_columns(&conv_out, d, ch, freq);
        let mut got = linear(&a, &fm, None, ch * freq, d);
        for (r, row) in got.chunks_exact_mut(d).enumerate() {
            let p = &positions[(r % per) * d..(r % per + 1) * d];
            row.iter_mut().zip(p).for_each(|(o, p)| *o += p);
        }
        got.truncate(want.len());
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        assert!(err < 1e-4, "{frames} frames: max abs err {err}");
        let n_window_cfg = serde_json::json!({
            "num_mel_bins": mels, "encoder_layers": 1, "encoder_attention_heads": 2,
            "encoder_ffn_dim": 8, "d_model": d, "activation_function": "gelu",
            "n_window": n_window, "n_window_infer": 4 * n_window, "output_dim": d,
            "downsample_hidden_size": ch, "max_source_positions": 64
        });
        let cfg: AudioEncoderConfig = serde_json::from_value(n_window_cfg).unwrap();
        assert_eq!(
            want.len(),
            cfg.output_len(frames) * d,
            "valid rows are a prefix"
        );
    }
}
