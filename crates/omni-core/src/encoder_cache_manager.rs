//! The scheduler's view of the workers' encoder caches (vLLM's `EncoderCacheManager` and
//! `_try_schedule_encoder_inputs`), counted in embeddings (encoder output rows), not tokens.
//!
//! * An item is encoded in the step whose scheduled positions first overlap its placeholder
//!   range; later steps of a chunked prefill that cut the range read the cached output.
//! * An item whose content hash is in the cache (held by another running request, or
//!   scheduled earlier in the same step) is not encoded again: it only gains a reference.
//! * Each step has a compute budget (embeddings encoded in one step) and the cache a capacity
//!   (embeddings held at once). An item that does not fit in either stops its request's tokens
//!   just before the item's placeholder this step (vLLM: the encoder usually attends
//!   bidirectionally, so an item is encoded whole).
//! * A reference ends when the request's KV holds the whole placeholder, or the request
//!   finishes, is aborted or preempted. An entry without references is freed at once and its
//!   hash goes to the workers in the next step's `free_encoder_mm_hashes`. (vLLM keeps such
//!   entries until the space is needed, so that a later request with the same item can skip its
//!   encoder; here a repeated item in the same prompt position is a prefix-cache hit anyway, and
//!   freeing at once bounds the workers' memory by the live requests' items.)
//!
//! Budgets: vLLM's rule is `max(max_num_batched_tokens, max_tokens_per_mm_item)` for both. The
//! engine core has no model code to know the largest item, so it takes `max_model_len` (no
//! item is longer than a prompt) as that bound: any admitted item fits an empty cache.

use std::collections::HashMap;

use omni_protocol::RequestId;

use crate::request::Request;

/// What [`EncoderCacheManager::plan`] found for one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncoderPlan {
    /// Tokens the request can be scheduled for (fewer than asked when an item did not fit).
    pub num_new: usize,
    /// Embeddings it encodes: charge them to the step's compute budget.
    pub embeds: usize,
    /// (item, content hash, embeddings, to encode) for every item the tokens need.
    items: Vec<(u32, u64, usize, bool)>,
}

impl EncoderPlan {
    fn encodes(&self, hash: u64) -> bool {
        self.items.iter().any(|&(_, h, _, e)| e && h == hash)
    }
}

/// One cached encoder output.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Encoder output rows.
    num_embeds: usize,
    /// (request, item) pairs holding it.
    refs: usize,
}

/// Which encoder outputs the workers hold, who needs them, and what may be freed.
#[derive(Debug)]
pub struct EncoderCacheManager {
    cache_size: usize,
    compute_budget: usize,
    num_free: usize,
    entries: HashMap<u64, Entry>,
    /// Per request, the (item index, content hash) pairs it holds a reference for.
    held: HashMap<RequestId, Vec<(u32, u64)>>,
    /// Freed since the last [`Self::take_freed`].
    freed: Vec<u64>,
    /// Items scheduled for encoding so far.
    num_scheduled: u64,
}

impl EncoderCacheManager {
    /// A cache of `cache_size` embeddings, encoding at most `compute_budget` per step.
    pub fn new(cache_size: usize, compute_budget: usize) -> Self {
        Self {
            cache_size,
            compute_budget,
            num_free: cache_size,
            entries: HashMap::new(),
            held: HashMap::new(),
            freed: Vec::new(),
            num_scheduled: 0,
        }
    }

    /// Capacity in embeddings.
    pub fn cache_size(&self) -> usize {
        self.cache_size
    }

    /// Embeddings one step may encode.
    pub fn compute_budget(&self) -> usize {
        self.compute_budget
    }

    /// Embeddings not held by any entry.
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Content hashes in the cache.
    pub fn num_entries(&self) -> usize {
        self.entries.len()
    }

    /// Items scheduled for encoding since start-up.
    pub fn num_scheduled(&self) -> u64 {
        self.num_scheduled
    }

    /// Whether the request holds a reference for its item `input`.
    pub fn holds(&self, request_id: &str, input: u32) -> bool {
        self.held
            .get(request_id)
            .is_some_and(|h| h.iter().any(|&(i, _)| i == input))
    }

    /// Picks the request's items to encode for scheduled positions `computed .. computed +
    /// num_new` and the cached items those positions need (see the module docs), within
    /// `step_budget`, what is left of this step's compute budget. Changes nothing:
    /// [`Self::commit`] takes the references once the request is scheduled.
    pub fn plan(
        &self,
        req: &Request,
        computed: usize,
        num_new: usize,
        step_budget: usize,
    ) -> EncoderPlan {
        let mut plan = EncoderPlan {
            num_new,
            ..EncoderPlan::default()
        };
        for (i, f) in req.mm_features.iter().enumerate() {
            let i = i as u32;
            let range = f.range();
            if plan.num_new == 0 || range.start >= computed + plan.num_new {
                break; // not needed this step (items are sorted by offset)
            }
            if range.end <= computed || self.holds(&req.request_id, i) {
                continue; // in the KV cache already, or referenced since an earlier step
            }
            let n = range.len();
            if self.entries.contains_key(&f.mm_hash) || plan.encodes(f.mm_hash) {
                plan.items.push((i, f.mm_hash, n, false));
                continue;
            }
            if n > step_budget - plan.embeds || plan.embeds + n > self.num_free {
                // Only the tokens before the item; none if prefix caching put us inside it.
                plan.num_new = range.start.saturating_sub(computed);
                break;
            }
            plan.embeds += n;
            plan.items.push((i, f.mm_hash, n, true));
        }
        plan
    }

    /// Takes the request's references of `plan` (the request is scheduled with
    /// `plan.num_new` tokens) and returns the items to encode this step. A cached entry the
    /// plan counted on that is gone by now (its holder was preempted meanwhile) is encoded.
    pub fn commit(&mut self, request_id: &str, plan: &EncoderPlan) -> Vec<u32> {
        let mut encode = Vec::new();
        for &(i, h, n, _) in &plan.items {
            let e = self.entries.entry(h).or_insert_with(|| {
                encode.push(i);
                Entry {
                    num_embeds: n,
                    refs: 0,
                }
            });
            if e.refs == 0 {
                self.num_free = self.num_free.saturating_sub(n);
            }
            e.refs += 1;
            self.held
                .entry(request_id.to_owned())
                .or_default()
                .push((i, h));
        }
        self.num_scheduled += encode.len() as u64;
        encode
    }

    /// Drops the request's references for items whose placeholder lies wholly before its
    /// `num_computed_tokens` (their rows are in the KV cache now).
    pub fn release_computed(&mut self, req: &Request) {
        let computed = req.num_computed_tokens;
        self.release_where(&req.request_id, |i| {
            req.mm_features
                .get(i as usize)
                .is_none_or(|f| f.range().end <= computed)
        });
    }

    /// Drops every reference of the request (finished, aborted or preempted).
    pub fn release_all(&mut self, request_id: &str) {
        self.release_where(request_id, |_| true);
    }

    fn release_where(&mut self, request_id: &str, pred: impl Fn(u32) -> bool) {
        let Some(held) = self.held.get_mut(request_id) else {
            return;
        };
        let mut dropped = Vec::new();
        held.retain(|&(i, h)| {
            let drop = pred(i);
            if drop {
                dropped.push(h);
            }
            !drop
        });
        if held.is_empty() {
            self.held.remove(request_id);
        }
        for h in dropped {
            let Some(e) = self.entries.get_mut(&h) else {
                continue;
            };
            e.refs = e.refs.saturating_sub(1);
            if e.refs == 0 {
                self.num_free += e.num_embeds;
                self.entries.remove(&h);
                self.freed.push(h);
            }
        }
    }

    /// The hashes freed since the last call (for `free_encoder_mm_hashes`).
    pub fn take_freed(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.freed)
    }
}
