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

/// Which of the three position rows (0 temporal, 1 height, 2 width) turns each rotary frequency
/// under multimodal RoPE (M-RoPE; HF `rope_parameters.mrope_section`).
///
/// Interleaved (Qwen3-VL / Qwen3-Omni, `interleaved: true`): frequency `i` follows height when
/// `i % 3 == 1` and `i < 3 * section[1]`, width when `i % 3 == 2` and `i < 3 * section[2]`,
/// temporal otherwise; sections [24, 20, 20] over 64 frequencies give 24/20/20. Contiguous
/// (Qwen2-VL): the first `section[0]` frequencies temporal, the next `section[1]` height, the
/// rest width.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MropeLayout {
    axes: Vec<u8>,
}

impl MropeLayout {
    /// The layout of `section` over `head_dim / 2` frequencies.
    pub fn new(head_dim: usize, section: [usize; 3], interleaved: bool) -> Result<Self> {
        let half = head_dim / 2;
        if section.iter().sum::<usize>() != half {
            return Err(Error::Shape {
                what: "mrope_section (sums to head_dim / 2)",
                expected: half,
                got: section.iter().sum(),
            });
        }
        let axes = (0..half)
            .map(|i| {
                if interleaved {
                    if i % 3 == 1 && i < 3 * section[1] {
                        1
                    } else if i % 3 == 2 && i < 3 * section[2] {
                        2
                    } else {
                        0
                    }
                } else if i < section[0] {
                    0
                } else if i < section[0] + section[1] {
                    1
                } else {
                    2
                }
            })
            .collect();
        Ok(Self { axes })
    }

    /// The row (0, 1, 2) of each frequency.
    pub fn axes(&self) -> &[u8] {
        &self.axes
    }
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

    /// [`Rope::cos_sin`] for M-RoPE: frequency `i` of token `t` turns by
    /// `rows[layout.axis(i)][t]` (temporal, height or width position) instead of one position.
    /// With equal rows this is exactly [`Rope::cos_sin`].
    pub fn cos_sin_mrope(
        &self,
        rows: [&[i64]; 3],
        layout: &MropeLayout,
        cos_sin: &mut Vec<f32>,
    ) -> Result<()> {
        let half = self.head_dim / 2;
        crate::check_len("M-RoPE frequencies", layout.axes.len(), half)?;
        let t = rows[0].len();
        crate::check_len("M-RoPE height row", rows[1].len(), t)?;
        crate::check_len("M-RoPE width row", rows[2].len(), t)?;
        cos_sin.clear();
        cos_sin.resize(t * self.head_dim, 0.0);
        for (tok, row) in cos_sin.chunks_exact_mut(self.head_dim).enumerate() {
            let (c, s) = row.split_at_mut(half);
            for i in 0..half {
                // As the reference: an f32 position times an f32 frequency.
                let angle = rows[layout.axes[i] as usize][tok] as f32 * self.inv_freq[i];
                c[i] = angle.cos();
                s[i] = angle.sin();
            }
        }
        Ok(())
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
    fn interleaved_mrope_gives_each_axis_its_section() {
        let l = MropeLayout::new(128, [24, 20, 20], true).unwrap();
        let count = |a: u8| l.axes().iter().filter(|&&x| x == a).count();
        assert_eq!((count(0), count(1), count(2)), (24, 20, 20));
        assert_eq!(&l.axes()[..6], &[0, 1, 2, 0, 1, 2]);
        assert_eq!(&l.axes()[60..], &[0, 0, 0, 0]);
        let c = MropeLayout::new(16, [4, 2, 2], false).unwrap();
        assert_eq!(c.axes(), &[0, 0, 0, 0, 1, 1, 2, 2]);
        assert!(MropeLayout::new(16, [4, 2, 1], true).is_err());
    }

    #[test]
    fn mrope_with_equal_rows_is_plain_rope() {
        let r = Rope::new(16, 1e6, &RopeScaling::None).unwrap();
        let l = MropeLayout::new(16, [4, 2, 2], true).unwrap();
        let pos = [0usize, 3, 7, 100];
        let row: Vec<i64> = pos.iter().map(|&p| p as i64).collect();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        r.cos_sin(&pos, &mut a);
        r.cos_sin_mrope([&row, &row, &row], &l, &mut b).unwrap();
        assert_eq!(a, b);
        let other: Vec<i64> = vec![0, 1, 1, 2];
        r.cos_sin_mrope([&row, &other, &row], &l, &mut b).unwrap();
        assert_ne!(a, b, "a different height row turns the height frequencies");
    }

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
