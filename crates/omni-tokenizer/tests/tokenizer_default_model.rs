//! The default model's tokenizer and chat template, built from its GGUF metadata, against ids
//! from Python `tokenizers` (the vocabulary, merges and added tokens that `transformers` reads
//! from the same GGUF, with SmolLM2's HF pre-tokenizer: individual digits, then byte-level).
//! Skips, with a printed reason, when the model has not been fetched
//! (`scripts/fetch-default-model.sh`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on failure

use omni_gguf::default_model;
use omni_tokenizer::Tokenizer;
use serde_json::json;

fn load() -> Option<Tokenizer> {
    match default_model::locate() {
        Some(path) => {
            Some(Tokenizer::from_gguf_path(path).expect("tokenizer builds from the default model"))
        }
        None => {
            eprintln!(
                "SKIP: default model not at {} (run scripts/fetch-default-model.sh)",
                default_model::cached_path().display()
            );
            None
        }
    }
}

#[test]
fn smollm2_chat_prompt_renders_and_tokenizes_like_hf() {
    let Some(tok) = load() else { return };
    let msgs = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let text = tok.apply_chat_template(&msgs, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode_chat(&msgs, true).unwrap();
    assert_eq!(
        ids,
        [
            1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
            407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
            520, 9531, 198
        ]
    );
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn smollm2_special_tokens_and_vocab() {
    let Some(tok) = load() else { return };
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_ids(), [2]);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
    assert!(tok.is_special(0) && tok.is_special(16) && !tok.is_special(17));
}

#[test]
fn smollm2_encodes_text_like_hf() {
    let Some(tok) = load() else { return };
    let cases: [(&str, &[u32]); 4] = [
        (
            "Hello world 12345 naïve café 😀!",
            &[
                19556, 905, 216, 33, 34, 35, 36, 37, 15486, 46494, 37366, 40303, 218, 17,
            ],
        ),
        (
            "  leading spaces\n\nand\ttabs",
            &[216, 2899, 5600, 198, 198, 397, 197, 100, 7366],
        ),
        (
            "def f(x):\n    return x**2  # square\n",
            &[
                1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5222, 198,
            ],
        ),
        (
            "Ünïcödé 日本語のテキスト, emojis 👍🏽 and math ∑∫√ 3.14159",
            &[
                142, 246, 94, 25972, 83, 7466, 84, 2756, 17097, 241, 115, 40993, 179, 120, 248,
                26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 28, 649, 21658, 271, 15107,
                235, 231, 10813, 233, 138, 284, 4119, 19995, 235, 22052, 121, 22052, 244, 216, 35,
                30, 33, 36, 33, 37, 41,
            ],
        ),
    ];
    for (text, want) in cases {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        // Streaming the same ids gives the same text.
        let mut d = tok.incremental_detokenizer(&[1, 520, 9531, 198], true);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&d.push(&tok, id).unwrap());
        }
        streamed.push_str(&d.finish(&tok).unwrap());
        assert_eq!(streamed, text);
    }
}
