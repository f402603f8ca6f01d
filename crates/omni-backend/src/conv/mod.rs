//! 1-D convolutions over time-major sequences `[len, channels]` (row-major), with weights in
//! PyTorch layout: [`conv1d`] (stride, dilation, groups, depthwise; `weight [out, in/groups, k]`)
//! and [`conv_transpose1d`] (`weight [in, out, k]`), plus the causal forms of Qwen3-Omni's
//! Code2Wav ([`causal_conv1d`], [`causal_conv_transpose1d`]).
//!
//! Products go through [`crate::linalg::gemm_strided`]. A one-group convolution unfolds blocks
//! of output rows (im2col: `col[t, i * k + tap] = x[t*s + tap*d - pad, i]`) and does one GEMM of
//! depth `in * k` per block against the weight as stored. Grouped convolutions and 1x1 kernels
//! do one strided GEMM per (group, tap) (`out[t, :] += x[t*s + tap*d - pad, :] @ W[:, :, tap]^T`)
//! over the rows where the tap reads inside the input, so the zero padding is never
//! materialised. Depthwise convolutions are a per-channel loop (vectorisable across channels in
//! this layout). Transposed convolutions are one strided GEMM per tap into the output rows it
//! reaches.

use rayon::prelude::*;

use crate::linalg::{MatMut, MatRef, Threads, gemm_strided};
use crate::{Error, Result, check_len};

mod transpose;

pub use transpose::{ConvTranspose1dSpec, causal_conv_transpose1d, conv_transpose1d};

/// Elements of one block of the unfolded input in [`conv1d`]'s im2col path (16 MiB).
const IM2COL_BLOCK_ELEMENTS: usize = 1 << 22;

/// Output rows per rayon task in the depthwise loop.
const DEPTHWISE_ROWS_PER_TASK: usize = 256;

/// The geometry of a [`conv1d`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv1dSpec {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel taps.
    pub kernel_size: usize,
    /// Step between output positions, in input samples.
    pub stride: usize,
    /// Step between taps, in input samples.
    pub dilation: usize,
    /// Channel groups (`in_channels` = depthwise).
    pub groups: usize,
}

impl Conv1dSpec {
    /// A plain convolution (stride 1, dilation 1, one group).
    pub fn new(in_channels: usize, out_channels: usize, kernel_size: usize) -> Self {
        Self {
            in_channels,
            out_channels,
            kernel_size,
            stride: 1,
            dilation: 1,
            groups: 1,
        }
    }

    /// With this dilation.
    pub fn with_dilation(self, dilation: usize) -> Self {
        Self { dilation, ..self }
    }

    /// With this stride.
    pub fn with_stride(self, stride: usize) -> Self {
        Self { stride, ..self }
    }

    /// With this many groups.
    pub fn with_groups(self, groups: usize) -> Self {
        Self { groups, ..self }
    }

    /// Input samples one output sample spans: `(k - 1) * dilation + 1`.
    pub fn effective_kernel(&self) -> usize {
        (self.kernel_size.saturating_sub(1)) * self.dilation + 1
    }

    /// Elements of the weight, `[out, in / groups, k]`.
    pub fn weight_len(&self) -> usize {
        self.out_channels * (self.in_channels / self.groups.max(1)) * self.kernel_size
    }

    /// Output length for an input of `len` samples padded by `pad_left` and `pad_right` zeros.
    pub fn out_len(&self, len: usize, pad_left: usize, pad_right: usize) -> usize {
        let padded = len + pad_left + pad_right;
        let eff = self.effective_kernel();
        if padded < eff || self.stride == 0 {
            0
        } else {
            (padded - eff) / self.stride + 1
        }
    }

    /// Hugging Face's causal padding (`Qwen3OmniMoeCausalConvNet`): `effective_kernel - stride`
    /// zeros on the left, and on the right as many as make the output `ceil(len / stride)` long
    /// (none for stride 1, which keeps the length).
    pub fn causal_padding(&self, len: usize) -> Result<(usize, usize)> {
        let (eff, s) = (self.effective_kernel(), self.stride);
        if s == 0 || eff < s {
            return Err(Error::Metadata(format!(
                "causal conv: stride {s} must be in 1..={eff} (the effective kernel)"
            )));
        }
        Ok((eff - s, len.div_ceil(s) * s - len))
    }

    fn validate(&self) -> Result<()> {
        let g = self.groups;
        if g == 0
            || self.stride == 0
            || self.dilation == 0
            || self.kernel_size == 0
            || self.in_channels == 0
            || self.out_channels == 0
            || !self.in_channels.is_multiple_of(g)
            || !self.out_channels.is_multiple_of(g)
        {
            return Err(Error::Metadata(format!("invalid conv1d geometry {self:?}")));
        }
        Ok(())
    }
}

/// The first and one-past-last output rows `t` for which `t * stride + offset` (offset
/// `tap * dilation - pad_left`, possibly negative) lies in `0..len`, capped at `out_len`.
fn tap_rows(offset: isize, stride: usize, len: usize, out_len: usize) -> (usize, usize) {
    let s = stride as isize;
    let first = if offset < 0 { (-offset + s - 1) / s } else { 0 };
    let end = (len as isize - offset + s - 1).div_euclid(s).max(0);
    let first = (first as usize).min(out_len);
    (first, (end as usize).clamp(first, out_len))
}

/// `out = conv1d(pad(x))` for `x` `[len, in_channels]`, `weight` `[out, in / groups, k]`
/// (PyTorch `nn.Conv1d` layout), optional `bias` `[out]`, `pad = (left, right)` zeros; `out` is
/// `[spec.out_len(len, left, right), out_channels]`.
pub fn conv1d(
    x: &[f32],
    len: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    spec: &Conv1dSpec,
    pad: (usize, usize),
    out: &mut [f32],
) -> Result<()> {
    spec.validate()?;
    let (cin, cout, k) = (spec.in_channels, spec.out_channels, spec.kernel_size);
    let out_len = spec.out_len(len, pad.0, pad.1);
    check_len("conv1d input", x.len(), len * cin)?;
    check_len("conv1d weight", weight.len(), spec.weight_len())?;
    check_len("conv1d out", out.len(), out_len * cout)?;
    init_with_bias(out, bias, cout)?;
    if out_len == 0 {
        return Ok(());
    }
    let (cin_g, cout_g) = (cin / spec.groups, cout / spec.groups);
    if cin_g == 1 && cout_g == 1 {
        return depthwise(x, len, weight, spec, pad.0, out);
    }
    if spec.groups == 1 && k > 1 {
        return im2col(x, len, weight, spec, pad.0, out, IM2COL_BLOCK_ELEMENTS);
    }
    for tap in 0..k {
        let offset = (tap * spec.dilation) as isize - pad.0 as isize;
        let (t0, t1) = tap_rows(offset, spec.stride, len, out_len);
        if t0 == t1 {
            continue;
        }
        let first_in = (t0 * spec.stride) as isize + offset;
        for g in 0..spec.groups {
            let w0 = g * cout_g * cin_g * k + tap;
            gemm_strided(
                MatMut {
                    data: &mut out[t0 * cout + g * cout_g..],
                    rows: t1 - t0,
                    cols: cout_g,
                    rs: cout,
                    cs: 1,
                },
                MatRef {
                    data: &x[first_in as usize * cin + g * cin_g..],
                    rows: t1 - t0,
                    cols: cin_g,
                    rs: spec.stride * cin,
                    cs: 1,
                },
                // W[:, :, tap]^T: element (i, o) at ((o * cin_g) + i) * k + tap.
                MatRef {
                    data: &weight[w0..],
                    rows: cin_g,
                    cols: cout_g,
                    rs: k,
                    cs: cin_g * k,
                },
                1.0,
                true,
                Threads::Auto,
            )?;
        }
    }
    Ok(())
}

/// One dense GEMM per block of output rows over the unfolded input: `col[t, i * k + tap] =
/// x[t * s + tap * d - pad, i]` (zero outside), so `out = col @ W^T` with `W` `[out, in * k]` as
/// stored. One product of depth `in * k` instead of `k` accumulating products of depth `in`.
/// `out` holds the bias rows (or zeros) already; `block_elements` bounds the unfolded block.
fn im2col(
    x: &[f32],
    len: usize,
    weight: &[f32],
    spec: &Conv1dSpec,
    pad_left: usize,
    out: &mut [f32],
    block_elements: usize,
) -> Result<()> {
    let (cin, cout, k) = (spec.in_channels, spec.out_channels, spec.kernel_size);
    let depth = cin * k;
    let out_len = out.len() / cout;
    let rows = (block_elements / depth).clamp(1, out_len.max(1));
    let mut col = vec![0.0f32; rows * depth];
    for t0 in (0..out_len).step_by(rows) {
        let n = rows.min(out_len - t0);
        let col = &mut col[..n * depth];
        col.par_chunks_mut(depth).enumerate().for_each(|(r, c)| {
            let t = t0 + r;
            for tap in 0..k {
                let src = (t * spec.stride + tap * spec.dilation) as isize - pad_left as isize;
                if src < 0 || src as usize >= len {
                    c.iter_mut().skip(tap).step_by(k).for_each(|v| *v = 0.0);
                } else {
                    let xs = &x[src as usize * cin..(src as usize + 1) * cin];
                    c.iter_mut()
                        .skip(tap)
                        .step_by(k)
                        .zip(xs)
                        .for_each(|(v, xv)| *v = *xv);
                }
            }
        });
        gemm_strided(
            MatMut::row_major(&mut out[t0 * cout..(t0 + n) * cout], n, cout),
            MatRef::row_major(col, n, depth),
            MatRef::row_major(weight, cout, depth).t(),
            1.0,
            true,
            Threads::Auto,
        )?;
    }
    Ok(())
}

/// Sets every row of `out` (`[rows, channels]`) to `bias`, or to zero.
pub(crate) fn init_with_bias(out: &mut [f32], bias: Option<&[f32]>, channels: usize) -> Result<()> {
    match bias {
        Some(b) => {
            check_len("conv bias", b.len(), channels)?;
            out.chunks_exact_mut(channels.max(1))
                .for_each(|r| r.copy_from_slice(b));
        }
        None => out.fill(0.0),
    }
    Ok(())
}

/// One filter per channel (`groups == in == out`): `out[t, c] += sum_tap w[c, tap] * x[...]`.
fn depthwise(
    x: &[f32],
    len: usize,
    weight: &[f32],
    spec: &Conv1dSpec,
    pad_left: usize,
    out: &mut [f32],
) -> Result<()> {
    let (c, k) = (spec.in_channels, spec.kernel_size);
    // Taps major, so one tap is a contiguous row across channels.
    let mut w_t = vec![0.0f32; k * c];
    for ch in 0..c {
        for tap in 0..k {
            w_t[tap * c + ch] = weight[ch * k + tap];
        }
    }
    let rows_of = |t_base: usize, chunk: &mut [f32]| {
        for (i, row) in chunk.chunks_exact_mut(c).enumerate() {
            let t = t_base + i;
            for tap in 0..k {
                let src = (t * spec.stride + tap * spec.dilation) as isize - pad_left as isize;
                if src < 0 || src as usize >= len {
                    continue;
                }
                let xs = &x[src as usize * c..(src as usize + 1) * c];
                let ws = &w_t[tap * c..(tap + 1) * c];
                for ((o, xv), wv) in row.iter_mut().zip(xs).zip(ws) {
                    *o += xv * wv;
                }
            }
        }
    };
    let chunk = DEPTHWISE_ROWS_PER_TASK * c;
    out.par_chunks_mut(chunk)
        .enumerate()
        .for_each(|(j, ch)| rows_of(j * DEPTHWISE_ROWS_PER_TASK, ch));
    Ok(())
}

/// [`conv1d`] with [`Conv1dSpec::causal_padding`]; returns `(out, out_len)`.
pub fn causal_conv1d(
    x: &[f32],
    len: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    spec: &Conv1dSpec,
) -> Result<(Vec<f32>, usize)> {
    let pad = spec.causal_padding(len)?;
    let out_len = spec.out_len(len, pad.0, pad.1);
    let mut out = vec![0.0; out_len * spec.out_channels];
    conv1d(x, len, weight, bias, spec, pad, &mut out)?;
    Ok((out, out_len))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use crate::test_util::max_diff;

    pub(crate) fn data(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 37 + seed * 11) % 29) as f32 - 14.0) / 9.0)
            .collect()
    }

    /// PyTorch `F.conv1d(F.pad(x, pad))` written out, channel by channel.
    fn naive_conv(
        x: &[f32],
        len: usize,
        w: &[f32],
        b: &[f32],
        s: &Conv1dSpec,
        pad: (usize, usize),
    ) -> Vec<f32> {
        let out_len = s.out_len(len, pad.0, pad.1);
        let (cin_g, cout_g) = (s.in_channels / s.groups, s.out_channels / s.groups);
        let mut out = vec![0.0; out_len * s.out_channels];
        for t in 0..out_len {
            for o in 0..s.out_channels {
                let g = o / cout_g;
                let mut acc = b[o];
                for i in 0..cin_g {
                    for tap in 0..s.kernel_size {
                        let p = (t * s.stride + tap * s.dilation) as isize - pad.0 as isize;
                        if p >= 0 && (p as usize) < len {
                            let xv = x[p as usize * s.in_channels + g * cin_g + i];
                            acc += xv * w[(o * cin_g + i) * s.kernel_size + tap];
                        }
                    }
                }
                out[t * s.out_channels + o] = acc;
            }
        }
        out
    }

    #[test]
    fn conv1d_matches_naive_for_strides_dilations_groups_and_padding() {
        let cases = [
            (Conv1dSpec::new(3, 4, 3), (2, 0), 9),
            (Conv1dSpec::new(3, 4, 7).with_dilation(3), (18, 0), 30),
            (Conv1dSpec::new(4, 6, 4).with_stride(2), (2, 1), 11),
            (Conv1dSpec::new(4, 6, 3).with_groups(2), (1, 1), 8),
            (Conv1dSpec::new(5, 5, 7).with_groups(5), (6, 0), 12),
            (
                Conv1dSpec::new(5, 5, 3).with_groups(5).with_dilation(2),
                (4, 2),
                6,
            ),
            (Conv1dSpec::new(2, 3, 1), (0, 0), 5),
            // Input shorter than the padding on the left.
            (Conv1dSpec::new(2, 2, 7).with_dilation(9), (54, 0), 4),
            (Conv1dSpec::new(48, 40, 7).with_dilation(3), (18, 0), 300),
        ];
        for (spec, pad, len) in cases {
            let x = data(len * spec.in_channels, 1);
            let w = data(spec.weight_len(), 2);
            let b = data(spec.out_channels, 3);
            let mut got = vec![0.0; spec.out_len(len, pad.0, pad.1) * spec.out_channels];
            conv1d(&x, len, &w, Some(&b), &spec, pad, &mut got).unwrap();
            let want = naive_conv(&x, len, &w, &b, &spec, pad);
            assert!(max_diff(&got, &want) < 1e-4, "{spec:?} pad {pad:?}");
        }
    }

    #[test]
    fn im2col_blocks_of_rows_match_naive() {
        let spec = Conv1dSpec::new(3, 2, 5).with_dilation(2).with_stride(2);
        let (len, pad) = (23, (8, 1));
        let x = data(len * 3, 9);
        let w = data(spec.weight_len(), 10);
        let b = data(2, 11);
        let want = naive_conv(&x, len, &w, &b, &spec, pad);
        // 15 * 3 elements: blocks of 3 rows, the last one short.
        for block in [15, 45, 10_000] {
            let mut got = vec![0.0; want.len()];
            init_with_bias(&mut got, Some(&b), 2).unwrap();
            im2col(&x, len, &w, &spec, pad.0, &mut got, block).unwrap();
            assert!(max_diff(&got, &want) < 1e-5, "block {block}");
        }
    }

    #[test]
    fn causal_padding_keeps_stride_one_lengths_and_rounds_strided_up() {
        let s = Conv1dSpec::new(1, 1, 7).with_dilation(9);
        assert_eq!(s.causal_padding(10).unwrap(), (54, 0));
        let (_, n) = causal_conv1d(&[0.0; 10], 10, &[0.0; 7], None, &s).unwrap();
        assert_eq!(n, 10);
        let s2 = Conv1dSpec::new(1, 1, 4).with_stride(2);
        assert_eq!(s2.causal_padding(7).unwrap(), (2, 1));
        assert_eq!(s2.out_len(7, 2, 1), 4);
        assert!(
            Conv1dSpec::new(1, 1, 1)
                .with_stride(2)
                .causal_padding(4)
                .is_err()
        );
    }

    #[test]
    fn causal_conv_output_prefix_depends_only_on_input_prefix() {
        let spec = Conv1dSpec::new(3, 2, 7).with_dilation(3);
        let x = data(20 * 3, 4);
        let w = data(spec.weight_len(), 5);
        let (full, _) = causal_conv1d(&x, 20, &w, None, &spec).unwrap();
        let (head, n) = causal_conv1d(&x[..12 * 3], 12, &w, None, &spec).unwrap();
        assert_eq!(n, 12);
        assert!(max_diff(&full[..12 * 2], &head) < 1e-6);
    }

    #[test]
    fn short_buffers_are_rejected() {
        let spec = Conv1dSpec::new(2, 2, 3);
        let mut out = vec![0.0; 4];
        assert!(conv1d(&[0.0; 3], 2, &[0.0; 12], None, &spec, (2, 0), &mut out).is_err());
        assert!(conv1d(&[0.0; 4], 2, &[0.0; 11], None, &spec, (2, 0), &mut out).is_err());
        assert!(
            conv1d(
                &[0.0; 4],
                2,
                &[0.0; 12],
                Some(&[0.0]),
                &spec,
                (2, 0),
                &mut out
            )
            .is_err()
        );
    }
}
