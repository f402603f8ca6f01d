//! The encoder kernels against the host ops. Two kinds:
//!
//! - CPU emulators (run everywhere): plain loops that mirror a kernel's index math, or run the
//!   exact cuBLAS calls of [`segment_attention_plan`] through a column-major reference GEMM,
//!   checked against the host op;
//! - device tests (SKIP without a driver): each launcher on random data vs the host op.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::activation::{gelu, layer_norm_inplace};
use crate::conv2d::{Conv2dSpec, conv2d};
use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
use crate::gelu_tanh::gelu_tanh;
use crate::rope::{Rope, RopeScaling};
use crate::varlen_attention::{HeadShape, segment_attention};

/// cuBLAS's `gemm_strided_batched` on host buffers, column-major as cuBLAS defines it.
fn emulate_gemm(g: &StridedGemm, a: &[f32], b: &[f32], c: &mut [f32]) {
    for bi in 0..g.batch {
        let (ao, bo, co) = (
            g.a_off + bi * g.stride_a,
            g.b_off + bi * g.stride_b,
            g.c_off + bi * g.stride_c,
        );
        for i in 0..g.m {
            for j in 0..g.n {
                let mut acc = 0f32;
                for p in 0..g.k {
                    let av = if g.trans_a {
                        a[ao + p + i * g.lda]
                    } else {
                        a[ao + i + p * g.lda]
                    };
                    let bv = if g.trans_b {
                        b[bo + j + p * g.ldb]
                    } else {
                        b[bo + p + j * g.ldb]
                    };
                    acc += av * bv;
                }
                c[co + i + j * g.ldc] = g.alpha * acc;
            }
        }
    }
}

/// Runs the plan's steps on the host (f32 softmax like `enc_softmax_rows`).
fn emulate_attention(
    qkv: &[f32],
    cu: &[usize],
    shape: SegmentAttnShape,
    scratch: usize,
) -> Vec<f32> {
    let dim = shape.heads * shape.head_dim;
    let tokens = *cu.last().unwrap();
    let mut out = vec![f32::NAN; tokens * dim];
    let (mut s, mut p) = (vec![f32::NAN; scratch], vec![f32::NAN; scratch]);
    for st in segment_attention_plan(cu, shape, scratch) {
        assert!(st.qk.extents()[2] <= scratch && st.pv.extents()[1] <= scratch);
        assert!(st.qk.extents()[0] <= qkv.len() && st.pv.extents()[2] <= out.len());
        emulate_gemm(&st.qk, qkv, qkv, &mut s);
        for r in 0..st.softmax_rows {
            let row = &s[r * st.keys..(r + 1) * st.keys];
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row.iter().map(|v| (v - m).exp()).sum();
            for (d, v) in p[r * st.keys..(r + 1) * st.keys].iter_mut().zip(row) {
                *d = (v - m).exp() / sum;
            }
        }
        emulate_gemm(&st.pv, qkv, &p, &mut out);
    }
    out
}

/// The host op on the same `[tokens, 3 * dim]` rows.
fn host_attention(qkv: &[f32], cu: &[usize], shape: SegmentAttnShape) -> Vec<f32> {
    let dim = shape.heads * shape.head_dim;
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for r in qkv.chunks_exact(3 * dim) {
        q.extend_from_slice(&r[..dim]);
        k.extend_from_slice(&r[dim..2 * dim]);
        v.extend_from_slice(&r[2 * dim..]);
    }
    let mut out = vec![0.0; q.len()];
    let heads = HeadShape {
        num_heads: shape.heads,
        head_dim: shape.head_dim,
    };
    segment_attention(&q, &k, &v, cu, heads, shape.scale, &mut out).unwrap();
    out
}

fn shape(heads: usize, head_dim: usize) -> SegmentAttnShape {
    SegmentAttnShape {
        heads,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
    }
}

#[test]
fn emulated_attention_plan_matches_segment_attention() {
    let cu = [0, 5, 5, 12, 13, 20];
    let sh = shape(3, 8);
    let qkv: Vec<f32> = rand_bf16_f32(20 * 3 * 24, 7)
        .iter()
        .map(|v| 3.0 * v)
        .collect();
    let want = host_attention(&qkv, &cu, sh);
    let full = segment_attention_scratch_len(&cu, 3);
    assert_eq!(full, 3 * 7 * 7);
    // The whole segment at once, then query blocks of 2 rows, then of 1.
    for scratch in [full, 3 * 7 * 2, 3 * 7] {
        let got = emulate_attention(&qkv, &cu, sh, scratch);
        let err = rel_err(&got, &want);
        assert!(err < 1e-5, "scratch {scratch}: {err}");
    }
    // Segments of 5, 0, 7, 1, 7 tokens in blocks of 2 query rows (the 1-token one in 1).
    assert_eq!(
        segment_attention_plan(&cu, sh, 3 * 7 * 2).len(),
        3 + 4 + 1 + 4
    );
}

/// The per-element math of `enc_qkv_rope` (element `i` of `[tokens, 3 * dim]`).
fn emulate_qkv_rope(
    y: &[f32],
    bias: &[f32],
    cs: Option<&[f32]>,
    dim: usize,
    hd: usize,
) -> Vec<f32> {
    let (row, half) = (3 * dim, hd / 2);
    (0..y.len())
        .map(|i| {
            let (t, j) = (i / row, i % row);
            let mut v = y[i] + bias[j];
            if let Some(cs) = cs
                && j < 2 * dim
            {
                let d = j % hd;
                let f = if d < half { d } else { d - half };
                let pj = if d < half { j + half } else { j - half };
                let p = y[t * row + pj] + bias[pj];
                let (c, s) = (cs[t * hd + f], cs[t * hd + half + f]);
                v = if d < half {
                    v * c - p * s
                } else {
                    v * c + p * s
                };
            }
            v
        })
        .collect()
}

/// Bias, split, and `Rope::apply` on q and k, rejoined.
fn host_qkv_rope(y: &[f32], bias: &[f32], cs: &[f32], rope: &Rope, heads: usize) -> Vec<f32> {
    let dim = heads * rope.head_dim();
    let mut parts = [Vec::new(), Vec::new(), Vec::new()];
    for r in y.chunks_exact(3 * dim) {
        for (k, p) in parts.iter_mut().enumerate() {
            p.extend(
                r[k * dim..(k + 1) * dim]
                    .iter()
                    .zip(&bias[k * dim..])
                    .map(|(a, b)| a + b),
            );
        }
    }
    rope.apply(&mut parts[0], heads, cs).unwrap();
    rope.apply(&mut parts[1], heads, cs).unwrap();
    let tokens = y.len() / (3 * dim);
    (0..tokens)
        .flat_map(|t| {
            parts
                .iter()
                .flat_map(move |p| p[t * dim..(t + 1) * dim].to_vec())
        })
        .collect()
}

#[test]
fn emulated_qkv_rope_matches_rope_apply() {
    let (tokens, heads, hd) = (6, 2, 12);
    let dim = heads * hd;
    let rope = Rope::new(hd, 10000.0, &RopeScaling::None).unwrap();
    let mut cs = Vec::new();
    rope.cos_sin(&[0, 3, 1, 7, 2, 40], &mut cs);
    let y = rand_bf16_f32(tokens * 3 * dim, 3);
    let bias = rand_bf16_f32(3 * dim, 4);
    let got = emulate_qkv_rope(&y, &bias, Some(&cs), dim, hd);
    let want = host_qkv_rope(&y, &bias, &cs, &rope, heads);
    assert!(rel_err(&got, &want) < 1e-6);
    let plain = emulate_qkv_rope(&y, &bias, None, dim, hd);
    assert_eq!(plain[5], y[5] + bias[5]);
}

/// `enc_im2col_s2`'s per-element index math on `[n, W, H, C]` images.
fn emulate_im2col(x: &[f32], img: ConvImages) -> Vec<f32> {
    let (ow, oh) = img.out_size();
    let depth = 9 * img.channels;
    let total = img.out_pixels() * depth;
    let (w, h, c) = (img.width as isize, img.height as isize, img.channels);
    (0..total)
        .map(|i| {
            let (p, d) = (i / depth, i % depth);
            let (tap, ch) = (d / c, d % c);
            let (ky, kx) = ((tap / 3) as isize, (tap % 3) as isize);
            let oy = (p % oh) as isize;
            let q = p / oh;
            let ox = (q % ow) as isize;
            let b = q / ow;
            let (iy, ix) = (2 * oy + ky - 1, 2 * ox + kx - 1);
            if iy >= 0 && iy < h && ix >= 0 && ix < w {
                x[((b * img.width + ix as usize) * img.height + iy as usize) * c + ch]
            } else {
                0.0
            }
        })
        .collect()
}

/// `[n, W, H, C]` to the host op's channel-major `[C, H, W]` of image `b`.
fn channel_major(x: &[f32], img: ConvImages, b: usize) -> Vec<f32> {
    let (w, h, c) = (img.width, img.height, img.channels);
    let mut out = vec![0.0; c * h * w];
    for ch in 0..c {
        for y in 0..h {
            for xx in 0..w {
                out[(ch * h + y) * w + xx] = x[((b * w + xx) * h + y) * c + ch];
            }
        }
    }
    out
}

#[test]
fn emulated_im2col_gemm_matches_conv2d_and_conv_out_reorder() {
    // Two images (audio chunks) of 7 time steps x 9 mel bins x 3 channels, 4 output channels.
    let img = ConvImages {
        images: 2,
        width: 7,
        height: 9,
        channels: 3,
    };
    let (ic, oc) = (3, 4);
    let x = rand_bf16_f32(2 * 7 * 9 * 3, 11);
    let w = rand_bf16_f32(oc * ic * 9, 12);
    let bias = rand_bf16_f32(oc, 13);
    let col = emulate_im2col(&x, img);
    let g = conv3x3_weight_gemm(&w, oc, ic);
    let (ow, oh) = img.out_size();
    let pixels = img.out_pixels();
    // out[p, o] = col[p, :] . g[o, :] + bias (the GEMM + `enc_bias_act`): `[n, OW, OH, oc]`.
    let mut out = vec![0.0f32; pixels * oc];
    for p in 0..pixels {
        for o in 0..oc {
            let dot: f32 = (0..9 * ic)
                .map(|d| col[p * 9 * ic + d] * g[o * 9 * ic + d])
                .sum();
            out[p * oc + o] = dot + bias[o];
        }
    }
    let spec = Conv2dSpec {
        in_channels: ic,
        out_channels: oc,
        kernel: (3, 3),
        stride: (2, 2),
        padding: (1, 1),
    };
    for b in 0..2 {
        let mut want = Vec::new();
        let (h2, w2) = conv2d(
            &channel_major(&x, img, b),
            9,
            7,
            &w,
            Some(&bias),
            &spec,
            &mut want,
        )
        .unwrap();
        assert_eq!((h2, w2), (oh, ow));
        let oimg = ConvImages {
            images: 2,
            width: ow,
            height: oh,
            channels: oc,
        };
        let got = channel_major(&out, oimg, b);
        assert!(rel_err(&got, &want) < 1e-5, "image {b}");
        // The host flattens each time step channel-major (`c * freq + f`); the device rows are
        // `[time, freq, channels]`: a linear over them with `freq_major_columns` agrees.
        let rows_out = 5;
        let lin = rand_bf16_f32(rows_out * oc * oh, 14);
        let lin_dev = freq_major_columns(&lin, rows_out, oc, oh);
        for t in 0..ow {
            let host_row: Vec<f32> = (0..oc * oh)
                .map(|j| want[((j / oh) * oh + j % oh) * ow + t])
                .collect();
            let dev_row = &out[((b * ow + t) * oh) * oc..((b * ow + t + 1) * oh) * oc];
            for r in 0..rows_out {
                let a: f32 = (0..oc * oh)
                    .map(|j| lin[r * oc * oh + j] * host_row[j])
                    .sum();
                let d: f32 = (0..oc * oh)
                    .map(|j| lin_dev[r * oc * oh + j] * dev_row[j])
                    .sum();
                assert!(
                    (a - d).abs() < 1e-4 * (1.0 + a.abs()),
                    "t {t} r {r}: {a} vs {d}"
                );
            }
        }
    }
}

// ---- device tests (SKIP without a driver) ----

fn up(cx: &CudaContext, v: &[f32]) -> CudaSlice<f32> {
    cx.stream.clone_htod(v).unwrap()
}

fn down32(cx: &CudaContext, v: &CudaSlice<f32>) -> Vec<f32> {
    cx.stream.clone_dtoh(v).unwrap()
}

#[test]
fn layer_norm_and_bias_act_match_host() {
    let Some(cx) = ctx_or_skip("layer_norm_and_bias_act_match_host") else {
        return;
    };
    for &(rows, dim) in &[(3usize, 32usize), (37, 1152), (5, 4608), (2, 1280)] {
        let x: Vec<f32> = rand_bf16_f32(rows * dim, dim as u64)
            .iter()
            .map(|v| 20.0 * v + 3.0)
            .collect();
        let (w, b) = (rand_bf16_f32(dim, 1), rand_bf16_f32(dim, 2));
        let mut want = x.clone();
        layer_norm_inplace(&mut want, &w, &b, dim, 1e-6).unwrap();
        let mut out = cx.zeros_bf16(rows * dim).unwrap();
        let shape = Rows { rows, cols: dim };
        cx.enc_layer_norm(
            &up(&cx, &x),
            (&up(&cx, &w), &up(&cx, &b)),
            &mut out,
            shape,
            1e-6,
        )
        .unwrap();
        let err = rel_err(&cx.download_f32(&out).unwrap(), &want);
        println!("gpu encoder layer_norm {rows}x{dim}: rel err {err:.2e}");
        assert!(err < 1e-2);
        for (act, f) in [
            (EncoderAct::Identity, (|v| v) as fn(f32) -> f32),
            (EncoderAct::Gelu, gelu),
            (EncoderAct::GeluTanh, gelu_tanh),
        ] {
            let want: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, v)| f(v + b[i % dim]))
                .collect();
            cx.enc_bias_act(&up(&cx, &x), &up(&cx, &b), &mut out, shape, act)
                .unwrap();
            let err = rel_err(&cx.download_f32(&out).unwrap(), &want);
            println!("gpu encoder bias_act {act:?} {rows}x{dim}: rel err {err:.2e}");
            assert!(err < 1e-2);
        }
        let y = rand_bf16_f32(rows * dim, 9);
        let mut dx = up(&cx, &x);
        cx.enc_add_rows(&mut dx, Some(&up(&cx, &y)), &up(&cx, &b), shape, 1)
            .unwrap();
        let want: Vec<f32> = (0..rows * dim).map(|i| x[i] + y[i] + b[i % dim]).collect();
        assert!(rel_err(&down32(&cx, &dx), &want) < 1e-6);
        let table = rand_bf16_f32(2 * dim, 10);
        let mut dx = up(&cx, &x);
        cx.enc_add_rows(&mut dx, None, &up(&cx, &table), shape, 2)
            .unwrap();
        let want: Vec<f32> = (0..rows * dim)
            .map(|i| x[i] + table[((i / dim) % 2) * dim + i % dim])
            .collect();
        assert!(rel_err(&down32(&cx, &dx), &want) < 1e-6);
    }
}

#[test]
fn qkv_rope_matches_host() {
    let Some(cx) = ctx_or_skip("qkv_rope_matches_host") else {
        return;
    };
    for &(tokens, heads, hd) in &[(7usize, 2usize, 16usize), (300, 16, 72), (50, 20, 64)] {
        let dim = heads * hd;
        let rope = Rope::new(hd, 10000.0, &RopeScaling::None).unwrap();
        let pos: Vec<usize> = (0..tokens).map(|t| (t * 7) % 97).collect();
        let mut cs = Vec::new();
        rope.cos_sin(&pos, &mut cs);
        let y = rand_bf16_f32(tokens * 3 * dim, 5);
        let bias = rand_bf16_f32(3 * dim, 6);
        let want = host_qkv_rope(&y, &bias, &cs, &rope, heads);
        let mut out = cx.zeros_bf16(tokens * 3 * dim).unwrap();
        let sh = shape(heads, hd);
        let dcs = up(&cx, &cs);
        cx.enc_qkv_rope(
            &up(&cx, &y),
            &up(&cx, &bias),
            Some(&dcs),
            &mut out,
            tokens,
            sh,
        )
        .unwrap();
        let err = rel_err(&cx.download_f32(&out).unwrap(), &want);
        println!("gpu encoder qkv_rope t={tokens} h={heads} hd={hd}: rel err {err:.2e}");
        assert!(err < 1e-2);
    }
}

#[test]
fn segment_attention_matches_host() {
    let Some(cx) = ctx_or_skip("segment_attention_matches_host") else {
        return;
    };
    // (cu_seqlens, heads, head_dim, scratch cap): vision-like frames at head_dim 72, audio-like
    // windows of 104 at 64, the tiny fixture's 16, and a forced split into query blocks.
    let cases: [(Vec<usize>, usize, usize, Option<usize>); 4] = [
        (vec![0, 700, 1900], 4, 72, None),
        (vec![0, 104, 208, 312, 390], 20, 64, None),
        (vec![0, 24, 64, 96], 2, 16, None),
        (vec![0, 300, 301, 517], 3, 72, Some(3 * 300 * 7)),
    ];
    for (cu, heads, hd, cap) in cases {
        let tokens = *cu.last().unwrap();
        let sh = shape(heads, hd);
        let qkv: Vec<f32> = rand_bf16_f32(tokens * 3 * heads * hd, hd as u64)
            .iter()
            .map(|v| bf16::from_f32(2.0 * v).to_f32())
            .collect();
        let want = host_attention(&qkv, &cu, sh);
        let len = cap.unwrap_or_else(|| segment_attention_scratch_len(&cu, heads));
        let mut scratch = AttnScratch::new(&cx, len).unwrap();
        let mut out = cx
            .upload_bf16(&vec![bf16::NAN; tokens * heads * hd])
            .unwrap();
        let dq = cx.upload_f32_as_bf16(&qkv).unwrap();
        cx.enc_segment_attention(&dq, &mut out, &cu, sh, &mut scratch)
            .unwrap();
        let err = rel_err(&cx.download_f32(&out).unwrap(), &want);
        println!("gpu encoder attention {cu:?} h={heads} hd={hd} scratch {len}: rel err {err:.2e}");
        assert!(err < 2e-2);
    }
}

#[test]
fn im2col_conv_and_vision_stem_match_host() {
    let Some(cx) = ctx_or_skip("im2col_conv_and_vision_stem_match_host") else {
        return;
    };
    let img = ConvImages {
        images: 3,
        width: 100,
        height: 128,
        channels: 5,
    };
    let x = rand_bf16_f32(3 * 100 * 128 * 5, 21);
    let want = emulate_im2col(&x, img);
    let mut col = cx.zeros_bf16(want.len()).unwrap();
    cx.enc_im2col_s2(&cx.upload_f32_as_bf16(&x).unwrap(), &mut col, img)
        .unwrap();
    assert_eq!(cx.download_f32(&col).unwrap(), want, "im2col is a copy");

    // Vision position interpolation and the rotary table.
    let (patches, hidden, rows) = (10usize, 48usize, 16usize);
    let y = rand_bf16_f32(patches * hidden, 22);
    let bias = rand_bf16_f32(hidden, 23);
    let table = rand_bf16_f32(rows * hidden, 24);
    let idx: Vec<i32> = (0..4 * patches).map(|i| ((i * 5) % rows) as i32).collect();
    let wts = rand_bf16_f32(4 * patches, 25);
    let mut want = vec![0.0; patches * hidden];
    for p in 0..patches {
        for c in 0..hidden {
            want[p * hidden + c] = y[p * hidden + c]
                + bias[c]
                + (0..4)
                    .map(|k| wts[p * 4 + k] * table[idx[p * 4 + k] as usize * hidden + c])
                    .sum::<f32>();
        }
    }
    let di = cx.stream.clone_htod(&idx).unwrap();
    let mut dx = up(&cx, &vec![0.0; patches * hidden]);
    let shape = Rows {
        rows: patches,
        cols: hidden,
    };
    cx.enc_vision_pos(
        &up(&cx, &y),
        &up(&cx, &bias),
        &up(&cx, &table),
        (&di, &up(&cx, &wts)),
        &mut dx,
        shape,
    )
    .unwrap();
    assert!(rel_err(&down32(&cx, &dx), &want) < 1e-6);
    let inv_freq: Vec<f32> = (0..3)
        .map(|i| 1.0 / 10000f32.powf(i as f32 / 3.0))
        .collect();
    let rc: Vec<i32> = (0..2 * patches as i32).map(|v| v % 7).collect();
    let mut want = Vec::new();
    for t in 0..patches {
        let ang: Vec<f32> = inv_freq
            .iter()
            .map(|f| rc[2 * t] as f32 * f)
            .chain(inv_freq.iter().map(|f| rc[2 * t + 1] as f32 * f))
            .collect();
        want.extend(ang.iter().map(|a| a.cos()));
        want.extend(ang.iter().map(|a| a.sin()));
    }
    let mut dt = up(&cx, &vec![0.0; patches * 12]);
    cx.enc_rope_table(
        &cx.stream.clone_htod(&rc).unwrap(),
        &up(&cx, &inv_freq),
        &mut dt,
        patches,
    )
    .unwrap();
    assert!(rel_err(&down32(&cx, &dt), &want) < 1e-5);
}
