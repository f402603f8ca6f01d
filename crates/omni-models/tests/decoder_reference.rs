//! The models against Hugging Face transformers: logits for every prompt position, and greedy
//! 32-token continuations through the paged KV cache (block size 4), with whole and chunked
//! prefills.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use omni_models::{ForwardBatch, SeqChunk, TpContext};

#[test]
fn logits_match_transformers_at_every_position() {
    for arch in ARCHS {
        let model = load(arch, TpContext::single());
        let r = reference(arch);
        for (i, ids) in r.input_ids.iter().enumerate() {
            let (want, vocab) = reference_logits(arch, i);
            assert_eq!(vocab, model.vocab_size());
            let mut kv = fresh_cache(model.as_ref());
            let table = Blocks::new().table(ids.len());
            let got = run_all(model.as_ref(), &mut kv, &[(ids, 0, &table)]);
            let err = rel_err(&got, &want);
            assert!(err <= 1e-4, "{arch} prompt {i}: rel err {err}");
        }
    }
}

/// Greedy decoding: prefill in chunks of `chunk` tokens (the whole prompt if `None`), then
/// 1-token decode steps.
fn greedy(arch: &str, ids: &[u32], chunk: Option<usize>, new_tokens: usize) -> Vec<u32> {
    let model = load(arch, TpContext::single());
    let mut kv = fresh_cache(model.as_ref());
    let table = Blocks::new().table(ids.len() + new_tokens);
    let chunk = chunk.unwrap_or(ids.len());
    let mut logits = Vec::new();
    for start in (0..ids.len()).step_by(chunk) {
        let end = (start + chunk).min(ids.len());
        let batch = ForwardBatch::from_chunks(
            &[SeqChunk {
                tokens: &ids[start..end],
                start_pos: start,
                block_table: &table,
            }],
            BLOCK_SIZE,
        )
        .unwrap();
        logits = model.forward(&batch, &mut kv).unwrap().data;
    }
    let mut out = vec![argmax(&logits)];
    while out.len() < new_tokens {
        let pos = ids.len() + out.len() - 1;
        let last = [out[out.len() - 1]];
        let batch = ForwardBatch::from_chunks(
            &[SeqChunk {
                tokens: &last,
                start_pos: pos,
                block_table: &table,
            }],
            BLOCK_SIZE,
        )
        .unwrap();
        out.push(argmax(&model.forward(&batch, &mut kv).unwrap().data));
    }
    out
}

#[test]
fn greedy_continuations_match_transformers_generate() {
    for arch in ARCHS {
        let r = reference(arch);
        for (i, ids) in r.input_ids.iter().enumerate() {
            assert_eq!(
                greedy(arch, ids, None, 32),
                r.greedy[i],
                "{arch} prompt {i}"
            );
        }
    }
}

#[test]
fn chunked_prefill_gives_the_same_continuations() {
    for arch in ARCHS {
        let r = reference(arch);
        for (i, ids) in r.input_ids.iter().enumerate() {
            assert_eq!(
                greedy(arch, ids, Some(7), 32),
                r.greedy[i],
                "{arch} prompt {i} (chunks of 7)"
            );
        }
    }
}
