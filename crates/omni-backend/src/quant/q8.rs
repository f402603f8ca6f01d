//! Activations quantized to Q8 blocks, and the portable integer dot products against weight
//! blocks.
//!
//! Each 32 values `x` of an activation row become `q = round(x / d)` (`i8` in `-127..=127`)
//! with `d = max|x| / 127`, and `s = d * sum(q)` (llama.cpp's Q8_1; Q4_1's `m` term needs it).
//! The rounding error of a value is at most `d / 2`, so a dot product with weights `w` is off
//! by at most `sum |w_j| d_b / 2` over blocks `b` (the tests check against that bound).
//!
//! The scalar kernels add up each block as the AVX2 kernels do — eight lanes of four products,
//! `lane = fma(d_w d_a, lane_sum, lane)`, then `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`
//! — so both give the same bits (integer sums are exact; the float operations are the same in
//! the same order).

use super::{BLOCK, half_at};

/// `m` activation rows of `k` values as Q8 blocks: values, a scale per block and, per block,
/// `d * sum(q)`.
#[derive(Debug, Clone, Default)]
pub struct Q8Rows {
    k: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Q8Rows {
    /// Quantizes `a` (`[m, k]`, `k` a multiple of 32) block by block.
    pub fn quantize(a: &[f32], m: usize, k: usize) -> Self {
        debug_assert!(k.is_multiple_of(BLOCK) && a.len() == m * k);
        let nb = a.len() / BLOCK;
        let mut out = Self {
            k,
            qs: vec![0; a.len()],
            d: Vec::with_capacity(nb),
            s: Vec::with_capacity(nb),
        };
        for (x, q) in a.chunks_exact(BLOCK).zip(out.qs.chunks_exact_mut(BLOCK)) {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in q.iter_mut().zip(x) {
                *q = (v * id).round().clamp(-127.0, 127.0) as i8;
                sum += i32::from(*q);
            }
            out.d.push(d);
            out.s.push(d * sum as f32);
        }
        out
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.qs.len() / self.k.max(1)
    }

    /// Row `i`: its values, its block scales, its block `d * sum(q)`.
    pub fn row(&self, i: usize) -> (&[i8], &[f32], &[f32]) {
        let nb = self.k / BLOCK;
        (
            &self.qs[i * self.k..(i + 1) * self.k],
            &self.d[i * nb..(i + 1) * nb],
            &self.s[i * nb..(i + 1) * nb],
        )
    }

    /// Row `i` dequantized (`q * d`), for tests.
    pub fn dequantize_row(&self, i: usize) -> Vec<f32> {
        let (q, d, _) = self.row(i);
        q.iter()
            .enumerate()
            .map(|(j, &q)| f32::from(q) * d[j / BLOCK])
            .collect()
    }
}

/// The lane order of the SIMD kernels' horizontal sum.
#[inline]
pub(crate) fn hsum8(l: [f32; 8]) -> f32 {
    let t = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// Adds one block's eight lane sums (`lane = elements 4i..4i+4`) times `scale` into `acc`.
#[inline]
fn add_lanes(acc: &mut [f32; 8], scale: f32, prod: impl Fn(usize) -> i32) {
    for (lane, a) in acc.iter_mut().enumerate() {
        let sum: i32 = (lane * 4..lane * 4 + 4).map(&prod).sum();
        *a = scale.mul_add(sum as f32, *a);
    }
}

/// Q4_1 weight row (20-byte blocks) . Q8 activation row: `sum_b d_w d_a sum(nibble q_a) + m_w s_a`.
pub fn dot_q4_1(w: &[u8], q: &[i8], d: &[f32], s: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut summ = 0.0f32;
    for (b, blk) in w.chunks_exact(20).enumerate() {
        let (dw, mw) = (half_at(blk, 0), half_at(blk, 2));
        let qa = &q[b * BLOCK..(b + 1) * BLOCK];
        let nibble = |e: usize| {
            if e < 16 {
                blk[4 + e] & 0x0f
            } else {
                blk[4 + e - 16] >> 4
            }
        };
        add_lanes(&mut acc, dw * d[b], |e| {
            i32::from(nibble(e)) * i32::from(qa[e])
        });
        summ += mw * s[b];
    }
    hsum8(acc) + summ
}

/// Q8_0 weight row (34-byte blocks) . Q8 activation row: `sum_b d_w d_a sum(q_w q_a)`.
pub fn dot_q8_0(w: &[u8], q: &[i8], d: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, blk) in w.chunks_exact(34).enumerate() {
        let qa = &q[b * BLOCK..(b + 1) * BLOCK];
        add_lanes(&mut acc, half_at(blk, 0) * d[b], |e| {
            i32::from(blk[2 + e] as i8) * i32::from(qa[e])
        });
    }
    hsum8(acc)
}
