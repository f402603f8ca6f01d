//! The output head's product: Q8_0 weight rows against f32 activations, each block's 32 values
//! dequantized in registers (`d * q`), no rounding of the activations.
//!
//! The head is one matrix (`[vocab, hidden]`, the tied embedding in SmolLM2's GGUF) read once per
//! step, so its cost is its bytes, as the integer kernels'; what changes is that the logits are
//! those of the f32 hidden state: on the default model the Q8 rounding of the final hidden state
//! moved a logit by 0.12 and flipped the first answer token of a near-tie (0.08 apart).
//!
//! Order of the sums (the AVX2 kernel and [`dot_q8_0_f32`] alike): per block, eight lanes
//! `p = q[0..8] * x[0..8]`, then `p = fma(q[8g..], x[8g..], p)` for `g = 1, 2, 3`; then
//! `acc = fma(d, p, acc)`; at the end [`super::q8::hsum8`]'s order.

use super::q8::hsum8;
use super::{BLOCK, Kernel, KernelKind, half_at};

/// Q8_0 weight row (34-byte blocks) . f32 activation row.
pub fn dot_q8_0_f32(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, blk) in w.chunks_exact(34).enumerate() {
        let d = half_at(blk, 0);
        let xs = &x[b * BLOCK..(b + 1) * BLOCK];
        let q = |e: usize| f32::from(blk[2 + e] as i8);
        let mut p = [0.0f32; 8];
        for (l, p) in p.iter_mut().enumerate() {
            *p = q(l) * xs[l];
        }
        for g in 1..4 {
            for (l, p) in p.iter_mut().enumerate() {
                *p = q(8 * g + l).mul_add(xs[8 * g + l], *p);
            }
        }
        for (a, p) in acc.iter_mut().zip(p) {
            *a = d.mul_add(p, *a);
        }
    }
    hsum8(acc)
}

/// Fills `t` (`[rows, m]`, out transposed) with the products of the Q8_0 weight rows `w` (`rb`
/// bytes each) and the `m` rows of `a` (`k` values each).
pub(super) fn fill_q8_0(kernel: Kernel, w: &[u8], rb: usize, a: &[f32], k: usize, t: &mut [f32]) {
    let m = a.len() / k.max(1);
    for (wr, vals) in w.chunks_exact(rb).zip(t.chunks_exact_mut(m)) {
        for (v, x) in vals.iter_mut().zip(a.chunks_exact(k)) {
            *v = match kernel.0 {
                KernelKind::Scalar => dot_q8_0_f32(wr, x),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: every SIMD kind is only made after its `available()` saw AVX2, FMA
                // and F16C (and more) on this CPU.
                KernelKind::Avx2 | KernelKind::AvxVnni | KernelKind::Avx512Vnni => unsafe {
                    avx2::dot_q8_0_f32(wr, x)
                },
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        _mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32, _mm_loadl_epi64, _mm256_cvtepi8_epi32,
        _mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps,
        _mm256_setzero_ps,
    };

    use super::BLOCK;
    use crate::quant::avx2::hsum;

    /// [`super::dot_q8_0_f32`] with AVX2.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0_f32(w: &[u8], x: &[f32]) -> f32 {
        let nb = w.len() / 34;
        // Every pointer read below is within these lengths.
        assert!(w.len() == nb * 34 && x.len() == nb * BLOCK);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            crate::quant::avx2::prefetch(w.as_ptr().wrapping_add(b * 34));
            // SAFETY: `b < nb`: the block's 34 bytes at `34 b` and its 32 activations at `32 b`
            // are inside `w` and `x` (asserted); the loads are unaligned.
            let (d, p) = unsafe {
                let blk = w.as_ptr().add(b * 34);
                let xp = x.as_ptr().add(b * BLOCK);
                let q = |g: usize| {
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        blk.add(2 + 8 * g).cast(),
                    )))
                };
                let mut p = _mm256_mul_ps(q(0), _mm256_loadu_ps(xp));
                for g in 1..4 {
                    p = _mm256_fmadd_ps(q(g), _mm256_loadu_ps(xp.add(8 * g)), p);
                }
                let d = i32::from(blk.cast::<u16>().read_unaligned());
                (_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d))), p)
            };
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc);
        }
        hsum(acc)
    }
}
