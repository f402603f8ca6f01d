//! Per-request block tables on top of the [`BlockPool`], with prefix caching (vLLM's
//! `KvCacheManager`).
//!
//! A request's block table covers positions `0..num_computed_tokens + scheduled`; position `p`
//! lives in `block_ids[p / block_size]`. Full blocks are registered in the prefix cache under the
//! chained hash of their tokens once the step that computed them has returned
//! ([`KvCacheManager::cache_blocks`]), so a hit never points at KV still being written.

use std::collections::HashMap;

use omni_protocol::{BlockId, RequestId};

use crate::block_pool::{BlockPool, hash_block_tokens_with_keys};
use crate::request::Request;

/// The prefix-cache hit of a request about to be scheduled from the waiting queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ComputedBlocks {
    /// Cached blocks covering the first `num_tokens` tokens.
    pub blocks: Vec<BlockId>,
    /// Tokens whose KV the hit provides (a multiple of the block size).
    pub num_tokens: usize,
}

/// Block tables of every live request.
#[derive(Debug)]
pub struct KvCacheManager {
    block_size: usize,
    enable_caching: bool,
    pool: BlockPool,
    req_to_blocks: HashMap<RequestId, Vec<BlockId>>,
    /// How many leading blocks of each request are registered in the prefix cache.
    num_cached_blocks: HashMap<RequestId, usize>,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
}

impl KvCacheManager {
    /// A manager of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, enable_caching: bool) -> Self {
        Self {
            block_size: block_size.max(1),
            enable_caching,
            pool: BlockPool::new(num_blocks),
            req_to_blocks: HashMap::new(),
            num_cached_blocks: HashMap::new(),
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The underlying pool.
    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Fraction of blocks in use, 0..=1.
    pub fn usage(&self) -> f32 {
        self.pool.usage()
    }

    /// Blocks not in use by any request.
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// Prompt tokens looked up in the prefix cache so far.
    pub fn prefix_cache_queries(&self) -> u64 {
        self.prefix_cache_queries
    }

    /// Tokens found in the prefix cache so far.
    pub fn prefix_cache_hits(&self) -> u64 {
        self.prefix_cache_hits
    }

    /// The request's block table (empty if it holds none).
    pub fn block_ids(&self, request_id: &str) -> &[BlockId] {
        self.req_to_blocks
            .get(request_id)
            .map_or(&[], Vec::as_slice)
    }

    /// Extends the request's chained block hashes to cover every full block of its tokens.
    fn update_block_hashes(&self, req: &mut Request) {
        let num_full = req.num_tokens() / self.block_size;
        while req.block_hashes.len() < num_full {
            let i = req.block_hashes.len();
            let parent = req.block_hashes.last().copied();
            let span = i * self.block_size..(i + 1) * self.block_size;
            // The content hashes of the items whose placeholders overlap this block.
            let keys: Vec<u64> = req
                .mm_features
                .iter()
                .filter(|p| {
                    let r = p.range();
                    r.start < span.end && span.start < r.end
                })
                .map(|p| p.mm_hash)
                .collect();
            let tokens = &req.all_token_ids()[span];
            let hash = hash_block_tokens_with_keys(parent, tokens, &keys);
            req.block_hashes.push(hash);
        }
    }

    /// The longest run of leading full blocks of the request found in the prefix cache. At least
    /// the last token is always left to compute, so the model produces logits to sample from.
    pub fn get_computed_blocks(&self, req: &mut Request) -> ComputedBlocks {
        if !self.enable_caching || req.num_tokens() == 0 {
            return ComputedBlocks::default();
        }
        self.update_block_hashes(req);
        let max_blocks = (req.num_tokens() - 1) / self.block_size;
        let blocks: Vec<BlockId> = req
            .block_hashes
            .iter()
            .take(max_blocks)
            .map_while(|&h| self.pool.get_cached_block(h))
            .collect();
        let num_tokens = blocks.len() * self.block_size;
        ComputedBlocks { blocks, num_tokens }
    }

    /// Makes room for `num_new_tokens` more tokens after the request's computed ones (and after
    /// `computed`, the prefix-cache hit, for a request leaving the waiting queue). Returns the
    /// blocks appended to its table (hit blocks first), or `None`, changing nothing, if the free
    /// blocks do not suffice.
    pub fn allocate_slots(
        &mut self,
        req: &Request,
        num_new_tokens: usize,
        computed: &ComputedBlocks,
    ) -> Option<Vec<BlockId>> {
        let have = self.block_ids(&req.request_id).len() + computed.blocks.len();
        let total_tokens = req.num_computed_tokens + computed.num_tokens + num_new_tokens;
        let required = total_tokens.div_ceil(self.block_size);
        let num_new_blocks = required.saturating_sub(have);
        // Hit blocks that are free leave the free queue when touched.
        let num_free_hits = computed
            .blocks
            .iter()
            .filter(|&&b| self.pool.ref_cnt(b) == 0)
            .count();
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks() {
            return None;
        }
        self.pool.touch(&computed.blocks);
        let fresh = self.pool.get_new_blocks(num_new_blocks).ok()?;

        if self.enable_caching && req.num_computed_tokens == 0 {
            self.prefix_cache_queries += req.num_tokens() as u64;
            self.prefix_cache_hits += computed.num_tokens as u64;
        }
        let cached = self
            .num_cached_blocks
            .entry(req.request_id.clone())
            .or_insert(0);
        *cached += computed.blocks.len();

        let mut appended = computed.blocks.clone();
        appended.extend_from_slice(&fresh);
        self.req_to_blocks
            .entry(req.request_id.clone())
            .or_default()
            .extend_from_slice(&appended);
        Some(appended)
    }

    /// Registers the request's full blocks whose KV is computed (`num_computed_tokens`) in the
    /// prefix cache. Call after the step that computed them returned.
    pub fn cache_blocks(&mut self, req: &mut Request) {
        if !self.enable_caching {
            return;
        }
        self.update_block_hashes(req);
        let Some(blocks) = self.req_to_blocks.get(&req.request_id) else {
            return;
        };
        let computed = req.num_computed_tokens.min(req.num_tokens());
        let num_full = (computed / self.block_size)
            .min(blocks.len())
            .min(req.block_hashes.len());
        let cached = self
            .num_cached_blocks
            .entry(req.request_id.clone())
            .or_insert(0);
        for (&block, &hash) in blocks[..num_full]
            .iter()
            .zip(&req.block_hashes[..num_full])
            .skip(*cached)
        {
            self.pool.cache_full_block(block, hash);
        }
        *cached = (*cached).max(num_full);
    }

    /// Frees every block of the request (tail first, so its last blocks are evicted first).
    pub fn free(&mut self, request_id: &str) {
        if let Some(blocks) = self.req_to_blocks.remove(request_id) {
            self.pool.free_blocks(blocks.into_iter().rev());
        }
        self.num_cached_blocks.remove(request_id);
    }

    /// Forgets every cached hash. Returns the number of blocks forgotten.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.num_cached_blocks.clear();
        self.pool.reset_prefix_cache()
    }
}

#[cfg(test)]
mod tests {
    use omni_protocol::{EngineCoreRequest, SamplingParams};

    use super::*;

    fn request(id: &str, tokens: Vec<u32>) -> Request {
        Request::new(
            EngineCoreRequest::new(id, tokens, SamplingParams::default(), None),
            0,
        )
    }

    #[test]
    fn allocation_rounds_up_to_whole_blocks() {
        let mut kv = KvCacheManager::new(10, 4, false);
        let mut r = request("a", (0..9).collect());
        let got = kv
            .allocate_slots(&r, 9, &ComputedBlocks::default())
            .unwrap();
        assert_eq!(got.len(), 3);
        r.num_computed_tokens = 9;
        // Positions 9..12 fit in the third block: nothing new.
        assert_eq!(
            kv.allocate_slots(&r, 3, &ComputedBlocks::default()),
            Some(vec![])
        );
        assert_eq!(kv.num_free_blocks(), 7);
        kv.free("a");
        assert_eq!(kv.num_free_blocks(), 10);
    }

    #[test]
    fn allocation_that_does_not_fit_changes_nothing() {
        let mut kv = KvCacheManager::new(2, 4, false);
        let r = request("a", (0..12).collect());
        assert_eq!(kv.allocate_slots(&r, 12, &ComputedBlocks::default()), None);
        assert_eq!(kv.num_free_blocks(), 2);
        assert!(kv.block_ids("a").is_empty());
    }

    #[test]
    fn shared_prefix_hits_cached_blocks_and_leaves_last_token() {
        let mut kv = KvCacheManager::new(10, 4, true);
        let mut a = request("a", (0..8).collect());
        let got = kv
            .allocate_slots(&a, 8, &ComputedBlocks::default())
            .unwrap();
        a.num_computed_tokens = 8;
        kv.cache_blocks(&mut a);

        // Same 8 tokens: only the first block may hit, the last token must be recomputed.
        let mut b = request("b", (0..8).collect());
        let hit = kv.get_computed_blocks(&mut b);
        assert_eq!(hit.blocks, vec![got[0]]);
        assert_eq!(hit.num_tokens, 4);

        // Longer prompt with the same 8-token prefix: both blocks hit.
        let mut c = request("c", (0..10).collect());
        let hit = kv.get_computed_blocks(&mut c);
        assert_eq!(hit.blocks, got);
        let appended = kv.allocate_slots(&c, 2, &hit).unwrap();
        assert_eq!(&appended[..2], &got[..]);
        assert_eq!(kv.block_pool().ref_cnt(got[0]), 2);
        assert_eq!(kv.prefix_cache_hits(), 8);
        assert_eq!(kv.prefix_cache_queries(), 8 + 10);
    }

    fn with_image(id: &str, tokens: Vec<u32>, mm_hash: u64) -> Request {
        let mut r = EngineCoreRequest::new(id, tokens, SamplingParams::default(), None);
        // Placeholder tokens 6..10: the second and third blocks of 4.
        r.mm_features = vec![omni_protocol::MultiModalFeatureSpec {
            mm_hash,
            offset: 6,
            length: 4,
            kind: omni_protocol::MmKind::Audio { num_frames: 40 },
            tensor: omni_protocol::TensorRef {
                name: "input_features".into(),
                request_id: None,
                dtype: omni_protocol::DType::Bf16,
                shape: vec![128, 40],
                buffer_index: 0,
            },
        }];
        Request::new(r, 0)
    }

    #[test]
    fn equal_placeholder_ids_with_different_media_never_share_blocks() {
        let mut kv = KvCacheManager::new(16, 4, true);
        // 13 tokens: three full blocks; the image's placeholders touch blocks 1 and 2.
        let tokens: Vec<u32> = (0..13).collect();
        let mut a = with_image("a", tokens.clone(), 0xAAAA);
        let got = kv
            .allocate_slots(&a, 13, &ComputedBlocks::default())
            .unwrap();
        a.num_computed_tokens = 13;
        kv.cache_blocks(&mut a);

        // Another image, the same token ids: only the block before the image is shared.
        let mut b = with_image("b", tokens.clone(), 0xBBBB);
        let hit = kv.get_computed_blocks(&mut b);
        assert_eq!(hit.blocks, vec![got[0]]);
        assert_ne!(a.block_hashes[1], b.block_hashes[1]);
        assert_ne!(a.block_hashes[2], b.block_hashes[2]);

        // The same image again: every full block hits.
        let mut c = with_image("c", tokens.clone(), 0xAAAA);
        assert_eq!(kv.get_computed_blocks(&mut c).blocks, got[..3].to_vec());

        // No image at all: the text-only hash differs from both from block 1 on.
        let mut d = request("d", tokens);
        assert_eq!(kv.get_computed_blocks(&mut d).blocks, vec![got[0]]);
    }

    #[test]
    fn freed_cached_blocks_still_hit_until_evicted() {
        let mut kv = KvCacheManager::new(2, 4, true);
        let mut a = request("a", (0..5).collect());
        kv.allocate_slots(&a, 5, &ComputedBlocks::default())
            .unwrap();
        a.num_computed_tokens = 5;
        kv.cache_blocks(&mut a);
        kv.free("a");
        let mut b = request("b", (0..6).collect());
        assert_eq!(kv.get_computed_blocks(&mut b).num_tokens, 4);

        // A request that needs both blocks evicts the cached one.
        let c = request("c", (100..108).collect());
        kv.allocate_slots(&c, 8, &ComputedBlocks::default())
            .unwrap();
        let mut b = request("b2", (0..6).collect());
        assert_eq!(kv.get_computed_blocks(&mut b).num_tokens, 0);
    }
}
