//! `bench serve`'s random dataset: every prompt is exactly the asked number of tokens as the
//! server counts a completion prompt (`Tokenizer::encode(prompt, true)`, special tokens
//! included), for byte-level BPE tokenizers whose decode and re-encode do not round-trip.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use omni_bench::serve::dataset;
use omni_tokenizer::Tokenizer;
use serde_json::{Value, json};

/// A small byte-level BPE with merges (trained by `scripts/make_fixtures.py`).
fn fixture_json() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/omni-models/tests/fixtures/llama/tokenizer.json"
    );
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn fixture() -> Tokenizer {
    Tokenizer::from_tokenizer_json(fixture_json().to_string().as_bytes()).unwrap()
}

/// The fixture with a post-processor that puts its first added token before every text, as a
/// BOS-adding checkpoint does.
fn fixture_with_bos() -> Tokenizer {
    let mut tj = fixture_json();
    let bos = tj["added_tokens"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let id = tj["added_tokens"][0]["id"].clone();
    tj["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos.clone(): {"id": bos, "ids": [id], "tokens": [bos]}}
    });
    Tokenizer::from_tokenizer_json(tj.to_string().as_bytes()).unwrap()
}

/// The built-in default model's tokenizer (SmolLM2, 49 152 tokens) when it has been fetched
/// (`scripts/fetch-default-model.sh`; the path rule is `omni_gguf::default_model`'s).
fn default_model() -> Option<Tokenizer> {
    let base = std::env::var_os("OMNI_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("omni-engine"))
        })?;
    let path = base.join("models").join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!(
            "SKIP: default model not at {} (run scripts/fetch-default-model.sh)",
            path.display()
        );
        return None;
    }
    Some(Tokenizer::from_gguf_path(path).unwrap())
}

/// Asks for `num` prompts of `len` tokens with each seed and checks every count.
fn assert_exact(tok: &Tokenizer, len: usize, seeds: std::ops::Range<u64>, num: usize) {
    for seed in seeds {
        let samples = dataset::random(Some(tok), num, len, 16, 0.0, 0, seed).unwrap();
        assert_eq!(samples.len(), num);
        for (i, s) in samples.iter().enumerate() {
            let served = tok.encode(&s.prompt, true).unwrap().len();
            assert_eq!(served, len, "seed {seed}, prompt {i}: {:?}", s.prompt);
            assert_eq!(s.prompt_len, len, "seed {seed}, prompt {i}");
            assert_eq!(s.output_len, 16);
        }
    }
}

#[test]
fn decoded_vocabulary_runs_do_not_re_encode_to_their_length() {
    // Why the dataset has to fit: 128 consecutive ids, decoded and re-encoded, come back as
    // another number of tokens for some offsets.
    for tok in [Some(fixture()), default_model()].into_iter().flatten() {
        let vocab = tok.vocab_size() as u32;
        let off = (0..64u32).filter(|&o| {
            let ids: Vec<u32> = (0..128u32)
                .map(|k| (o * 97 + k) % vocab)
                .filter(|&id| !tok.is_special(id))
                .collect();
            let text = tok.decode(&ids, false).unwrap();
            tok.encode(&text, false).unwrap().len() != ids.len()
        });
        assert!(off.count() > 0, "{tok:?}");
    }
}

#[test]
fn random_prompts_are_exactly_128_tokens_for_many_seeds() {
    assert_exact(&fixture(), 128, 0..50, 8);
}

#[test]
fn a_bos_the_server_adds_counts_towards_the_length() {
    let tok = fixture_with_bos();
    assert_exact(&tok, 128, 0..20, 8);
    let s = &dataset::random(Some(&tok), 1, 128, 16, 0.0, 0, 7).unwrap()[0];
    assert_eq!(tok.encode(&s.prompt, false).unwrap().len(), 127);
    // One token asked, one BOS added: nothing left for the prompt.
    assert!(dataset::random(Some(&tok), 1, 1, 16, 0.0, 0, 7).is_err());
}

#[test]
fn default_model_prompts_are_exactly_the_asked_length() {
    let Some(tok) = default_model() else { return };
    assert_exact(&tok, 128, 0..40, 8);
    assert_exact(&tok, 1000, 0..4, 4);
    assert_exact(&tok, 1, 0..20, 4);
}

#[test]
fn ranges_and_a_shared_prefix_keep_every_count_exact() {
    let tok = fixture();
    let samples = dataset::random(Some(&tok), 64, 128, 32, 0.5, 24, 3).unwrap();
    let prefix = tok.encode(&samples[0].prompt, false).unwrap()[..16].to_vec();
    for s in &samples {
        let ids = tok.encode(&s.prompt, true).unwrap();
        assert_eq!(ids.len(), s.prompt_len);
        // 24 prefix tokens plus 64..=192 sampled.
        assert!(
            (24 + 64..=24 + 192).contains(&s.prompt_len),
            "{}",
            s.prompt_len
        );
        assert!((16..=48).contains(&s.output_len), "{}", s.output_len);
        assert_eq!(
            ids[..16],
            prefix[..],
            "every prompt starts with the shared prefix"
        );
    }
    assert_ne!(samples[0].prompt, samples[1].prompt);
    assert_eq!(
        samples,
        dataset::random(Some(&tok), 64, 128, 32, 0.5, 24, 3).unwrap(),
        "a seed gives the same prompts"
    );
}
