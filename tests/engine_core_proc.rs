//! The engine core in its own process (`--enable-multiprocessing`, an `omni-engine-core` child
//! that spawns the workers) gives the greedy tokens of the in-process engine core, which are
//! the transformers reference, at tensor-parallel size 1 and 2.

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;

use common::*;

/// Greedy continuations of the fixture's prompts; `mp`: the engine core in its own process.
fn run(name: &str, tp: u32, mp: bool) -> Vec<Vec<u32>> {
    let r = reference(name);
    let mut args = s(&["--model"]);
    args.push(fixture(name).display().to_string());
    args.extend(s(&["--max-tokens", "32", "-tp"]));
    args.push(tp.to_string());
    if mp {
        args.push("--enable-multiprocessing".into());
    }
    args.extend(prompt_args(&r.input_ids));
    let (gens, stderr) = generate(&args);
    // The log line of the client that started the engine-core process, and only then.
    assert_eq!(
        stderr.contains("engine core ready in its own process"),
        mp,
        "{name} tp={tp} mp={mp}: {stderr}"
    );
    assert_eq!(gens.len(), r.greedy.len(), "{stderr}");
    gens.into_iter()
        .enumerate()
        .map(|(i, g)| {
            assert_eq!(g.prompt_token_ids, r.input_ids[i]);
            g.token_ids
        })
        .collect()
}

fn check(name: &str, tp: u32) {
    let in_process = run(name, tp, false);
    let own_process = run(name, tp, true);
    assert_eq!(own_process, in_process, "{name} tp={tp}");
    assert_eq!(own_process, reference(name).greedy, "{name} tp={tp}");
}

#[test]
fn tp1_engine_core_process_greedy_tokens_equal_in_process_ones() {
    check("llama", 1);
    check("qwen3-moe", 1);
}

#[test]
fn tp2_engine_core_process_greedy_tokens_equal_in_process_ones() {
    check("llama", 2);
    check("qwen3", 2);
    check("qwen3-moe", 2);
}
