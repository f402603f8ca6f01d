//! The Qwen3-Omni Thinker's multimodal forward on a CUDA GPU (placeholder rows replaced by the
//! encoder outputs, M-RoPE rows in the rotary kernel, deepstack added after the first layers)
//! against transformers on the tiny `qwen3-omni-mm` fixture: each request's logits within bf16
//! tolerance and its greedy tokens, alone and all four in one batch. Feature `cuda`; SKIPs
//! without a driver. The encoders here are the host towers (`ThinkerMm`), exact against
//! transformers, so what is measured is the device decoder's multimodal path.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

mod common;
mod mm_fixture;

use common::{Blocks, NUM_BLOCKS, config, dir, reference_json, reference_tensor, rel_err};
use mm_fixture::{FIXTURE, columns, features, items, request_ids, request_positions};
use omni_models::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, MmStep, StepLimits};
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::thinker_mm::ThinkerMm;
use omni_models::registry::{causal_lm_weights, decoder_spec};
use omni_models::{EncoderOutput, ForwardBatch, MultiModalFeature, SeqChunk};
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

/// Greedy decode from `first` for `n - 1` more tokens at 1-D positions `p + delta`.
fn decode(
    gpu: &mut CudaDecoderModel,
    table: &[u32],
    start: usize,
    delta: i64,
    first: u32,
    n: usize,
) -> Vec<u32> {
    let vocab = gpu.vocab_size();
    let mut tok = first;
    let mut out = vec![tok];
    for p in start..start + n - 1 {
        let mut batch = ForwardBatch::from_chunks(
            &[SeqChunk {
                tokens: &[tok],
                start_pos: p,
                block_table: table,
            }],
            BLOCK,
        )
        .unwrap();
        batch.positions = vec![(p as i64 + delta) as usize];
        gpu.forward(&batch).unwrap();
        tok = common::argmax(&gpu.logits_to_host().unwrap()[..vocab]);
        out.push(tok);
    }
    out
}

fn requests(r: &Value) -> Vec<Value> {
    r["requests"].as_array().unwrap().clone()
}

#[test]
fn gpu_mm_requests_match_transformers_logits_and_greedy_tokens() {
    let Some(cx) =
        common::gpu_or_skip("gpu_mm_requests_match_transformers_logits_and_greedy_tokens")
    else {
        return;
    };
    let (mut gpu, mm) = load(cx);
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let cols: Vec<usize> = serde_json::from_value(r["logit_ids"].clone()).unwrap();
    let vocab = gpu.vocab_size();
    let mut blocks = Blocks::new();
    for (i, req) in requests(&r).iter().enumerate() {
        let ids = request_ids(req);
        let want: Vec<u32> = serde_json::from_value(req["greedy"].clone()).unwrap();
        let table = blocks.table(ids.len() + want.len());
        let chunk = SeqChunk {
            tokens: &ids,
            start_pos: 0,
            block_table: &table,
        };
        let logits = prefill(
            &mut gpu,
            &mm,
            &[chunk],
            &request_positions(req),
            &features(req, &it, 0),
        );
        let (ref_logits, _) = reference_tensor(FIXTURE, &format!("req.{i}.logits"));
        let e = rel_err(&columns(&logits, vocab, &cols), &ref_logits);
        println!(
            "request {i}: {} tokens, logits rel err {e:.2e} (bf16)",
            ids.len()
        );
        assert!(e <= TOL, "request {i}: logits rel err {e}");
        let first = common::argmax(&logits[(ids.len() - 1) * vocab..]);
        let delta = req["rope_delta"].as_i64().unwrap();
        let got = decode(&mut gpu, &table, ids.len(), delta, first, want.len());
        assert_eq!(got, want, "request {i}: greedy tokens");
    }
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
