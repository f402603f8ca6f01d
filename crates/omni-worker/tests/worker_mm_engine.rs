//! Images and audio through the in-process engine (EngineCore + scheduler + encoder cache
//! manager + UniprocExecutor + Worker + Qwen3-Omni's Thinker with both towers) on the tiny
//! transformers fixture `qwen3-omni-mm`: requests carry the fixture's preprocessed tensors as
//! their items' buffers, and the greedy tokens must be transformers' (fixture pixels are random,
//! so the requests are built here rather than from image files; the server test sends a PNG).

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::Arc;

use omni_core::{EngineCore, SchedulerConfig, StartupSpec, UniprocExecutor};
use omni_protocol::{EngineCoreRequest, LoadFormat, LoadModelSpec};
use omni_worker::Worker;

// The workspace tests' loader of the same fixture (requests with its tensors as buffers).
#[path = "../../../tests/mm_common.rs"]
mod mm_common;
use mm_common::{MmFixture, content_hash, mm_fixture};

type Core = EngineCore<UniprocExecutor<Worker>>;

fn engine(max_num_batched_tokens: usize) -> Core {
    let cfg = SchedulerConfig {
        max_num_batched_tokens,
        max_model_len: 256,
        block_size: 4,
        num_blocks: 512,
        ..Default::default()
    };
    let spec = StartupSpec {
        load: LoadModelSpec {
            model: mm_fixture().display().to_string(),
            load_format: LoadFormat::Auto,
            max_model_len: 256,
            block_size: 4,
            tensor_parallel_size: 1,
            ..LoadModelSpec::default()
        },
        kv_cache_memory_bytes: Some(1 << 24),
        num_blocks_override: Some(512),
    };
    let worker = Worker::in_process(0, Arc::new(omni_models::IdentityAllReduce));
    EngineCore::new(cfg, UniprocExecutor::start(worker, &spec).unwrap()).unwrap()
}

/// Runs the requests to completion: tokens and prefix-cache hits per request.
fn run(core: &mut Core, reqs: Vec<EngineCoreRequest>) -> HashMap<String, (Vec<u32>, u32)> {
    for r in reqs {
        core.add_request(r).unwrap();
    }
    let mut out: HashMap<String, (Vec<u32>, u32)> = HashMap::new();
    while core.has_unfinished_requests() {
        for o in core.step().unwrap() {
            let e = out.entry(o.request_id).or_default();
            e.0.extend(o.new_token_ids);
            e.1 = o.num_cached_tokens;
        }
    }
    out
}

fn items_encoded(core: &Core) -> u64 {
    let runner = core.executor().worker().runner().unwrap();
    runner.encoder_stats().items_encoded
}

#[test]
fn image_audio_and_both_with_text_between_give_the_transformers_tokens_alone_and_batched() {
    let fx = MmFixture::load();
    let mut core = engine(512);
    for i in 0..fx.requests.len() {
        let (req, want) = fx.request(i, &format!("alone-{i}"));
        let got = run(&mut core, vec![req]);
        assert_eq!(got[&format!("alone-{i}")].0, want, "request {i} alone");
    }
    // Image, audio, image + text + audio, text only: one batch.
    let (reqs, wants): (Vec<_>, Vec<_>) = (0..fx.requests.len())
        .map(|i| fx.request(i, &format!("batch-{i}")))
        .unzip();
    let got = run(&mut core, reqs);
    for (i, want) in wants.iter().enumerate() {
        assert_eq!(&got[&format!("batch-{i}")].0, want, "request {i} batched");
    }
    let stats = core.executor().worker().runner().unwrap().encoder_stats();
    assert_eq!(
        stats.cached, 0,
        "every encoder output freed once its request finished"
    );
}

#[test]
fn the_same_image_twice_in_one_batch_is_encoded_once() {
    let fx = MmFixture::load();
    let mut core = engine(512);
    let (a, want_a) = fx.request(0, "a");
    let (b, _) = fx.request(0, "b");
    let (c, want_c) = fx.request(2, "c");
    let got = run(&mut core, vec![a, b, c]);
    assert_eq!(got["a"].0, want_a);
    assert_eq!(got["b"].0, want_a);
    assert_eq!(got["c"].0, want_c);
    // a's and b's image once, c's image and audio clip.
    assert_eq!(items_encoded(&core), 3);
}

#[test]
fn a_prefill_chunked_across_images_and_audio_gives_the_same_tokens() {
    let fx = MmFixture::load();
    // 5 tokens a step: every placeholder range is split over several steps.
    let mut core = engine(5);
    let (reqs, wants): (Vec<_>, Vec<_>) = (0..3).map(|i| fx.request(i, &format!("r{i}"))).unzip();
    let got = run(&mut core, reqs);
    for (i, want) in wants.iter().enumerate() {
        assert_eq!(&got[&format!("r{i}")].0, want, "request {i} chunked");
    }
    assert_eq!(
        items_encoded(&core),
        4,
        "each item encoded once across its chunks"
    );
}

#[test]
fn different_images_with_equal_placeholder_counts_never_share_prefix_blocks() {
    let fx = MmFixture::load();
    let (a, want_a) = fx.request(0, "a");
    // Another image of the same grid (so the same token ids): image 1's first 24 patches.
    let other = |id: &str| {
        let (mut r, _) = fx.request(0, id);
        let n = r.mm_buffers.get(0).unwrap().len();
        let mut b = omni_protocol::TensorBuffers::new();
        b.push(fx.images[1].1[..n].to_vec().into());
        r.mm_buffers = b;
        r.mm_features[0].mm_hash = content_hash(&fx.images[1].1[..n]);
        r
    };
    let alone = run(&mut engine(512), vec![other("b")])["b"].0.clone();

    let mut core = engine(512);
    assert_eq!(run(&mut core, vec![a])["a"].0, want_a);
    let got = run(&mut core, vec![other("b")]);
    // Block 0 (tokens 0..4) is shared; block 1 holds the first placeholder (token 7).
    assert_eq!(got["b"].1, 4, "prefix hits of the other image");
    assert_eq!(got["b"].0, alone, "no KV of the first image leaked");
    let encoded = items_encoded(&core);
    // The same image again: every full block before the last token hits, the encoder
    // does not run (the placeholder's KV is cached).
    let (a2, _) = fx.request(0, "a2");
    let got = run(&mut core, vec![a2]);
    assert_eq!(got["a2"].1, 20);
    assert_eq!(got["a2"].0, want_a);
    assert_eq!(items_encoded(&core), encoded);
}
