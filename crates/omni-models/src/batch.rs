//! What one forward step computes: [`ForwardBatch`], built from per-sequence chunks with
//! [`ForwardBatch::from_chunks`].

use omni_backend::attention::AttentionMetadata;

use crate::error::ModelError;

/// The new tokens of one sequence in a step.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Token ids to run (a whole prompt, a prompt chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV cache (the first new token's position).
    pub start_pos: usize,
    /// The sequence's block table (must cover `start_pos + tokens.len()` tokens).
    pub block_table: &'a [u32],
}

/// One forward step over a flat batch of tokens from several sequences.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForwardBatch {
    /// `[num_tokens]` token ids, sequences one after another.
    pub input_ids: Vec<u32>,
    /// `[num_tokens]` absolute positions (for RoPE).
    pub positions: Vec<usize>,
    /// Where K/V go and how to read context back (vLLM names).
    pub attn: AttentionMetadata,
    /// Token rows whose logits to return; `None` = the last token of each sequence.
    pub logits_indices: Option<Vec<usize>>,
}

impl ForwardBatch {
    /// A batch from per-sequence chunks, with slots computed from each block table.
    pub fn from_chunks(chunks: &[SeqChunk<'_>], block_size: usize) -> Result<Self, ModelError> {
        if block_size == 0 {
            return Err(ModelError::Batch("block_size is 0".into()));
        }
        let mut b = ForwardBatch::default();
        b.attn.query_start_loc.push(0);
        for (s, c) in chunks.iter().enumerate() {
            let end = c.start_pos + c.tokens.len();
            if c.block_table.len() * block_size < end {
                return Err(ModelError::Batch(format!(
                    "sequence {s}: {} blocks of {block_size} cannot hold {end} tokens",
                    c.block_table.len()
                )));
            }
            for (i, &tok) in c.tokens.iter().enumerate() {
                let pos = c.start_pos + i;
                b.input_ids.push(tok);
                b.positions.push(pos);
                let slot = c.block_table[pos / block_size] as usize * block_size + pos % block_size;
                b.attn.slot_mapping.push(slot as i64);
            }
            b.attn.block_tables.push(c.block_table.to_vec());
            b.attn.seq_lens.push(end);
            b.attn.query_start_loc.push(b.input_ids.len());
        }
        Ok(b)
    }

    /// A batch for warming a backend up (vLLM's dummy run): sequence `s` computes `q` new
    /// tokens after `ctx` of context, `seqs[s] = (ctx, q)`, reading block 0 for all of it and
    /// writing nothing into the KV cache (every slot is padding). The ids are spread over the
    /// `vocab_size` ids, so that an MoE routes them across its experts as a prompt's would and
    /// the warm-up meets the expert GEMM shapes real prompts need (identical ids would all
    /// take the same few experts).
    pub fn dummy(
        seqs: &[(usize, usize)],
        block_size: usize,
        vocab_size: usize,
    ) -> Result<Self, ModelError> {
        let vocab = vocab_size.max(1) as u64;
        let mut k = 0u64;
        let tokens: Vec<Vec<u32>> = seqs
            .iter()
            .map(|&(_, q)| {
                (0..q)
                    .map(|_| {
                        k += 1;
                        ((k * 7919 + 13) % vocab) as u32
                    })
                    .collect()
            })
            .collect();
        let tables: Vec<Vec<u32>> = seqs
            .iter()
            .map(|&(ctx, q)| vec![0; (ctx + q).div_ceil(block_size.max(1)).max(1)])
            .collect();
        let chunks: Vec<SeqChunk<'_>> = seqs
            .iter()
            .zip(&tokens)
            .zip(&tables)
            .map(|((&(ctx, _), t), bt)| SeqChunk {
                tokens: t,
                start_pos: ctx,
                block_table: bt,
            })
            .collect();
        let mut b = Self::from_chunks(&chunks, block_size)?;
        b.attn.slot_mapping.iter_mut().for_each(|s| *s = -1);
        Ok(b)
    }

    /// Asks for the logits of every token, not only the last of each sequence.
    pub fn with_all_logits(mut self) -> Self {
        self.logits_indices = Some((0..self.input_ids.len()).collect());
        self
    }

    /// The token rows whose logits [`crate::CausalLm::forward`] returns, in order.
    pub fn output_rows(&self) -> Vec<usize> {
        match &self.logits_indices {
            Some(ix) => ix.clone(),
            None => self
                .attn
                .query_start_loc
                .windows(2)
                .filter(|w| w[1] > w[0])
                .map(|w| w[1] - 1)
                .collect(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn chunks_get_slots_from_their_block_tables() {
        let b = ForwardBatch::from_chunks(
            &[
                SeqChunk {
                    tokens: &[1, 2, 3],
                    start_pos: 0,
                    block_table: &[7],
                },
                SeqChunk {
                    tokens: &[9],
                    start_pos: 5,
                    block_table: &[2, 4],
                },
            ],
            4,
        )
        .unwrap();
        assert_eq!(b.attn.slot_mapping, vec![28, 29, 30, 17]);
        assert_eq!(b.attn.seq_lens, vec![3, 6]);
        assert_eq!(b.attn.query_start_loc, vec![0, 3, 4]);
        assert_eq!(b.positions, vec![0, 1, 2, 5]);
        assert_eq!(b.output_rows(), vec![2, 3]);
    }

    #[test]
    fn a_dummy_batch_reads_block_zero_and_writes_no_slot() {
        let b = ForwardBatch::dummy(&[(0, 5), (7, 1)], 4, 1).unwrap();
        assert_eq!(b.input_ids, vec![0; 6]);
        let spread = ForwardBatch::dummy(&[(0, 5), (7, 1)], 4, 100).unwrap();
        assert!(spread.input_ids.iter().all(|&t| t < 100));
        let distinct: std::collections::HashSet<_> = spread.input_ids.iter().collect();
        assert_eq!(distinct.len(), 6, "{:?}", spread.input_ids);
        assert_eq!(b.positions, vec![0, 1, 2, 3, 4, 7]);
        assert_eq!(b.attn.slot_mapping, vec![-1; 6]);
        assert_eq!(b.attn.block_tables, vec![vec![0, 0], vec![0, 0]]);
        assert_eq!(b.attn.seq_lens, vec![5, 8]);
        assert_eq!(b.output_rows(), vec![4, 5]);
        b.attn.validate(4, 1).unwrap();
    }

    #[test]
    fn too_small_block_table_is_an_error() {
        let r = ForwardBatch::from_chunks(
            &[SeqChunk {
                tokens: &[1, 2, 3],
                start_pos: 2,
                block_table: &[0],
            }],
            4,
        );
        assert!(r.is_err());
    }
}
