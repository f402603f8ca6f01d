//! Bidirectional attention over packed variable-length segments without a KV cache (the encoder
//! towers of a multimodal model: each image, video frame or audio window attends only within
//! itself, like flash-attention's `cu_seqlens`).
//!
//! Tokens `cu_seqlens[s]..cu_seqlens[s + 1]` form segment `s`; query `i` of a segment sees every
//! key of that segment and no other. Work is split over (segment, head) on the rayon pool, and
//! each pair is two products (`dense_attention`): scores `Q K^T * scale`, a softmax per
//! row, then `P V`.

use crate::dense_attention::{DenseInputs, Tile, TokenLayout, attend_tiles};
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
pub fn segment_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
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
    let tiles: Vec<Tile> = cu_seqlens
        .windows(2)
        .filter(|w| w[1] > w[0])
        .flat_map(|w| {
            (0..num_heads).map(move |head| Tile {
                head,
                kv_head: head,
                q_start: w[0],
                rows: w[1] - w[0],
                k_start: w[0],
                cols: w[1] - w[0],
            })
        })
        .collect();
    let inputs = DenseInputs {
        q,
        k,
        v,
        layout: TokenLayout {
            head_dim,
            q_row: row,
            kv_row: row,
        },
        scale,
    };
    attend_tiles(&inputs, &tiles, |_, _, _| {}, out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::test_util::{NaiveHeads, data, max_diff, naive_attention};

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
        // Token `i` lies in segment `seg[i]`.
        let seg: Vec<usize> = cu
            .windows(2)
            .enumerate()
            .flat_map(|(s, w)| std::iter::repeat_n(s, w[1] - w[0]))
            .collect();
        let heads = NaiveHeads { t, nh, nkv: nh, hd };
        let want = naive_attention(&q, &k, &v, heads, 0.5, |i, j| seg[i] == seg[j]);
        let err = max_diff(&got, &want);
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
