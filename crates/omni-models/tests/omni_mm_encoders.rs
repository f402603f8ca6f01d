//! Qwen3-Omni's audio and vision towers and the Thinker's multimodal forward (placeholder
//! merge, deepstack, M-RoPE) against transformers (`scripts/make_omni_mm_fixtures.py`): a tiny
//! random Thinker with the real token ids, f32 references computed from the same bf16 weights
//! and bf16 inputs.
#![allow(clippy::unwrap_used)]

mod common;

use common::{BLOCK_SIZE, Blocks, NUM_BLOCKS, dir, reference_json, reference_tensor, rel_err};
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::thinker::Thinker;
use omni_models::{
    EncoderOutput, ForwardBatch, LayerKvCache, ModelInputs, MropePositions, MultiModalFeature,
    MultiModalKind, PositionInputs, SeqChunk, StageModel, TokenInputs, TpContext,
};
use serde_json::Value;

const FIXTURE: &str = "qwen3-omni-mm";

fn load_thinker() -> Thinker {
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    Thinker::load(&common::config(FIXTURE), &ws, TpContext::single()).unwrap()
}

fn cache(m: &dyn StageModel) -> Vec<LayerKvCache> {
    m.kv_cache_spec().unwrap().allocate(NUM_BLOCKS, BLOCK_SIZE)
}

/// A bf16 tensor of `reference.safetensors` as its raw little-endian bytes, and its shape.
fn bf16_tensor(key: &str) -> (Vec<u8>, Vec<usize>) {
    let bytes = std::fs::read(dir(FIXTURE).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(key).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::BF16, "{key}");
    (t.data().to_vec(), t.shape().to_vec())
}

fn bf16_to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

/// The fixture's multimodal items as wire bytes: images (rows of `vision.pixel_values`) and
/// audio clips.
struct Items {
    grids: Vec<[usize; 3]>,
    pixels: Vec<u8>,
    image_bytes: Vec<Vec<u8>>,
    frames: Vec<usize>,
    audio_bytes: Vec<Vec<u8>>,
}

fn items(r: &Value) -> Items {
    let grids: Vec<[usize; 3]> = serde_json::from_value(r["vision.grid_thw"].clone()).unwrap();
    let (pixels, shape) = bf16_tensor("vision.pixel_values");
    let row = shape[1] * 2;
    let mut start = 0;
    let image_bytes = grids
        .iter()
        .map(|g| {
            let n = g[0] * g[1] * g[2];
            start += n;
            pixels[(start - n) * row..start * row].to_vec()
        })
        .collect();
    let frames: Vec<usize> = serde_json::from_value(r["audio.frames"].clone()).unwrap();
    let audio_bytes = (0..frames.len())
        .map(|k| bf16_tensor(&format!("audio.features.{k}")).0)
        .collect();
    Items {
        grids,
        pixels,
        image_bytes,
        frames,
        audio_bytes,
    }
}

/// Request `req`'s items as features whose placeholders start `shift` rows into the batch.
fn features<'a>(req: &Value, it: &'a Items, shift: usize) -> Vec<MultiModalFeature<'a>> {
    req["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| {
            let (off, len) = (
                item["offset"].as_u64().unwrap() as usize,
                item["len"].as_u64().unwrap() as usize,
            );
            let i = item["index"].as_u64().unwrap() as usize;
            let (kind, data) = match item["modality"].as_str().unwrap() {
                "image" => (
                    MultiModalKind::Image {
                        grid_thw: it.grids[i],
                    },
                    &it.image_bytes[i],
                ),
                "audio" => (
                    MultiModalKind::Audio {
                        num_frames: it.frames[i],
                    },
                    &it.audio_bytes[i],
                ),
                m => panic!("{m}"),
            };
            MultiModalFeature {
                modality: kind.modality(),
                mm_hash: (i as u64) << 8 | len as u64,
                placeholder: shift + off..shift + off + len,
                item_offset: 0,
                kind,
                data,
            }
        })
        .collect()
}

fn request_ids(req: &Value) -> Vec<u32> {
    serde_json::from_value(req["ids"].clone()).unwrap()
}

fn request_positions(req: &Value) -> [Vec<i64>; 3] {
    serde_json::from_value(req["positions"].clone()).unwrap()
}

/// Our logits at the reference's columns.
fn columns(logits: &[f32], vocab: usize, cols: &[usize]) -> Vec<f32> {
    logits
        .chunks_exact(vocab)
        .flat_map(|row| cols.iter().map(|&c| row[c]))
        .collect()
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
