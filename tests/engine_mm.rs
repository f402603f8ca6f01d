//! Images and audio through the real multi-process engine (`omni_launch::launch`: CPU worker
//! processes joined by the broadcast queue): every rank receives each request's tensors once,
//! in the step that schedules it first, and runs the whole encoder tower (replicated towers).
//! Greedy tokens equal transformers' for an image, an audio clip, both with text between and a
//! text-only request in one batch, at `-tp 1` with the engine core in its own process (the
//! tensors cross the API -> engine-core queue too) and at `-tp 2`; on a GPU machine
//! (`scripts/gpu-check.sh mm`) the same with the CUDA worker (SKIP without `nvidia-smi`).

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;
#[path = "mm_common.rs"]
mod mm_common;

use mm_common::{MmFixture, mm_fixture};
use omni_config::{DeviceKind, EngineConfig};

fn config(tp: u32, own_process: bool, max_num_batched_tokens: usize) -> EngineConfig {
    let mut c = EngineConfig::default();
    c.model.model = Some(mm_fixture());
    c.model.max_model_len = 256;
    c.cache.block_size = 4;
    c.cache.kv_cache_memory = Some(16 << 20);
    c.parallel.tensor_parallel_size = tp;
    c.parallel.enable_multiprocessing = own_process;
    c.scheduler.max_num_batched_tokens = max_num_batched_tokens;
    c.device.device = DeviceKind::Cpu;
    c
}

/// Fixture requests `which` at once through an engine started from `c`: each one's tokens and
/// transformers' greedy tokens.
fn run(c: &EngineConfig, which: &[usize]) -> Vec<(Vec<u32>, Vec<u32>)> {
    let fx = MmFixture::load();
    let started = omni_launch::launch(c, &common::engine_bin()).unwrap();
    let mut streams = Vec::new();
    for &i in which {
        let (req, want) = fx.request(i, &format!("r{i}"));
        streams.push((started.engine.add_request(req).unwrap(), want));
    }
    let mut out = Vec::new();
    for (mut s, want) in streams {
        let mut got = Vec::new();
        while let Some(o) = s.blocking_next() {
            got.extend(o.unwrap().new_token_ids);
        }
        out.push((got, want));
    }
    started.engine.shutdown();
    out
}

/// All four fixture requests at once; each one's tokens must be transformers'.
fn check(c: &EngineConfig, what: &str) {
    for (i, (got, want)) in run(c, &[0, 1, 2, 3]).into_iter().enumerate() {
        assert_eq!(got, want, "{what}: request {i}");
    }
}

#[test]
fn tp1_with_the_engine_core_in_its_own_process_gives_the_transformers_tokens() {
    check(&config(1, true, 512), "tp 1, engine-core process");
}

#[test]
fn tp2_gives_the_tokens_of_tp1() {
    check(&config(2, false, 512), "tp 2");
    // Chunked across the items too (8 tokens a step).
    check(&config(2, false, 8), "tp 2, chunked prefill");
}

/// Whether `nvidia-smi` lists a GPU (the CUDA tests SKIP without one).
fn has_gpu() -> bool {
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
}

/// On CUDA (bf16, device towers) the tiny random MoE may flip a near-tied expert choice, so
/// the tokens are not held to transformers' (the model-level `cuda_thinker_mm` test compares
/// logits before such ties); here every request completes, a request gives the same tokens
/// alone and batched with the others, and the agreement with transformers is printed.
#[test]
fn cuda_requests_complete_and_give_the_same_tokens_alone_and_batched() {
    if !has_gpu() {
        println!("SKIP cuda_requests_complete_and_give_the_same_tokens_alone_and_batched: no GPU");
        return;
    }
    let mut c = config(1, false, 512);
    c.device.device = DeviceKind::Cuda;
    let batched = run(&c, &[0, 1, 2, 3]);
    for (i, (got, want)) in batched.iter().enumerate() {
        let same = got.iter().zip(want).take_while(|(a, b)| a == b).count();
        println!(
            "cuda request {i}: {got:?}; transformers {want:?} ({same} of {} agree)",
            want.len()
        );
        assert_eq!(got.len(), want.len(), "request {i}: tokens generated");
        let alone = run(&c, &[i]).remove(0).0;
        assert_eq!(&alone, got, "request {i}: alone vs batched");
    }
}
