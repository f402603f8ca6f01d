//! VNNI kernels of the integer dot products (x86_64, checked at run time): `dpbusd` sums four
//! adjacent `u8 * i8` products into each `i32` lane in one instruction, which is exactly what
//! [`super::avx2`]'s `maddubs` + `madd` by ones give (neither saturates here: a pair is at most
//! `2 * 255 * 127`), so every kernel here gives the scalar kernel's bits.
//!
//! - [`avx`]: AVX-VNNI (`_mm256_dpbusd_avx_epi32`), the AVX2 loops with one instruction less per
//!   block.
//! - [`avx512`]: AVX-512 VNNI. Batch 1 takes two blocks per 512-bit vector (`_mm512_dpbusd_epi32`):
//!   the low eight lanes are block `b`, the high eight block `b + 1`, so two accumulators
//!   `[g0 | g1]`, `[g2 | g3]` are the four accumulator groups of [`super::q8::SINGLE_ROW_GROUPS`],
//!   each lane receiving the same FMAs in the same order. Several rows use the 256-bit loops with
//!   the EVEX `_mm256_dpbusd_epi32`.

/// AVX-VNNI (256-bit, VEX): the AVX2 loops with `dpbusd`.
pub mod avx {
    /// Whether this CPU runs these kernels.
    pub fn available() -> bool {
        super::super::avx2::available() && is_x86_feature_detected!("avxvnni")
    }

    /// The loops.
    mod loops {
        use std::arch::x86_64::{
            __m256, __m256i, _mm256_cvtepi32_ps, _mm256_dpbusd_avx_epi32, _mm256_setzero_si256,
            _mm256_sign_epi8,
        };

        /// The eight `i32` lane sums of one block's products, as f32.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
        fn lanes<const Q4: bool>(qw: __m256i, qa: __m256i) -> __m256 {
            let (u, s) = if Q4 {
                (qw, qa)
            } else {
                // As the AVX2 kernel: |q_w| unsigned, q_a with q_w's sign.
                (_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw))
            };
            _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s))
        }

        crate::quant::avx2::int_kernels!("avx2,fma,f16c,avxvnni", single);
    }
    pub use loops::fill;
}

/// AVX-512 VNNI (with F, BW, VL): batch 1 two blocks per 512-bit vector.
pub mod avx512 {
    /// Whether this CPU runs these kernels.
    pub fn available() -> bool {
        super::super::avx2::available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
    }

    /// The loops.
    mod loops {
        use std::arch::x86_64::{
            __m256, __m256i, __m512, __m512i, _mm_loadu_si128, _mm256_broadcastsi128_si256,
            _mm256_castpd_ps, _mm256_cvtepi32_ps, _mm256_dpbusd_epi32, _mm256_setzero_si256,
            _mm256_sign_epi8, _mm512_abs_epi8, _mm512_and_si512, _mm512_castps_pd,
            _mm512_castps512_ps256, _mm512_castsi256_si512, _mm512_cvtepi32_ps,
            _mm512_dpbusd_epi32, _mm512_extractf64x4_pd, _mm512_fmadd_ps, _mm512_inserti64x4,
            _mm512_loadu_si512, _mm512_mask_mov_ps, _mm512_mask_srli_epi16, _mm512_mask_sub_epi8,
            _mm512_mask3_fmadd_ps, _mm512_movepi8_mask, _mm512_set1_epi8, _mm512_set1_ps,
            _mm512_setzero_ps, _mm512_setzero_si512, _mm512_zextsi256_si512,
        };

        /// The eight `i32` lane sums of one block's products, as f32 (256-bit, EVEX).
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        fn lanes<const Q4: bool>(qw: __m256i, qa: __m256i) -> __m256 {
            let (u, s) = if Q4 {
                (qw, qa)
            } else {
                (_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw))
            };
            _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s))
        }

        /// Blocks `b` and `b + 1` of the weight row at `w` (block `bb` bytes): their values as 64
        /// bytes (block `b` in the low half), and each block's `d` and `m`.
        ///
        /// # Safety
        /// The CPU must have AVX-512 F/BW/VL/VNNI and AVX2/FMA/F16C; both blocks must be inside
        /// the row.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn unpack2<const Q4: bool>(blk: *const u8) -> (__m512i, [f32; 2], [f32; 2]) {
            let bb = if Q4 { 20 } else { 34 };
            // SAFETY: the caller guarantees both blocks (`2 bb` bytes from `blk`) are readable;
            // every read below is inside one of them, unaligned.
            unsafe {
                let (d0, m0) = crate::quant::avx2::scales::<Q4>(blk);
                let (d1, m1) = crate::quant::avx2::scales::<Q4>(blk.add(bb));
                let q = if Q4 {
                    // [n0, n0, n1, n1] (16 bytes of nibbles each), the second and fourth
                    // shifted right by 4, then masked: [lo0, hi0, lo1, hi1], each block's
                    // 32 values in ggml's order.
                    let n0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(blk.add(4).cast()));
                    let n1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(blk.add(bb + 4).cast()));
                    let z = _mm512_inserti64x4(_mm512_castsi256_si512(n0), n1, 1);
                    let z = _mm512_mask_srli_epi16(z, 0xff00_ff00, z, 4);
                    _mm512_and_si512(z, _mm512_set1_epi8(0x0f))
                } else {
                    let q0 = _mm256_loadu_si256(blk.add(2).cast());
                    let q1 = _mm256_loadu_si256(blk.add(bb + 2).cast());
                    _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1)
                };
                (q, [d0, d1], [m0, m1])
            }
        }

        /// The sixteen `i32` lane sums of two blocks' products, as f32.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        fn lanes2<const Q4: bool>(qw: __m512i, qa: __m512i) -> __m512 {
            let (u, s) = if Q4 {
                (qw, qa)
            } else {
                // |q_w| (-128 stays 0x80, i.e. 128 unsigned) and q_a negated where q_w < 0.
                let neg = _mm512_movepi8_mask(qw);
                (
                    _mm512_abs_epi8(qw),
                    _mm512_mask_sub_epi8(qa, neg, _mm512_setzero_si512(), qa),
                )
            };
            _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s))
        }

        /// The high eight lanes of `v`.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        fn high(v: __m512) -> __m256 {
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))
        }

        /// One weight row against one activation row, as the 256-bit `single` (four groups:
        /// block `b` into group `b % 4`), two blocks per vector.
        ///
        /// # Safety
        /// The CPU must have AVX-512 F/BW/VL/VNNI and AVX2/FMA/F16C.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn single512<const Q4: bool>(w: &[u8], a: Q8Row<'_>) -> f32 {
            let bb = if Q4 { 20 } else { 34 };
            let nb = blocks::<Q4>(w, &[a]);
            // acc[0] = [g0 | g1], acc[1] = [g2 | g3].
            let mut acc = [_mm512_setzero_ps(); 2];
            let mut summ = [0.0f32; SINGLE_ROW_GROUPS];
            // Blocks `b`, `b + 1` (groups `g`, `g + 1`, `g` even) into `acc[g / 2]`; only the
            // low half when `half` (block `b + 1` is past the row's end).
            let mut pair = |b: usize, g: usize, half: bool| {
                // SAFETY: `b < nb`, and `b + 1 < nb` unless `half`: the blocks read are inside
                // `w` and `a` (`blocks` asserted their lengths); with `half` nothing of block
                // `b + 1` is read.
                let (qw, dw, mw, qa, da, sa) = unsafe {
                    let p = w.as_ptr().add(b * bb);
                    let q = a.q.as_ptr().add(b * BLOCK);
                    let (d0, s0) = (*a.d.get_unchecked(b), *a.s.get_unchecked(b));
                    if half {
                        let (qw, dw, mw) = unpack::<Q4>(p);
                        let qa = _mm256_loadu_si256(q.cast());
                        let z = _mm512_zextsi256_si512;
                        (z(qw), [dw, 0.0], [mw, 0.0], z(qa), [d0, 0.0], [s0, 0.0])
                    } else {
                        let (qw, dw, mw) = unpack2::<Q4>(p);
                        let (d1, s1) = (*a.d.get_unchecked(b + 1), *a.s.get_unchecked(b + 1));
                        (qw, dw, mw, _mm512_loadu_si512(q.cast()), [d0, d1], [s0, s1])
                    }
                };
                let scale = _mm512_mask_mov_ps(
                    _mm512_set1_ps(dw[0] * da[0]),
                    0xff00,
                    _mm512_set1_ps(dw[1] * da[1]),
                );
                let l = lanes2::<Q4>(qw, qa);
                let k = &mut acc[g / 2];
                // The half case leaves the high lanes (group `g + 1`) as they are.
                *k = if half {
                    _mm512_mask3_fmadd_ps(scale, l, *k, 0x00ff)
                } else {
                    _mm512_fmadd_ps(scale, l, *k)
                };
                if Q4 {
                    summ[g] += mw[0] * sa[0];
                    if !half {
                        summ[g + 1] += mw[1] * sa[1];
                    }
                }
            };
            let mut b = 0;
            while b + 4 <= nb {
                crate::quant::avx2::prefetch(w.as_ptr().wrapping_add(b * bb));
                crate::quant::avx2::prefetch(w.as_ptr().wrapping_add(b * bb + 64));
                pair(b, 0, false);
                pair(b + 2, 2, false);
                b += 4;
            }
            match nb - b {
                1 => pair(b, 0, true),
                2 => pair(b, 0, false),
                3 => {
                    pair(b, 0, false);
                    pair(b + 2, 2, true);
                }
                _ => {}
            }
            let g01 = _mm256_add_ps(_mm512_castps512_ps256(acc[0]), high(acc[0]));
            let g23 = _mm256_add_ps(_mm512_castps512_ps256(acc[1]), high(acc[1]));
            let l = _mm256_add_ps(g01, g23);
            if Q4 {
                hsum(l) + ((summ[0] + summ[1]) + (summ[2] + summ[3]))
            } else {
                hsum(l)
            }
        }

        crate::quant::avx2::int_kernels!(
            "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
            single512
        );
    }
    pub use loops::fill;
}
