//! The noise generator of the DSP, bit-compatible with numpy's
//! `np.random.default_rng(seed).standard_normal(n, dtype=np.float32)`.
//!
//! The reference package draws the noise branch of every frame from numpy's default generator, so
//! audio made here equals the reference's only if the noise does too. Three parts, each written
//! from the published algorithms and checked against numpy's draws:
//!
//! - `SeedSequence` (O'Neill's seed_seq hash, pool of four 32-bit words) turns the integer seed
//!   into the generator's 256-bit initial state;
//! - PCG64 (128-bit LCG, XSL-RR output) gives 64-bit words; a 32-bit draw takes the low half and
//!   keeps the high half for the next 32-bit draw, as numpy's bit generator does;
//! - the float32 normal is Marsaglia and Tsang's 256-level ziggurat on 32-bit draws (8 bits of
//!   level, 1 sign bit, 23 bits of mantissa), tables built at first use from the construction.

use std::sync::OnceLock;

const MULTIPLIER: u128 = 0x2360_ED05_1FC6_5DA4_4385_DF64_9FCC_F645;

/// numpy-compatible PCG64 generator with its float32 standard normal.
#[derive(Debug, Clone)]
pub struct NumpyRng {
    state: u128,
    inc: u128,
    /// The high half of the last 64-bit word, not yet handed out as a 32-bit draw.
    pending: Option<u32>,
}

impl NumpyRng {
    /// The generator `np.random.default_rng(seed)` starts with.
    pub fn from_seed(seed: u64) -> Self {
        let entropy: Vec<u32> = if seed >> 32 == 0 {
            vec![seed as u32]
        } else {
            vec![seed as u32, (seed >> 32) as u32]
        };
        let words = seed_sequence_state(&entropy, 4);
        let init_state = (u128::from(words[0]) << 64) | u128::from(words[1]);
        let init_seq = (u128::from(words[2]) << 64) | u128::from(words[3]);
        let mut rng = Self {
            state: 0,
            inc: (init_seq << 1) | 1,
            pending: None,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(init_state);
        rng.step();
        rng
    }

    /// A generator seeded from the clock and the process's hash seed (`default_rng()` with no seed).
    pub fn from_entropy() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        h.write_u128(nanos);
        Self::from_seed(h.finish())
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(MULTIPLIER).wrapping_add(self.inc);
    }

    /// The next 64-bit word (step, then XSL-RR of the new state).
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let x = ((self.state >> 64) as u64) ^ (self.state as u64);
        x.rotate_right((self.state >> 122) as u32)
    }

    fn next_u32(&mut self) -> u32 {
        if let Some(high) = self.pending.take() {
            return high;
        }
        let word = self.next_u64();
        self.pending = Some((word >> 32) as u32);
        word as u32
    }

    fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 * (1.0 / 16_777_216.0)
    }

    /// One float32 standard normal draw.
    pub fn standard_normal(&mut self) -> f32 {
        let t = tables();
        loop {
            let r = self.next_u32();
            let idx = (r & 0xff) as usize;
            let negative = (r >> 8) & 1 == 1;
            let rabs = (r >> 9) & 0x007f_ffff;
            let mut x = rabs as f32 * t.wi[idx];
            if negative {
                x = -x;
            }
            if rabs < t.ki[idx] {
                return x;
            }
            if idx == 0 {
                // The tail beyond R: Marsaglia's exponential rejection.
                loop {
                    let xx = -INV_R * (-self.next_f32()).ln_1p();
                    let yy = -(-self.next_f32()).ln_1p();
                    if yy + yy > xx * xx {
                        return if (rabs >> 8) & 1 == 1 {
                            -(R + xx)
                        } else {
                            R + xx
                        };
                    }
                }
            }
            let y = (t.fi[idx - 1] - t.fi[idx]) * self.next_f32() + t.fi[idx];
            if f64::from(y) < (-0.5 * f64::from(x) * f64::from(x)).exp() {
                return x;
            }
        }
    }

    /// Fills `out` with standard normal draws in order.
    pub fn fill_standard_normal(&mut self, out: &mut [f32]) {
        for v in out {
            *v = self.standard_normal();
        }
    }
}

/// `SeedSequence(entropy).generate_state(n64, np.uint64)`.
fn seed_sequence_state(entropy: &[u32], n64: usize) -> Vec<u64> {
    const INIT_A: u32 = 0x43b0_d7e5;
    const MULT_A: u32 = 0x931e_8875;
    const INIT_B: u32 = 0x8b51_f9dd;
    const MULT_B: u32 = 0x58f3_8ded;
    const MIX_L: u32 = 0xca01_f9dd;
    const MIX_R: u32 = 0x4973_f715;
    let mut hash_const = INIT_A;
    let mut hashmix = |value: u32| {
        let mut v = value ^ hash_const;
        hash_const = hash_const.wrapping_mul(MULT_A);
        v = v.wrapping_mul(hash_const);
        v ^ (v >> 16)
    };
    let mix = |x: u32, y: u32| {
        let r = MIX_L.wrapping_mul(x).wrapping_sub(MIX_R.wrapping_mul(y));
        r ^ (r >> 16)
    };
    let mut pool = [0u32; 4];
    for (i, p) in pool.iter_mut().enumerate() {
        *p = hashmix(entropy.get(i).copied().unwrap_or(0));
    }
    for src in 0..4 {
        for dst in 0..4 {
            if src != dst {
                let h = hashmix(pool[src]);
                pool[dst] = mix(pool[dst], h);
            }
        }
    }
    for &e in entropy.iter().skip(4) {
        for p in pool.iter_mut() {
            let h = hashmix(e);
            *p = mix(*p, h);
        }
    }
    let mut hash_b = INIT_B;
    let words: Vec<u32> = (0..2 * n64)
        .map(|i| {
            let mut v = pool[i % 4] ^ hash_b;
            hash_b = hash_b.wrapping_mul(MULT_B);
            v = v.wrapping_mul(hash_b);
            v ^ (v >> 16)
        })
        .collect();
    words
        .chunks(2)
        .map(|w| u64::from(w[0]) | (u64::from(w[1]) << 32))
        .collect()
}

const R: f32 = 3.654_152_9;
const INV_R: f32 = 0.273_661_24;

struct Tables {
    ki: [u32; 256],
    wi: [f32; 256],
    fi: [f32; 256],
}

/// The ziggurat for float32 draws: 256 layers of equal area `V` under exp(-x^2/2), the base
/// layer ending at `R`; built in f64 and rounded, like the published tables.
fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| {
        let m = f64::from(1u32 << 23);
        let r = 3.654_152_885_361_009_f64;
        let v = 4.928_673_233_99e-3_f64;
        let f = |x: f64| (-0.5 * x * x).exp();
        let mut t = Tables {
            ki: [0; 256],
            wi: [0.0; 256],
            fi: [0.0; 256],
        };
        let mut dn = r;
        let mut tn = dn;
        let q = v / f(dn);
        t.ki[0] = ((dn / q) * m) as u32;
        t.ki[1] = 0;
        t.wi[0] = (q / m) as f32;
        t.wi[255] = (dn / m) as f32;
        t.fi[0] = 1.0;
        t.fi[255] = f(dn) as f32;
        for i in (1..=254).rev() {
            dn = (-2.0 * (v / dn + f(dn)).ln()).sqrt();
            t.ki[i + 1] = ((dn / tn) * m) as u32;
            tn = dn;
            t.fi[i] = f(dn) as f32;
            t.wi[i] = (dn / m) as f32;
        }
        t
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_sequence_matches_numpy_for_seed_zero() {
        // np.random.SeedSequence(0).generate_state(4, np.uint64)
        assert_eq!(
            seed_sequence_state(&[0], 4),
            [
                0xdb2c_d7e7_b0f4_78be,
                0xabf4_641a_2c71_ba49,
                0x20c6_ed6d_9d7b_8d41,
                0x2c40_99de_223c_39d4
            ]
        );
    }

    #[test]
    fn first_word_matches_numpy_pcg64() {
        // np.random.default_rng(0).bit_generator.random_raw()
        assert_eq!(NumpyRng::from_seed(0).next_u64(), 0xa30f_ebcf_d9c2_825f);
    }

    #[test]
    fn normals_match_numpy_bit_for_bit() {
        let bits = |rng: &mut NumpyRng, n: usize| -> Vec<u32> {
            (0..n).map(|_| rng.standard_normal().to_bits()).collect()
        };
        // np.random.default_rng(0).standard_normal(4, dtype=np.float32).view(np.uint32)
        assert_eq!(
            bits(&mut NumpyRng::from_seed(0), 4),
            [0x3f8f0e3d, 0xbfb18d4f, 0xbeda6798, 0xbf4db7e5]
        );
        // A seed of two 32-bit words.
        assert_eq!(
            bits(&mut NumpyRng::from_seed((1 << 40) + 5), 5),
            [0xbd162eca, 0x3c50249c, 0xbea45034, 0x3e0f1e68, 0x3facdb60]
        );
        // 200,000 draws (the tail and wedge paths included): the sum of their bit patterns.
        let mut rng = NumpyRng::from_seed(0);
        let sum: u64 = (0..200_000)
            .map(|_| u64::from(rng.standard_normal().to_bits()))
            .sum();
        assert_eq!(sum, 0x1837d5630e576);
    }
}
