//! Continuous batching through the real engine does not change greedy outputs: 16 concurrent
//! requests of different lengths, a KV cache small enough to force preemption, and shared
//! prefixes served from the prefix cache.

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;

use common::*;

fn model_args() -> Vec<String> {
    vec!["--model".into(), fixture("llama").display().to_string()]
}

#[test]
fn sixteen_concurrent_requests_give_the_same_tokens_as_each_alone() {
    let r = reference("llama");
    // 16 prompts of different lengths: prefixes of the three reference prompts.
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            let p = &r.input_ids[i % 3];
            p[..(3 + 2 * i).min(p.len())].to_vec()
        })
        .collect();
    let mut together = model_args();
    together.extend(s(&["--max-tokens", "12", "-tp", "2"]));
    together.extend(prompt_args(&prompts));
    let (batched, _) = generate(&together);
    // One at a time: a batch of one request, no prefix cache.
    let mut alone = together.clone();
    alone.extend(s(&["--max-num-seqs", "1", "--no-prefix-caching"]));
    let (single, _) = generate(&alone);
    // The same batch scheduled synchronously (the runs above schedule a step ahead, the
    // default: the two worker processes fill in the tokens they sampled themselves).
    let mut sync = together.clone();
    sync.push("--no-async-scheduling".into());
    let (batched_sync, _) = generate(&sync);
    assert_eq!(batched.len(), 16);
    assert_eq!(batched_sync.len(), 16);
    for (i, ((b, a), h)) in batched.iter().zip(&single).zip(&batched_sync).enumerate() {
        assert_eq!(b.token_ids.len(), 12);
        assert_eq!(b.token_ids, a.token_ids, "request {i}");
        assert_eq!(
            h.token_ids, a.token_ids,
            "request {i}, synchronous scheduling"
        );
    }
}

#[test]
fn small_kv_cache_forces_preemption_and_outputs_are_unchanged() {
    let r = reference("llama");
    let mut args = model_args();
    // 20 blocks of 4 tokens cannot hold the 3 sequences (71 + 62 + 37 tokens) at once.
    args.extend(s(&[
        "--max-tokens",
        "32",
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "20",
        "--max-model-len",
        "72",
        "--max-num-batched-tokens",
        "16",
    ]));
    args.extend(prompt_args(&r.input_ids));
    for async_scheduling in [false, true] {
        let mut args = args.clone();
        args.push(format!("--async-scheduling={async_scheduling}"));
        let (gens, stderr) = generate(&args);
        assert!(stat(&stderr, "preemptions ") > 0, "no preemption: {stderr}");
        for (i, g) in gens.iter().enumerate() {
            assert_eq!(
                g.token_ids, r.greedy[i],
                "prompt {i}, async {async_scheduling}"
            );
        }
    }
}

#[test]
fn shared_prefix_requests_hit_the_prefix_cache_and_outputs_are_unchanged() {
    let r = reference("llama");
    let mut args = model_args();
    // The same 39-token prompt three times, one request at a time: the 2nd and 3rd find its
    // full blocks in the prefix cache.
    args.extend(s(&[
        "--max-tokens",
        "32",
        "--block-size",
        "4",
        "--max-num-seqs",
        "1",
    ]));
    args.extend(s(&["--repeat", "3"]));
    args.extend(prompt_args(&r.input_ids[2..3]));
    let (gens, stderr) = generate(&args);
    assert!(stat(&stderr, "prefix cache hits ") >= 2 * 36, "{stderr}");
    for g in &gens {
        assert_eq!(g.token_ids, r.greedy[2]);
    }
}
