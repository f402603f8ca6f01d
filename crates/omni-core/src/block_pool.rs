//! The pool of KV cache blocks: reference counts, an LRU free queue, and the prefix-cache map from
//! block hash to block (vLLM's `BlockPool`).
//!
//! A block is in exactly one of two states: in use (`ref_cnt > 0`, not in the free queue) or free
//! (`ref_cnt == 0`, in the free queue). A free block may still carry a hash and be found by a
//! prefix-cache lookup; taking it back ("touching") removes it from the free queue. New blocks are
//! taken from the front of the free queue (least recently freed first), which evicts their hash.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use omni_protocol::{BlockId, TokenId};

/// Chained hash of one full block: it covers the block's tokens and, through the parent hash, every
/// token before them. 128 bits, so a collision (which would silently reuse the wrong KV) is out of
/// reach. Stable within one process only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Hashes one full block given the hash of the block before it (`None` for the first block).
pub fn hash_block_tokens(parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
    hash_block_tokens_with_keys(parent, tokens, &[])
}

/// [`hash_block_tokens`] with extra keys (vLLM's `extra_keys`): the content hashes of the
/// multimodal items whose placeholder tokens fall in the block, so two prompts whose token ids
/// are equal but whose images differ get different block hashes. No keys gives the plain hash.
pub fn hash_block_tokens_with_keys(
    parent: Option<BlockHash>,
    tokens: &[TokenId],
    extra_keys: &[u64],
) -> BlockHash {
    let half = |salt: u64| {
        // `DefaultHasher::new()` has fixed keys: deterministic within one build.
        let mut h = DefaultHasher::new();
        salt.hash(&mut h);
        parent.hash(&mut h);
        tokens.hash(&mut h);
        if !extra_keys.is_empty() {
            extra_keys.hash(&mut h);
        }
        h.finish()
    };
    BlockHash((u128::from(half(0x9e37_79b9)) << 64) | u128::from(half(0x7f4a_7c15)))
}

/// No free block left for an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("need {requested} free KV blocks, only {available} available")]
pub struct BlockAllocError {
    /// Blocks asked for.
    pub requested: usize,
    /// Blocks free.
    pub available: usize,
}

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    /// Key in the free queue while free.
    free_key: Option<u64>,
}

/// Every KV block of one worker's cache, by id `0..num_blocks`.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Free blocks ordered by the time they were freed (smallest key = evicted first).
    free_queue: BTreeMap<u64, BlockId>,
    next_free_key: u64,
    cached: HashMap<BlockHash, BlockId>,
}

impl BlockPool {
    /// A pool with every block free.
    pub fn new(num_blocks: usize) -> Self {
        let mut pool = Self {
            blocks: vec![Block::default(); num_blocks],
            free_queue: BTreeMap::new(),
            next_free_key: 0,
            cached: HashMap::new(),
        };
        for id in 0..num_blocks {
            pool.push_free(id as BlockId);
        }
        pool
    }

    fn push_free(&mut self, id: BlockId) {
        let key = self.next_free_key;
        self.next_free_key += 1;
        self.free_queue.insert(key, id);
        self.blocks[id as usize].free_key = Some(key);
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks not used by any request (cached ones included).
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len()
    }

    /// Fraction of blocks in use, 0..=1.
    pub fn usage(&self) -> f32 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.num_free_blocks() as f32 / self.num_blocks() as f32
    }

    /// References to a block.
    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.ref_cnt)
    }

    /// The block holding the KV of a full block with this hash, if cached.
    pub fn get_cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Takes `n` blocks from the front of the free queue, evicting their cached hashes.
    pub fn get_new_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, BlockAllocError> {
        if n > self.free_queue.len() {
            return Err(BlockAllocError {
                requested: n,
                available: self.free_queue.len(),
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let Some((_, id)) = self.free_queue.pop_first() else {
                break;
            };
            let block = &mut self.blocks[id as usize];
            block.free_key = None;
            block.ref_cnt = 1;
            if let Some(hash) = block.hash.take()
                && self.cached.get(&hash) == Some(&id)
            {
                self.cached.remove(&hash);
            }
            out.push(id);
        }
        Ok(out)
    }

    /// Adds a reference to each block (prefix-cache hits), taking free ones out of the free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let block = &mut self.blocks[id as usize];
            if let Some(key) = block.free_key.take() {
                self.free_queue.remove(&key);
            }
            block.ref_cnt += 1;
        }
    }

    /// Drops one reference to each block, in the given order; blocks that reach zero go to the
    /// back of the free queue (so the first ones given are evicted first).
    pub fn free_blocks(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            let block = &mut self.blocks[id as usize];
            block.ref_cnt = block.ref_cnt.saturating_sub(1);
            if block.ref_cnt == 0 && block.free_key.is_none() {
                self.push_free(id);
            }
        }
    }

    /// Registers a full, computed block under its hash. If another block already holds that hash,
    /// this one stays uncached (its twin serves future hits).
    pub fn cache_full_block(&mut self, id: BlockId, hash: BlockHash) {
        if self.blocks[id as usize].hash.is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(id);
            self.blocks[id as usize].hash = Some(hash);
        }
    }

    /// Forgets every cached hash (blocks in use keep their data). Returns the number forgotten.
    pub fn reset_prefix_cache(&mut self) -> usize {
        let n = self.cached.len();
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hash_depends_on_parent_and_tokens() {
        let a = hash_block_tokens(None, &[1, 2, 3, 4]);
        assert_eq!(a, hash_block_tokens(None, &[1, 2, 3, 4]));
        assert_ne!(a, hash_block_tokens(None, &[1, 2, 3, 5]));
        let b = hash_block_tokens(Some(a), &[5, 6, 7, 8]);
        assert_ne!(b, hash_block_tokens(None, &[5, 6, 7, 8]));
    }

    #[test]
    fn allocation_fails_without_enough_free_blocks() {
        let mut pool = BlockPool::new(4);
        let got = pool.get_new_blocks(3).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(pool.num_free_blocks(), 1);
        assert_eq!(
            pool.get_new_blocks(2),
            Err(BlockAllocError {
                requested: 2,
                available: 1
            })
        );
        assert!((pool.usage() - 0.75).abs() < 1e-6);
    }

    #[test]
    fn freed_blocks_are_reused_least_recently_freed_first() {
        let mut pool = BlockPool::new(3);
        let ids = pool.get_new_blocks(3).unwrap();
        pool.free_blocks([ids[2], ids[0], ids[1]]);
        assert_eq!(
            pool.get_new_blocks(3).unwrap(),
            vec![ids[2], ids[0], ids[1]]
        );
    }

    #[test]
    fn cached_free_block_is_found_until_evicted() {
        let mut pool = BlockPool::new(2);
        let h = hash_block_tokens(None, &[1, 2]);
        let ids = pool.get_new_blocks(1).unwrap();
        pool.cache_full_block(ids[0], h);
        pool.free_blocks(ids.clone());
        assert_eq!(pool.get_cached_block(h), Some(ids[0]));

        // Touching takes it back out of the free queue.
        pool.touch(&ids);
        assert_eq!(pool.ref_cnt(ids[0]), 1);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.free_blocks(ids.clone());

        // The never-used block is older in the queue, so it goes first; then the cached one.
        let first = pool.get_new_blocks(1).unwrap();
        assert_ne!(first, ids);
        assert_eq!(pool.get_cached_block(h), Some(ids[0]));
        pool.get_new_blocks(1).unwrap();
        assert_eq!(pool.get_cached_block(h), None);
    }

    #[test]
    fn shared_block_is_freed_only_by_last_reference() {
        let mut pool = BlockPool::new(1);
        let ids = pool.get_new_blocks(1).unwrap();
        pool.touch(&ids);
        pool.free_blocks(ids.clone());
        assert_eq!(pool.num_free_blocks(), 0);
        pool.free_blocks(ids);
        assert_eq!(pool.num_free_blocks(), 1);
    }
}
