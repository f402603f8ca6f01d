//! The kernel sequence of one `(batch, frames)` Code2Wav step: the code-embedding mean, the
//! sliding-window pre-transformer, the upsampling blocks and the SnakeBeta decoder, all on the
//! preallocated buffers (so a step is capturable as a CUDA graph).

use omni_backend::cuda::audio::{ConvTaps, DwConvNorm, Seqs, Snake, TransConvGeom, WindowAttnGeom};
use omni_backend::cuda::cudarc::driver::{CudaEvent, DevicePtr, sys as driver_sys};
use omni_backend::cuda::{CudaContext, CudaError};

use super::weights::DSnake;
use super::{CudaCode2Wav, gemm_flops};
use crate::ModelError;
use crate::qwen3_omni::code2wav::config::{CONV_KERNEL, CONVNEXT_EXPANSION, CONVNEXT_LN_EPS};

impl CudaCode2Wav {
    /// Queues one decode of `batch` sequences of `frames` frames (the codes buffer's first
    /// `batch * nq * frames` entries) into the wav buffer (`[batch, num_samples(frames)]`).
    /// Launches only: capturable.
    pub(super) fn run(&mut self, batch: usize, frames: usize) -> Result<(), ModelError> {
        self.pre_transformer(batch, frames)?;
        self.vocoder(batch, frames)
    }

    fn pre_transformer(&mut self, batch: usize, frames: usize) -> Result<(), ModelError> {
        let c = self.config.clone();
        let cx = self.cx.clone();
        let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim());
        let seqs = Seqs { batch, len: frames };
        let rows = seqs.rows();
        let geom = WindowAttnGeom {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: hd,
            window: c.sliding_window,
        };
        let q_out = c.num_attention_heads * hd;
        let eps = c.rms_norm_eps as f32;
        cx.c2w_embed(
            &self.buf.codes,
            &self.w.embedding,
            &mut self.buf.h,
            seqs,
            c.num_quantizers,
            c.codebook_size,
            h,
        )?;
        mark(&mut self.marks, &cx, "embedding mean", 0.0)?;
        for l in 0..self.w.layers.len() {
            {
                let b = &mut self.buf;
                let layer = &self.w.layers[l];
                let update: Option<(&dyn DevicePtr<f32>, &dyn DevicePtr<f32>)> = if l == 0 {
                    None
                } else {
                    Some((&b.t, &self.w.layers[l - 1].mlp_scale))
                };
                cx.c2w_scale_add_rms_norm(
                    &mut b.h,
                    update,
                    &layer.input_norm,
                    &mut b.xn,
                    rows,
                    h,
                    eps,
                )?;
            }
            mark(
                &mut self.marks,
                &cx,
                "pre-transformer: residual + rms_norm",
                0.0,
            )?;
            {
                let b = &mut self.buf;
                let layer = &self.w.layers[l];
                cx.c2w_gemm(
                    &b.xn,
                    &layer.qkv,
                    &mut b.qkv,
                    rows,
                    h,
                    geom.qkv_width(),
                    false,
                )?;
            }
            mark(
                &mut self.marks,
                &cx,
                "pre-transformer: GEMMs",
                gemm_flops(rows, h, geom.qkv_width()),
            )?;
            {
                let b = &mut self.buf;
                cx.c2w_rope(&mut b.qkv, &b.cos_sin, seqs, geom)?;
                cx.c2w_window_attention(&b.qkv, &mut b.attn, seqs, geom, 1.0 / (hd as f32).sqrt())?;
            }
            mark(
                &mut self.marks,
                &cx,
                "pre-transformer: rope + window attention",
                0.0,
            )?;
            {
                let b = &mut self.buf;
                let layer = &self.w.layers[l];
                cx.matmul_nt_bf16_f32(&b.attn, &layer.o, &mut b.t, rows, q_out, h)?;
            }
            mark(
                &mut self.marks,
                &cx,
                "pre-transformer: GEMMs",
                gemm_flops(rows, q_out, h),
            )?;
            {
                let b = &mut self.buf;
                let layer = &self.w.layers[l];
                cx.c2w_scale_add_rms_norm(
                    &mut b.h,
                    Some((&b.t, &layer.attn_scale)),
                    &layer.post_norm,
                    &mut b.xn,
                    rows,
                    h,
                    eps,
                )?;
            }
            mark(
                &mut self.marks,
                &cx,
                "pre-transformer: residual + rms_norm",
                0.0,
            )?;
            {
                let b = &mut self.buf;
                let layer = &self.w.layers[l];
                cx.c2w_gemm(&b.xn, &layer.gate_up, &mut b.gu, rows, h, 2 * i, false)?;
                cx.silu_and_mul_bf16(
                    &b.gu.slice(0..rows * 2 * i),
                    &mut b.act.slice_mut(0..rows * i),
                    i,
                )?;
                cx.matmul_nt_bf16_f32(&b.act, &layer.down, &mut b.t, rows, i, h)?;
            }
            mark(
                &mut self.marks,
                &cx,
                "pre-transformer: GEMMs",
                gemm_flops(rows, h, 2 * i) + gemm_flops(rows, i, h),
            )?;
        }
        {
            let b = &mut self.buf;
            let update: Option<(&dyn DevicePtr<f32>, &dyn DevicePtr<f32>)> =
                self.w.layers.last().map(|l| {
                    (
                        &b.t as &dyn DevicePtr<f32>,
                        &l.mlp_scale as &dyn DevicePtr<f32>,
                    )
                });
            cx.c2w_scale_add_rms_norm(&mut b.h, update, &self.w.norm, &mut b.a, rows, h, eps)?;
        }
        mark(
            &mut self.marks,
            &cx,
            "pre-transformer: residual + rms_norm",
            0.0,
        )?;
        Ok(())
    }

    /// The conv stack from the pre-transformer's output in buffer `a` to the wav buffer.
    fn vocoder(&mut self, batch: usize, frames: usize) -> Result<(), ModelError> {
        let c = self.config.clone();
        let cx = self.cx.clone();
        let h = c.hidden_size;
        let wide = CONVNEXT_EXPANSION * h;
        let mut len = frames;
        // `x_in_a`: whether the current activation is in buffer `a` (else `b`).
        let mut x_in_a = true;
        for (n, up) in self.w.upsample.iter().enumerate() {
            let b = &mut self.buf;
            let (x, y) = if x_in_a {
                (&mut b.a, &mut b.b)
            } else {
                (&mut b.b, &mut b.a)
            };
            let f = up.factor;
            let rows = batch * len;
            cx.c2w_gemm(&*x, &up.up_w, &mut b.s, rows, h, f * h, false)?;
            let g = TransConvGeom {
                len_in: len,
                out_channels: h,
                kernel: f,
                stride: f,
            };
            cx.c2w_col2im(&b.s, y, &up.up_b, batch, g)?;
            len = g.len_out();
            let seqs = Seqs { batch, len };
            let rows = seqs.rows();
            let p = DwConvNorm {
                weight: &up.dw_w,
                bias: &up.dw_b,
                ln_weight: &up.ln_w,
                ln_bias: &up.ln_b,
                kernel: CONV_KERNEL,
                eps: CONVNEXT_LN_EPS,
            };
            cx.c2w_dwconv_ln(&*y, x, p, seqs, h)?;
            cx.c2w_gemm(&*x, &up.pw1_w, &mut b.s, rows, h, wide, false)?;
            cx.c2w_bias_gelu(&mut b.s, &up.pw1_b, rows, wide)?;
            cx.c2w_gemm(&b.s, &up.pw2_w, x, rows, wide, h, false)?;
            cx.c2w_bias_residual(y, Some(&*x), &up.pw2_b, Some(&up.gamma), rows, h)?;
            x_in_a = !x_in_a;
            let flops = gemm_flops(rows / f, h, f * h) + 2.0 * gemm_flops(rows, h, wide);
            mark(
                &mut self.marks,
                &cx,
                &format!("upsample {n} (ConvNeXt)"),
                flops,
            )?;
        }
        // Decoder input conv.
        let d = c.decoder_dim;
        {
            let b = &mut self.buf;
            let (x, y) = if x_in_a {
                (&mut b.a, &mut b.b)
            } else {
                (&mut b.b, &mut b.a)
            };
            let seqs = Seqs { batch, len };
            let taps = ConvTaps {
                channels: h,
                kernel: CONV_KERNEL,
                dilation: 1,
            };
            cx.c2w_im2col(&*x, &mut b.s, None, seqs, taps)?;
            cx.c2w_gemm(
                &b.s,
                &self.w.conv_in_w,
                y,
                seqs.rows(),
                CONV_KERNEL * h,
                d,
                false,
            )?;
            cx.c2w_bias_residual(y, None, &self.w.conv_in_b, None, seqs.rows(), d)?;
            x_in_a = !x_in_a;
        }
        mark(
            &mut self.marks,
            &cx,
            "decoder conv in (im2col + GEMM)",
            gemm_flops(batch * len, CONV_KERNEL * h, d),
        )?;
        for bi in 0..self.w.blocks.len() {
            let (cin, cout, r) = {
                let blk = &self.w.blocks[bi];
                (blk.cin, blk.cout, blk.rate)
            };
            let len_out;
            {
                let b = &mut self.buf;
                let blk = &self.w.blocks[bi];
                let (x, y) = if x_in_a {
                    (&mut b.a, &mut b.b)
                } else {
                    (&mut b.b, &mut b.a)
                };
                let rows = batch * len;
                cx.c2w_snake(&*x, y, snake(&blk.act), rows, cin)?;
                cx.c2w_gemm(&*y, &blk.up_w, &mut b.s, rows, cin, 2 * r * cout, false)?;
                let g = TransConvGeom {
                    len_in: len,
                    out_channels: cout,
                    kernel: 2 * r,
                    stride: r,
                };
                cx.c2w_col2im(&b.s, x, &blk.up_b, batch, g)?;
                len_out = g.len_out();
            }
            mark(
                &mut self.marks,
                &cx,
                &format!("block {bi}: snake + transposed conv (GEMM + col2im)"),
                gemm_flops(batch * len, cin, 2 * r * cout),
            )?;
            len = len_out;
            let seqs = Seqs { batch, len };
            let rows = seqs.rows();
            for ui in 0..self.w.blocks[bi].units.len() {
                {
                    let b = &mut self.buf;
                    let unit = &self.w.blocks[bi].units[ui];
                    let (x, _) = if x_in_a {
                        (&mut b.a, &mut b.b)
                    } else {
                        (&mut b.b, &mut b.a)
                    };
                    let taps = ConvTaps {
                        channels: cout,
                        kernel: CONV_KERNEL,
                        dilation: unit.dilation,
                    };
                    cx.c2w_im2col(&*x, &mut b.s, Some(snake(&unit.act1)), seqs, taps)?;
                }
                mark(
                    &mut self.marks,
                    &cx,
                    &format!("block {bi}: snake + im2col"),
                    0.0,
                )?;
                {
                    let b = &mut self.buf;
                    let unit = &self.w.blocks[bi].units[ui];
                    let y = if x_in_a { &mut b.b } else { &mut b.a };
                    cx.c2w_gemm(
                        &b.s,
                        &unit.conv1_w,
                        y,
                        rows,
                        CONV_KERNEL * cout,
                        cout,
                        false,
                    )?;
                }
                mark(
                    &mut self.marks,
                    &cx,
                    &format!("block {bi}: conv k7 GEMM"),
                    gemm_flops(rows, CONV_KERNEL * cout, cout),
                )?;
                {
                    let b = &mut self.buf;
                    let unit = &self.w.blocks[bi].units[ui];
                    let (x, y) = if x_in_a {
                        (&mut b.a, &mut b.b)
                    } else {
                        (&mut b.b, &mut b.a)
                    };
                    cx.c2w_bias_snake(
                        y,
                        Some(&unit.conv1_b),
                        snake(&unit.act2),
                        Some((x, &unit.conv2_b)),
                        rows,
                        cout,
                    )?;
                }
                mark(
                    &mut self.marks,
                    &cx,
                    &format!("block {bi}: bias + snake"),
                    0.0,
                )?;
                {
                    let b = &mut self.buf;
                    let unit = &self.w.blocks[bi].units[ui];
                    let (x, y) = if x_in_a {
                        (&mut b.a, &mut b.b)
                    } else {
                        (&mut b.b, &mut b.a)
                    };
                    cx.c2w_gemm(&*y, &unit.conv2_w, x, rows, cout, cout, true)?;
                }
                mark(
                    &mut self.marks,
                    &cx,
                    &format!("block {bi}: conv 1x1 GEMM (+= residual)"),
                    gemm_flops(rows, cout, cout),
                )?;
            }
        }
        {
            let b = &mut self.buf;
            let (x, y) = if x_in_a {
                (&mut b.a, &mut b.b)
            } else {
                (&mut b.b, &mut b.a)
            };
            let last = d >> c.upsample_rates.len();
            let seqs = Seqs { batch, len };
            cx.c2w_snake(&*x, y, snake(&self.w.act_out), seqs.rows(), last)?;
            let taps = ConvTaps {
                channels: last,
                kernel: CONV_KERNEL,
                dilation: 1,
            };
            cx.c2w_conv_out_clamp(
                &*y,
                &mut b.wav,
                &self.w.conv_out_w,
                self.w.conv_out_b,
                seqs,
                taps,
            )?;
        }
        mark(&mut self.marks, &cx, "snake + conv out + clamp", 0.0)?;
        debug_assert_eq!(len, self.config.num_samples(frames));
        Ok(())
    }
}

/// Records an event labelled `label` (with the FLOPs of the ops since the last one) while
/// profiling.
pub(super) fn mark(
    marks: &mut Option<Vec<(String, f64, CudaEvent)>>,
    cx: &CudaContext,
    label: &str,
    flops: f64,
) -> Result<(), ModelError> {
    if let Some(m) = marks.as_mut() {
        let ev = cx
            .raw()
            .new_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(CudaError::from)?;
        ev.record(cx.stream()).map_err(CudaError::from)?;
        m.push((label.to_string(), flops, ev));
    }
    Ok(())
}

fn snake(s: &DSnake) -> Snake<'_> {
    Snake {
        alpha: &s.alpha,
        inv_beta: &s.inv_beta,
    }
}
