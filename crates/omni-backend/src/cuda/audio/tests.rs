//! Code2Wav kernels against the CPU ops (`conv`, `activation`, `window_attention`, `rope`,
//! `ops`), on bf16-rounded inputs. The host mirrors of im2col and col2im (the kernels'
//! indexing) are checked against the CPU convolutions everywhere; the GPU tests SKIP without a
//! driver.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaSlice;

use super::*;
use crate::activation::{SnakeBeta, gelu, layer_norm_inplace};
use crate::conv::{Conv1dSpec, ConvTranspose1dSpec, causal_conv_transpose1d, causal_conv1d};
use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
use crate::linalg::matmul_nt;
use crate::rope::{Rope, RopeScaling};
use crate::window_attention::{WindowAttentionShape, causal_window_attention};

/// The host mirror of `c2w_im2col`: `cols[r, j * C + c] = x[r - (k - 1 - j) * d, c]` within
/// each sequence of `len` rows, zero before its start (gathered, where the kernel scatters).
fn im2col_host(x: &[f32], seqs: Seqs, taps: ConvTaps) -> Vec<f32> {
    let (c, k, d) = (taps.channels, taps.kernel, taps.dilation);
    let mut cols = vec![0.0; seqs.rows() * k * c];
    for r in 0..seqs.rows() {
        let t = r % seqs.len;
        for j in 0..k {
            let shift = (k - 1 - j) * d;
            if t >= shift {
                let src = (r - shift) * c;
                cols[(r * k + j) * c..(r * k + j + 1) * c].copy_from_slice(&x[src..src + c]);
            }
        }
    }
    cols
}

/// The host mirror of `c2w_col2im` (same loop over `(t, j)` per output element).
fn col2im_host(z: &[f32], bias: &[f32], batch: usize, g: TransConvGeom) -> Vec<f32> {
    let (co, k, s) = (g.out_channels, g.kernel, g.stride);
    let lout = g.len_out();
    let mut y = vec![0.0; batch * lout * co];
    for b in 0..batch {
        for u in 0..lout {
            let full = u + (k - s);
            for o in 0..co {
                let mut acc = bias[o];
                let (mut t, mut j) = ((full / s) as isize, full % s);
                while j < k && t >= 0 {
                    if (t as usize) < g.len_in {
                        acc += z[((b * g.len_in + t as usize) * k + j) * co + o];
                    }
                    t -= 1;
                    j += s;
                }
                y[(b * lout + u) * co + o] = acc;
            }
        }
    }
    y
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The CPU causal conv of each of `batch` sequences `[len, cin]` in `x`.
fn cpu_conv(x: &[f32], seqs: Seqs, w: &[f32], b: &[f32], spec: &Conv1dSpec) -> Vec<f32> {
    let cin = spec.in_channels;
    let mut out = Vec::new();
    for s in x.chunks_exact(seqs.len * cin).take(seqs.batch) {
        let (y, l) = causal_conv1d(s, seqs.len, w, Some(b), spec).unwrap();
        assert_eq!(l, seqs.len);
        out.extend(y);
    }
    out
}

fn cpu_transconv(
    x: &[f32],
    seqs: Seqs,
    w: &[f32],
    b: &[f32],
    spec: &ConvTranspose1dSpec,
) -> Vec<f32> {
    let mut out = Vec::new();
    for s in x.chunks_exact(seqs.len * spec.in_channels) {
        out.extend(
            causal_conv_transpose1d(s, seqs.len, w, Some(b), spec)
                .unwrap()
                .0,
        );
    }
    out
}

/// Geometries of the dense convs: (channels, dilation), channel counts for both kernel widths.
const CONV_CASES: [(usize, usize); 4] = [(4, 1), (12, 3), (16, 9), (24, 1)];

#[test]
fn im2col_host_gemm_is_the_causal_conv() {
    for (c, d) in CONV_CASES {
        let (cout, k) = (c + 3, 7);
        let seqs = Seqs { batch: 3, len: 23 };
        let x = rand_bf16_f32(seqs.rows() * c, 1 + c as u64);
        let w = rand_bf16_f32(cout * c * k, 2);
        let b = rand_bf16_f32(cout, 3);
        let spec = Conv1dSpec::new(c, cout, k).with_dilation(d);
        let want = cpu_conv(&x, seqs, &w, &b, &spec);
        let taps = ConvTaps {
            channels: c,
            kernel: k,
            dilation: d,
        };
        let cols = im2col_host(&x, seqs, taps);
        let mut got = vec![0.0; seqs.rows() * cout];
        let wg = conv_weight_gemm(&w, cout, c, k);
        matmul_nt(&cols, &wg, &mut got, seqs.rows(), k * c, cout).unwrap();
        for (row, o) in got.chunks_exact_mut(cout).zip(0..) {
            let _ = o;
            row.iter_mut().zip(&b).for_each(|(v, bb)| *v += bb);
        }
        assert!(max_diff(&got, &want) < 1e-4, "c {c} d {d}");
    }
}

#[test]
fn gemm_and_col2im_host_are_the_causal_transposed_conv() {
    for (cin, cout, k, s) in [(6, 4, 16, 8), (8, 16, 10, 5), (16, 8, 2, 2), (5, 3, 6, 3)] {
        let seqs = Seqs { batch: 2, len: 9 };
        let x = rand_bf16_f32(seqs.rows() * cin, 5);
        let w = rand_bf16_f32(cin * cout * k, 6);
        let b = rand_bf16_f32(cout, 7);
        let spec = ConvTranspose1dSpec {
            in_channels: cin,
            out_channels: cout,
            kernel_size: k,
            stride: s,
        };
        let want = cpu_transconv(&x, seqs, &w, &b, &spec);
        let g = TransConvGeom {
            len_in: seqs.len,
            out_channels: cout,
            kernel: k,
            stride: s,
        };
        let mut z = vec![0.0; seqs.rows() * k * cout];
        matmul_nt(
            &x,
            &transconv_weight_gemm(&w, cin, cout, k),
            &mut z,
            seqs.rows(),
            cin,
            k * cout,
        )
        .unwrap();
        let got = col2im_host(&z, &b, seqs.batch, g);
        assert_eq!(got.len(), want.len(), "k {k} s {s}");
        assert!(max_diff(&got, &want) < 1e-4, "k {k} s {s}");
    }
}

fn up(cx: &CudaContext, v: &[f32]) -> CudaSlice<f32> {
    cx.stream().clone_htod(v).unwrap()
}

fn snake_cpu(alpha: &[f32], beta: &[f32], x: &mut [f32]) {
    SnakeBeta::from_log_params(alpha, beta)
        .unwrap()
        .apply_inplace(x)
        .unwrap();
}

#[test]
fn conv1d_im2col_gemm_matches_cpu() {
    let Some(cx) = ctx_or_skip("conv1d_im2col_gemm_matches_cpu") else {
        return;
    };
    for (c, d) in CONV_CASES.into_iter().chain([(96, 9), (192, 3)]) {
        for snake in [false, true] {
            let (cout, k) = (c + 8, 7);
            let seqs = Seqs { batch: 3, len: 41 };
            let x = rand_bf16_f32(seqs.rows() * c, c as u64);
            let w: Vec<f32> = rand_bf16_f32(cout * c * k, 9)
                .iter()
                .map(|v| v / (c as f32).sqrt())
                .collect();
            let b = rand_bf16_f32(cout, 10);
            let (alpha, beta) = (rand_bf16_f32(c, 11), rand_bf16_f32(c, 12));
            let spec = Conv1dSpec::new(c, cout, k).with_dilation(d);
            let mut xs = x.clone();
            if snake {
                snake_cpu(&alpha, &beta, &mut xs);
            }
            let want = cpu_conv(&xs, seqs, &w, &b, &spec);

            let xd = cx.upload_f32_as_bf16(&x).unwrap();
            let wd = cx
                .upload_f32_as_bf16(&conv_weight_gemm(&w, cout, c, k))
                .unwrap();
            let (a, ib) = snake_params(&alpha, &beta);
            let (ad, ibd, bd) = (up(&cx, &a), up(&cx, &ib), up(&cx, &b));
            let mut cols = cx.zeros_bf16(seqs.rows() * k * c + 8).unwrap();
            // Poison, so an element im2col fails to write shows.
            cx.fill_uniform_bf16(&mut cols, 1, 100.0, 200.0).unwrap();
            let taps = ConvTaps {
                channels: c,
                kernel: k,
                dilation: d,
            };
            let sn = snake.then_some(Snake {
                alpha: &ad,
                inv_beta: &ibd,
            });
            cx.c2w_im2col(&xd, &mut cols, sn, seqs, taps).unwrap();
            let mut y = cx.zeros_bf16(seqs.rows() * cout).unwrap();
            cx.c2w_gemm(&cols, &wd, &mut y, seqs.rows(), k * c, cout, false)
                .unwrap();
            cx.c2w_bias_residual(&mut y, None, &bd, None, seqs.rows(), cout)
                .unwrap();
            let got = cx.download_f32(&y).unwrap();
            let e = rel_err(&got, &want);
            println!("conv1d C {c} -> {cout} d {d} snake {snake}: rel err {e:.2e}");
            assert!(e < 1e-2, "C {c} d {d} snake {snake}: rel err {e}");
        }
    }
}

#[test]
fn transposed_conv_gemm_col2im_matches_cpu() {
    let Some(cx) = ctx_or_skip("transposed_conv_gemm_col2im_matches_cpu") else {
        return;
    };
    for (cin, cout, k, s) in [
        (6, 4, 16, 8),
        (16, 8, 10, 5),
        (32, 32, 2, 2),
        (5, 3, 6, 3),
        (192, 96, 6, 3),
    ] {
        let seqs = Seqs { batch: 2, len: 13 };
        let x = rand_bf16_f32(seqs.rows() * cin, 21);
        let w: Vec<f32> = rand_bf16_f32(cin * cout * k, 22)
            .iter()
            .map(|v| v / (cin as f32).sqrt())
            .collect();
        let b = rand_bf16_f32(cout, 23);
        let spec = ConvTranspose1dSpec {
            in_channels: cin,
            out_channels: cout,
            kernel_size: k,
            stride: s,
        };
        let want = cpu_transconv(&x, seqs, &w, &b, &spec);
        let g = TransConvGeom {
            len_in: seqs.len,
            out_channels: cout,
            kernel: k,
            stride: s,
        };
        let xd = cx.upload_f32_as_bf16(&x).unwrap();
        let wd = cx
            .upload_f32_as_bf16(&transconv_weight_gemm(&w, cin, cout, k))
            .unwrap();
        let bd = up(&cx, &b);
        let mut z = cx.zeros_bf16(seqs.rows() * k * cout).unwrap();
        cx.c2w_gemm(&xd, &wd, &mut z, seqs.rows(), cin, k * cout, false)
            .unwrap();
        let mut y = cx.zeros_bf16(seqs.batch * g.len_out() * cout).unwrap();
        cx.c2w_col2im(&z, &mut y, &bd, seqs.batch, g).unwrap();
        let got = cx.download_f32(&y).unwrap();
        assert_eq!(got.len(), want.len());
        let e = rel_err(&got, &want);
        println!("transposed conv {cin} -> {cout} k {k} s {s}: rel err {e:.2e}");
        assert!(e < 1e-2, "k {k} s {s}: rel err {e}");
    }
}

#[test]
fn dwconv_layer_norm_matches_cpu() {
    let Some(cx) = ctx_or_skip("dwconv_layer_norm_matches_cpu") else {
        return;
    };
    for c in [16, 64, 1024] {
        let k = 7;
        let seqs = Seqs { batch: 2, len: 19 };
        let x = rand_bf16_f32(seqs.rows() * c, 31);
        let w = rand_bf16_f32(c * k, 32);
        let b = rand_bf16_f32(c, 33);
        let lw = rand_bf16_f32(c, 34);
        let lb = rand_bf16_f32(c, 35);
        let spec = Conv1dSpec::new(c, c, k).with_groups(c);
        let mut want = cpu_conv(&x, seqs, &w, &b, &spec);
        layer_norm_inplace(&mut want, &lw, &lb, c, 1e-6).unwrap();
        let xd = cx.upload_f32_as_bf16(&x).unwrap();
        let (wd, bd, lwd, lbd) = (up(&cx, &w), up(&cx, &b), up(&cx, &lw), up(&cx, &lb));
        let mut out = cx.zeros_bf16(seqs.rows() * c).unwrap();
        let p = DwConvNorm {
            weight: &wd,
            bias: &bd,
            ln_weight: &lwd,
            ln_bias: &lbd,
            kernel: k,
            eps: 1e-6,
        };
        cx.c2w_dwconv_ln(&xd, &mut out, p, seqs, c).unwrap();
        let got = cx.download_f32(&out).unwrap();
        let e = rel_err(&got, &want);
        println!("dwconv + layer_norm C {c}: rel err {e:.2e}");
        assert!(e < 1e-2, "C {c}: rel err {e}");
    }
}

#[test]
fn snake_gelu_and_residuals_match_cpu() {
    let Some(cx) = ctx_or_skip("snake_gelu_and_residuals_match_cpu") else {
        return;
    };
    for c in [4, 96] {
        let rows = 37;
        let n = rows * c;
        let x: Vec<f32> = rand_bf16_f32(n, 41).iter().map(|v| 3.0 * v).collect();
        let x: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let res = rand_bf16_f32(n, 42);
        let (alpha, beta, b1, b2) = (
            rand_bf16_f32(c, 43),
            rand_bf16_f32(c, 44),
            rand_bf16_f32(c, 45),
            rand_bf16_f32(c, 46),
        );
        let (a, ib) = snake_params(&alpha, &beta);
        let (ad, ibd, b1d, b2d) = (up(&cx, &a), up(&cx, &ib), up(&cx, &b1), up(&cx, &b2));
        let sn = Snake {
            alpha: &ad,
            inv_beta: &ibd,
        };
        // y = snake(x + b1), res += b2.
        let mut want: Vec<f32> = x
            .chunks_exact(c)
            .flat_map(|r| r.iter().zip(&b1).map(|(v, b)| v + b))
            .collect();
        snake_cpu(&alpha, &beta, &mut want);
        let want_res: Vec<f32> = res
            .chunks_exact(c)
            .flat_map(|r| r.iter().zip(&b2).map(|(v, b)| v + b))
            .collect();
        let mut yd = cx.upload_f32_as_bf16(&x).unwrap();
        let mut rd = cx.upload_f32_as_bf16(&res).unwrap();
        cx.c2w_bias_snake(&mut yd, Some(&b1d), sn, Some((&mut rd, &b2d)), rows, c)
            .unwrap();
        let e1 = rel_err(&cx.download_f32(&yd).unwrap(), &want);
        let e2 = rel_err(&cx.download_f32(&rd).unwrap(), &want_res);
        // y = snake(x) out of place.
        let mut want_s = x.clone();
        snake_cpu(&alpha, &beta, &mut want_s);
        let xd = cx.upload_f32_as_bf16(&x).unwrap();
        let mut sd = cx.zeros_bf16(n).unwrap();
        cx.c2w_snake(&xd, &mut sd, sn, rows, c).unwrap();
        let e3 = rel_err(&cx.download_f32(&sd).unwrap(), &want_s);
        // gelu(x + b1).
        let want_g: Vec<f32> = x
            .chunks_exact(c)
            .flat_map(|r| r.iter().zip(&b1).map(|(v, b)| gelu(v + b)))
            .collect();
        let mut gd = cx.upload_f32_as_bf16(&x).unwrap();
        cx.c2w_bias_gelu(&mut gd, &b1d, rows, c).unwrap();
        let e4 = rel_err(&cx.download_f32(&gd).unwrap(), &want_g);
        // res += gamma * (x + b1).
        let want_r: Vec<f32> = (0..n)
            .map(|i| res[i] + b2[i % c] * (x[i] + b1[i % c]))
            .collect();
        let mut rd = cx.upload_f32_as_bf16(&res).unwrap();
        cx.c2w_bias_residual(&mut rd, Some(&xd), &b1d, Some(&b2d), rows, c)
            .unwrap();
        let e5 = rel_err(&cx.download_f32(&rd).unwrap(), &want_r);
        println!(
            "C {c}: bias+snake {e1:.2e}, residual bias {e2:.2e}, snake {e3:.2e}, gelu {e4:.2e}, gamma residual {e5:.2e}"
        );
        for e in [e1, e2, e3, e4, e5] {
            assert!(e < 1e-2, "C {c}: rel err {e}");
        }
    }
}

#[test]
fn rope_and_window_attention_match_cpu() {
    let Some(cx) = ctx_or_skip("rope_and_window_attention_match_cpu") else {
        return;
    };
    for (heads, kv_heads, hd, window, len) in [(4, 2, 16, 8, 29), (16, 16, 64, 72, 100)] {
        let seqs = Seqs { batch: 2, len };
        let geom = WindowAttnGeom {
            heads,
            kv_heads,
            head_dim: hd,
            window,
        };
        let width = geom.qkv_width();
        let qkv = rand_bf16_f32(seqs.rows() * width, 51);
        let rope = Rope::new(hd, 10000.0, &RopeScaling::None).unwrap();
        let positions: Vec<usize> = (0..len).collect();
        let mut cs = Vec::new();
        rope.cos_sin(&positions, &mut cs);
        let scale = 1.0 / (hd as f32).sqrt();
        let shape = WindowAttentionShape {
            seq_len: len,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: hd,
            window: Some(window),
        };
        let mut want = Vec::new();
        for s in qkv.chunks_exact(len * width) {
            let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            for r in s.chunks_exact(width) {
                q.extend_from_slice(&r[..heads * hd]);
                k.extend_from_slice(&r[heads * hd..(heads + kv_heads) * hd]);
                v.extend_from_slice(&r[(heads + kv_heads) * hd..]);
            }
            rope.apply(&mut q, heads, &cs).unwrap();
            rope.apply(&mut k, kv_heads, &cs).unwrap();
            let mut out = vec![0.0; len * heads * hd];
            causal_window_attention(&q, &k, &v, &shape, scale, &mut out).unwrap();
            want.extend(out);
        }
        let mut qd = cx.upload_f32_as_bf16(&qkv).unwrap();
        let csd = up(&cx, &cs);
        cx.c2w_rope(&mut qd, &csd, seqs, geom).unwrap();
        let mut out = cx.zeros_bf16(seqs.rows() * heads * hd).unwrap();
        cx.c2w_window_attention(&qd, &mut out, seqs, geom, scale)
            .unwrap();
        let e = rel_err(&cx.download_f32(&out).unwrap(), &want);
        println!(
            "rope + window attention {heads}/{kv_heads} x {hd}, window {window}, len {len}: rel err {e:.2e}"
        );
        assert!(e < 1e-2, "rel err {e}");
    }
}

#[test]
fn embed_and_rms_norm_match_cpu() {
    let Some(cx) = ctx_or_skip("embed_and_rms_norm_match_cpu") else {
        return;
    };
    let (nq, cb, hidden) = (16, 32, 64);
    let seqs = Seqs { batch: 3, len: 5 };
    let table = rand_bf16_f32(nq * cb * hidden, 61);
    let codes: Vec<i32> = (0..seqs.rows() * nq)
        .map(|i| ((i * 7 + 3) % cb) as i32)
        .collect();
    // codes [b, q, t]
    let mut want = vec![0.0f32; seqs.rows() * hidden];
    for b in 0..seqs.batch {
        for t in 0..seqs.len {
            let row = &mut want[(b * seqs.len + t) * hidden..][..hidden];
            for q in 0..nq {
                let r = codes[(b * nq + q) * seqs.len + t] as usize + cb * q;
                row.iter_mut()
                    .zip(&table[r * hidden..(r + 1) * hidden])
                    .for_each(|(o, e)| *o += e);
            }
            row.iter_mut().for_each(|v| *v /= nq as f32);
        }
    }
    let cd = cx.stream().clone_htod(&codes).unwrap();
    let td = cx.upload_f32_as_bf16(&table).unwrap();
    let mut h = cx
        .stream()
        .alloc_zeros::<f32>(seqs.rows() * hidden)
        .unwrap();
    cx.c2w_embed(&cd, &td, &mut h, seqs, nq, cb, hidden)
        .unwrap();
    let got: Vec<f32> = cx.stream().clone_dtoh(&h).unwrap();
    let e = rel_err(&got, &want);
    println!("embedding mean: rel err {e:.2e}");
    assert!(e < 1e-5, "embed rel err {e}");
    // h += scale * t, then rms_norm.
    let rows = seqs.rows();
    let (t, scale, w) = (
        rand_bf16_f32(rows * hidden, 62),
        rand_bf16_f32(hidden, 63),
        rand_bf16_f32(hidden, 64),
    );
    let mut want_h = got.clone();
    want_h
        .iter_mut()
        .zip(&t)
        .enumerate()
        .for_each(|(i, (v, tt))| *v += scale[i % hidden] * tt);
    let mut want_n = want_h.clone();
    crate::ops::rms_norm_inplace(&mut want_n, &w, hidden, 1e-5).unwrap();
    let (td, sd, wd) = (up(&cx, &t), up(&cx, &scale), up(&cx, &w));
    let mut out = cx.zeros_bf16(rows * hidden).unwrap();
    cx.c2w_scale_add_rms_norm(&mut h, Some((&td, &sd)), &wd, &mut out, rows, hidden, 1e-5)
        .unwrap();
    let eh = rel_err(&cx.stream().clone_dtoh(&h).unwrap(), &want_h);
    let en = rel_err(&cx.download_f32(&out).unwrap(), &want_n);
    println!("LayerScale residual: rel err {eh:.2e}, rms_norm: {en:.2e}");
    assert!(eh < 1e-6 && en < 1e-2, "{eh} {en}");
}

#[test]
fn conv_out_clamp_matches_cpu() {
    let Some(cx) = ctx_or_skip("conv_out_clamp_matches_cpu") else {
        return;
    };
    for c in [4, 96] {
        let (k, seqs) = (7, Seqs { batch: 2, len: 301 });
        let x = rand_bf16_f32(seqs.rows() * c, 71);
        let w: Vec<f32> = rand_bf16_f32(c * k, 72).iter().map(|v| 3.0 * v).collect();
        let b = [0.05f32];
        let spec = Conv1dSpec::new(c, 1, k);
        let mut want = cpu_conv(&x, seqs, &w, &b, &spec);
        want.iter_mut().for_each(|v| *v = v.clamp(-1.0, 1.0));
        assert!(
            want.iter().any(|v| v.abs() == 1.0),
            "the clamp is exercised"
        );
        let xd = cx.upload_f32_as_bf16(&x).unwrap();
        let wd = up(&cx, &conv_weight_gemm(&w, 1, c, k));
        let mut wav = cx.stream().alloc_zeros::<f32>(seqs.rows()).unwrap();
        let taps = ConvTaps {
            channels: c,
            kernel: k,
            dilation: 1,
        };
        cx.c2w_conv_out_clamp(&xd, &mut wav, &wd, b[0], seqs, taps)
            .unwrap();
        let got: Vec<f32> = cx.stream().clone_dtoh(&wav).unwrap();
        let e = max_diff(&got, &want);
        println!("conv out C {c}: max abs err {e:.2e}");
        assert!(e < 1e-4, "C {c}: {e}");
    }
}
