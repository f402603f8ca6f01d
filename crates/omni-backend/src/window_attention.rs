//! Dense causal attention over one whole sequence, optionally within a sliding window, without a
//! KV cache (a vocoder's pre-transformer decodes each window in one pass).
//!
//! Key `j` is visible to query `i` iff `i - window < j <= i` (Hugging Face
//! `sliding_window_overlay` with the causal mask); with no window, iff `j <= i`. Grouped-query:
//! query head `h` reads KV head `h / (num_heads / num_kv_heads)`. Work is split over (head,
//! block of queries) on the rayon pool; each block multiplies only against the keys its window
//! reaches, so the cost is `O(len * window)`, not `O(len^2)`.

use crate::dense_attention::{DenseInputs, Tile, TokenLayout, attend_tiles};
use crate::{Error, Result, check_len};

/// Queries per task.
const QUERY_BLOCK: usize = 64;

/// The geometry of a [`causal_window_attention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowAttentionShape {
    /// Tokens in the sequence.
    pub seq_len: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (divides `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Keys per query including itself (`Some(w)`: `i - w < j <= i`), or `None` for full causal.
    pub window: Option<usize>,
}

/// Attention of `q` (`[seq_len, num_heads, head_dim]`) over `k` and `v` (`[seq_len,
/// num_kv_heads, head_dim]`) into `out` (like `q`), scores scaled by `scale`.
pub fn causal_window_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &WindowAttentionShape,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let &WindowAttentionShape {
        seq_len: t,
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        window,
    } = shape;
    if nkv == 0 || !nh.is_multiple_of(nkv) || window == Some(0) {
        return Err(Error::Metadata(format!(
            "invalid window attention {shape:?}"
        )));
    }
    check_len("window attention query", q.len(), t * nh * hd)?;
    check_len("window attention key", k.len(), t * nkv * hd)?;
    check_len("window attention value", v.len(), t * nkv * hd)?;
    check_len("window attention out", out.len(), t * nh * hd)?;
    let window = window.unwrap_or(t.max(1));
    let group = nh / nkv;
    let (q_row, kv_row) = (nh * hd, nkv * hd);
    let blocks = t.div_ceil(QUERY_BLOCK);
    let tiles: Vec<Tile> = (0..nh)
        .flat_map(|head| {
            (0..blocks).map(move |b| {
                let i0 = b * QUERY_BLOCK;
                let i1 = (i0 + QUERY_BLOCK).min(t);
                // Keys the block's windows reach: (i0 - window, i1).
                let j0 = (i0 + 1).saturating_sub(window);
                Tile {
                    head,
                    kv_head: head / group,
                    q_start: i0,
                    rows: i1 - i0,
                    k_start: j0,
                    cols: i1 - j0,
                }
            })
        })
        .collect();
    let inputs = DenseInputs {
        q,
        k,
        v,
        layout: TokenLayout {
            head_dim: hd,
            q_row,
            kv_row,
        },
        scale,
    };
    // Query `i` sees keys `i + 1 - window..=i`, columns relative to the tile's first key.
    let mask = |tile: &Tile, r: usize, row: &mut [f32]| {
        let i = tile.q_start + r;
        let first = (i + 1).saturating_sub(window) - tile.k_start;
        let last = i - tile.k_start;
        row[..first].fill(f32::NEG_INFINITY);
        row[last + 1..].fill(f32::NEG_INFINITY);
    };
    attend_tiles(&inputs, &tiles, mask, out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::test_util::{NaiveHeads, data, max_diff, naive_attention};

    /// Every (query, key) pair written out, masked by the window.
    fn naive(q: &[f32], k: &[f32], v: &[f32], s: &WindowAttentionShape, scale: f32) -> Vec<f32> {
        let heads = NaiveHeads {
            t: s.seq_len,
            nh: s.num_heads,
            nkv: s.num_kv_heads,
            hd: s.head_dim,
        };
        let w = s.window.unwrap_or(usize::MAX);
        naive_attention(q, k, v, heads, scale, |i, j| j <= i && i - j < w)
    }

    #[test]
    fn matches_naive_masked_attention_across_block_edges() {
        for (t, window) in [
            (1, Some(3)),
            (5, Some(1)),
            (9, None),
            (150, Some(72)),
            (130, None),
        ] {
            let s = WindowAttentionShape {
                seq_len: t,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 8,
                window,
            };
            let q = data(t * 4 * 8, 1);
            let k = data(t * 2 * 8, 2);
            let v = data(t * 2 * 8, 3);
            let mut got = vec![0.0; q.len()];
            causal_window_attention(&q, &k, &v, &s, 0.35, &mut got).unwrap();
            let want = naive(&q, &k, &v, &s, 0.35);
            let err = max_diff(&got, &want);
            assert!(err < 1e-5, "t {t} window {window:?}: {err}");
        }
    }

    #[test]
    fn window_of_one_returns_own_value() {
        let s = WindowAttentionShape {
            seq_len: 3,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            window: Some(1),
        };
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = vec![0.0; 12];
        causal_window_attention(&[0.3; 12], &[0.1; 6], &v, &s, 1.0, &mut out).unwrap();
        assert_eq!(out, [1., 2., 1., 2., 3., 4., 3., 4., 5., 6., 5., 6.]);
    }

    #[test]
    fn bad_geometry_is_rejected() {
        let s = WindowAttentionShape {
            seq_len: 2,
            num_heads: 3,
            num_kv_heads: 2,
            head_dim: 1,
            window: None,
        };
        assert!(
            causal_window_attention(&[0.0; 6], &[0.0; 4], &[0.0; 4], &s, 1.0, &mut [0.0; 6])
                .is_err()
        );
    }
}
