//! Bidirectional attention over packed variable-length segments without a KV cache (the encoder
//! towers of a multimodal model: each image, video frame or audio window attends only within
//! itself, like flash-attention's `cu_seqlens`).
//!
//! Tokens `cu_seqlens[s]..cu_seqlens[s + 1]` form segment `s`; query `i` of a segment sees every
//! key of that segment and no other. Work is split over (segment, head) on the rayon pool, and
//! each pair is two products: scores `Q K^T * scale`, a softmax per row, then `P V`.

use rayon::prelude::*;

use crate::linalg::{MatMut, MatRef, Threads, gemm_strided};
use crate::ops::softmax_inplace;
use crate::{Error, Result, check_len};

/// The head geometry of [`segment_attention`] (as many key/value heads as query heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// Heads.
    pub num_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// Attention of `q`, `k`, `v` (`[tokens, num_heads, head_dim]` each) into `out` (like `q`),
/// within the segments of `cu_seqlens` (`[0, .., tokens]`, non-decreasing), scores scaled by
/// `scale`.
pub fn segment_attention<'a>(
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    cu_seqlens: &[usize],
    heads: HeadShape,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let HeadShape {
        num_heads,
        head_dim,
    } = heads;
    let tokens = cu_seqlens.last().copied().unwrap_or(0);
    if cu_seqlens.first() != Some(&0) || cu_seqlens.windows(2).any(|w| w[1] < w[0]) {
        return Err(Error::Metadata(format!(
            "cu_seqlens {cu_seqlens:?}: non-decreasing from 0 expected"
        )));
    }
    let row = num_heads * head_dim;
    check_len("segment attention query", q.len(), tokens * row)?;
    check_len("segment attention key", k.len(), tokens * row)?;
    check_len("segment attention value", v.len(), tokens * row)?;
    check_len("segment attention out", out.len(), tokens * row)?;
    let tasks: Vec<(usize, usize, usize)> = cu_seqlens
        .windows(2)
        .filter(|w| w[1] > w[0])
        .flat_map(|w| (0..num_heads).map(move |h| (w[0], w[1] - w[0], h)))
        .collect();
    let results: Vec<Result<Vec<f32>>> = tasks
        .par_iter()
        .map(|&(start, len, h)| {
            let at = start * row + h * head_dim;
            let strided = |data: &'a [f32]| MatRef {
                data: &data[at..],
                rows: len,
                cols: head_dim,
                rs: row,
                cs: 1,
            };
            let mut scores = vec![0.0f32; len * len];
            gemm_strided(
                MatMut::row_major(&mut scores, len, len),
                strided(q),
                strided(k).t(),
                scale,
                false,
                Threads::Single,
            )?;
            scores.chunks_exact_mut(len).for_each(softmax_inplace);
            let mut o = vec![0.0f32; len * head_dim];
            gemm_strided(
                MatMut::row_major(&mut o, len, head_dim),
                MatRef::row_major(&scores, len, len),
                strided(v),
                1.0,
                false,
                Threads::Single,
            )?;
            Ok(o)
        })
        .collect();
    for (&(start, _, h), res) in tasks.iter().zip(results) {
        for (r, src) in res?.chunks_exact(head_dim).enumerate() {
            let dst = (start + r) * row + h * head_dim;
            out[dst..dst + head_dim].copy_from_slice(src);
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn data(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 31 + seed * 17) % 23) as f32 - 11.0) / 7.0)
            .collect()
    }

    #[test]
    fn each_segment_attends_only_within_itself() {
        let (nh, hd) = (2, 4);
        let cu = [0, 3, 3, 8, 9];
        let t = 9;
        let (q, k, v) = (
            data(t * nh * hd, 1),
            data(t * nh * hd, 2),
            data(t * nh * hd, 3),
        );
        let mut got = vec![0.0; q.len()];
        segment_attention(
            &q,
            &k,
            &v,
            &cu,
            HeadShape {
                num_heads: nh,
                head_dim: hd,
            },
            0.5,
            &mut got,
        )
        .unwrap();
        let mut want = vec![0.0; q.len()];
        for w in cu.windows(2) {
            for h in 0..nh {
                for i in w[0]..w[1] {
                    let mut p: Vec<f32> = (w[0]..w[1])
                        .map(|j| {
                            0.5 * (0..hd)
                                .map(|d| q[(i * nh + h) * hd + d] * k[(j * nh + h) * hd + d])
                                .sum::<f32>()
                        })
                        .collect();
                    softmax_inplace(&mut p);
                    for (jj, pj) in p.iter().enumerate() {
                        for d in 0..hd {
                            want[(i * nh + h) * hd + d] += pj * v[((w[0] + jj) * nh + h) * hd + d];
                        }
                    }
                }
            }
        }
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-5, "{err}");
    }

    #[test]
    fn bad_boundaries_are_rejected() {
        const ONE: HeadShape = HeadShape {
            num_heads: 1,
            head_dim: 2,
        };
        let mut out = [0.0; 4];
        assert!(
            segment_attention(
                &[0.0; 4],
                &[0.0; 4],
                &[0.0; 4],
                &[0, 3, 2],
                ONE,
                1.0,
                &mut out
            )
            .is_err()
        );
        assert!(
            segment_attention(&[0.0; 4], &[0.0; 4], &[0.0; 4], &[1, 2], ONE, 1.0, &mut out)
                .is_err()
        );
    }
}
