//! The scheduler's multimodal bookkeeping: items ride `NewRequestData` once with their bytes as
//! the step's buffers, each item is scheduled for encoding in the step its placeholder starts,
//! once per content hash among running requests, within the encoder budget, and freed (told
//! to the workers) when no running request needs it.

#![allow(clippy::unwrap_used)]

use omni_core::{Scheduler, SchedulerConfig};
use omni_protocol::{
    AddRequestError, DType, EngineCoreRequest, MmKind, ModelRunnerOutput, MultiModalFeatureSpec,
    SamplingParams, SchedulerOutput, TensorRef,
};

const PAD: u32 = 9;

/// A request of `len` tokens with one image of `n` placeholder tokens per `(offset, n, hash)`.
fn request(id: &str, len: usize, items: &[(u32, u32, u64)]) -> EngineCoreRequest {
    let mut ids: Vec<u32> = (0..len as u32).map(|i| 100 + i).collect();
    let mut r = EngineCoreRequest::new(id, Vec::new(), SamplingParams::greedy(2), None);
    for &(offset, n, hash) in items {
        for p in offset..offset + n {
            ids[p as usize] = PAD;
        }
        let bytes = vec![hash as u8; n as usize * 4 * 2];
        let buffer_index = r.mm_buffers.push(bytes.into());
        r.mm_features.push(MultiModalFeatureSpec {
            mm_hash: hash,
            offset,
            length: n,
            kind: MmKind::Image {
                grid_thw: [1, 2, 2 * n],
            },
            tensor: TensorRef {
                name: "pixel_values".into(),
                request_id: None,
                dtype: DType::Bf16,
                shape: vec![u64::from(n), 4],
                buffer_index,
            },
        });
    }
    r.prompt_token_ids = ids;
    r
}

fn scheduler(max_num_batched_tokens: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        max_num_batched_tokens,
        max_model_len: 256,
        block_size: 4,
        num_blocks: 256,
        enable_prefix_caching: false,
        ..Default::default()
    })
    .unwrap()
}

/// One step: schedule, then a model that samples token 5 for every request.
fn step(s: &mut Scheduler) -> SchedulerOutput {
    let so = s.schedule();
    let req_ids: Vec<String> = so.num_scheduled_tokens.keys().cloned().collect();
    let out = ModelRunnerOutput {
        sampled_token_ids: vec![vec![5]; req_ids.len()],
        req_ids,
        ..Default::default()
    };
    s.update_from_output(&so, &out);
    so
}

fn encoded(so: &SchedulerOutput, id: &str) -> Vec<u32> {
    so.scheduled_encoder_inputs
        .get(id)
        .cloned()
        .unwrap_or_default()
}

#[test]
fn items_ride_the_first_scheduling_once_with_their_bytes_as_buffers() {
    let mut s = scheduler(64);
    s.add_request(request("a", 20, &[(2, 3, 0xA1), (10, 4, 0xA2)]))
        .unwrap();
    let so = step(&mut s);
    let new = &so.scheduled_new_reqs[0];
    assert_eq!(new.mm_features.len(), 2);
    assert_eq!(so.buffers.len(), 2);
    for f in &new.mm_features {
        let b = so.buffers.get(f.tensor.buffer_index as usize).unwrap();
        assert_eq!(b.len() as u64, f.tensor.num_bytes());
        assert!(b.iter().all(|&x| x == f.mm_hash as u8));
    }
    assert_eq!(so.tensor_views(&so.buffers.as_slices()).unwrap().len(), 2);
    assert_eq!(encoded(&so, "a"), vec![0, 1]);
    // The next step is a decode: nothing multimodal travels again.
    let so = step(&mut s);
    assert!(so.scheduled_new_reqs.is_empty() && so.buffers.is_empty());
    assert!(so.scheduled_encoder_inputs.is_empty());
    // Both placeholders were computed in step 1: freed, and told to the workers now.
    let mut freed = so.free_encoder_mm_hashes.clone();
    freed.sort_unstable();
    assert_eq!(freed, vec![0xA1, 0xA2]);
    assert_eq!(s.encoder_cache_manager().num_entries(), 0);
}

#[test]
fn a_chunked_prefill_encodes_an_item_in_the_step_its_placeholder_starts() {
    // Budget 5: steps cover 0..5, 5..10, 10..15, 15..16; the image sits at 3..11.
    let mut s = scheduler(5);
    s.add_request(request("a", 16, &[(3, 8, 0xB)])).unwrap();
    let steps: Vec<SchedulerOutput> = (0..4).map(|_| step(&mut s)).collect();
    assert_eq!(encoded(&steps[0], "a"), vec![0]);
    assert!(
        steps[1..]
            .iter()
            .all(|so| so.scheduled_encoder_inputs.is_empty())
    );
    // Held through step 2 (which computes 5..10), freed once 3..11 is in the KV cache.
    assert!(steps[1].free_encoder_mm_hashes.is_empty());
    assert!(steps[2].free_encoder_mm_hashes.is_empty());
    assert_eq!(steps[3].free_encoder_mm_hashes, vec![0xB]);
    assert_eq!(s.encoder_cache_manager().num_scheduled(), 1);
}

#[test]
fn the_same_content_in_one_batch_is_encoded_once() {
    let mut s = scheduler(64);
    // Two requests with the same image, and one request with it twice.
    s.add_request(request("a", 12, &[(2, 4, 0xC)])).unwrap();
    s.add_request(request("b", 12, &[(5, 4, 0xC)])).unwrap();
    s.add_request(request("c", 16, &[(1, 4, 0xC), (8, 4, 0xC)]))
        .unwrap();
    let so = step(&mut s);
    assert_eq!(so.scheduled_new_reqs.len(), 3);
    assert_eq!(encoded(&so, "a"), vec![0]);
    assert!(encoded(&so, "b").is_empty() && encoded(&so, "c").is_empty());
    assert_eq!(s.encoder_cache_manager().num_scheduled(), 1);
    // Freed once, when the last reference is gone.
    assert_eq!(step(&mut s).free_encoder_mm_hashes, vec![0xC]);
}

#[test]
fn an_item_over_the_step_budget_waits_and_the_tokens_before_it_run() {
    let mut s = scheduler(64);
    s.set_encoder_budget(8, 6);
    s.add_request(request("a", 12, &[(2, 5, 0xD1)])).unwrap();
    s.add_request(request("b", 12, &[(3, 4, 0xD2)])).unwrap();
    let so = step(&mut s);
    assert_eq!(encoded(&so, "a"), vec![0]);
    // b's image does not fit the 6-embedding budget after a's 5: only its 3 leading tokens.
    assert_eq!(so.num_scheduled_tokens["b"], 3);
    assert!(encoded(&so, "b").is_empty());
    let so = step(&mut s);
    assert_eq!(encoded(&so, "b"), vec![0]);
    assert_eq!(so.free_encoder_mm_hashes, vec![0xD1]);
    assert_eq!(so.num_scheduled_tokens["b"], 9);
}

#[test]
fn an_aborted_request_frees_its_entries() {
    let mut s = scheduler(4);
    s.add_request(request("a", 12, &[(2, 6, 0xE)])).unwrap();
    let so = step(&mut s);
    assert_eq!(encoded(&so, "a"), vec![0]);
    s.abort_requests(["a"]);
    let so = s.schedule();
    assert_eq!(so.free_encoder_mm_hashes, vec![0xE]);
    assert_eq!(so.finished_req_ids, vec!["a".to_string()]);
    assert_eq!(s.encoder_cache_manager().num_free(), 256);
}

#[test]
fn items_that_do_not_match_their_prompt_or_bytes_are_refused() {
    let mut s = scheduler(64);
    let mut r = request("a", 12, &[(2, 4, 1)]);
    r.mm_features[0].length = 20;
    assert!(matches!(
        s.add_request(r),
        Err(AddRequestError::InvalidMultiModal { .. })
    ));
    let mut r = request("b", 12, &[(2, 4, 1)]);
    r.mm_buffers = Default::default();
    assert!(matches!(
        s.add_request(r),
        Err(AddRequestError::InvalidMultiModal { .. })
    ));
    let r = request("c", 12, &[(6, 4, 1), (2, 2, 2)]);
    let e = s.add_request(r).unwrap_err().to_string();
    assert!(e.contains("out of order"), "{e}");
}
