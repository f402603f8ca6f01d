//! Activations and the channel LayerNorm of a vocoder: exact (erf) GELU, SnakeBeta, LayerNorm
//! with affine over the channel dimension. Buffers are time-major `[len, channels]`, row-major.

use rayon::prelude::*;

use crate::{Error, Result, check_len};

/// Element counts from which the element-wise ops below run on the rayon pool.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// Rows per rayon task for row-wise ops.
const ROWS_PER_TASK: usize = 64;

/// The error function, to about 1e-15 relative error.
///
/// `|x| < 3`: Kummer's series `erf(x) = 2/sqrt(pi) * exp(-x^2) * sum_n (2x^2)^n x / (2n+1)!!`
/// (all terms positive, no cancellation). `3 <= |x| < 6`: `1 - erfc(x)` with erfc from its
/// continued fraction (Laplace). `|x| >= 6`: `+-1` (erfc(6) < 3e-17).
pub fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 3.0 {
        erf_series(a)
    } else if a < 6.0 {
        1.0 - erfc_continued_fraction(a)
    } else {
        1.0
    };
    if x < 0.0 { -r } else { r }
}

fn erf_series(a: f64) -> f64 {
    let two_a2 = 2.0 * a * a;
    let mut term = a;
    let mut sum = a;
    let mut n = 0.0;
    while term > 1e-17 * sum {
        n += 1.0;
        term *= two_a2 / (2.0 * n + 1.0);
        sum += term;
    }
    std::f64::consts::FRAC_2_SQRT_PI * (-a * a).exp() * sum
}

/// `erfc(a) = exp(-a^2) / sqrt(pi) / (a + (1/2)/(a + 1/(a + (3/2)/(a + 2/(a + ...)))))`,
/// evaluated from the back; 80 levels are ample for `a >= 3`.
fn erfc_continued_fraction(a: f64) -> f64 {
    let mut f = a;
    for k in (1..=80).rev() {
        f = a + (k as f64 * 0.5) / f;
    }
    (-a * a).exp() / (std::f64::consts::PI.sqrt() * f)
}

/// GELU with the exact error function (PyTorch `nn.GELU()`, `approximate='none'`):
/// `x / 2 * (1 + erf(x / sqrt(2)))`, computed in f64.
#[inline]
pub fn gelu(x: f32) -> f32 {
    let x = f64::from(x);
    (0.5 * x * (1.0 + erf(x * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

/// [`gelu`] on every element, in place.
pub fn gelu_inplace(x: &mut [f32]) {
    if x.len() >= PARALLEL_MIN_ELEMENTS {
        x.par_chunks_mut(PARALLEL_MIN_ELEMENTS / 4)
            .for_each(|c| c.iter_mut().for_each(|v| *v = gelu(*v)));
    } else {
        x.iter_mut().for_each(|v| *v = gelu(*v));
    }
}

/// SnakeBeta with per-channel parameters stored in log scale (BigVGAN, Qwen3-Omni's Code2Wav):
/// `y = x + 1 / (exp(beta) + 1e-9) * sin^2(exp(alpha) * x)`.
///
/// The exponentials are taken once here, in f32, in the order the reference computes them.
#[derive(Debug, Clone, PartialEq)]
pub struct SnakeBeta {
    /// `exp(alpha)` per channel.
    alpha: Vec<f32>,
    /// `1 / (exp(beta) + 1e-9)` per channel.
    inv_beta: Vec<f32>,
}

impl SnakeBeta {
    /// The reference's guard against a zero magnitude.
    const NO_DIV_BY_ZERO: f32 = 1e-9;

    /// From the checkpoint's log-scale `alpha` and `beta` (`[channels]` each).
    pub fn from_log_params(alpha: &[f32], beta: &[f32]) -> Result<Self> {
        check_len("snake beta", beta.len(), alpha.len())?;
        Ok(Self {
            alpha: alpha.iter().map(|a| a.exp()).collect(),
            inv_beta: beta
                .iter()
                .map(|b| 1.0 / (b.exp() + Self::NO_DIV_BY_ZERO))
                .collect(),
        })
    }

    /// Number of channels.
    pub fn channels(&self) -> usize {
        self.alpha.len()
    }

    /// Applies the activation to `x` (`[len, channels]`) in place.
    pub fn apply_inplace(&self, x: &mut [f32]) -> Result<()> {
        let c = self.channels();
        if c == 0 || !x.len().is_multiple_of(c) {
            return Err(Error::Shape {
                what: "snake beta input (multiple of channels)",
                expected: c,
                got: x.len(),
            });
        }
        let rows = |chunk: &mut [f32]| {
            for row in chunk.chunks_exact_mut(c) {
                for ((v, a), ib) in row.iter_mut().zip(&self.alpha).zip(&self.inv_beta) {
                    let s = (*v * a).sin();
                    *v += ib * (s * s);
                }
            }
        };
        if x.len() >= PARALLEL_MIN_ELEMENTS {
            x.par_chunks_mut(c * ROWS_PER_TASK).for_each(rows);
        } else {
            rows(x);
        }
        Ok(())
    }
}

/// LayerNorm over rows of width `dim` with affine weight and bias, in place (PyTorch
/// `nn.LayerNorm(dim, eps)`): `y = (x - mean) / sqrt(var + eps) * weight + bias`, with the biased
/// variance. Mean and variance are accumulated in f64.
pub fn layer_norm_inplace(
    x: &mut [f32],
    weight: &[f32],
    bias: &[f32],
    dim: usize,
    eps: f32,
) -> Result<()> {
    check_len("layer_norm weight", weight.len(), dim)?;
    check_len("layer_norm bias", bias.len(), dim)?;
    if dim == 0 || !x.len().is_multiple_of(dim) {
        return Err(Error::Shape {
            what: "layer_norm input (multiple of dim)",
            expected: dim,
            got: x.len(),
        });
    }
    let rows = |chunk: &mut [f32]| {
        for row in chunk.chunks_exact_mut(dim) {
            let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / dim as f64;
            let var = row
                .iter()
                .map(|&v| {
                    let d = f64::from(v) - mean;
                    d * d
                })
                .sum::<f64>()
                / dim as f64;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            for ((v, w), b) in row.iter_mut().zip(weight).zip(bias) {
                *v = ((f64::from(*v) - mean) * inv) as f32 * w + b;
            }
        }
    };
    if x.len() >= PARALLEL_MIN_ELEMENTS {
        x.par_chunks_mut(dim * ROWS_PER_TASK).for_each(rows);
    } else {
        rows(x);
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_tabulated_values() {
        // Values from a 30-digit evaluation.
        let table = [
            (0.0, 0.0),
            (1e-8, 1.128_379_167_095_512_6e-8),
            (0.1, 0.112_462_916_018_284_9),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (1.5, 0.966_105_146_475_310_7),
            (2.0, 0.995_322_265_018_952_7),
            (2.9, 0.999_958_902_121_900_6),
            (3.0, 0.999_977_909_503_001_4),
            (3.5, 0.999_999_256_901_627_7),
            (4.5, 0.999_999_999_803_383_9),
            (7.0, 1.0),
        ];
        for (x, want) in table {
            let got = erf(x);
            assert!(
                (got - want).abs() <= 1e-15 + 1e-14 * want,
                "erf({x}) = {got}"
            );
            assert_eq!(erf(-x), -got);
        }
        // erfc through the continued fraction keeps its relative precision.
        let erfc3 = erfc_continued_fraction(3.0);
        assert!((erfc3 / 2.209_049_699_858_544e-5 - 1.0).abs() < 1e-12);
    }

    #[test]
    fn gelu_is_exact_erf_form() {
        assert_eq!(gelu(0.0), 0.0);
        assert!((gelu(1.0) - 0.841_344_7).abs() < 1e-7);
        assert!((gelu(-1.0) + 0.158_655_3).abs() < 1e-7);
        assert!((gelu(3.0) - 2.995_950_2).abs() < 1e-6);
        assert_eq!(gelu(-10.0), 0.0);
        let mut v = vec![1.0f32; 70_000];
        gelu_inplace(&mut v);
        assert!(v.iter().all(|&g| g == gelu(1.0)));
    }

    #[test]
    fn snake_beta_uses_log_scale_parameters_per_channel() {
        // Channel 0: alpha = beta = 0 -> x + sin^2(x); channel 1: alpha = ln 2, beta = ln 4
        // -> x + sin^2(2x) / 4.
        let snake = SnakeBeta::from_log_params(&[0.0, 2f32.ln()], &[0.0, 4f32.ln()]).unwrap();
        let mut x = vec![0.5, 0.5, -1.0, 2.0];
        snake.apply_inplace(&mut x).unwrap();
        let want = [
            0.5 + 0.5f32.sin().powi(2),
            0.5 + 1.0f32.sin().powi(2) / 4.0,
            -1.0 + 1.0f32.sin().powi(2),
            2.0 + 4.0f32.sin().powi(2) / 4.0,
        ];
        for (g, w) in x.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
        assert!(snake.apply_inplace(&mut [0.0; 3]).is_err());
    }

    #[test]
    fn layer_norm_centres_and_scales_each_row() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 4.0, 4.0, 4.0, 4.0];
        layer_norm_inplace(&mut x, &[1.0, 1.0, 2.0, 1.0], &[0.0, 0.0, 0.0, 0.5], 4, 0.0).unwrap();
        let s = (1.25f32).sqrt();
        let want = [-1.5 / s, -0.5 / s, 2.0 * 0.5 / s, 1.5 / s + 0.5];
        for (g, w) in x[..4].iter().zip(want) {
            assert!((g - w).abs() < 1e-6);
        }
        // A constant row with eps 0 would divide by zero; with eps it is the bias.
        let mut c = vec![4.0; 4];
        layer_norm_inplace(&mut c, &[1.0; 4], &[0.0, 0.0, 0.0, 0.5], 4, 1e-6).unwrap();
        assert_eq!(c, vec![0.0, 0.0, 0.0, 0.5]);
    }
}
