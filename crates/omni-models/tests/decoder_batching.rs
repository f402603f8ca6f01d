//! Batching: several sequences of different lengths in one step, and a step that mixes a decode,
//! a full prefill and a chunked prefill, give each sequence the logits it gets alone.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use omni_models::TpContext;

#[test]
fn batch_of_different_lengths_matches_each_sequence_alone() {
    for arch in ARCHS {
        let model = load(arch, TpContext::single());
        let r = reference(arch);
        let mut blocks = Blocks::new();
        let tables: Vec<Vec<u32>> = r
            .input_ids
            .iter()
            .map(|ids| blocks.table(ids.len()))
            .collect();
        let mut kv = fresh_cache(model.as_ref());
        let chunks: Vec<(&[u32], usize, &[u32])> = r
            .input_ids
            .iter()
            .zip(&tables)
            .map(|(ids, t)| (ids.as_slice(), 0, t.as_slice()))
            .collect();
        let batched = run_all(model.as_ref(), &mut kv, &chunks);
        let vocab = model.vocab_size();
        let mut row = 0;
        for (i, ids) in r.input_ids.iter().enumerate() {
            let mut kv1 = fresh_cache(model.as_ref());
            let alone = run_all(model.as_ref(), &mut kv1, &[(ids, 0, &tables[i])]);
            let part = &batched[row * vocab..(row + ids.len()) * vocab];
            let err = rel_err(part, &alone);
            assert!(err <= 1e-5, "{arch} sequence {i}: rel err {err}");
            row += ids.len();
        }
    }
}

#[test]
fn mixed_decode_prefill_and_chunk_step_matches_reference() {
    for arch in ARCHS {
        let model = load(arch, TpContext::single());
        let r = reference(arch);
        let (a, b, c) = (&r.input_ids[1], &r.input_ids[0], &r.input_ids[2]);
        let mut blocks = Blocks::new();
        let (ta, tb, tc) = (
            blocks.table(a.len()),
            blocks.table(b.len()),
            blocks.table(c.len()),
        );
        let mut kv = fresh_cache(model.as_ref());
        // Step 1: A's prompt but its last token, and C's first 10 tokens.
        let split = 10;
        run_all(
            model.as_ref(),
            &mut kv,
            &[(&a[..a.len() - 1], 0, &ta), (&c[..split], 0, &tc)],
        );
        // Step 2: A decodes its last prompt token, B prefills whole, C prefills the rest.
        let got = run_all(
            model.as_ref(),
            &mut kv,
            &[
                (&a[a.len() - 1..], a.len() - 1, &ta),
                (b, 0, &tb),
                (&c[split..], split, &tc),
            ],
        );
        let vocab = model.vocab_size();
        let (ra, _) = reference_logits(arch, 1);
        let (rb, _) = reference_logits(arch, 0);
        let (rc, _) = reference_logits(arch, 2);
        let want: Vec<f32> = ra[(a.len() - 1) * vocab..]
            .iter()
            .chain(&rb)
            .chain(&rc[split * vocab..])
            .copied()
            .collect();
        let err = rel_err(&got, &want);
        assert!(err <= 1e-4, "{arch}: rel err {err}");
    }
}
