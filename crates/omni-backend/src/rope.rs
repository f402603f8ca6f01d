//! Rotary position embeddings in the Hugging Face `rotate_half` (GPT-NeoX) convention: a head
//! vector `[x1 | x2]` of halves becomes `[x1 cos - x2 sin | x2 cos + x1 sin]`, with frequency `i`
//! shared by elements `i` and `i + head_dim / 2`.

use crate::{Error, Result};

/// How the inverse frequencies are scaled (`rope_scaling` / `rope_parameters` in HF configs).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Llama 3.x (`rope_type: "llama3"`): long wavelengths divided by `factor`, short ones kept,
    /// a smooth blend between.
    Llama3 {
        /// Scale for low frequencies.
        factor: f32,
        /// Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f32,
        /// Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f32,
        /// Context length of pre-training.
        original_max_position_embeddings: f32,
    },
    /// Linear position interpolation (`rope_type: "linear"`): every frequency divided by `factor`.
    Linear {
        /// Divisor.
        factor: f32,
    },
}

/// Precomputed inverse frequencies for one head size.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Frequencies `1 / theta^(2i / head_dim)` for `i < head_dim / 2`, then `scaling`.
    pub fn new(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::Shape {
                what: "rope head_dim (even)",
                expected: head_dim + 1,
                got: head_dim,
            });
        }
        let half = head_dim / 2;
        // Computed in f32 like the reference implementation, so positions match bit for bit.
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        match *scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: orig,
            } => {
                let low_freq_wavelen = orig / low_freq_factor;
                let high_freq_wavelen = orig / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_freq_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_freq_wavelen {
                        let smooth = (orig / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        Ok(Self { head_dim, inv_freq })
    }

    /// The inverse frequencies, `head_dim / 2` of them, with the scaling applied (what a device
    /// kernel needs to rotate exactly as this table does).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Head size this table was built for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Fills `cos_sin` with `[cos | sin]` rows of width `head_dim` (half each) per position.
    pub fn cos_sin(&self, positions: &[usize], cos_sin: &mut Vec<f32>) {
        let half = self.head_dim / 2;
        cos_sin.clear();
        cos_sin.resize(positions.len() * self.head_dim, 0.0);
        for (&p, row) in positions
            .iter()
            .zip(cos_sin.chunks_exact_mut(self.head_dim))
        {
            let (c, s) = row.split_at_mut(half);
            for i in 0..half {
                let angle = p as f32 * self.inv_freq[i];
                c[i] = angle.cos();
                s[i] = angle.sin();
            }
        }
    }

    /// Rotates `x` (`[tokens, heads, head_dim]`) in place using rows from [`Rope::cos_sin`].
    pub fn apply(&self, x: &mut [f32], heads: usize, cos_sin: &[f32]) -> Result<()> {
        let hd = self.head_dim;
        let half = hd / 2;
        let tokens = cos_sin.len() / hd;
        crate::check_len("rope input", x.len(), tokens * heads * hd)?;
        for (tok, cs) in x.chunks_exact_mut(heads * hd).zip(cos_sin.chunks_exact(hd)) {
            let (cos, sin) = cs.split_at(half);
            for head in tok.chunks_exact_mut(hd) {
                let (x1, x2) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * cos[i] - b * sin[i];
                    x2[i] = b * cos[i] + a * sin[i];
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_rotation_keeps_norm() {
        let rope = Rope::new(4, 10000.0, &RopeScaling::None).unwrap();
        let mut cs = Vec::new();
        rope.cos_sin(&[0, 7], &mut cs);
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
        rope.apply(&mut x, 1, &cs).unwrap();
        assert_eq!(&x[..4], &[1.0, 2.0, 3.0, 4.0]);
        let n0: f32 = x[..4].iter().map(|v| v * v).sum();
        let n1: f32 = x[4..].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32.0,
        };
        let plain = Rope::new(16, 500000.0, &RopeScaling::None).unwrap();
        let scaled = Rope::new(16, 500000.0, &scaling).unwrap();
        assert_eq!(plain.inv_freq[0], scaled.inv_freq[0]);
        assert_eq!(plain.inv_freq[7] / 8.0, scaled.inv_freq[7]);
    }
}
