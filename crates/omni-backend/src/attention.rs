//! Paged attention over a block-based KV cache, with vLLM's metadata names.
//!
//! One [`LayerKvCache`] per layer holds K and V, each `[num_blocks, block_size, num_kv_heads,
//! head_dim]`. A forward step first writes the new tokens' K/V with [`reshape_and_cache`] (token
//! `t` goes to slot `slot_mapping[t] = block * block_size + offset`), then [`paged_attention`]
//! reads each sequence's context through its block table.
//!
//! The batch is flat: sequence `s` owns query tokens `query_start_loc[s]..query_start_loc[s + 1]`
//! and has `seq_lens[s]` tokens of context including those new ones, so its queries sit at
//! positions `seq_lens[s] - query_len ..seq_lens[s]`. That covers full prefills (query length =
//! context length), chunked prefills that start mid-prompt, and 1-token decodes in one batch.
//! Query `i` of a chunk sees context positions `0..=start + i` (causal inside the chunk). Grouped
//! query attention maps query head `h` to KV head `h / (num_heads / num_kv_heads)`.

use crate::linalg::{MatMut, MatRef, Threads, gemm_strided};
use crate::ops::softmax_inplace;
use crate::{Error, Result};

/// The K and V blocks of one layer (on one tensor-parallel rank: its local KV heads only).
#[derive(Debug, Clone)]
pub struct LayerKvCache {
    /// `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub k: Vec<f32>,
    /// Same layout as `k`.
    pub v: Vec<f32>,
    /// Number of blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads held here.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl LayerKvCache {
    /// A zeroed cache.
    pub fn new(num_blocks: usize, block_size: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        let n = num_blocks * block_size * num_kv_heads * head_dim;
        Self {
            k: vec![0.0; n],
            v: vec![0.0; n],
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
        }
    }

    /// Bytes one block takes in one layer (K and V, f32).
    pub fn bytes_per_block(block_size: usize, num_kv_heads: usize, head_dim: usize) -> usize {
        2 * block_size * num_kv_heads * head_dim * std::mem::size_of::<f32>()
    }

    fn slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// Per-step attention metadata, named as in vLLM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttentionMetadata {
    /// Cache slot (`block * block_size + offset`) of each new token; negative = padding, skipped.
    pub slot_mapping: Vec<i64>,
    /// Per sequence, the block ids holding its context in order.
    pub block_tables: Vec<Vec<u32>>,
    /// Per sequence, context length including this step's new tokens.
    pub seq_lens: Vec<usize>,
    /// Prefix sums of query lengths: `num_seqs + 1` entries starting at 0.
    pub query_start_loc: Vec<usize>,
}

impl AttentionMetadata {
    /// Number of sequences.
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Total number of new tokens.
    pub fn num_tokens(&self) -> usize {
        self.query_start_loc.last().copied().unwrap_or(0)
    }

    /// Checks lengths and prefix sums against each other and a cache geometry.
    pub fn validate(&self, block_size: usize, num_blocks: usize) -> Result<()> {
        let n = self.num_seqs();
        let bad = |m: String| Err(Error::Metadata(m));
        if self.query_start_loc.len() != n + 1 || self.block_tables.len() != n {
            return bad(format!(
                "{} seq_lens, {} block tables, {} query_start_loc entries",
                n,
                self.block_tables.len(),
                self.query_start_loc.len()
            ));
        }
        if self.query_start_loc.first() != Some(&0) {
            return bad("query_start_loc must start at 0".into());
        }
        if self.slot_mapping.len() != self.num_tokens() {
            return bad(format!(
                "{} slots for {} tokens",
                self.slot_mapping.len(),
                self.num_tokens()
            ));
        }
        for s in 0..n {
            let (a, b) = (self.query_start_loc[s], self.query_start_loc[s + 1]);
            if b < a || b - a > self.seq_lens[s] {
                return bad(format!(
                    "sequence {s}: query {a}..{b} longer than context {}",
                    self.seq_lens[s]
                ));
            }
            let need = self.seq_lens[s].div_ceil(block_size);
            let table = &self.block_tables[s];
            if table.len() < need {
                return bad(format!(
                    "sequence {s}: {} blocks for {} tokens",
                    table.len(),
                    self.seq_lens[s]
                ));
            }
            if let Some(&blk) = table[..need].iter().find(|&&b| b as usize >= num_blocks) {
                return bad(format!("sequence {s}: block {blk} out of {num_blocks}"));
            }
        }
        Ok(())
    }
}

/// Writes new tokens' `k` and `v` (`[tokens, num_kv_heads, head_dim]`) into their cache slots.
pub fn reshape_and_cache(
    k: &[f32],
    v: &[f32],
    slot_mapping: &[i64],
    cache: &mut LayerKvCache,
) -> Result<()> {
    let row = cache.num_kv_heads * cache.head_dim;
    crate::check_len("new keys", k.len(), slot_mapping.len() * row)?;
    crate::check_len("new values", v.len(), slot_mapping.len() * row)?;
    let slots = cache.slots();
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let slot = slot as usize;
        if slot >= slots {
            return Err(Error::Metadata(format!("slot {slot} out of {slots}")));
        }
        cache.k[slot * row..(slot + 1) * row].copy_from_slice(&k[t * row..(t + 1) * row]);
        cache.v[slot * row..(slot + 1) * row].copy_from_slice(&v[t * row..(t + 1) * row]);
    }
    Ok(())
}

/// Attention of `q` (`[tokens, num_heads, head_dim]`) over the paged cache into `out` (same
/// shape), with softmax scale `scale`. The new tokens' K/V must already be cached.
///
/// Work is split over (sequence, KV head) pairs on the rayon pool; inside one, the KV head's
/// context is gathered once into contiguous `[context, head_dim]` buffers and each query head of
/// the group does two products through `gemm` (scores, then weighted values).
pub fn paged_attention(
    q: &[f32],
    num_heads: usize,
    cache: &LayerKvCache,
    meta: &AttentionMetadata,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let (hd, nkv, bs) = (cache.head_dim, cache.num_kv_heads, cache.block_size);
    let tokens = meta.num_tokens();
    crate::check_len("attention query", q.len(), tokens * num_heads * hd)?;
    crate::check_len("attention out", out.len(), tokens * num_heads * hd)?;
    if nkv == 0 || !num_heads.is_multiple_of(nkv) {
        return Err(Error::Metadata(format!(
            "{num_heads} query heads over {nkv} KV heads"
        )));
    }
    meta.validate(bs, cache.num_blocks)?;
    let group = num_heads / nkv;
    let q_row = num_heads * hd;

    let tasks: Vec<(usize, usize)> = (0..meta.num_seqs())
        .flat_map(|s| (0..nkv).map(move |g| (s, g)))
        .filter(|&(s, _)| meta.query_start_loc[s + 1] > meta.query_start_loc[s])
        .collect();
    let task = |&(s, g): &(usize, usize)| -> Result<Vec<f32>> {
        let q0 = meta.query_start_loc[s];
        let qlen = meta.query_start_loc[s + 1] - q0;
        let ctx = meta.seq_lens[s];
        let start = ctx - qlen;
        let table = &meta.block_tables[s];
        let mut kbuf = vec![0.0f32; ctx * hd];
        let mut vbuf = vec![0.0f32; ctx * hd];
        for p in 0..ctx {
            let slot = table[p / bs] as usize * bs + p % bs;
            let src = (slot * nkv + g) * hd;
            kbuf[p * hd..(p + 1) * hd].copy_from_slice(&cache.k[src..src + hd]);
            vbuf[p * hd..(p + 1) * hd].copy_from_slice(&cache.v[src..src + hd]);
        }
        let mut scores = vec![0.0f32; qlen * ctx];
        let mut head_out = vec![0.0f32; group * qlen * hd];
        for hi in 0..group {
            let h = g * group + hi;
            let q_off = q0 * q_row + h * hd;
            gemm_strided(
                MatMut::row_major(&mut scores, qlen, ctx),
                MatRef {
                    data: &q[q_off..],
                    rows: qlen,
                    cols: hd,
                    rs: q_row,
                    cs: 1,
                },
                MatRef::row_major(&kbuf, ctx, hd).t(),
                scale,
                false,
                Threads::Single,
            )?;
            for (i, row) in scores.chunks_exact_mut(ctx).enumerate() {
                let visible = start + i + 1;
                row[visible..].fill(f32::NEG_INFINITY);
                softmax_inplace(row);
            }
            gemm_strided(
                MatMut::row_major(
                    &mut head_out[hi * qlen * hd..(hi + 1) * qlen * hd],
                    qlen,
                    hd,
                ),
                MatRef::row_major(&scores, qlen, ctx),
                MatRef::row_major(&vbuf, ctx, hd),
                1.0,
                false,
                Threads::Single,
            )?;
        }
        Ok(head_out)
    };
    // The spinning pool (a decode step runs one of these per layer, tens of µs apart: rayon's
    // threads would be asleep); each task fills its own slot.
    let slots: Vec<std::sync::OnceLock<Result<Vec<f32>>>> =
        tasks.iter().map(|_| std::sync::OnceLock::new()).collect();
    crate::spin_pool::SpinPool::global().run(tasks.len(), &|i| {
        let _ = slots[i].set(task(&tasks[i]));
    });
    let results = slots.into_iter().map(|slot| {
        slot.into_inner()
            .unwrap_or_else(|| Err(Error::Metadata("attention task did not run".into())))
    });

    for (&(s, g), res) in tasks.iter().zip(results) {
        let head_out = res?;
        let q0 = meta.query_start_loc[s];
        let qlen = meta.query_start_loc[s + 1] - q0;
        for hi in 0..group {
            let h = g * group + hi;
            for i in 0..qlen {
                let dst = (q0 + i) * q_row + h * hd;
                let src = (hi * qlen + i) * hd;
                out[dst..dst + hd].copy_from_slice(&head_out[src..src + hd]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::test_util::{NaiveHeads, data, max_diff, naive_attention};

    #[test]
    fn chunked_prefill_and_decode_match_dense_causal_attention() {
        let (t, nh, nkv, hd, bs) = (7, 4, 2, 8, 3);
        let q = data(t * nh * hd, 1);
        let k = data(t * nkv * hd, 2);
        let v = data(t * nkv * hd, 3);
        // Dense causal attention over the whole sequence.
        let heads = NaiveHeads { t, nh, nkv, hd };
        let want = naive_attention(&q, &k, &v, heads, 1.0 / (hd as f32).sqrt(), |i, j| j <= i);
        // Blocks deliberately out of order; positions 0..4 as one chunk, 4..6 as a second, then
        // one decode token.
        let table = vec![5u32, 1, 3];
        let slot = |p: usize| (table[p / bs] as usize * bs + p % bs) as i64;
        let mut cache = LayerKvCache::new(6, bs, nkv, hd);
        let mut got = vec![0.0; t * nh * hd];
        for (a, b) in [(0, 4), (4, 6), (6, 7)] {
            let meta = AttentionMetadata {
                slot_mapping: (a..b).map(slot).collect(),
                block_tables: vec![table.clone()],
                seq_lens: vec![b],
                query_start_loc: vec![0, b - a],
            };
            let row = nkv * hd;
            reshape_and_cache(
                &k[a * row..b * row],
                &v[a * row..b * row],
                &meta.slot_mapping,
                &mut cache,
            )
            .unwrap();
            let qr = nh * hd;
            paged_attention(
                &q[a * qr..b * qr],
                nh,
                &cache,
                &meta,
                1.0 / (hd as f32).sqrt(),
                &mut got[a * qr..b * qr],
            )
            .unwrap();
        }
        let err = max_diff(&want, &got);
        assert!(err < 1e-5, "max abs err {err}");
    }

    #[test]
    fn metadata_with_too_few_blocks_is_rejected() {
        let meta = AttentionMetadata {
            slot_mapping: vec![0, 1, 2, 3, 4],
            block_tables: vec![vec![0]],
            seq_lens: vec![5],
            query_start_loc: vec![0, 5],
        };
        assert!(meta.validate(4, 8).is_err());
    }

    #[test]
    fn kv_bytes_per_block_counts_k_and_v() {
        assert_eq!(
            LayerKvCache::bytes_per_block(16, 3, 64),
            2 * 16 * 3 * 64 * 4
        );
    }
}
