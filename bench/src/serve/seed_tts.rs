//! A Seed-TTS-like text-to-speech dataset (vLLM-Omni's `seed-tts` for `openai-chat-omni`): each
//! request is a system turn that makes the model a text-to-speech engine and a user turn with
//! the text to speak.
//!
//! - From files: `--dataset-path DIR` with `DIR/meta.lst` (or `DIR/en/meta.lst`, the layout of
//!   BytedanceSpeech/seed-tts-eval), or the `meta.lst` file itself; each line is
//!   `utt_id|prompt_transcript|prompt_wav|text` and `text` is spoken. The reference voice
//!   (`prompt_transcript`, `prompt_wav`) is for voice-cloning models and is not sent
//!   (Qwen3-Omni speaks in its own voices).
//! - Generated (the real files cannot be fetched here): texts of exactly `prompt_len` tokens,
//!   the prompt lengths of vLLM-Omni's blog being [`SEED_TTS_PROMPT_LENS`]. With `--tokenizer`
//!   they are fitted to that count by the tokenizer; without one they are `w<id>` words, one
//!   token each for the word-level bench tokenizers (`scripts/make_omni_bench_tokenizer.py`).

use std::path::{Path, PathBuf};

use omni_tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::ServeBenchError;
use super::dataset::{self, SampleRequest};

/// The prompt lengths (tokens of text to speak) of vLLM-Omni's Seed-TTS benchmark.
pub const SEED_TTS_PROMPT_LENS: [usize; 4] = [10, 160, 320, 640];

/// vLLM-Omni's `DEFAULT_OUTPUT_LEN` for Seed-TTS (the Thinker's `max_tokens`).
pub const SEED_TTS_OUTPUT_LEN: usize = 2048;

/// The system turn of every Seed-TTS request: Qwen3-Omni's own identity line (it is trained
/// with it, and speaks only under it), then the text-to-speech instruction.
pub const SEED_TTS_SYSTEM_PROMPT: &str = "You are Qwen, a virtual human developed by the Qwen \
Team, Alibaba Group, capable of perceiving auditory and visual inputs, as well as generating \
text and speech.\nFor this request you act as a text-to-speech engine: speak the user's text \
exactly as it is written, word for word, in a clear and natural voice, and write that same text \
as your reply, adding nothing and leaving nothing out.";

/// Highest id a generated `w<id>` word uses: below Qwen's special tokens (151643 and up), so
/// every word is an ordinary token of the word-level bench tokenizers.
const MAX_WORD_ID: u32 = 151_643;

fn dataset_error(path: &Path, reason: impl Into<String>) -> ServeBenchError {
    ServeBenchError::Dataset {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// `meta.lst` under `path` (`path/meta.lst`, then `path/en/meta.lst`), or `path` itself.
fn meta_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        let top = path.join("meta.lst");
        if top.exists() {
            return top;
        }
        return path.join("en").join("meta.lst");
    }
    path.to_path_buf()
}

/// The texts of a `meta.lst` (`utt_id|prompt_transcript|prompt_wav|text`), in file order.
pub fn parse_meta(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let fields: Vec<&str> = line.splitn(4, '|').collect();
            let spoken = fields.get(3)?.trim();
            (!spoken.is_empty()).then(|| spoken.to_string())
        })
        .collect()
}

/// `num_prompts` requests from a Seed-TTS `meta.lst`: its lines shuffled by `seed`, repeated
/// when there are fewer than `num_prompts`.
pub fn from_meta(
    path: &Path,
    tokenizer: Option<&Tokenizer>,
    num_prompts: usize,
    output_len: usize,
    seed: u64,
) -> Result<Vec<SampleRequest>, ServeBenchError> {
    let file = meta_file(path);
    let text = std::fs::read_to_string(&file).map_err(|e| dataset_error(&file, e.to_string()))?;
    let mut texts = parse_meta(&text);
    if texts.is_empty() {
        return Err(dataset_error(
            &file,
            "no `utt_id|prompt_transcript|prompt_wav|text` line",
        ));
    }
    texts.shuffle(&mut StdRng::seed_from_u64(seed));
    texts
        .iter()
        .cycle()
        .take(num_prompts)
        .map(|t| {
            let prompt_len = match tokenizer {
                Some(tok) => tok.encode(t, false)?.len(),
                None => t.split_whitespace().count(),
            };
            Ok(request(t.clone(), prompt_len, output_len))
        })
        .collect()
}

/// `num_prompts` generated requests whose text to speak is `prompt_len` tokens.
pub fn generated(
    tokenizer: Option<&Tokenizer>,
    num_prompts: usize,
    prompt_len: usize,
    output_len: usize,
    seed: u64,
) -> Result<Vec<SampleRequest>, ServeBenchError> {
    if prompt_len == 0 {
        return Err(ServeBenchError::Args(
            "--seed-tts-prompt-len must be >= 1".into(),
        ));
    }
    if let Some(tok) = tokenizer {
        let fitted = dataset::random(Some(tok), num_prompts, prompt_len, output_len, 0.0, 0, seed)?;
        return Ok(fitted
            .into_iter()
            .map(|s| request(s.prompt, s.prompt_len, output_len))
            .collect());
    }
    let mut rng = StdRng::seed_from_u64(seed);
    Ok((0..num_prompts)
        .map(|_| {
            let words: Vec<String> = (0..prompt_len)
                .map(|_| format!("w{}", rng.random_range(0..MAX_WORD_ID)))
                .collect();
            request(words.join(" "), prompt_len, output_len)
        })
        .collect())
}

fn request(text: String, prompt_len: usize, output_len: usize) -> SampleRequest {
    SampleRequest {
        prompt: text,
        prompt_len,
        output_len,
        system: Some(SEED_TTS_SYSTEM_PROMPT.to_string()),
        images: Vec::new(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn meta_lines_give_the_text_to_speak() {
        let meta = "utt1|hello there|prompt-wavs/utt1.wav|The quick brown fox.\n\
                    smoke002|||Jumps over the lazy dog\n\
                    \n\
                    broken line without fields\n\
                    utt3|a|b|\n";
        assert_eq!(
            parse_meta(meta),
            ["The quick brown fox.", "Jumps over the lazy dog"]
        );
        let dir = std::env::temp_dir().join(format!("omni-seed-tts-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("en")).unwrap();
        std::fs::write(dir.join("en").join("meta.lst"), meta).unwrap();
        let s = from_meta(&dir, None, 5, 64, 0).unwrap();
        assert_eq!(s.len(), 5, "two lines repeated to five requests");
        assert!(
            s.iter()
                .all(|r| r.system.as_deref() == Some(SEED_TTS_SYSTEM_PROMPT))
        );
        assert!(s.iter().all(|r| r.output_len == 64));
        assert!(s.iter().all(|r| r.prompt_len == 4 || r.prompt_len == 5));
        assert!(from_meta(&dir.join("missing"), None, 1, 1, 0).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn generated_texts_are_prompt_len_bench_words() {
        for len in SEED_TTS_PROMPT_LENS {
            let s = generated(None, 3, len, 2048, 7).unwrap();
            assert_eq!(s, generated(None, 3, len, 2048, 7).unwrap());
            for r in &s {
                let words: Vec<&str> = r.prompt.split_whitespace().collect();
                assert_eq!(words.len(), len);
                assert_eq!(r.prompt_len, len);
                assert!(
                    words
                        .iter()
                        .all(|w| w[1..].parse::<u32>().unwrap() < MAX_WORD_ID)
                );
            }
        }
        assert!(generated(None, 1, 0, 1, 0).is_err());
    }
}
