//! 2-D convolution over one channel-major image `[channels, height, width]` (PyTorch `nn.Conv2d` on
//! one batch entry), weights in PyTorch layout `[out, in, kh, kw]`.
//!
//! The input is unfolded (im2col: `col[(i * kh + y) * kw + x, p] = in[i, oy * sh + y - ph, ox *
//! sw + x - pw]`, zero outside) and multiplied once: `out[o, p] = W[o, :] @ col[:, p]`, so the
//! output comes out channel-major too and feeds the next convolution as is.

use crate::linalg::{MatMut, MatRef, Threads, gemm_strided};
use crate::{Error, Result, check_len};

/// The geometry of one 2-D convolution (no dilation, no groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dSpec {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel `(height, width)`.
    pub kernel: (usize, usize),
    /// Stride `(height, width)`.
    pub stride: (usize, usize),
    /// Zero padding on both sides `(height, width)`.
    pub padding: (usize, usize),
}

impl Conv2dSpec {
    /// Output `(height, width)` for an input of `(height, width)`:
    /// `(len + 2 * pad - k) / stride + 1` per axis.
    pub fn out_size(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let axis = |len: usize, k: usize, s: usize, p: usize| {
            if s == 0 || len + 2 * p < k {
                Err(Error::Shape {
                    what: "conv2d input (at least the kernel, padded; stride > 0)",
                    expected: k,
                    got: len + 2 * p,
                })
            } else {
                Ok((len + 2 * p - k) / s + 1)
            }
        };
        Ok((
            axis(height, self.kernel.0, self.stride.0, self.padding.0)?,
            axis(width, self.kernel.1, self.stride.1, self.padding.1)?,
        ))
    }

    /// Weight elements, `out * in * kh * kw`.
    pub fn weight_len(&self) -> usize {
        self.out_channels * self.in_channels * self.kernel.0 * self.kernel.1
    }
}

/// `out = conv2d(x) + bias` for `x` `[in, height, width]`; `out` becomes `[out, oh, ow]` and
/// `(oh, ow)` is returned.
pub fn conv2d(
    x: &[f32],
    height: usize,
    width: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    spec: &Conv2dSpec,
    out: &mut Vec<f32>,
) -> Result<(usize, usize)> {
    let (ic, oc) = (spec.in_channels, spec.out_channels);
    let (kh, kw) = spec.kernel;
    let (sh, sw) = spec.stride;
    let (ph, pw) = spec.padding;
    check_len("conv2d input", x.len(), ic * height * width)?;
    check_len("conv2d weight", weight.len(), spec.weight_len())?;
    if let Some(b) = bias {
        check_len("conv2d bias", b.len(), oc)?;
    }
    let (oh, ow) = spec.out_size(height, width)?;
    let (depth, pixels) = (ic * kh * kw, oh * ow);
    let mut col = vec![0.0f32; depth * pixels];
    for i in 0..ic {
        let plane = &x[i * height * width..(i + 1) * height * width];
        for y in 0..kh {
            for xk in 0..kw {
                let row = &mut col[((i * kh + y) * kw + xk) * pixels..][..pixels];
                for oy in 0..oh {
                    let Some(iy) = (oy * sh + y).checked_sub(ph).filter(|&v| v < height) else {
                        continue;
                    };
                    let src = &plane[iy * width..(iy + 1) * width];
                    let dst = &mut row[oy * ow..(oy + 1) * ow];
                    for (ox, d) in dst.iter_mut().enumerate() {
                        if let Some(ix) = (ox * sw + xk).checked_sub(pw).filter(|&v| v < width) {
                            *d = src[ix];
                        }
                    }
                }
            }
        }
    }
    out.clear();
    out.resize(oc * pixels, 0.0);
    gemm_strided(
        MatMut::row_major(out, oc, pixels),
        MatRef::row_major(weight, oc, depth),
        MatRef::row_major(&col, depth, pixels),
        1.0,
        false,
        Threads::Auto,
    )?;
    if let Some(b) = bias {
        for (row, &bv) in out.chunks_exact_mut(pixels).zip(b) {
            row.iter_mut().for_each(|v| *v += bv);
        }
    }
    Ok((oh, ow))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::test_util::max_diff;

    /// Every output element written out from the definition.
    fn naive(x: &[f32], h: usize, w: usize, wt: &[f32], b: &[f32], s: &Conv2dSpec) -> Vec<f32> {
        let (oh, ow) = s.out_size(h, w).unwrap();
        let (kh, kw) = s.kernel;
        let mut out = vec![0.0; s.out_channels * oh * ow];
        for o in 0..s.out_channels {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = b[o];
                    for i in 0..s.in_channels {
                        for y in 0..kh {
                            for xk in 0..kw {
                                let iy = (oy * s.stride.0 + y) as isize - s.padding.0 as isize;
                                let ix = (ox * s.stride.1 + xk) as isize - s.padding.1 as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                acc += x[(i * h + iy as usize) * w + ix as usize]
                                    * wt[((o * s.in_channels + i) * kh + y) * kw + xk];
                            }
                        }
                    }
                    out[(o * oh + oy) * ow + ox] = acc;
                }
            }
        }
        out
    }

    #[test]
    fn matches_the_definition_with_stride_and_padding() {
        for (h, w, stride, padding) in [
            (7, 5, (2, 2), (1, 1)),
            (8, 9, (1, 2), (0, 1)),
            (3, 3, (2, 2), (1, 1)),
        ] {
            let s = Conv2dSpec {
                in_channels: 3,
                out_channels: 4,
                kernel: (3, 3),
                stride,
                padding,
            };
            let x: Vec<f32> = (0..3 * h * w)
                .map(|i| ((i * 7) % 11) as f32 / 5.0 - 1.0)
                .collect();
            let wt: Vec<f32> = (0..s.weight_len())
                .map(|i| ((i * 5) % 13) as f32 / 6.0 - 1.0)
                .collect();
            let b = [0.5, -0.25, 0.0, 1.0];
            let mut out = Vec::new();
            let (oh, ow) = conv2d(&x, h, w, &wt, Some(&b), &s, &mut out).unwrap();
            assert_eq!(out.len(), 4 * oh * ow);
            let want = naive(&x, h, w, &wt, &b, &s);
            let err = max_diff(&out, &want);
            assert!(err < 1e-5, "{h}x{w} {stride:?} {padding:?}: {err}");
        }
    }

    #[test]
    fn too_small_input_is_rejected() {
        let s = Conv2dSpec {
            in_channels: 1,
            out_channels: 1,
            kernel: (3, 3),
            stride: (1, 1),
            padding: (0, 0),
        };
        assert!(conv2d(&[0.0; 4], 2, 2, &[0.0; 9], None, &s, &mut Vec::new()).is_err());
    }
}
