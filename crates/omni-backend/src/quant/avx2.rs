//! AVX2 kernels of the integer dot products (x86_64, AVX2 + FMA + F16C checked at run time).
//!
//! One 32-value block per step: the weight's values as 32 bytes (Q4_1: the 16 low nibbles,
//! then the 16 high nibbles, unsigned; Q8_0: signed, made unsigned by moving its sign onto the
//! activation), `_mm256_maddubs_epi16` against the 32 activation bytes (pairs of `u8 * i8`
//! products in `i16`: at most `2 * 128 * 127`, no saturation), `_mm256_madd_epi16` by ones to
//! eight `i32` lanes of four products, converted and fused-multiply-added with `d_w d_a` into
//! eight f32 lanes. [`super::q8`] mirrors this order exactly, so the results are equal.
//!
//! One chain of FMAs would wait on the FMA's latency every block, so the accumulators come in
//! independent chains: batch 1 ([`single`]) spreads a row's blocks over four accumulator groups;
//! more activation rows ([`multi`]) take one weight row against up to four of them, each
//! weight block unpacked once for all.
//!
//! [`int_kernels!`] writes these loops once for every 256-bit variant: the AVX2 one here, and
//! those of [`super::vnni`], which only replace `maddubs` + `madd` by one VNNI `dpbusd` (the
//! same eight sums of four products, exact in `i32`, so the same bits).

use std::arch::x86_64::{
    __m256, __m256i, _mm_add_ps, _mm_add_ss, _mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32,
    _mm_loadu_si128, _mm_movehdup_ps, _mm_movehl_ps, _mm_shuffle_ps, _mm_srli_epi16,
    _mm256_and_si256, _mm256_castps256_ps128, _mm256_cvtepi32_ps, _mm256_extractf128_ps,
    _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_set_m128i,
    _mm256_set1_epi8, _mm256_set1_epi16, _mm256_sign_epi8,
};

use super::BLOCK;
use super::q8::Q8Row;

/// Whether this CPU runs these kernels.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, as [`super::q8::hsum8`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)))
}

/// The `d` and `m` (0 for Q8_0) of the weight block at `blk`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `blk` must point at a whole block (20 or 34 bytes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scales<const Q4: bool>(blk: *const u8) -> (f32, f32) {
    // SAFETY: the reads (4 or 2 bytes) stay inside the block, unaligned.
    unsafe {
        if Q4 {
            // [d_w, m_w, 0, 0]: both halves converted at once.
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(blk.cast::<i32>().read_unaligned()));
            (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)))
        } else {
            let d = i32::from(blk.cast::<u16>().read_unaligned());
            (_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d))), 0.0)
        }
    }
}

/// One weight block at `blk`: its values as 32 bytes (Q4_1: unsigned nibbles; Q8_0: signed),
/// `d` and `m` (0 for Q8_0).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `blk` must point at a whole block (20 or 34 bytes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack<const Q4: bool>(blk: *const u8) -> (__m256i, f32, f32) {
    // SAFETY: the reads stay inside the block (Q4_1: 4 + 16 bytes; Q8_0: 2 + 32), unaligned.
    unsafe {
        let (d, m) = scales::<Q4>(blk);
        if Q4 {
            let nib = _mm_loadu_si128(blk.add(4).cast());
            let low = _mm256_set1_epi8(0x0f);
            let qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), low);
            (qw, d, m)
        } else {
            (_mm256_loadu_si256(blk.add(2).cast()), d, m)
        }
    }
}

/// How far ahead of the block being read the batch-1 kernels (and the head's) ask for the
/// weight's bytes: a decode step streams 96 MB of blocks that do not stay in cache, and the
/// hardware prefetchers alone left one thread at ~5 GB/s; 1 KiB ahead (into the next rows of
/// the same task, which are contiguous) took the step's Q4_1 layers from 11.7-13.2 to
/// 8.2-9.3 ms of one thread's CPU time on the development VM (`quant_bench --variants`).
pub(crate) const PREFETCH_AHEAD: usize = 1024;

/// Asks for the cache line `PREFETCH_AHEAD` bytes past `at` (a hint: the address may lie
/// past the slice, which is fine for a prefetch, and is only formed with `wrapping_add`).
#[inline(always)]
pub(crate) fn prefetch(at: *const u8) {
    if PREFETCH_AHEAD > 0 {
        // SAFETY: a prefetch reads nothing the program sees and cannot fault, whatever the
        // address; SSE is part of x86_64.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                at.wrapping_add(PREFETCH_AHEAD).cast(),
            )
        }
    }
}

/// The eight `i32` lane sums of one block's products, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes<const Q4: bool>(qw: __m256i, qa: __m256i) -> __m256 {
    let p = if Q4 {
        _mm256_maddubs_epi16(qw, qa)
    } else {
        // |q_w| (unsigned; -128 becomes 128) times q_a with q_w's sign (q_a is in -127..=127,
        // so negating it cannot overflow).
        _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw))
    };
    _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

/// Asserts that `w` and `a` hold the same number of whole blocks; returns it.
pub(super) fn blocks<const Q4: bool>(w: &[u8], a: &[Q8Row<'_>]) -> usize {
    let bb = if Q4 { 20 } else { 34 };
    let nb = w.len() / bb;
    assert!(
        w.len() == nb * bb
            && a.iter()
                .all(|r| r.q.len() == nb * BLOCK && r.d.len() == nb && r.s.len() == nb)
    );
    nb
}

/// The integer kernels' loops (`single`, `multi`, `fill`) for one 256-bit variant, in the module
/// that calls it: that module has `lanes::<Q4>(qw, qa) -> __m256` (a block's eight lane sums as
/// f32) in scope; `$features` are the CPU features its functions are compiled for (which its
/// parent's `available()` checks), and `$single` the batch-1 row kernel that `fill` uses
/// (`single`, or a wider one of the module).
macro_rules! int_kernels {
    ($features:literal, $single:ident) => {
        use std::arch::x86_64::{
            _mm256_add_ps, _mm256_fmadd_ps, _mm256_loadu_si256, _mm256_set1_ps, _mm256_setzero_ps,
        };

        use $crate::quant::avx2::{blocks, hsum, unpack};
        use $crate::quant::q8::{Q8Row, Q8Rows, SINGLE_ROW_GROUPS};
        use $crate::quant::{BLOCK, QuantType};

        /// One weight row against one activation row with [`SINGLE_ROW_GROUPS`] accumulator groups
        /// (block `b` into group `b % 4`), as [`crate::quant::q8::dot_q4_1`] / `dot_q8_0` with 4
        /// groups.
        ///
        /// # Safety
        /// The CPU must have `$features` (the parent module's `available()`).
        // A module with a wider batch-1 kernel leaves this one unused.
        #[allow(dead_code)]
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn single<const Q4: bool>(w: &[u8], a: Q8Row<'_>) -> f32 {
            const G: usize = SINGLE_ROW_GROUPS;
            let bb = if Q4 { 20 } else { 34 };
            let nb = blocks::<Q4>(w, &[a]);
            let mut acc = [_mm256_setzero_ps(); G];
            let mut summ = [0.0f32; G];
            for b0 in (0..nb).step_by(G) {
                $crate::quant::avx2::prefetch(w.as_ptr().wrapping_add(b0 * bb));
                $crate::quant::avx2::prefetch(w.as_ptr().wrapping_add(b0 * bb + 64));
                // A constant trip count: the groups stay in registers.
                for g in 0..G {
                    let b = b0 + g;
                    if b >= nb {
                        break;
                    }
                    // SAFETY: `b < nb`, so block `b` of `w` (`bb` bytes at `bb b`) and of `a.q` (32 bytes
                    // at `32 b`) are inside the slices (`blocks` asserted their lengths).
                    let (qw, dw, mw, qa, da, sa) = unsafe {
                        let (qw, dw, mw) = unpack::<Q4>(w.as_ptr().add(b * bb));
                        let qa = _mm256_loadu_si256(a.q.as_ptr().add(b * BLOCK).cast());
                        (qw, dw, mw, qa, *a.d.get_unchecked(b), *a.s.get_unchecked(b))
                    };
                    acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da), lanes::<Q4>(qw, qa), acc[g]);
                    if Q4 {
                        summ[g] += mw * sa;
                    }
                }
            }
            let l = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            if Q4 {
                hsum(l) + ((summ[0] + summ[1]) + (summ[2] + summ[3]))
            } else {
                hsum(l)
            }
        }

        /// One weight row against `R` activation rows, one accumulator per pair: each weight block
        /// is unpacked once for the `R` rows.
        ///
        /// # Safety
        /// The CPU must have `$features` (the parent module's `available()`).
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn multi<const Q4: bool, const R: usize>(w: &[u8], a: [Q8Row<'_>; R]) -> [f32; R] {
            let bb = if Q4 { 20 } else { 34 };
            let nb = blocks::<Q4>(w, &a);
            let mut acc = [_mm256_setzero_ps(); R];
            let mut summ = [0.0f32; R];
            for b in 0..nb {
                // SAFETY: `b < nb`: block `b` of `w` is inside it (`blocks` asserted its length).
                let (qw, dw, mw) = unsafe { unpack::<Q4>(w.as_ptr().add(b * bb)) };
                for r in 0..R {
                    // SAFETY: `b < nb`: block `b` of each activation row is inside it (asserted).
                    let (qa, da, sa) = unsafe {
                        let qa = _mm256_loadu_si256(a[r].q.as_ptr().add(b * BLOCK).cast());
                        (qa, *a[r].d.get_unchecked(b), *a[r].s.get_unchecked(b))
                    };
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da), lanes::<Q4>(qw, qa), acc[r]);
                    if Q4 {
                        summ[r] += mw * sa;
                    }
                }
            }
            let mut out = [0.0f32; R];
            for r in 0..R {
                out[r] = if Q4 {
                    hsum(acc[r]) + summ[r]
                } else {
                    hsum(acc[r])
                };
            }
            out
        }

        /// Fills `t` (`[rows, m]`, out transposed) with the products of the weight rows `w` (`rb`
        /// bytes each) and every row of `acts`.
        ///
        /// # Safety
        /// The CPU must have `$features` (the parent module's `available()`).
        #[target_feature(enable = $features)]
        pub unsafe fn fill(ty: QuantType, w: &[u8], rb: usize, acts: &Q8Rows, t: &mut [f32]) {
            match ty {
                // SAFETY: the caller guarantees the CPU features.
                QuantType::Q4_1 => unsafe { fill_typed::<true>(w, rb, acts, t) },
                // SAFETY: the caller guarantees the CPU features.
                QuantType::Q8_0 => unsafe { fill_typed::<false>(w, rb, acts, t) },
            }
        }

        /// [`fill`] for one block type.
        ///
        /// # Safety
        /// The CPU must have `$features` (the parent module's `available()`).
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn fill_typed<const Q4: bool>(w: &[u8], rb: usize, acts: &Q8Rows, t: &mut [f32]) {
            let m = acts.rows();
            let row = |j: usize| &w[j * rb..(j + 1) * rb];
            if m == 1 {
                let a = acts.row(0);
                for (j, o) in t.iter_mut().enumerate() {
                    // SAFETY: the caller guarantees the CPU features.
                    *o = unsafe { $single::<Q4>(row(j), a) };
                }
                return;
            }
            for (j, o) in t.chunks_exact_mut(m).enumerate() {
                let w0 = row(j);
                let mut i = 0;
                while i + 4 <= m {
                    let a = [
                        acts.row(i),
                        acts.row(i + 1),
                        acts.row(i + 2),
                        acts.row(i + 3),
                    ];
                    // SAFETY: the caller guarantees the CPU features.
                    o[i..i + 4].copy_from_slice(&unsafe { multi::<Q4, 4>(w0, a) });
                    i += 4;
                }
                let rest = &mut o[i..];
                match rest.len() {
                    3 => {
                        let a = [acts.row(i), acts.row(i + 1), acts.row(i + 2)];
                        // SAFETY: the caller guarantees the CPU features.
                        rest.copy_from_slice(&unsafe { multi::<Q4, 3>(w0, a) });
                    }
                    2 => {
                        let a = [acts.row(i), acts.row(i + 1)];
                        // SAFETY: the caller guarantees the CPU features.
                        rest.copy_from_slice(&unsafe { multi::<Q4, 2>(w0, a) });
                    }
                    1 => {
                        // SAFETY: the caller guarantees the CPU features.
                        rest[0] = unsafe { multi::<Q4, 1>(w0, [acts.row(i)]) }[0];
                    }
                    _ => {}
                }
            }
        }
    };
}
pub(super) use int_kernels;

/// The loops, with `maddubs` + `madd`.
mod loops {
    use super::lanes;

    int_kernels!("avx2,fma,f16c", single);
}
pub use loops::fill;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hsum_adds_lanes_in_the_scalar_order() {
        if !available() {
            return;
        }
        let lanes = [1e8f32, 1.0, -1e8, 3.0, 0.5, 7.0, 2.0, -0.25];
        // SAFETY: AVX2 / FMA / F16C checked above; `lanes` is 8 readable f32.
        let got = unsafe {
            let v = std::arch::x86_64::_mm256_loadu_ps(lanes.as_ptr());
            hsum(v)
        };
        assert_eq!(got.to_bits(), super::super::q8::hsum8(lanes).to_bits());
    }
}
