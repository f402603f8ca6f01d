//! The core that [`crate::varlen_attention`] and [`crate::window_attention`] share: dense
//! attention over tiles of (query block, key range) of one head, without a KV cache.
//!
//! Each [`Tile`] is two products on one rayon task: scores `Q K^T * scale`, a caller's mask and a
//! softmax per row, then `P V`. The tiles' outputs are then written into `out`, row `r` of a tile
//! at token `q_start + r`, head `head`.

use rayon::prelude::*;

use crate::linalg::{MatMut, MatRef, Threads, gemm_strided};
use crate::ops::softmax_inplace;
use crate::{Error, Result};

/// How tokens and heads lie in the `q` / `out` and `k` / `v` buffers (`[tokens, heads,
/// head_dim]` row-major each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TokenLayout {
    /// Elements per head.
    pub head_dim: usize,
    /// Elements per token of `q` and `out` (`num_heads * head_dim`).
    pub q_row: usize,
    /// Elements per token of `k` and `v` (`num_kv_heads * head_dim`).
    pub kv_row: usize,
}

/// What every tile reads: the three buffers, their layout and the score scale.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DenseInputs<'a> {
    /// Queries, `[tokens, num_heads, head_dim]`.
    pub q: &'a [f32],
    /// Keys, `[tokens, num_kv_heads, head_dim]`.
    pub k: &'a [f32],
    /// Values, like `k`.
    pub v: &'a [f32],
    /// How tokens and heads lie in them.
    pub layout: TokenLayout,
    /// Factor on `Q K^T`.
    pub scale: f32,
}

/// One task: queries `q_start..q_start + rows` of query head `head` against keys
/// `k_start..k_start + cols` of KV head `kv_head`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tile {
    /// Query head (also the head written in `out`).
    pub head: usize,
    /// Key/value head it reads.
    pub kv_head: usize,
    /// First query token.
    pub q_start: usize,
    /// Query tokens.
    pub rows: usize,
    /// First key token.
    pub k_start: usize,
    /// Key tokens.
    pub cols: usize,
}

/// A `rows x head_dim` strided view of one head, from token `start` of `data`.
fn head_view<'a>(
    data: &'a [f32],
    start: usize,
    head: usize,
    rows: usize,
    layout: TokenLayout,
    row: usize,
) -> Result<MatRef<'a>> {
    let at = start * row + head * layout.head_dim;
    let data = data.get(at..).ok_or_else(|| {
        Error::Metadata(format!("attention tile at element {at} of {}", data.len()))
    })?;
    Ok(MatRef {
        data,
        rows,
        cols: layout.head_dim,
        rs: row,
        cs: 1,
    })
}

/// The `rows x head_dim` output of one tile; `mask(tile, r, scores)` may set the scores of query
/// row `r` to `-inf` before its softmax.
fn attend_tile<M>(inputs: &DenseInputs<'_>, tile: &Tile, mask: &M) -> Result<Vec<f32>>
where
    M: Fn(&Tile, usize, &mut [f32]),
{
    let &Tile {
        head,
        kv_head,
        q_start,
        rows,
        k_start,
        cols,
    } = tile;
    let DenseInputs {
        q,
        k,
        v,
        layout,
        scale,
    } = *inputs;
    let hd = layout.head_dim;
    let mut scores = vec![0.0f32; rows * cols];
    gemm_strided(
        MatMut::row_major(&mut scores, rows, cols),
        head_view(q, q_start, head, rows, layout, layout.q_row)?,
        head_view(k, k_start, kv_head, cols, layout, layout.kv_row)?.t(),
        scale,
        false,
        Threads::Single,
    )?;
    for (r, row) in scores.chunks_exact_mut(cols).enumerate() {
        mask(tile, r, row);
        softmax_inplace(row);
    }
    let mut o = vec![0.0f32; rows * hd];
    gemm_strided(
        MatMut::row_major(&mut o, rows, hd),
        MatRef::row_major(&scores, rows, cols),
        head_view(v, k_start, kv_head, cols, layout, layout.kv_row)?,
        1.0,
        false,
        Threads::Single,
    )?;
    Ok(o)
}

/// Every tile of `tiles` on the rayon pool, written into `out`; the first failing tile's error
/// (in `tiles` order) is returned. The callers check the buffer lengths; tiles with no rows or no
/// keys must not be passed.
pub(crate) fn attend_tiles<M>(
    inputs: &DenseInputs<'_>,
    tiles: &[Tile],
    mask: M,
    out: &mut [f32],
) -> Result<()>
where
    M: Fn(&Tile, usize, &mut [f32]) + Sync,
{
    let results: Vec<Result<Vec<f32>>> = tiles
        .par_iter()
        .map(|tile| attend_tile(inputs, tile, &mask))
        .collect();
    let TokenLayout {
        head_dim: hd,
        q_row,
        ..
    } = inputs.layout;
    for (tile, res) in tiles.iter().zip(results) {
        for (r, src) in res?.chunks_exact(hd).enumerate() {
            let dst = (tile.q_start + r) * q_row + tile.head * hd;
            let dst = out
                .get_mut(dst..dst + hd)
                .ok_or_else(|| Error::Metadata(format!("attention output row at element {dst}")))?;
            dst.copy_from_slice(src);
        }
    }
    Ok(())
}
