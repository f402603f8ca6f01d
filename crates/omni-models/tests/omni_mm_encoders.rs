//! Qwen3-Omni's audio and vision towers and the Thinker's multimodal forward (placeholder
//! merge, deepstack, M-RoPE) against transformers (`scripts/make_omni_mm_fixtures.py`): a tiny
//! random Thinker with the real token ids, f32 references computed from the same bf16 weights
//! and bf16 inputs.
#![allow(clippy::unwrap_used)]

mod common;
mod mm_fixture;

use common::{BLOCK_SIZE, Blocks, NUM_BLOCKS, dir, reference_json, reference_tensor, rel_err};
use mm_fixture::{FIXTURE, bf16_to_f32, columns, features, items, request_ids, request_positions};
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::thinker::Thinker;
use omni_models::{
    EncoderOutput, ForwardBatch, LayerKvCache, ModelInputs, MropePositions, MultiModalFeature,
    MultiModalKind, PositionInputs, SeqChunk, StageModel, TokenInputs, TpContext,
};

fn load_thinker() -> Thinker {
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    Thinker::load(&common::config(FIXTURE), &ws, TpContext::single()).unwrap()
}

fn cache(m: &dyn StageModel) -> Vec<LayerKvCache> {
    m.kv_cache_spec().unwrap().allocate(NUM_BLOCKS, BLOCK_SIZE)
}

#[test]
fn vision_tower_matches_transformers_for_images_and_a_video_in_one_call() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let tower = thinker.vision_encoder().unwrap();
    let out = tower.encode(&bf16_to_f32(&it.pixels), &it.grids).unwrap();
    let (want, shape) = reference_tensor(FIXTURE, "vision.merged");
    assert_eq!(out.merged.shape, shape);
    let e = rel_err(&out.merged.data, &want);
    assert!(e <= 1e-4, "merged: rel err {e}");
    assert_eq!(out.deepstack.len(), 2);
    for (j, d) in out.deepstack.iter().enumerate() {
        let (want, _) = reference_tensor(FIXTURE, &format!("vision.deepstack.{j}"));
        let e = rel_err(&d.data, &want);
        assert!(e <= 1e-4, "deepstack {j}: rel err {e}");
    }
    println!("vision tower rel err {e:.2e}");
}

#[test]
fn audio_tower_matches_transformers_across_chunks_and_attention_windows() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let tower = thinker.audio_encoder().unwrap();
    for (k, &frames) in it.frames.iter().enumerate() {
        let out = tower
            .encode(&bf16_to_f32(&it.audio_bytes[k]), frames)
            .unwrap();
        let (want, shape) = reference_tensor(FIXTURE, &format!("audio.out.{k}"));
        assert_eq!(out.shape, shape);
        assert_eq!(shape[0], tower.config().output_len(frames));
        let e = rel_err(&out.data, &want);
        assert!(e <= 1e-4, "clip {k} ({frames} frames): rel err {e}");
        println!(
            "audio clip {k}: {frames} frames, {} tokens, rel err {e:.2e}",
            shape[0]
        );
    }
}

/// One forward of one sequence chunk: all-position logits.
fn prefill(
    thinker: &Thinker,
    kv: &mut [LayerKvCache],
    chunks: &[SeqChunk<'_>],
    rows: &MropePositions,
    mm: &[MultiModalFeature<'_>],
) -> Vec<f32> {
    let batch = ForwardBatch::from_chunks(chunks, BLOCK_SIZE)
        .unwrap()
        .with_all_logits();
    let inputs = ModelInputs {
        batch: &batch,
        tokens: TokenInputs::Ids,
        positions: PositionInputs::Mrope(rows),
        mm_features: mm,
        capture: &[],
    };
    thinker.forward(&inputs, kv).unwrap().logits.unwrap().data
}

#[test]
fn requests_match_transformers_logits_and_greedy_tokens() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let cols: Vec<usize> = serde_json::from_value(r["logit_ids"].clone()).unwrap();
    let vocab = thinker.config().thinker_config.text_config.vocab_size;
    for (i, req) in r["requests"].as_array().unwrap().iter().enumerate() {
        let ids = request_ids(req);
        let n_new = req["greedy"].as_array().unwrap().len();
        let table = Blocks::new().table(ids.len() + n_new);
        let mut kv = cache(&thinker);
        let rows = MropePositions {
            rows: request_positions(req),
        };
        let chunk = SeqChunk {
            tokens: &ids,
            start_pos: 0,
            block_table: &table,
        };
        let logits = prefill(&thinker, &mut kv, &[chunk], &rows, &features(req, &it, 0));
        let (want, _) = reference_tensor(FIXTURE, &format!("req.{i}.logits"));
        let e = rel_err(&columns(&logits, vocab, &cols), &want);
        assert!(e <= 1e-4, "request {i}: logits rel err {e}");
        println!("request {i}: {} tokens, logits rel err {e:.2e}", ids.len());

        let delta = req["rope_delta"].as_i64().unwrap();
        let mut tok = common::argmax(&logits[(ids.len() - 1) * vocab..]);
        let mut greedy = vec![tok];
        for p in ids.len()..ids.len() + n_new - 1 {
            let q = p as i64 + delta;
            let rows = MropePositions {
                rows: [vec![q], vec![q], vec![q]],
            };
            let chunk = SeqChunk {
                tokens: &[tok],
                start_pos: p,
                block_table: &table,
            };
            tok = common::argmax(&prefill(&thinker, &mut kv, &[chunk], &rows, &[]));
            greedy.push(tok);
        }
        let want: Vec<u32> = serde_json::from_value(req["greedy"].clone()).unwrap();
        assert_eq!(greedy, want, "request {i}: greedy tokens");
    }
}

#[test]
fn a_batch_of_all_requests_equals_each_alone() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let reqs = r["requests"].as_array().unwrap();
    let vocab = thinker.config().thinker_config.text_config.vocab_size;
    let ids: Vec<Vec<u32>> = reqs.iter().map(request_ids).collect();
    let mut blocks = Blocks::new();
    let tables: Vec<Vec<u32>> = ids.iter().map(|s| blocks.table(s.len())).collect();
    let mut alone = Vec::new();
    for (req, (s, table)) in reqs.iter().zip(ids.iter().zip(&tables)) {
        let rows = MropePositions {
            rows: request_positions(req),
        };
        let chunk = SeqChunk {
            tokens: s,
            start_pos: 0,
            block_table: table,
        };
        alone.extend(prefill(
            &thinker,
            &mut cache(&thinker),
            &[chunk],
            &rows,
            &features(req, &it, 0),
        ));
    }
    let mut rows: [Vec<i64>; 3] = Default::default();
    let mut mm = Vec::new();
    let mut shift = 0;
    for (req, s) in reqs.iter().zip(&ids) {
        for (dst, src) in rows.iter_mut().zip(request_positions(req)) {
            dst.extend(src);
        }
        mm.extend(features(req, &it, shift));
        shift += s.len();
    }
    let chunks: Vec<SeqChunk<'_>> = ids
        .iter()
        .zip(&tables)
        .map(|(s, t)| SeqChunk {
            tokens: s,
            start_pos: 0,
            block_table: t,
        })
        .collect();
    let together = prefill(
        &thinker,
        &mut cache(&thinker),
        &chunks,
        &MropePositions { rows },
        &mm,
    );
    let e = rel_err(&together, &alone);
    assert!(e <= 1e-5, "batched vs alone: rel err {e}");
    assert_eq!(together.len() / vocab, shift);
}

#[test]
fn an_image_split_across_two_prefill_steps_equals_one_step() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let req = &r["requests"][0];
    let ids = request_ids(req);
    let pos = request_positions(req);
    let table = Blocks::new().table(ids.len());
    let whole = features(req, &it, 0);
    let one = prefill(
        &thinker,
        &mut cache(&thinker),
        &[SeqChunk {
            tokens: &ids,
            start_pos: 0,
            block_table: &table,
        }],
        &MropePositions { rows: pos.clone() },
        &whole,
    );
    let ph = whole[0].placeholder.clone();
    let cut = ph.start + ph.len() / 2;
    let part = |range: std::ops::Range<usize>| MropePositions {
        rows: pos.clone().map(|r| r[range.clone()].to_vec()),
    };
    // Step 1 encodes the image itself; step 2 reuses the cached encoder output.
    let mut kv = cache(&thinker);
    let mut first = whole[0].clone();
    first.placeholder = ph.start..cut;
    let a = prefill(
        &thinker,
        &mut kv,
        &[SeqChunk {
            tokens: &ids[..cut],
            start_pos: 0,
            block_table: &table,
        }],
        &part(0..cut),
        &[first],
    );
    let encoded: EncoderOutput = thinker.encode_mm(&whole[0]).unwrap();
    let mut second = whole[0].clone();
    second.placeholder = 0..ph.end - cut;
    second.item_offset = cut - ph.start;
    let batch = ForwardBatch::from_chunks(
        &[SeqChunk {
            tokens: &ids[cut..],
            start_pos: cut,
            block_table: &table,
        }],
        BLOCK_SIZE,
    )
    .unwrap()
    .with_all_logits();
    let rows = part(cut..ids.len());
    let b = thinker
        .forward_encoded(
            &ModelInputs {
                batch: &batch,
                tokens: TokenInputs::Ids,
                positions: PositionInputs::Mrope(&rows),
                mm_features: &[second],
                capture: &[],
            },
            &[&encoded],
            &mut kv,
        )
        .unwrap()
        .logits
        .unwrap()
        .data;
    let two: Vec<f32> = a.into_iter().chain(b).collect();
    let e = rel_err(&two, &one);
    assert!(e <= 1e-5, "two steps vs one: rel err {e}");
}

#[test]
fn misplaced_placeholders_are_refused() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let it = items(&r);
    let req = &r["requests"][0];
    let ids = request_ids(req);
    let table = Blocks::new().table(ids.len());
    let mut f = features(req, &it, 0);
    f[0].placeholder = f[0].placeholder.start - 1..f[0].placeholder.end - 1;
    let batch = ForwardBatch::from_chunks(
        &[SeqChunk {
            tokens: &ids,
            start_pos: 0,
            block_table: &table,
        }],
        BLOCK_SIZE,
    )
    .unwrap();
    let rows = MropePositions {
        rows: request_positions(req),
    };
    let err = thinker
        .forward(
            &ModelInputs {
                batch: &batch,
                tokens: TokenInputs::Ids,
                positions: PositionInputs::Mrope(&rows),
                mm_features: &f,
                capture: &[],
            },
            &mut cache(&thinker),
        )
        .unwrap_err();
    assert!(err.to_string().contains("holds token"), "{err}");
}

#[test]
fn mrope_positions_of_each_request_match_transformers() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let it = items(&r);
    for (i, req) in r["requests"].as_array().unwrap().iter().enumerate() {
        let kinds: Vec<MultiModalKind> = features(req, &it, 0).iter().map(|f| f.kind).collect();
        let (rows, delta) = thinker
            .mrope_positions(&request_ids(req), &kinds)
            .unwrap()
            .unwrap();
        assert_eq!(rows.rows, request_positions(req), "request {i}");
        assert_eq!(delta, req["rope_delta"].as_i64().unwrap(), "request {i}");
    }
}
