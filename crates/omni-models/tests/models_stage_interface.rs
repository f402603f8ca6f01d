//! The stage-model interface on the CPU decoder, against the transformers references and the
//! checkpoint's own tensors: logits through `StageModel` equal transformers'; input embeddings
//! in give the ids' logits; the captured layer-0 input is the embedding table's rows; the
//! captured state after the last layer, normed and through the head, is the logits.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use omni_models::hf_dir::SafetensorsDir;
use omni_models::registry::build_stage_model;
use omni_models::{
    Capture, ForwardBatch, ModelInputs, ModelStage, MropePositions, MultiModalFeature,
    MultiModalKind, PositionInputs, SeqChunk, StageModel, TokenInputs, TpContext, WeightSource,
};

fn stage_model(arch: &str) -> Box<dyn StageModel> {
    let w = SafetensorsDir::open(&dir(arch)).unwrap();
    build_stage_model(&config(arch), ModelStage::CausalLm, &w, TpContext::single()).unwrap()
}

fn all_rows(ids: &[u32], table: &[u32]) -> ForwardBatch {
    ForwardBatch::from_chunks(
        &[SeqChunk {
            tokens: ids,
            start_pos: 0,
            block_table: table,
        }],
        BLOCK_SIZE,
    )
    .unwrap()
    .with_all_logits()
}

fn cache(m: &dyn StageModel) -> Vec<omni_models::LayerKvCache> {
    m.kv_cache_spec().unwrap().allocate(NUM_BLOCKS, BLOCK_SIZE)
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(h) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| v * r * g));
    }
    out
}

#[test]
fn logits_through_the_stage_interface_match_transformers() {
    for arch in ARCHS {
        let m = stage_model(arch);
        assert_eq!(m.stage(), ModelStage::CausalLm);
        for (i, ids) in reference(arch).input_ids.iter().enumerate() {
            let table = Blocks::new().table(ids.len());
            let batch = all_rows(ids, &table);
            let out = m
                .forward(&ModelInputs::text(&batch), &mut cache(m.as_ref()))
                .unwrap();
            let (want, _) = reference_logits(arch, i);
            let err = rel_err(&out.logits.unwrap().data, &want);
            assert!(err <= 1e-4, "{arch} prompt {i}: rel err {err}");
        }
    }
}

#[test]
fn captured_states_are_the_embedding_and_the_residual_the_head_reads() {
    for arch in ARCHS {
        let m = stage_model(arch);
        let cfg = config(arch);
        let layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
        let eps = cfg["rms_norm_eps"].as_f64().unwrap() as f32;
        let w = SafetensorsDir::open(&dir(arch)).unwrap();
        let embed = w.load("model.embed_tokens.weight").unwrap();
        let h = embed.shape[1];
        let head = if w.tensor_names().iter().any(|n| n == "lm_head.weight") {
            w.load("lm_head.weight").unwrap()
        } else {
            embed.clone()
        };
        let norm = w.load("model.norm.weight").unwrap().data;
        let ids = &reference(arch).input_ids[0];
        let table = Blocks::new().table(ids.len());
        let batch = all_rows(ids, &table);
        let capture = [Capture::Embedding, Capture::AfterLayers(layers)];
        let inputs = ModelInputs {
            capture: &capture,
            ..ModelInputs::text(&batch)
        };
        let out = m.forward(&inputs, &mut cache(m.as_ref())).unwrap();
        assert_eq!(out.hidden_states.len(), 2);
        let (c0, e) = &out.hidden_states[0];
        assert_eq!(
            (*c0, e.shape.clone()),
            (Capture::Embedding, vec![ids.len(), h])
        );
        for (t, &id) in ids.iter().enumerate() {
            let want = &embed.data[id as usize * h..(id as usize + 1) * h];
            assert_eq!(
                &e.data[t * h..(t + 1) * h],
                want,
                "{arch}: embedding row {t}"
            );
        }
        let (c1, last) = &out.hidden_states[1];
        assert_eq!(*c1, Capture::AfterLayers(layers));
        let normed = rms_norm(&last.data, &norm, eps);
        let v = head.shape[0];
        let mut logits = vec![0.0f32; ids.len() * v];
        for (t, row) in normed.chunks_exact(h).enumerate() {
            for j in 0..v {
                logits[t * v + j] = row
                    .iter()
                    .zip(&head.data[j * h..(j + 1) * h])
                    .map(|(a, b)| a * b)
                    .sum();
            }
        }
        let err = rel_err(&logits, &out.logits.unwrap().data);
        assert!(
            err <= 1e-5,
            "{arch}: head(norm(captured)) vs logits rel err {err}"
        );
    }
}

#[test]
fn input_embeddings_in_give_the_logits_of_the_ids() {
    let m = stage_model("llama");
    let ids = &reference("llama").input_ids[1];
    let table = Blocks::new().table(ids.len());
    let batch = all_rows(ids, &table);
    let capture = [Capture::Embedding];
    let by_ids = m
        .forward(
            &ModelInputs {
                capture: &capture,
                ..ModelInputs::text(&batch)
            },
            &mut cache(m.as_ref()),
        )
        .unwrap();
    let embeds = &by_ids.hidden_states[0].1.data;
    let by_embeds = m
        .forward(
            &ModelInputs {
                tokens: TokenInputs::Embeds(embeds),
                ..ModelInputs::text(&batch)
            },
            &mut cache(m.as_ref()),
        )
        .unwrap();
    assert_eq!(by_embeds.logits, by_ids.logits);
    let short = &embeds[..embeds.len() - 1];
    let err = m
        .forward(
            &ModelInputs {
                tokens: TokenInputs::Embeds(short),
                ..ModelInputs::text(&batch)
            },
            &mut cache(m.as_ref()),
        )
        .unwrap_err();
    assert!(err.to_string().contains("input-embedding"), "{err}");
}

#[test]
fn text_only_mrope_is_1d_rope_and_what_the_decoder_cannot_take_is_refused() {
    let m = stage_model("qwen3");
    let ids = &reference("qwen3").input_ids[0];
    let table = Blocks::new().table(ids.len());
    let batch = all_rows(ids, &table);
    let plain = m
        .forward(&ModelInputs::text(&batch), &mut cache(m.as_ref()))
        .unwrap();
    let row: Vec<i64> = (0..ids.len() as i64).collect();
    let same = MropePositions {
        rows: [row.clone(), row.clone(), row.clone()],
    };
    let mrope = m
        .forward(
            &ModelInputs {
                positions: PositionInputs::Mrope(&same),
                ..ModelInputs::text(&batch)
            },
            &mut cache(m.as_ref()),
        )
        .unwrap();
    assert_eq!(mrope.logits, plain.logits);
    let mut spatial = same.clone();
    spatial.rows[1][0] = 5;
    let err = m
        .forward(
            &ModelInputs {
                positions: PositionInputs::Mrope(&spatial),
                ..ModelInputs::text(&batch)
            },
            &mut cache(m.as_ref()),
        )
        .unwrap_err();
    assert!(err.to_string().contains("M-RoPE"), "{err}");
    let image = [MultiModalFeature {
        modality: "image",
        mm_hash: 7,
        placeholder: 0..1,
        item_offset: 0,
        kind: MultiModalKind::Image {
            grid_thw: [1, 2, 2],
        },
        data: &[0u8; 16],
    }];
    let err = m
        .forward(
            &ModelInputs {
                mm_features: &image,
                ..ModelInputs::text(&batch)
            },
            &mut cache(m.as_ref()),
        )
        .unwrap_err();
    assert!(err.to_string().contains("image"), "{err}");
}

#[test]
fn a_stage_the_architecture_does_not_have_is_a_clear_error() {
    let w = SafetensorsDir::open(&dir("llama")).unwrap();
    let err = build_stage_model(
        &config("llama"),
        ModelStage::Talker,
        &w,
        TpContext::single(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("Talker"), "{err}");
}
