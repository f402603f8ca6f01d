//! Qwen3-Omni's Thinker and Talker against transformers (`scripts/make_omni_fixtures.py`): a tiny
//! random checkpoint with the real token ids, f32 references computed from the same
//! bf16-rounded weights.
#![allow(clippy::unwrap_used)]

mod common;

use common::{BLOCK_SIZE, Blocks, NUM_BLOCKS, dir, reference_json, reference_tensor, rel_err};
use omni_models::hf_dir::SafetensorsDir;
use omni_models::qwen3_omni::talker::sampling::{
    argmax, repetition_penalty, suppress_control_codes,
};
use omni_models::qwen3_omni::talker::{Talker, ThinkerExports};
use omni_models::qwen3_omni::thinker::Thinker;
use omni_models::{
    Capture, ForwardBatch, LayerKvCache, ModelInputs, MropePositions, PositionInputs, SeqChunk,
    StageModel, TokenInputs, TpContext,
};

const FIXTURE: &str = "qwen3-omni";
/// transformers' default `talker_repetition_penalty`, applied when greedy too.
const REPETITION_PENALTY: f32 = 1.05;

fn load_thinker() -> Thinker {
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    Thinker::load(&common::config(FIXTURE), &ws, TpContext::single()).unwrap()
}

fn load_talker() -> Talker {
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    Talker::load(&common::config(FIXTURE), &ws, TpContext::single()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn cache(m: &dyn StageModel) -> Vec<LayerKvCache> {
    m.kv_cache_spec().unwrap().allocate(NUM_BLOCKS, BLOCK_SIZE)
}

/// One forward over `tokens` (ids, or embeddings when given) at `start`, all-position logits
/// unless `last_only`.
#[allow(clippy::too_many_arguments)]
fn step(
    m: &dyn StageModel,
    kv: &mut [LayerKvCache],
    table: &[u32],
    tokens: &[u32],
    start: usize,
    embeds: Option<&[f32]>,
    positions: PositionInputs<'_>,
    capture: &[Capture],
    last_only: bool,
) -> omni_models::ModelOutputs {
    let chunk = SeqChunk {
        tokens,
        start_pos: start,
        block_table: table,
    };
    let mut batch = ForwardBatch::from_chunks(&[chunk], BLOCK_SIZE).unwrap();
    if !last_only {
        batch = batch.with_all_logits();
    }
    let inputs = ModelInputs {
        batch: &batch,
        tokens: embeds.map_or(TokenInputs::Ids, TokenInputs::Embeds),
        positions,
        mm_features: &[],
        capture,
    };
    m.forward(&inputs, kv).unwrap()
}

fn captured(out: &omni_models::ModelOutputs, c: Capture) -> Vec<f32> {
    out.hidden_states
        .iter()
        .find(|(k, _)| *k == c)
        .map(|(_, t)| t.data.clone())
        .unwrap()
}

/// Our logits at the reference's columns, checking the rest are zero (their head rows are).
fn active_columns(logits: &[f32], vocab: usize, cols: &[usize]) -> Vec<f32> {
    let mut out = Vec::new();
    for row in logits.chunks_exact(vocab) {
        out.extend(cols.iter().map(|&c| row[c]));
        let mut inactive = row.to_vec();
        cols.iter().for_each(|&c| inactive[c] = 0.0);
        assert!(inactive.iter().all(|x| x.abs() < 1e-6));
    }
    out
}

#[test]
fn thinker_logits_and_exported_states_match_transformers() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let cols: Vec<usize> = serde_json::from_value(r["thinker.logit_ids"].clone()).unwrap();
    let accept = r["thinker.accept_hidden_layer"].as_u64().unwrap() as usize;
    assert_eq!(thinker.exports()[1], Capture::AfterLayers(accept));
    let vocab = thinker.config().thinker_config.text_config.vocab_size;
    for (i, prompt) in r["thinker.prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(prompt);
        let mut kv = cache(&thinker);
        let table = Blocks::new().table(prompt.len());
        let out = step(
            &thinker,
            &mut kv,
            &table,
            &prompt,
            0,
            None,
            PositionInputs::Batch,
            &thinker.exports(),
            false,
        );
        let logits = active_columns(&out.logits.as_ref().unwrap().data, vocab, &cols);
        let (want, _) = reference_tensor(FIXTURE, &format!("thinker.logits.{i}"));
        let e = rel_err(&logits, &want);
        assert!(e <= 1e-4, "prompt {i}: logits rel err {e}");
        for (capture, key) in [
            (Capture::Embedding, format!("thinker.hidden.0.{i}")),
            (
                Capture::AfterLayers(accept),
                format!("thinker.hidden.{accept}.{i}"),
            ),
        ] {
            let (want, _) = reference_tensor(FIXTURE, &key);
            let e = rel_err(&captured(&out, capture), &want);
            assert!(e <= 1e-4, "{key}: rel err {e}");
        }
    }
}

#[test]
fn thinker_interleaved_mrope_matches_transformers_for_distinct_rows() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    let cols: Vec<usize> = serde_json::from_value(r["thinker.logit_ids"].clone()).unwrap();
    let prompt = ids(&r["thinker.prompts"][0]);
    let (pos, shape) = reference_tensor(FIXTURE, "thinker.mrope.position_ids");
    assert_eq!(shape, [3, prompt.len()]);
    let row = |k: usize| -> Vec<i64> {
        pos[k * prompt.len()..(k + 1) * prompt.len()]
            .iter()
            .map(|&p| p as i64)
            .collect()
    };
    let m = MropePositions {
        rows: [row(0), row(1), row(2)],
    };
    assert!(!m.is_text_only());
    let mut kv = cache(&thinker);
    let table = Blocks::new().table(prompt.len());
    let out = step(
        &thinker,
        &mut kv,
        &table,
        &prompt,
        0,
        None,
        PositionInputs::Mrope(&m),
        &[],
        false,
    );
    let vocab = thinker.config().thinker_config.text_config.vocab_size;
    let logits = active_columns(&out.logits.unwrap().data, vocab, &cols);
    let (want, _) = reference_tensor(FIXTURE, "thinker.mrope.logits");
    let e = rel_err(&logits, &want);
    assert!(e <= 1e-4, "M-RoPE logits rel err {e}");
    let (plain, _) = reference_tensor(FIXTURE, "thinker.logits.0");
    assert!(rel_err(&plain, &want) > 1e-3, "the rows must matter");
}

/// Greedy decode with the KV cache; returns the generated ids.
fn thinker_greedy(thinker: &Thinker, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut kv = cache(thinker);
    let table = Blocks::new().table(prompt.len() + n);
    let mut out = Vec::new();
    let mut logits = step(
        thinker,
        &mut kv,
        &table,
        prompt,
        0,
        None,
        PositionInputs::Batch,
        &[],
        true,
    )
    .logits
    .unwrap()
    .data;
    let im_end = thinker.config().ids.im_end_token_id;
    while out.len() < n {
        let next = argmax(&logits);
        out.push(next);
        if next == im_end {
            break;
        }
        let pos = prompt.len() + out.len() - 1;
        logits = step(
            thinker,
            &mut kv,
            &table,
            &[next],
            pos,
            None,
            PositionInputs::Batch,
            &[],
            true,
        )
        .logits
        .unwrap()
        .data;
    }
    out
}

#[test]
fn thinker_greedy_tokens_match_transformers() {
    let thinker = load_thinker();
    let r = reference_json(FIXTURE);
    for (i, prompt) in r["thinker.prompts"].as_array().unwrap().iter().enumerate() {
        let want = ids(&r[format!("thinker.greedy.{i}").as_str()]);
        assert_eq!(
            thinker_greedy(&thinker, &ids(prompt), want.len()),
            want,
            "prompt {i}"
        );
    }
}

/// The Thinker's exports over `seq[..rows]` (what it computed: the prompt and every generated
/// token fed back).
fn exports(thinker: &Thinker, seq: &[u32], rows: usize) -> (Vec<f32>, Vec<f32>) {
    let mut kv = cache(thinker);
    let table = Blocks::new().table(rows);
    let out = step(
        thinker,
        &mut kv,
        &table,
        &seq[..rows],
        0,
        None,
        PositionInputs::Batch,
        &thinker.exports(),
        true,
    );
    let [a, b] = thinker.exports();
    (captured(&out, a), captured(&out, b))
}

#[test]
fn talker_prompt_prefill_logits_and_greedy_frames_match_transformers() {
    let (thinker, talker) = (load_thinker(), load_talker());
    let r = reference_json(FIXTURE);
    let h = talker.hidden_size();
    let (pad, _) = reference_tensor(FIXTURE, "talker.tts_pad_embed");
    let eos = talker.config().talker_config.codec_eos_token_id;
    for (i, prompt) in r["thinker.prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(prompt);
        let seq = ids(&r[format!("talker.thinker_sequence.{i}").as_str()]);
        let (embed, hidden) = exports(&thinker, &seq, seq.len() - 1);
        for speaker in r["talker.speakers"].as_array().unwrap() {
            let speaker = speaker.as_str().unwrap();
            let key = |what: &str| format!("talker.{what}.{i}.{speaker}");
            let codec_speaker = talker.config().talker_config.speaker(speaker).unwrap();
            let p = talker
                .build_prompt(
                    &ThinkerExports {
                        ids: &seq,
                        prompt_len: prompt.len(),
                        embed: &embed,
                        hidden: &hidden,
                        tts: thinker.tts_embeddings(),
                    },
                    codec_speaker,
                )
                .unwrap();
            let (want, shape) = reference_tensor(FIXTURE, &key("prefill_embeds"));
            assert_eq!(p.prefill_len(), shape[0], "{}", key("prefill_embeds"));
            assert!(
                rel_err(&p.prefill, &want) <= 1e-4,
                "{}",
                key("prefill_embeds")
            );
            let (want, _) = reference_tensor(FIXTURE, &key("trailing_text"));
            assert!(
                rel_err(&p.trailing_text, &want) <= 1e-4,
                "{}",
                key("trailing_text")
            );
            assert!(rel_err(&p.tts_pad, &pad) <= 1e-4);

            // Prefill: every position's codec logits.
            let n = p.prefill_len();
            let frames_want = ids(&r[key("layer0_codes").as_str()]);
            let mut kv = cache(&talker);
            let table = Blocks::new().table(n + frames_want.len() + 1);
            let dummy = vec![0u32; n];
            let out = step(
                &talker,
                &mut kv,
                &table,
                &dummy,
                0,
                Some(&p.prefill),
                PositionInputs::Batch,
                &[Capture::FinalNorm],
                false,
            );
            let (want, _) = reference_tensor(FIXTURE, &key("prefill_logits"));
            let logits = out.logits.clone().unwrap().data;
            let e = rel_err(&logits, &want);
            assert!(e <= 1e-4, "{}: rel err {e}", key("prefill_logits"));

            // Greedy frames: layer 0 under the codec constraints, groups 1..15 greedy.
            let v = logits.len() / n;
            let mut last = logits[(n - 1) * v..].to_vec();
            let mut hidden_last = captured(&out, Capture::FinalNorm)[(n - 1) * h..].to_vec();
            let (mut layer0, mut frames) = (Vec::new(), Vec::new());
            for k in 0..frames_want.len() {
                repetition_penalty(&mut last, &layer0, REPETITION_PENALTY);
                suppress_control_codes(&mut last, eos);
                let c0 = argmax(&last);
                layer0.push(c0);
                if c0 == eos || k + 1 == frames_want.len() {
                    break;
                }
                let c0_embed = talker.embed_codec(&[c0]).unwrap();
                let f = talker
                    .code_predictor()
                    .predict(&hidden_last, &[c0], &c0_embed, &mut |_, _, l| argmax(l))
                    .unwrap();
                frames.extend_from_slice(&f.codes);
                let input: Vec<f32> = f
                    .codec_sum
                    .iter()
                    .zip(p.text_for_step(k))
                    .map(|(a, b)| a + b)
                    .collect();
                let out = step(
                    &talker,
                    &mut kv,
                    &table,
                    &[0],
                    n + k,
                    Some(&input),
                    PositionInputs::Batch,
                    &[Capture::FinalNorm],
                    true,
                );
                last = out.logits.as_ref().unwrap().data.clone();
                hidden_last = captured(&out, Capture::FinalNorm);
            }
            assert_eq!(layer0, frames_want, "{}", key("layer0_codes"));
            let (want, shape) = reference_tensor(FIXTURE, &key("frames"));
            let want: Vec<u32> = want.iter().map(|&c| c as u32).collect();
            assert_eq!(frames.len(), shape[0] * shape[1]);
            assert_eq!(frames, want, "{}", key("frames"));
        }
    }
}

#[test]
fn the_registry_builds_each_stage_and_the_thinker_as_a_text_llm() {
    use omni_models::ModelStage;
    use omni_models::registry::{LoadFormat, build_stage_model, dummy_weights, load_model_dir};
    let c = common::config(FIXTURE);
    let ws = SafetensorsDir::open(&dir(FIXTURE)).unwrap();
    for stage in [
        ModelStage::Thinker,
        ModelStage::Talker,
        ModelStage::Code2Wav,
    ] {
        let m = build_stage_model(&c, stage, &ws, TpContext::single()).unwrap();
        assert_eq!(m.stage(), stage);
        // Dummy weights name every tensor each stage reads.
        let d = dummy_weights(&c, 7).unwrap();
        build_stage_model(&c, stage, &d, TpContext::single()).unwrap();
    }
    // Without `--omni` the checkpoint is its Thinker, text out: the same greedy tokens.
    let text = load_model_dir(&dir(FIXTURE), LoadFormat::Safetensors, TpContext::single()).unwrap();
    let r = reference_json(FIXTURE);
    let prompt = ids(&r["thinker.prompts"][0]);
    let mut kv = text.kv_cache_spec().allocate(NUM_BLOCKS, BLOCK_SIZE);
    let table = Blocks::new().table(prompt.len());
    let chunk = SeqChunk {
        tokens: &prompt,
        start_pos: 0,
        block_table: &table,
    };
    let batch = ForwardBatch::from_chunks(&[chunk], BLOCK_SIZE).unwrap();
    let logits = text.forward(&batch, &mut kv).unwrap().data;
    assert_eq!(argmax(&logits), ids(&r["thinker.greedy.0"])[0]);
}

/// The four (prompt, speaker) requests of the fixture decoded together: one batch for the four
/// prefills, one batch per decode step, one code-predictor call per step for every request.
/// Each request's frames equal transformers' single-request ones.
#[test]
fn talker_batches_requests_in_every_network() {
    let (thinker, talker) = (load_thinker(), load_talker());
    let r = reference_json(FIXTURE);
    let h = talker.hidden_size();
    let eos = talker.config().talker_config.codec_eos_token_id;
    let mut prompts = Vec::new();
    let mut want = Vec::new();
    for (i, prompt) in r["thinker.prompts"].as_array().unwrap().iter().enumerate() {
        let prompt_len = ids(prompt).len();
        let seq = ids(&r[format!("talker.thinker_sequence.{i}").as_str()]);
        let (embed, hidden) = exports(&thinker, &seq, seq.len() - 1);
        for speaker in r["talker.speakers"].as_array().unwrap() {
            let speaker = speaker.as_str().unwrap();
            let ex = ThinkerExports {
                ids: &seq,
                prompt_len,
                embed: &embed,
                hidden: &hidden,
                tts: thinker.tts_embeddings(),
            };
            let id = talker.config().talker_config.speaker(speaker).unwrap();
            prompts.push(talker.build_prompt(&ex, id).unwrap());
            let (f, _) = reference_tensor(FIXTURE, &format!("talker.frames.{i}.{speaker}"));
            want.push(f.iter().map(|&c| c as u32).collect::<Vec<u32>>());
        }
    }
    let n = prompts.len();
    let steps = want[0].len() / 16;
    let mut kv = cache(&talker);
    let mut blocks = Blocks::new();
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| blocks.table(p.prefill_len() + steps + 1))
        .collect();
    let dummies: Vec<Vec<u32>> = prompts.iter().map(|p| vec![0; p.prefill_len()]).collect();
    let run = |kv: &mut [LayerKvCache], chunks: &[SeqChunk<'_>], embeds: &[f32]| {
        let batch = ForwardBatch::from_chunks(chunks, BLOCK_SIZE).unwrap();
        let inputs = ModelInputs {
            batch: &batch,
            tokens: TokenInputs::Embeds(embeds),
            positions: PositionInputs::Batch,
            mm_features: &[],
            capture: &[Capture::FinalNorm],
        };
        let out = talker.forward(&inputs, kv).unwrap();
        let hidden = captured(&out, Capture::FinalNorm);
        (out.logits.unwrap().data, hidden)
    };
    let chunks: Vec<SeqChunk<'_>> = (0..n)
        .map(|k| SeqChunk {
            tokens: &dummies[k],
            start_pos: 0,
            block_table: &tables[k],
        })
        .collect();
    let embeds: Vec<f32> = prompts.iter().flat_map(|p| p.prefill.clone()).collect();
    let (mut logits, mut hidden) = run(&mut kv, &chunks, &embeds);
    let v = logits.len() / n;
    let mut layer0: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut frames: Vec<Vec<u32>> = vec![Vec::new(); n];
    for step in 0..steps {
        let mut c0 = Vec::with_capacity(n);
        for (k, row) in logits.chunks_exact_mut(v).enumerate() {
            repetition_penalty(row, &layer0[k], REPETITION_PENALTY);
            suppress_control_codes(row, eos);
            let c = argmax(row);
            assert_ne!(c, eos, "the fixture's requests never stop early");
            layer0[k].push(c);
            c0.push(c);
        }
        let c0_embed = talker.embed_codec(&c0).unwrap();
        let f = talker
            .code_predictor()
            .predict(&hidden, &c0, &c0_embed, &mut |_, _, l| argmax(l))
            .unwrap();
        for (frame, codes) in frames.iter_mut().zip(f.codes.chunks_exact(16)) {
            frame.extend_from_slice(codes);
        }
        let mut input = Vec::with_capacity(n * h);
        for (k, p) in prompts.iter().enumerate() {
            let sum = &f.codec_sum[k * h..(k + 1) * h];
            input.extend(sum.iter().zip(p.text_for_step(step)).map(|(a, b)| a + b));
        }
        let one = [0u32];
        let chunks: Vec<SeqChunk<'_>> = (0..n)
            .map(|k| SeqChunk {
                tokens: &one,
                start_pos: prompts[k].prefill_len() + step,
                block_table: &tables[k],
            })
            .collect();
        (logits, hidden) = run(&mut kv, &chunks, &input);
    }
    assert_eq!(frames, want);
}
