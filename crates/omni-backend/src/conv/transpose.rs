//! Transposed 1-D convolution over time-major sequences (`weight [in, out, k]`), with Hugging
//! Face's causal trim: one strided GEMM per tap into the output rows it reaches.

use crate::linalg::{MatMut, MatRef, Threads, gemm_strided};
use crate::{Error, Result, check_len};

use super::init_with_bias;

/// The geometry of a [`conv_transpose1d`] (one group, dilation 1, no output padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvTranspose1dSpec {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel taps.
    pub kernel_size: usize,
    /// Output samples per input sample.
    pub stride: usize,
}

impl ConvTranspose1dSpec {
    /// Elements of the weight, `[in, out, k]`.
    pub fn weight_len(&self) -> usize {
        self.in_channels * self.out_channels * self.kernel_size
    }

    /// Untrimmed output length `(len - 1) * stride + k` (0 for an empty input).
    pub fn full_len(&self, len: usize) -> usize {
        if len == 0 {
            0
        } else {
            (len - 1) * self.stride + self.kernel_size
        }
    }

    /// Hugging Face's causal trim (`Qwen3OmniMoeCausalTransConvNet`): `k - stride` samples off
    /// each end, so `len` inputs give `len * stride - (k - stride)` outputs.
    pub fn causal_trim(&self) -> Result<(usize, usize)> {
        let (k, s) = (self.kernel_size, self.stride);
        if s == 0 || k < s {
            return Err(Error::Metadata(format!(
                "causal transposed conv: stride {s} must be in 1..={k} (the kernel)"
            )));
        }
        Ok((k - s, k - s))
    }
}

/// `out = trim(conv_transpose1d(x))` for `x` `[len, in_channels]`, `weight` `[in, out, k]`
/// (PyTorch `nn.ConvTranspose1d` layout), optional `bias` `[out]`; `trim = (left, right)`
/// samples dropped from the full output; `out` is `[full_len - left - right, out_channels]`.
pub fn conv_transpose1d(
    x: &[f32],
    len: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    spec: &ConvTranspose1dSpec,
    trim: (usize, usize),
    out: &mut [f32],
) -> Result<()> {
    let (cin, cout, k, s) = (
        spec.in_channels,
        spec.out_channels,
        spec.kernel_size,
        spec.stride,
    );
    if s == 0 || k == 0 {
        return Err(Error::Metadata(format!(
            "invalid conv_transpose1d geometry {spec:?}"
        )));
    }
    let out_len = spec.full_len(len).saturating_sub(trim.0 + trim.1);
    check_len("conv_transpose1d input", x.len(), len * cin)?;
    check_len("conv_transpose1d weight", weight.len(), spec.weight_len())?;
    check_len("conv_transpose1d out", out.len(), out_len * cout)?;
    init_with_bias(out, bias, cout)?;
    for tap in 0..k {
        // Input row t lands on output row t * s + tap - trim_left.
        let offset = tap as isize - trim.0 as isize;
        let first = if offset < 0 {
            (-offset + s as isize - 1) / s as isize
        } else {
            0
        } as usize;
        let end = ((out_len as isize - offset + s as isize - 1).div_euclid(s as isize)).max(0);
        let end = (end as usize).min(len);
        if first >= end {
            continue;
        }
        let first_out = (first * s) as isize + offset;
        gemm_strided(
            MatMut {
                data: &mut out[first_out as usize * cout..],
                rows: end - first,
                cols: cout,
                rs: s * cout,
                cs: 1,
            },
            MatRef::row_major(&x[first * cin..end * cin], end - first, cin),
            // W[:, :, tap]: element (i, o) at (i * cout + o) * k + tap.
            MatRef {
                data: &weight[tap..],
                rows: cin,
                cols: cout,
                rs: cout * k,
                cs: k,
            },
            1.0,
            true,
            Threads::Auto,
        )?;
    }
    Ok(())
}

/// [`conv_transpose1d`] with [`ConvTranspose1dSpec::causal_trim`]; returns `(out, out_len)`.
pub fn causal_conv_transpose1d(
    x: &[f32],
    len: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    spec: &ConvTranspose1dSpec,
) -> Result<(Vec<f32>, usize)> {
    let trim = spec.causal_trim()?;
    let out_len = spec.full_len(len).saturating_sub(trim.0 + trim.1);
    let mut out = vec![0.0; out_len * spec.out_channels];
    conv_transpose1d(x, len, weight, bias, spec, trim, &mut out)?;
    Ok((out, out_len))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::conv::tests::data;
    use crate::test_util::max_diff;

    /// PyTorch `F.conv_transpose1d` then `[..., left:full - right]`.
    fn naive_transpose(
        x: &[f32],
        len: usize,
        w: &[f32],
        b: &[f32],
        s: &ConvTranspose1dSpec,
        trim: (usize, usize),
    ) -> Vec<f32> {
        let full = s.full_len(len);
        let mut y = vec![0.0; full * s.out_channels];
        for t in 0..len {
            for i in 0..s.in_channels {
                for o in 0..s.out_channels {
                    for tap in 0..s.kernel_size {
                        y[(t * s.stride + tap) * s.out_channels + o] += x[t * s.in_channels + i]
                            * w[(i * s.out_channels + o) * s.kernel_size + tap];
                    }
                }
            }
        }
        let mut out = y[trim.0 * s.out_channels..(full - trim.1) * s.out_channels].to_vec();
        for row in out.chunks_exact_mut(s.out_channels) {
            for (v, bo) in row.iter_mut().zip(b) {
                *v += bo;
            }
        }
        out
    }

    #[test]
    fn conv_transpose1d_matches_naive_with_and_without_trim() {
        let cases = [
            (2, 2, (0, 0)),
            (16, 8, (8, 8)),
            (10, 5, (5, 5)),
            (6, 3, (3, 3)),
            (5, 2, (1, 2)),
            (3, 3, (0, 0)),
        ];
        for (k, s, trim) in cases {
            let spec = ConvTranspose1dSpec {
                in_channels: 3,
                out_channels: 4,
                kernel_size: k,
                stride: s,
            };
            for len in [1, 2, 7] {
                let x = data(len * 3, 6);
                let w = data(spec.weight_len(), 7);
                let b = data(4, 8);
                let want = naive_transpose(&x, len, &w, &b, &spec, trim);
                let mut got = vec![0.0; want.len()];
                conv_transpose1d(&x, len, &w, Some(&b), &spec, trim, &mut got).unwrap();
                assert!(max_diff(&got, &want) < 1e-5, "k {k} s {s} len {len}");
            }
        }
    }

    #[test]
    fn causal_transposed_conv_gives_len_minus_one_times_rate() {
        for r in [3, 4, 5, 8] {
            let spec = ConvTranspose1dSpec {
                in_channels: 2,
                out_channels: 1,
                kernel_size: 2 * r,
                stride: r,
            };
            let (_, n) =
                causal_conv_transpose1d(&[1.0; 2 * 6], 6, &vec![0.5; 4 * r], None, &spec).unwrap();
            assert_eq!(n, 5 * r);
        }
    }
}
