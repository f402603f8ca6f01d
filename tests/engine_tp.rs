//! Greedy continuations through the real multi-process engine equal the transformers reference,
//! with one worker process and with two tensor-parallel worker processes.

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;

use common::*;

fn check(name: &str, tp: u32) {
    let r = reference(name);
    let mut args = s(&["--model"]);
    args.push(fixture(name).display().to_string());
    args.extend(s(&["--max-tokens", "32", "-tp"]));
    args.push(tp.to_string());
    args.extend(prompt_args(&r.input_ids));
    let (gens, stderr) = generate(&args);
    assert_eq!(gens.len(), r.greedy.len(), "{stderr}");
    for (i, g) in gens.iter().enumerate() {
        assert_eq!(g.prompt_token_ids, r.input_ids[i]);
        assert_eq!(g.token_ids, r.greedy[i], "{name} tp={tp} prompt {i}");
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
