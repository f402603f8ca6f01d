//! Helpers the unit tests of this crate share.

use crate::ops::softmax_inplace;

/// `n` deterministic values in about `[-1.6, 1.6]`, different for each `seed`.
pub(crate) fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 31 + seed * 17) % 23) as f32 - 11.0) / 7.0)
        .collect()
}

/// The largest absolute element-wise difference of `a` and `b` (of equal lengths).
pub(crate) fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The geometry of [`naive_attention`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct NaiveHeads {
    /// Tokens.
    pub t: usize,
    /// Query heads.
    pub nh: usize,
    /// Key/value heads (divides `nh`).
    pub nkv: usize,
    /// Elements per head.
    pub hd: usize,
}

/// Attention written out pair by pair, for comparison: `q` `[t, nh, hd]` over `k`, `v`
/// `[t, nkv, hd]` (query head `h` reads KV head `h / (nh / nkv)`), scores scaled by `scale`; key
/// `j` is seen by query `i` iff `visible(i, j)` (at least one key per query).
pub(crate) fn naive_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: NaiveHeads,
    scale: f32,
    visible: impl Fn(usize, usize) -> bool,
) -> Vec<f32> {
    let NaiveHeads { t, nh, nkv, hd } = s;
    let mut out = vec![0.0; t * nh * hd];
    for h in 0..nh {
        let g = h / (nh / nkv);
        for i in 0..t {
            let mut p: Vec<f32> = (0..t)
                .map(|j| {
                    if visible(i, j) {
                        scale
                            * (0..hd)
                                .map(|d| q[(i * nh + h) * hd + d] * k[(j * nkv + g) * hd + d])
                                .sum::<f32>()
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            softmax_inplace(&mut p);
            for (j, pj) in p.iter().enumerate() {
                for d in 0..hd {
                    out[(i * nh + h) * hd + d] += pj * v[(j * nkv + g) * hd + d];
                }
            }
        }
    }
    out
}
