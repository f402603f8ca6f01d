//! Element-wise and row-wise ops on row-major `f32` buffers: RMSNorm, SiLU-and-mul, softmax,
//! embedding lookup, residual add.

use crate::{Error, Result, check_len};

/// RMSNorm over rows of width `dim`, in place: `x = x / sqrt(mean(x^2) + eps) * weight`
/// (Hugging Face `LlamaRMSNorm`, computed in f32).
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], dim: usize, eps: f32) -> Result<()> {
    check_len("rms_norm weight", weight.len(), dim)?;
    if dim == 0 || !x.len().is_multiple_of(dim) {
        return Err(Error::Shape {
            what: "rms_norm input (multiple of dim)",
            expected: dim,
            got: x.len(),
        });
    }
    for row in x.chunks_exact_mut(dim) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
    Ok(())
}

/// RMSNorm from `x` into `out` (same shapes); see [`rms_norm_inplace`].
pub fn rms_norm(x: &[f32], weight: &[f32], out: &mut [f32], dim: usize, eps: f32) -> Result<()> {
    check_len("rms_norm out", out.len(), x.len())?;
    out.copy_from_slice(x);
    rms_norm_inplace(out, weight, dim, eps)
}

/// `sigmoid(x) = 1 / (1 + e^-x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `silu(x) = x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// SiLU-and-mul on fused rows `[gate | up]` of width `2 * inter`: `out[t, i] = silu(gate) * up`.
pub fn silu_and_mul(gate_up: &[f32], out: &mut [f32], inter: usize) -> Result<()> {
    if inter == 0 || !gate_up.len().is_multiple_of(2 * inter) {
        return Err(Error::Shape {
            what: "silu_and_mul input (multiple of 2 * inter)",
            expected: 2 * inter,
            got: gate_up.len(),
        });
    }
    check_len("silu_and_mul out", out.len(), gate_up.len() / 2)?;
    for (row, o) in gate_up
        .chunks_exact(2 * inter)
        .zip(out.chunks_exact_mut(inter))
    {
        let (gate, up) = row.split_at(inter);
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            *o = silu(*g) * u;
        }
    }
    Ok(())
}

/// Numerically stable softmax of one row, in place. An all `-inf` row becomes all zeros.
pub fn softmax_inplace(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// Gathers rows of `table` (`[vocab, dim]`) for `ids` into `out` (`[ids.len(), dim]`).
pub fn embedding(table: &[f32], dim: usize, ids: &[u32], out: &mut [f32]) -> Result<()> {
    check_len("embedding out", out.len(), ids.len() * dim)?;
    let vocab = table.len().checked_div(dim).unwrap_or(0);
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(dim.max(1))) {
        let id = id as usize;
        if id >= vocab {
            return Err(Error::Shape {
                what: "embedding token id (vocab size)",
                expected: vocab,
                got: id,
            });
        }
        o.copy_from_slice(&table[id * dim..(id + 1) * dim]);
    }
    Ok(())
}

/// Residual add in place: `x += y`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) -> Result<()> {
    check_len("add operand", y.len(), x.len())?;
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
    Ok(())
}

/// Adds `bias` (`[dim]`) to every row of `x` (`[rows, dim]`).
pub fn add_bias_inplace(x: &mut [f32], bias: &[f32]) -> Result<()> {
    if bias.is_empty() || !x.len().is_multiple_of(bias.len()) {
        return Err(Error::Shape {
            what: "bias (row width)",
            expected: bias.len(),
            got: x.len(),
        });
    }
    for row in x.chunks_exact_mut(bias.len()) {
        add_inplace(row, bias)?;
    }
    Ok(())
}

/// SplitMix64's finaliser (the Talker kernels' `tk_mix64`).
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform draw in `[0, 1)` of the Talker's code choices for `(seed, offset)` (offset =
/// frame index * groups + group, layer 0 being group 0): the CUDA choosing kernels compute the
/// same value, so the host and the device draw one stream.
pub fn talker_uniform(seed: u64, offset: u64) -> f32 {
    (mix64(seed ^ mix64(offset)) >> 40) as f32 * (1.0 / 16_777_216.0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_scales_rows_to_unit_rms() {
        let mut x = vec![3.0, 4.0, 0.0, 0.0];
        rms_norm_inplace(&mut x, &[1.0, 2.0], 2, 1e-12).unwrap();
        let r = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / r).abs() < 1e-6 && (x[1] - 8.0 / r).abs() < 1e-6);
        assert_eq!(&x[2..], &[0.0, 0.0]);
    }

    #[test]
    fn softmax_sums_to_one_and_handles_masked_rows() {
        let mut r = vec![1.0, 2.0, f32::NEG_INFINITY];
        softmax_inplace(&mut r);
        assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(r[2], 0.0);
        let mut m = vec![f32::NEG_INFINITY; 2];
        softmax_inplace(&mut m);
        assert_eq!(m, vec![0.0, 0.0]);
    }

    #[test]
    fn silu_and_mul_uses_gate_then_up_halves() {
        let mut out = [0.0; 1];
        silu_and_mul(&[1.0, 2.0], &mut out, 1).unwrap();
        assert!((out[0] - 2.0 * silu(1.0)).abs() < 1e-6);
    }

    #[test]
    fn embedding_rejects_out_of_vocab_ids() {
        let mut out = [0.0; 2];
        embedding(&[1.0, 2.0, 3.0, 4.0], 2, &[1], &mut out).unwrap();
        assert_eq!(out, [3.0, 4.0]);
        assert!(embedding(&[1.0, 2.0], 2, &[1], &mut out).is_err());
    }
}
