//! Images and audio through the in-process engine (EngineCore + scheduler + encoder cache
//! manager + UniprocExecutor + Worker + Qwen3-Omni's Thinker with both towers) on the tiny
//! transformers fixture `qwen3-omni-mm`: requests carry the fixture's preprocessed tensors as
//! their items' buffers, and the greedy tokens must be transformers' (fixture pixels are random,
//! so the requests are built here rather than from image files; the server test sends a PNG).

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;

use omni_core::{EngineCore, SchedulerConfig, StartupSpec, UniprocExecutor};
use omni_protocol::{
    DType, EngineCoreRequest, LoadFormat, LoadModelSpec, MmKind, MultiModalFeatureSpec,
    SamplingParams, TensorRef,
};
use omni_worker::Worker;
use serde_json::Value;

type Core = EngineCore<UniprocExecutor<Worker>>;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../omni-models/tests/fixtures/qwen3-omni-mm")
}

/// The fixture's requests and its items' wire bytes.
struct Fixture {
    requests: Vec<Value>,
    /// Per image: grid and bf16 pixel rows.
    images: Vec<([u32; 3], Vec<u8>)>,
    /// Per audio clip: frames and bf16 `[128, frames]`.
    audios: Vec<(u32, Vec<u8>)>,
}

fn load_fixture() -> Fixture {
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
            .unwrap();
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let grids: Vec<[u32; 3]> = serde_json::from_value(r["vision.grid_thw"].clone()).unwrap();
    let pixels = st.tensor("vision.pixel_values").unwrap();
    let row = pixels.shape()[1] * 2;
    let mut start = 0;
    let images = grids
        .iter()
        .map(|g| {
            let n = (g[0] * g[1] * g[2]) as usize;
            start += n;
            (*g, pixels.data()[(start - n) * row..start * row].to_vec())
        })
        .collect();
    let frames: Vec<u32> = serde_json::from_value(r["audio.frames"].clone()).unwrap();
    let audios = frames
        .iter()
        .enumerate()
        .map(|(k, &f)| {
            let t = st.tensor(&format!("audio.features.{k}")).unwrap();
            (f, t.data().to_vec())
        })
        .collect();
    Fixture {
        requests: r["requests"].as_array().unwrap().clone(),
        images,
        audios,
    }
}

fn content_hash(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// One item of a request: kind, tensor shape and bytes.
fn item(kind: MmKind, shape: [u64; 2], bytes: &[u8], offset: u32, length: u32) -> Item {
    Item {
        kind,
        shape,
        bytes: bytes.to_vec(),
        offset,
        length,
    }
}

struct Item {
    kind: MmKind,
    shape: [u64; 2],
    bytes: Vec<u8>,
    offset: u32,
    length: u32,
}

fn request(id: &str, ids: Vec<u32>, items: Vec<Item>, max_tokens: u32) -> EngineCoreRequest {
    let mut r = EngineCoreRequest::new(id, ids, SamplingParams::greedy(max_tokens), None);
    for it in items {
        let mm_hash = content_hash(&it.bytes);
        let buffer_index = r.mm_buffers.push(it.bytes.into());
        r.mm_features.push(MultiModalFeatureSpec {
            mm_hash,
            offset: it.offset,
            length: it.length,
            kind: it.kind,
            tensor: TensorRef {
                name: it.kind.modality().into(),
                request_id: None,
                dtype: DType::Bf16,
                shape: it.shape.to_vec(),
                buffer_index,
            },
        });
    }
    r
}

impl Fixture {
    /// Fixture request `i` as an engine request, and its transformers greedy tokens.
    fn request(&self, i: usize, id: &str) -> (EngineCoreRequest, Vec<u32>) {
        let req = &self.requests[i];
        let ids: Vec<u32> = serde_json::from_value(req["ids"].clone()).unwrap();
        let items = req["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|it| {
                let k = it["index"].as_u64().unwrap() as usize;
                let (offset, length) = (
                    it["offset"].as_u64().unwrap() as u32,
                    it["len"].as_u64().unwrap() as u32,
                );
                match it["modality"].as_str().unwrap() {
                    "image" => {
                        let (g, b) = &self.images[k];
                        let rows = u64::from(g[0] * g[1] * g[2]);
                        let kind = MmKind::Image { grid_thw: *g };
                        item(kind, [rows, 1536], b, offset, length)
                    }
                    _ => {
                        let (f, b) = &self.audios[k];
                        let kind = MmKind::Audio { num_frames: *f };
                        item(kind, [128, u64::from(*f)], b, offset, length)
                    }
                }
            })
            .collect();
        let greedy: Vec<u32> = serde_json::from_value(req["greedy"].clone()).unwrap();
        let n = greedy.len() as u32;
        (request(id, ids, items, n), greedy)
    }
}

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
            model: fixture().display().to_string(),
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
    let fx = load_fixture();
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
    let fx = load_fixture();
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
    let fx = load_fixture();
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
    let fx = load_fixture();
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
