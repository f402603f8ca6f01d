//! The Qwen3-Omni Thinker's multimodal forward on a CUDA GPU (placeholder rows replaced by the
//! encoder outputs, M-RoPE rows in the rotary kernel, deepstack added after the first layers)
//! against the f32 CPU Thinker (itself exact against transformers) on the tiny `qwen3-omni-mm`
//! fixture: each request's prefill logits within bf16 tolerance before its first MoE routing
//! near-tie, all four requests batched equal to each alone, and M-RoPE with equal rows equal to
//! 1-D RoPE. Feature `cuda`; SKIPs
//! without a driver. The encoders here are the host towers (`ThinkerMm`), exact against
//! transformers, so what is measured is the device decoder's multimodal path.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

mod common;
mod mm_fixture;

use common::{Blocks, NUM_BLOCKS, config, dir, reference_json, rel_err};
use mm_fixture::{FIXTURE, features, items, request_ids, request_positions};
use omni_models::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, MmStep, StepLimits};
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::mm_merge::MergePlan;
use omni_models::qwen3_omni::thinker_mm::ThinkerMm;
use omni_models::registry::{causal_lm_weights, decoder_spec};
use omni_models::{
    DecoderModel, EncoderOutput, ForwardBatch, ModelInputs, MropePositions, MultiModalFeature,
    PositionInputs, ResidualAdds, SeqChunk, StageModel, TokenInputs, TpContext,
};
use serde_json::Value;

/// bf16 weights and activations against the f32 reference: the text tests' tolerance.
const TOL: f32 = 3e-2;
const BLOCK: usize = common::BLOCK_SIZE;

fn load(cx: std::sync::Arc<omni_backend::cuda::CudaContext>) -> (CudaDecoderModel, ThinkerMm) {
    let c = config(FIXTURE);
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    let mm = ThinkerMm::load(&c, Some(&ws)).unwrap();
    let view = causal_lm_weights(&c, &ws).unwrap();
    let mut gpu = CudaDecoderModel::load(
        cx,
        decoder_spec(&c).unwrap(),
        &view,
        DeviceWeightInit::Host,
        0,
        1,
        None,
        StepLimits {
            max_tokens: 512,
            max_seqs: 512,
            max_model_len: 256,
            block_size: BLOCK,
        },
        &|_, _| {},
    )
    .unwrap();
    gpu.init_cache(NUM_BLOCKS, BLOCK).unwrap();
    (gpu, mm)
}

/// One multimodal prefill of `chunks` (their features already shifted to batch rows and
/// their M-RoPE rows concatenated): all-position logits.
fn prefill(
    gpu: &mut CudaDecoderModel,
    mm: &ThinkerMm,
    chunks: &[SeqChunk<'_>],
    rows: &[Vec<i64>; 3],
    feats: &[MultiModalFeature<'_>],
) -> Vec<f32> {
    let batch = ForwardBatch::from_chunks(chunks, BLOCK)
        .unwrap()
        .with_all_logits();
    let encoded: Vec<EncoderOutput> = feats.iter().map(|f| mm.encode(f).unwrap()).collect();
    let encoded: Vec<&EncoderOutput> = encoded.iter().collect();
    let h = gpu.spec().hidden_size;
    let t = batch.input_ids.len();
    let plan = mm
        .plan(t, h, Some(&batch.input_ids), feats, &encoded)
        .unwrap();
    let step = MmStep {
        mrope: Some([&rows[0], &rows[1], &rows[2]]),
        embed_rows: &plan.embed_rows,
        visual_rows: &plan.visual_rows,
        deepstack: &plan.deepstack,
    };
    gpu.forward_mm(&batch, &step).unwrap();
    gpu.logits_to_host().unwrap()
}

fn requests(r: &Value) -> Vec<Value> {
    r["requests"].as_array().unwrap().clone()
}

/// The f32 CPU decoder's all-position logits for the same merged step, and its per-token MoE
/// routing margins.
fn cpu_prefill(
    cpu: &DecoderModel,
    plan: &MergePlan<'_>,
    ids: &[u32],
    table: &[u32],
    rows: &[Vec<i64>; 3],
) -> (Vec<f32>, Vec<f32>) {
    let h = cpu.spec().hidden_size;
    let mut embeds = cpu.embed_ids(ids).unwrap();
    plan.apply(&mut embeds, h);
    let chunk = SeqChunk {
        tokens: ids,
        start_pos: 0,
        block_table: table,
    };
    let batch = ForwardBatch::from_chunks(&[chunk], BLOCK)
        .unwrap()
        .with_all_logits();
    let positions = MropePositions { rows: rows.clone() };
    let inputs = ModelInputs {
        batch: &batch,
        tokens: TokenInputs::Embeds(&embeds),
        positions: PositionInputs::Mrope(&positions),
        mm_features: &[],
        capture: &[],
    };
    let adds = ResidualAdds {
        rows: &plan.visual_rows,
        after_layer: &plan.deepstack,
    };
    let mut kv = StageModel::kv_cache_spec(cpu)
        .unwrap()
        .allocate(NUM_BLOCKS, BLOCK);
    let out = cpu.forward_with_adds(&inputs, adds, &mut kv).unwrap();
    (out.logits.unwrap().data, cpu.routing_margins())
}

/// Positions from the first MoE routing near-tie on are not compared (a bf16 device may flip
/// such a choice, and later positions attend to it): as `cuda_thinker.rs`.
const ROUTE_TOL: f32 = 0.05;

#[test]
fn gpu_mm_prefill_matches_the_cpu_thinker_before_routing_near_ties() {
    let Some(cx) =
        common::gpu_or_skip("gpu_mm_prefill_matches_the_cpu_thinker_before_routing_near_ties")
    else {
        return;
    };
    let (mut gpu, mm) = load(cx);
    let c = config(FIXTURE);
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    let view = causal_lm_weights(&c, &ws).unwrap();
    let cpu = DecoderModel::load(decoder_spec(&c).unwrap(), &view, TpContext::single()).unwrap();
    cpu.enable_routing_trace();
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let vocab = gpu.vocab_size();
    let h = gpu.spec().hidden_size;
    let mut blocks = Blocks::new();
    let mut compared = 0;
    for (i, req) in requests(&r).iter().enumerate() {
        let ids = request_ids(req);
        let rows = request_positions(req);
        let feats = features(req, &it, 0);
        let encoded: Vec<EncoderOutput> = feats.iter().map(|f| mm.encode(f).unwrap()).collect();
        let encoded: Vec<&EncoderOutput> = encoded.iter().collect();
        let plan = mm.plan(ids.len(), h, Some(&ids), &feats, &encoded).unwrap();
        let table = blocks.table(ids.len());
        let (want, margins) = cpu_prefill(&cpu, &plan, &ids, &table, &rows);
        let chunk = SeqChunk {
            tokens: &ids,
            start_pos: 0,
            block_table: &table,
        };
        let got = prefill(&mut gpu, &mm, &[chunk], &rows, &feats);
        let ok = margins
            .iter()
            .position(|&m| m < ROUTE_TOL)
            .unwrap_or(ids.len());
        let all = rel_err(&got, &want);
        println!(
            "request {i}: {} tokens ({} items), first near-tie at {ok}; rel err {all:.2e} over \
             every position",
            ids.len(),
            feats.len()
        );
        for p in 0..ok {
            let e = rel_err(
                &got[p * vocab..(p + 1) * vocab],
                &want[p * vocab..(p + 1) * vocab],
            );
            assert!(e <= TOL, "request {i} position {p}: logits rel err {e}");
        }
        compared += ok;
    }
    println!("compared {compared} positions before routing near-ties");
    assert!(compared > 0, "every position was after a near-tie");
}

#[test]
fn gpu_mrope_with_equal_rows_is_plain_rope() {
    let Some(cx) = common::gpu_or_skip("gpu_mrope_with_equal_rows_is_plain_rope") else {
        return;
    };
    let (mut gpu, mm) = load(cx);
    let r = reference_json(FIXTURE);
    let text = requests(&r)
        .into_iter()
        .find(|q| q["items"].as_array().unwrap().is_empty())
        .unwrap();
    let ids = request_ids(&text);
    let table = Blocks::new().table(ids.len());
    let chunk = SeqChunk {
        tokens: &ids,
        start_pos: 0,
        block_table: &table,
    };
    let rows = request_positions(&text);
    assert!(rows[0] == rows[1] && rows[1] == rows[2]);
    let with_mrope = prefill(&mut gpu, &mm, &[chunk], &rows, &[]);
    let batch = ForwardBatch::from_chunks(&[chunk], BLOCK)
        .unwrap()
        .with_all_logits();
    gpu.forward(&batch).unwrap();
    let plain = gpu.logits_to_host().unwrap();
    assert_eq!(with_mrope, plain, "M-RoPE with equal rows vs 1-D RoPE");
}

#[test]
fn gpu_mm_batch_of_all_requests_equals_each_alone() {
    let Some(cx) = common::gpu_or_skip("gpu_mm_batch_of_all_requests_equals_each_alone") else {
        return;
    };
    let (mut gpu, mm) = load(cx);
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let reqs = requests(&r);
    let vocab = gpu.vocab_size();
    let mut blocks = Blocks::new();
    let ids: Vec<Vec<u32>> = reqs.iter().map(request_ids).collect();
    let tables: Vec<Vec<u32>> = ids.iter().map(|x| blocks.table(x.len())).collect();
    let mut alone = Vec::new();
    for (i, req) in reqs.iter().enumerate() {
        let chunk = SeqChunk {
            tokens: &ids[i],
            start_pos: 0,
            block_table: &tables[i],
        };
        let l = prefill(
            &mut gpu,
            &mm,
            &[chunk],
            &request_positions(req),
            &features(req, &it, 0),
        );
        alone.push(l);
    }
    let mut chunks = Vec::new();
    let mut rows: [Vec<i64>; 3] = Default::default();
    let mut feats = Vec::new();
    let mut shift = 0;
    for (i, req) in reqs.iter().enumerate() {
        chunks.push(SeqChunk {
            tokens: &ids[i],
            start_pos: 0,
            block_table: &tables[i],
        });
        for (dst, src) in rows.iter_mut().zip(request_positions(req)) {
            dst.extend(src);
        }
        feats.extend(features(req, &it, shift));
        shift += ids[i].len();
    }
    let batched = prefill(&mut gpu, &mm, &chunks, &rows, &feats);
    let mut start = 0;
    for (i, a) in alone.iter().enumerate() {
        let n = ids[i].len() * vocab;
        let e = rel_err(&batched[start..start + n], a);
        println!("request {i}: batched vs alone rel err {e:.2e}");
        // The same bf16 math row by row; only the GEMM tiling may differ with the batch size.
        assert!(e <= 1e-2, "request {i}: batched vs alone rel err {e}");
        start += n;
    }
}
