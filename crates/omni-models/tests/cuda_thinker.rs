//! The Qwen3-Omni Thinker on a CUDA GPU: its hidden-state export (layer 0's input and the
//! residual stream after `accept_hidden_layer` layers) against the f32 CPU Thinker on the tiny
//! fixture, at prefill (eager) and at decode (CUDA graphs). Feature `cuda`; SKIPs without a
//! driver. Positions from the first MoE routing near-tie on (`ROUTE_TOL`) are not compared:
//! bf16 may flip such a choice, and later positions attend to it (as in cuda_reference.rs).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

mod common;

use common::{BLOCK_SIZE, Blocks, NUM_BLOCKS, config, dir, fro_err, reference_json};
use omni_models::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, StepLimits};
use omni_models::hf_dir::SafetensorsDir;
use omni_models::registry::{causal_lm_weights, decoder_spec};
use omni_models::{
    Capture, DecoderModel, ForwardBatch, ModelInputs, PositionInputs, SeqChunk, StageModel,
    TokenInputs, TpContext,
};

const FIXTURE: &str = "qwen3-omni";
const TOL: f32 = 2e-2;
const ROUTE_TOL: f32 = 0.05;

#[test]
fn gpu_thinker_exports_match_the_cpu_thinker() {
    let Some(cx) = common::gpu_or_skip("gpu_thinker_exports_match_the_cpu_thinker") else {
        return;
    };
    let c = config(FIXTURE);
    let accept = c["talker_config"]["accept_hidden_layer"].as_u64().unwrap() as usize;
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    let view = causal_lm_weights(&c, &ws).unwrap();
    let cpu = DecoderModel::load(decoder_spec(&c).unwrap(), &view, TpContext::single()).unwrap();
    cpu.enable_routing_trace();
    let mut gpu = CudaDecoderModel::load(
        cx,
        decoder_spec(&c).unwrap(),
        &view,
        DeviceWeightInit::Host,
        0,
        1,
        None,
        StepLimits {
            max_tokens: 256,
            max_seqs: 4,
            max_model_len: 128,
            block_size: BLOCK_SIZE,
        },
        &|_, _| {},
    )
    .unwrap();
    gpu.set_capture_after_layers(Some(accept)).unwrap();
    gpu.init_cache(NUM_BLOCKS, BLOCK_SIZE).unwrap();
    gpu.capture_decode_graphs(&[1, 2, 4]).unwrap();
    let r = reference_json(FIXTURE);
    let h = cpu.spec().hidden_size;
    let capture = [Capture::Embedding, Capture::AfterLayers(accept)];
    let mut compared = 0;
    for (i, p) in r["thinker.prompts"].as_array().unwrap().iter().enumerate() {
        let mut seq: Vec<u32> = serde_json::from_value(p.clone()).unwrap();
        let greedy: Vec<u32> =
            serde_json::from_value(r[format!("thinker.greedy.{i}").as_str()].clone()).unwrap();
        let mut cpu_kv = StageModel::kv_cache_spec(&cpu)
            .unwrap()
            .allocate(NUM_BLOCKS, BLOCK_SIZE);
        let table = Blocks::new().table(seq.len() + greedy.len());
        let mut tie_seen = false;
        // Prefill (eager), then decode steps along the reference tokens (graph replays).
        let mut start = 0;
        let mut chunk_len = seq.len();
        for step in 0..=greedy.len() {
            let tokens = seq[start..start + chunk_len].to_vec();
            let chunk = SeqChunk {
                tokens: &tokens,
                start_pos: start,
                block_table: &table,
            };
            let batch = ForwardBatch::from_chunks(&[chunk], BLOCK_SIZE).unwrap();
            let out = cpu
                .forward(
                    &ModelInputs {
                        batch: &batch,
                        tokens: TokenInputs::Ids,
                        positions: PositionInputs::Batch,
                        mm_features: &[],
                        capture: &capture,
                    },
                    &mut cpu_kv,
                )
                .unwrap();
            let margins = cpu.routing_margins();
            gpu.forward(&batch).unwrap();
            let (embed, after) = gpu.captured_to_host().unwrap();
            let after = after.unwrap();
            assert_eq!(embed.len(), tokens.len() * h);
            // Layer 0's input is the bf16 embedding row: exact.
            assert_eq!(embed, out.hidden_states[0].1.data, "prompt {i} step {step}");
            let ok = margins
                .iter()
                .position(|&m| m < ROUTE_TOL)
                .unwrap_or(tokens.len());
            let upto = if tie_seen { 0 } else { ok };
            tie_seen |= ok < tokens.len();
            if upto > 0 {
                let e = fro_err(&after[..upto * h], &out.hidden_states[1].1.data[..upto * h]);
                assert!(
                    e <= TOL,
                    "prompt {i} step {step}: after {accept} layers rel err {e}"
                );
                compared += upto;
            }
            if step == greedy.len() {
                break;
            }
            seq.push(greedy[step]);
            start = seq.len() - 1;
            chunk_len = 1;
        }
    }
    println!("compared {compared} positions before routing near-ties");
    assert!(compared > 0, "every position was after a near-tie");
}
