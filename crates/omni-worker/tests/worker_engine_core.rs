//! The in-process engine (EngineCore + UniprocExecutor + Worker) against the transformers
//! reference continuations of the fixture models, under batching, preemption and prefix caching.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use omni_core::{EngineCore, SchedulerConfig, StartupSpec, UniprocExecutor};
use omni_protocol::{EngineCoreRequest, FinishReason, LoadFormat, LoadModelSpec, SamplingParams};
use omni_worker::Worker;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../omni-models/tests/fixtures")
        .join(name)
}

#[derive(serde::Deserialize)]
struct Reference {
    input_ids: Vec<Vec<u32>>,
    greedy: Vec<Vec<u32>>,
}

fn reference(name: &str) -> Reference {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

fn engine(
    name: &str,
    num_blocks: u32,
    cfg: SchedulerConfig,
) -> EngineCore<UniprocExecutor<Worker>> {
    let spec = StartupSpec {
        load: LoadModelSpec {
            model: fixture(name).display().to_string(),
            load_format: LoadFormat::Auto,
            dtype: None,
            max_model_len: cfg.max_model_len as u32,
            block_size: cfg.block_size as u32,
            gpu_memory_utilization: 0.9,
            tensor_parallel_size: 1,
            seed: 0,
            ..LoadModelSpec::default()
        },
        kv_cache_memory_bytes: Some(1 << 20),
        num_blocks_override: Some(num_blocks),
    };
    let worker = Worker::in_process(0, Arc::new(omni_models::IdentityAllReduce));
    let exec = UniprocExecutor::start(worker, &spec).unwrap();
    EngineCore::new(
        SchedulerConfig {
            num_blocks: num_blocks as usize,
            ..cfg
        },
        exec,
    )
    .unwrap()
}

fn run(
    core: &mut EngineCore<UniprocExecutor<Worker>>,
    reqs: Vec<(String, Vec<u32>, u32)>,
) -> HashMap<String, Vec<u32>> {
    let mut out: HashMap<String, Vec<u32>> = HashMap::new();
    for (id, prompt, max) in reqs {
        core.add_request(EngineCoreRequest::new(
            id,
            prompt,
            SamplingParams::greedy(max),
            None,
        ))
        .unwrap();
    }
    while core.has_unfinished_requests() {
        for o in core.step().unwrap() {
            out.entry(o.request_id).or_default().extend(o.new_token_ids);
        }
    }
    out
}

fn small_cfg() -> SchedulerConfig {
    SchedulerConfig {
        max_model_len: 128,
        block_size: 4,
        ..Default::default()
    }
}

#[test]
fn greedy_tokens_match_transformers_reference_for_every_fixture() {
    for (name, async_scheduling) in [
        ("llama", false),
        ("qwen3", false),
        ("qwen3-moe", false),
        ("llama3-rope-bf16", false),
        ("llama", true),
        ("qwen3-moe", true),
    ] {
        let r = reference(name);
        let cfg = SchedulerConfig {
            async_scheduling,
            ..small_cfg()
        };
        let mut core = engine(name, 256, cfg);
        let reqs = r
            .input_ids
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("r{i}"), p.clone(), r.greedy[i].len() as u32))
            .collect();
        let got = run(&mut core, reqs);
        for (i, want) in r.greedy.iter().enumerate() {
            assert_eq!(
                &got[&format!("r{i}")],
                want,
                "{name} prompt {i}, async {async_scheduling}"
            );
        }
    }
}

/// One request alone until it ends: its tokens, finish reason and the batches the engine sent.
fn run_one(
    async_scheduling: bool,
    prompt: &[u32],
    params: SamplingParams,
) -> (Vec<u32>, Option<FinishReason>, u64) {
    let cfg = SchedulerConfig {
        async_scheduling,
        ..small_cfg()
    };
    let mut core = engine("llama", 256, cfg);
    core.add_request(EngineCoreRequest::new(
        "a".to_string(),
        prompt.to_vec(),
        params,
        None,
    ))
    .unwrap();
    let (mut tokens, mut finish) = (Vec::new(), None);
    while core.has_unfinished_requests() {
        for o in core.step().unwrap() {
            tokens.extend(o.new_token_ids);
            finish = finish.or(o.finish_reason);
        }
    }
    // One more call sends the batch that tells the worker the request is over, where the loop
    // did not already (the synchronous engine stops with the last token).
    assert!(core.step().unwrap().is_empty());
    let steps = core.stats().engine_steps;
    assert_eq!(core.executor().worker().runner().unwrap().num_requests(), 0);
    (tokens, finish, steps)
}

#[test]
fn async_scheduling_stops_on_a_token_and_at_max_tokens_like_the_synchronous_engine() {
    let r = reference("llama");
    let (prompt, greedy) = (&r.input_ids[0], &r.greedy[0]);
    // Stop on a token first sampled in the middle: the step already scheduled after it is
    // computed and its token discarded.
    let k = (greedy.len() / 2..greedy.len())
        .find(|&k| !greedy[..k].contains(&greedy[k]))
        .unwrap();
    let stop = SamplingParams {
        stop_token_ids: vec![greedy[k]],
        ..SamplingParams::greedy(greedy.len() as u32)
    };
    let (sync_tokens, sync_finish, sync_steps) = run_one(false, prompt, stop.clone());
    let (tokens, finish, steps) = run_one(true, prompt, stop);
    assert_eq!(sync_tokens, greedy[..=k]);
    assert_eq!(tokens, sync_tokens);
    assert_eq!(
        (sync_finish, finish),
        (Some(FinishReason::Stop), Some(FinishReason::Stop))
    );
    // Sync: prefill + k decodes, then a batch that only drops the request. Async: one more
    // decode, scheduled before the stop token was known.
    assert_eq!(sync_steps, k as u64 + 2);
    assert_eq!(steps, sync_steps + 1);

    // At max_tokens nothing runs ahead: the scheduler knows the last token is the last.
    let (sync_tokens, sync_finish, sync_steps) = run_one(false, prompt, SamplingParams::greedy(5));
    let (tokens, finish, steps) = run_one(true, prompt, SamplingParams::greedy(5));
    assert_eq!(sync_tokens, greedy[..5]);
    assert_eq!(tokens, sync_tokens);
    assert_eq!(
        (sync_finish, finish),
        (Some(FinishReason::Length), Some(FinishReason::Length))
    );
    assert_eq!(steps, sync_steps);
}

#[test]
fn small_cache_with_chunked_prefill_preempts_and_keeps_outputs() {
    let r = reference("llama");
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 16,
        max_model_len: 72,
        ..small_cfg()
    };
    for async_scheduling in [false, true] {
        // 18 blocks of 4 tokens = 72 slots, far less than the 3 sequences need together (~170).
        let mut core = engine(
            "llama",
            18,
            SchedulerConfig {
                async_scheduling,
                ..cfg.clone()
            },
        );
        let reqs = (0..6)
            .map(|i| (format!("r{i}"), r.input_ids[i % 3].clone(), 32))
            .collect();
        let got = run(&mut core, reqs);
        assert!(core.stats().num_preemptions > 0, "expected preemption");
        for i in 0..6 {
            assert_eq!(
                got[&format!("r{i}")],
                r.greedy[i % 3],
                "request {i}, async {async_scheduling}"
            );
        }
    }
}
