//! Greedy continuations through the real multi-process engine equal the transformers reference,
//! with one worker process, with two tensor-parallel worker processes, and with the decoder's
//! layers split over two pipeline stages (alone and with two tensor-parallel ranks each).

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;

use common::*;

fn check(name: &str, tp: u32) {
    check_parallel(name, tp, 1);
}

fn check_parallel(name: &str, tp: u32, pp: u32) {
    let r = reference(name);
    let mut args = s(&["--model"]);
    args.push(fixture(name).display().to_string());
    args.extend(s(&["--max-tokens", "32", "-tp"]));
    args.push(tp.to_string());
    args.extend(s(&["-pp"]));
    args.push(pp.to_string());
    args.extend(prompt_args(&r.input_ids));
    let (gens, stderr) = generate(&args);
    assert_eq!(gens.len(), r.greedy.len(), "{stderr}");
    for (i, g) in gens.iter().enumerate() {
        assert_eq!(g.prompt_token_ids, r.input_ids[i]);
        assert_eq!(
            g.token_ids, r.greedy[i],
            "{name} tp={tp} pp={pp} prompt {i}"
        );
    }
}

#[test]
fn tp1_greedy_tokens_equal_transformers_reference() {
    check("llama", 1);
    check("qwen3-moe", 1);
}

#[test]
fn tp2_greedy_tokens_equal_transformers_reference() {
    check("llama", 2);
    check("qwen3", 2);
    check("qwen3-moe", 2);
}

#[test]
fn pp2_greedy_tokens_equal_transformers_reference() {
    // llama ties its embeddings (the last stage loads the table as its head); qwen3-moe has
    // 3 layers (stage 0 gets 2) and its own lm_head.
    check_parallel("llama", 1, 2);
    check_parallel("qwen3-moe", 1, 2);
}

#[test]
fn tp2_pp2_greedy_tokens_equal_transformers_reference() {
    check_parallel("qwen3", 2, 2);
}
