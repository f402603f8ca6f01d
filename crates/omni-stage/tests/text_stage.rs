//! A text LLM as the omni pipeline's Thinker stage (`TextNet`, the `text_speech` profile's stage
//! 0): it exports no states, so it reuses cached prompt blocks, and what it generates is the
//! same with and without them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use omni_protocol::{
    CodecWindowing, Device, EngineCoreRequest, LoadFormat, SamplingParams, StageInput, StageKind,
    StageOutputs, StageSpec,
};
use omni_stage::Stage;
use omni_stage::profile::StepClock;
use omni_stage::text_net::TextNet;
use omni_stage::thinker::ThinkerStage;

const BLOCK: u32 = 16;

fn spec(enable_prefix_caching: bool) -> StageSpec {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../omni-models/tests/fixtures/llama");
    StageSpec {
        stage_id: 0,
        replica: 0,
        kind: StageKind::Thinker,
        model: model.display().to_string(),
        tokenizer: String::new(),
        device: Device::Cpu,
        device_ordinal: 0,
        gpu_memory_utilization: 0.9,
        enforce_eager: true,
        load_format: LoadFormat::Safetensors,
        seed: 0,
        max_num_seqs: 4,
        max_num_batched_tokens: 256,
        max_model_len: 128,
        block_size: BLOCK,
        num_blocks: 32,
        enable_prefix_caching,
        async_chunk: true,
        windowing: CodecWindowing {
            initial: 1,
            chunk: 1,
            left_context: 0,
        },
        default_sampling: SamplingParams::greedy(8),
        cuda_profile_steps: 0,
        profile_interval_s: 0.0,
    }
}

/// Runs two requests one after the other (the second shares the first's 40-token prefix):
/// each one's generated tokens and the prompt tokens the stage reported cached.
fn run(enable_prefix_caching: bool) -> Vec<(Vec<u32>, u32)> {
    let spec = spec(enable_prefix_caching);
    let net = TextNet::load(&spec).unwrap();
    let mut stage = ThinkerStage::new(Box::new(net), &spec).unwrap();
    let prefix: Vec<u32> = (0..40).map(|i| 3 + i * 7 % 300).collect();
    let mut results = Vec::new();
    for (id, tail) in [("a", vec![11, 12]), ("b", vec![21, 22, 23])] {
        let prompt = [prefix.clone(), tail].concat();
        let req = EngineCoreRequest::new(id, prompt, SamplingParams::greedy(8), None);
        let mut out = StageOutputs::default();
        stage.input(StageInput::Add(Box::new(req)), &[], &mut out);
        assert!(out.rejected.is_empty() && out.failed.is_empty(), "{out:?}");
        let (mut tokens, mut cached, mut done) = (Vec::new(), 0, false);
        let mut clock = StepClock::default();
        for _ in 0..64 {
            if done || !stage.has_work() {
                break;
            }
            let (step, _) = stage.step(&mut clock).unwrap();
            assert!(step.failed.is_empty(), "{:?}", step.failed);
            for o in step.outputs.iter().filter(|o| o.request_id == id) {
                tokens.extend_from_slice(&o.new_token_ids);
                cached = cached.max(o.num_cached_tokens);
                done |= o.finished();
            }
        }
        assert!(done, "request {id} did not finish in 64 steps");
        results.push((tokens, cached));
    }
    results
}

#[test]
fn a_text_stage_reuses_a_shared_prefix_and_generates_the_same_tokens() {
    let cold = run(false);
    let warm = run(true);
    assert_eq!(cold[0].0.len(), 8);
    assert_eq!(cold, [(cold[0].0.clone(), 0), (cold[1].0.clone(), 0)]);
    // The 40 shared tokens fill two 16-token blocks; the second request reuses both.
    assert_eq!(warm[0].1, 0);
    assert_eq!(warm[1].1, 2 * BLOCK);
    assert_eq!(warm[0].0, cold[0].0);
    assert_eq!(warm[1].0, cold[1].0);
}
