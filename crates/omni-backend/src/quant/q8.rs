//! Activations quantized to Q8 blocks, and the portable integer dot products against weight
//! blocks.
//!
//! Each 32 values `x` of an activation row become `q = round(x / d)` (`i8` in `-127..=127`)
//! with `d = max|x| / 127`, and `s = d * sum(q)` (llama.cpp's Q8_1; Q4_1's `m` term needs it).
//! The rounding error of a value is at most `d / 2`, so a dot product with weights `w` is off
//! by at most `sum |w_j| d_b / 2` over blocks `b` (the tests check against that bound).
//!
//! The scalar kernels add up each block as the AVX2 kernels do — eight lanes of four products,
//! `lane = fma(d_w d_a, lane_sum, lane)` in accumulator groups ([`SINGLE_ROW_GROUPS`]), then
//! `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` — so both give the same bits (integer
//! sums are exact; the float operations are the same in the same order).

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

    /// Row `i`.
    pub fn row(&self, i: usize) -> Q8Row<'_> {
        let nb = self.k / BLOCK;
        Q8Row {
            q: &self.qs[i * self.k..(i + 1) * self.k],
            d: &self.d[i * nb..(i + 1) * nb],
            s: &self.s[i * nb..(i + 1) * nb],
        }
    }

    /// Row `i` dequantized (`q * d`), for tests.
    pub fn dequantize_row(&self, i: usize) -> Vec<f32> {
        let Q8Row { q, d, .. } = self.row(i);
        q.iter()
            .enumerate()
            .map(|(j, &q)| f32::from(q) * d[j / BLOCK])
            .collect()
    }
}

/// One activation row of [`Q8Rows`]: `q.len() / 32` blocks.
#[derive(Debug, Clone, Copy)]
pub struct Q8Row<'a> {
    /// The values, 32 per block.
    pub q: &'a [i8],
    /// Each block's scale.
    pub d: &'a [f32],
    /// Each block's `d * sum(q)`.
    pub s: &'a [f32],
}

/// The lane order of the SIMD kernels' horizontal sum.
#[inline]
pub(crate) fn hsum8(l: [f32; 8]) -> f32 {
    let t = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// Accumulator groups of a batch-1 product: block `b` adds into group `b % 4`, so the SIMD
/// kernel has four independent FMA chains on one weight row (read front to back, which the
/// hardware prefetchers follow; interleaving rows instead halved the bandwidth from memory).
/// Products of several activation rows keep one group per pair: the rows give the chains.
pub const SINGLE_ROW_GROUPS: usize = 4;

/// Adds one block's eight lane sums (`lane = elements 4i..4i+4`) times `scale` into `acc`.
#[inline]
fn add_lanes(acc: &mut [f32; 8], scale: f32, prod: impl Fn(usize) -> i32) {
    for (lane, a) in acc.iter_mut().enumerate() {
        let sum: i32 = (lane * 4..lane * 4 + 4).map(&prod).sum();
        *a = scale.mul_add(sum as f32, *a);
    }
}

/// The groups' lanes added as `(g0 + g1) + (g2 + g3)` (one group: itself), then [`hsum8`];
/// plus the `m` terms' groups in the same order.
fn combine(acc: &[[f32; 8]; 4], summ: &[f32; 4], groups: usize, with_m: bool) -> f32 {
    let (lanes, m) = if groups == 1 {
        (acc[0], summ[0])
    } else {
        let mut l = [0.0f32; 8];
        for (i, l) in l.iter_mut().enumerate() {
            *l = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
        }
        (l, (summ[0] + summ[1]) + (summ[2] + summ[3]))
    };
    if with_m {
        hsum8(lanes) + m
    } else {
        hsum8(lanes)
    }
}

/// Q4_1 weight row (20-byte blocks) . Q8 activation row: `sum_b d_w d_a sum(nibble q_a) + m_w s_a`,
/// over `groups` (1 or [`SINGLE_ROW_GROUPS`]) accumulator groups.
pub fn dot_q4_1(w: &[u8], Q8Row { q, d, s }: Q8Row<'_>, groups: usize) -> f32 {
    debug_assert!(groups == 1 || groups == SINGLE_ROW_GROUPS);
    let mut acc = [[0.0f32; 8]; 4];
    let mut summ = [0.0f32; 4];
    for (b, blk) in w.chunks_exact(20).enumerate() {
        let g = b % groups;
        let (dw, mw) = (half_at(blk, 0), half_at(blk, 2));
        let qa = &q[b * BLOCK..(b + 1) * BLOCK];
        let nibble = |e: usize| {
            if e < 16 {
                blk[4 + e] & 0x0f
            } else {
                blk[4 + e - 16] >> 4
            }
        };
        add_lanes(&mut acc[g], dw * d[b], |e| {
            i32::from(nibble(e)) * i32::from(qa[e])
        });
        summ[g] += mw * s[b];
    }
    combine(&acc, &summ, groups, true)
}

/// Q8_0 weight row (34-byte blocks) . Q8 activation row: `sum_b d_w d_a sum(q_w q_a)`, over
/// `groups` accumulator groups.
pub fn dot_q8_0(w: &[u8], Q8Row { q, d, .. }: Q8Row<'_>, groups: usize) -> f32 {
    debug_assert!(groups == 1 || groups == SINGLE_ROW_GROUPS);
    let mut acc = [[0.0f32; 8]; 4];
    for (b, blk) in w.chunks_exact(34).enumerate() {
        let qa = &q[b * BLOCK..(b + 1) * BLOCK];
        add_lanes(&mut acc[b % groups], half_at(blk, 0) * d[b], |e| {
            i32::from(blk[2 + e] as i8) * i32::from(qa[e])
        });
    }
    combine(&acc, &[0.0; 4], groups, false)
}
