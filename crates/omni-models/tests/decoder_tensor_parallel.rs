//! Tensor parallelism simulated in one process: each rank a thread with its own model and KV
//! cache, joined by an in-process all-reduce; rank outputs equal the single-rank logits.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use omni_models::{InProcessAllReduce, TpContext};

fn tp_logits(arch: &str, tp_size: usize, ids: &[u32]) -> Vec<Vec<f32>> {
    let group = InProcessAllReduce::group(tp_size);
    let table = Blocks::new().table(ids.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, ar)| {
                let table = &table;
                s.spawn(move || {
                    let model = load(arch, TpContext::new(rank, tp_size, Arc::new(ar)));
                    let spec = model.kv_cache_spec();
                    assert!(spec.num_kv_heads <= 2usize.div_ceil(tp_size).max(1));
                    let mut kv = fresh_cache(model.as_ref());
                    // Prefill all but the last token, then decode it: exercises the cache too.
                    let n = ids.len();
                    let mut out = run_all(model.as_ref(), &mut kv, &[(&ids[..n - 1], 0, table)]);
                    out.extend(run_all(
                        model.as_ref(),
                        &mut kv,
                        &[(&ids[n - 1..], n - 1, table)],
                    ));
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn tp2_and_tp4_ranks_match_single_rank_logits() {
    for arch in ARCHS {
        let ids = &reference(arch).input_ids[2];
        let single = tp_logits(arch, 1, ids).remove(0);
        for tp in [2, 4] {
            for (rank, got) in tp_logits(arch, tp, ids).iter().enumerate() {
                let err = rel_err(got, &single);
                assert!(err <= 1e-4, "{arch} tp {tp} rank {rank}: rel err {err}");
            }
        }
    }
}

#[test]
fn kv_cache_holds_only_local_heads() {
    let c = config("llama");
    let one = omni_models::registry::kv_cache_bytes_per_block_per_layer(&c, 16, 0, 1).unwrap();
    let two = omni_models::registry::kv_cache_bytes_per_block_per_layer(&c, 16, 1, 2).unwrap();
    // 2 KV heads: split over 2 ranks, replicated (1 each) over 4.
    let four = omni_models::registry::kv_cache_bytes_per_block_per_layer(&c, 16, 3, 4).unwrap();
    assert_eq!(
        (one, two, four),
        (2 * 16 * 2 * 16 * 4, 16 * 2 * 16 * 4, 16 * 2 * 16 * 4)
    );
}
