//! AVX2 kernels of the integer dot products (x86_64, AVX2 + FMA + F16C checked at run time).
//!
//! One 32-value block per iteration: the weight's values as 32 bytes (Q4_1: the 16 low nibbles,
//! then the 16 high nibbles, unsigned; Q8_0: signed, made unsigned by moving its sign onto the
//! activation), `_mm256_maddubs_epi16` against the 32 activation bytes (pairs of `u8 * i8`
//! products in `i16`: at most `2 * 128 * 127`, no saturation), `_mm256_madd_epi16` by ones to
//! eight `i32` lanes of four products, converted and fused-multiply-added with `d_w d_a` into
//! eight f32 lanes. [`super::q8`] mirrors this order exactly, so the results are equal.

use std::arch::x86_64::{
    __m128i, __m256, __m256i, _mm_add_ps, _mm_add_ss, _mm_cvtph_ps, _mm_cvtsi32_si128,
    _mm_cvtss_f32, _mm_loadu_si128, _mm_movehdup_ps, _mm_movehl_ps, _mm_shuffle_ps, _mm_srli_epi16,
    _mm256_and_si256, _mm256_castps256_ps128, _mm256_cvtepi32_ps, _mm256_extractf128_ps,
    _mm256_fmadd_ps, _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_set_m128i,
    _mm256_set1_epi8, _mm256_set1_epi16, _mm256_set1_ps, _mm256_setzero_ps, _mm256_sign_epi8,
};

use super::BLOCK;

/// Whether this CPU runs these kernels.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`, as [`super::q8::hsum8`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)))
}

/// The 32 activation bytes of block `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_act(q: &[i8], b: usize) -> __m256i {
    let block = &q[b * BLOCK..(b + 1) * BLOCK];
    // SAFETY: `block` is 32 readable bytes (the slice index above checked it); the load is
    // unaligned.
    unsafe { _mm256_loadu_si256(block.as_ptr().cast()) }
}

/// Q4_1 weight row . Q8 activation row; see [`super::q8::dot_q4_1`].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1(w: &[u8], q: &[i8], d: &[f32], s: &[f32]) -> f32 {
    let low = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let mut summ = 0.0f32;
    for (b, blk) in w.chunks_exact(20).enumerate() {
        let dm = u32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
        // [d_w, m_w, 0, 0]: both halves converted at once.
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm as i32));
        let (dw, mw) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
        let packed = &blk[4..20];
        // SAFETY: `packed` is 16 readable bytes; the load is unaligned.
        let nib: __m128i = unsafe { _mm_loadu_si128(packed.as_ptr().cast()) };
        let qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), low);
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, load_act(q, b)), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[b]), _mm256_cvtepi32_ps(p), acc);
        summ += mw * s[b];
    }
    hsum(acc) + summ
}

/// Q8_0 weight row . Q8 activation row; see [`super::q8::dot_q8_0`].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0(w: &[u8], q: &[i8], d: &[f32]) -> f32 {
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for (b, blk) in w.chunks_exact(34).enumerate() {
        let dw = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
            u16::from_le_bytes([blk[0], blk[1]]),
        ))));
        let vals = &blk[2..34];
        // SAFETY: `vals` is 32 readable bytes; the load is unaligned.
        let qw: __m256i = unsafe { _mm256_loadu_si256(vals.as_ptr().cast()) };
        // |q_w| (unsigned; -128 becomes 128) times q_a with q_w's sign (q_a is in -127..=127).
        let qa = load_act(q, b);
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
        let p = _mm256_madd_epi16(p, ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[b]), _mm256_cvtepi32_ps(p), acc);
    }
    hsum(acc)
}
