//! Benchmark prompts: random (token ids decoded by a tokenizer, or random words) and ShareGPT.

use std::path::Path;

use omni_tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::ServeBenchError;

/// One benchmark request.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRequest {
    /// Prompt text.
    pub prompt: String,
    /// Prompt length in tokens (exact with a tokenizer, else an estimate).
    pub prompt_len: usize,
    /// `max_tokens` to ask for.
    pub output_len: usize,
}

const WORDS: [&str; 32] = [
    "the",
    "model",
    "serves",
    "tokens",
    "quickly",
    "while",
    "users",
    "wait",
    "for",
    "answers",
    "about",
    "rivers",
    "mountains",
    "cities",
    "history",
    "science",
    "music",
    "and",
    "art",
    "in",
    "many",
    "languages",
    "with",
    "care",
    "every",
    "day",
    "new",
    "ideas",
    "grow",
    "from",
    "old",
    "stories",
];

/// Lengths in `[len * (1 - ratio), len * (1 + ratio)]`, at least 1 (vLLM's range ratio).
fn sample_len(rng: &mut StdRng, len: usize, ratio: f64) -> usize {
    let lo = ((len as f64) * (1.0 - ratio)).floor().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + ratio)).ceil().max(lo as f64) as usize;
    rng.random_range(lo..=hi)
}

fn random_text(
    rng: &mut StdRng,
    tokenizer: Option<&Tokenizer>,
    len: usize,
) -> Result<String, ServeBenchError> {
    match tokenizer {
        Some(tok) => {
            let vocab = tok.vocab_size().max(1) as u32;
            let ids: Vec<u32> = (0..len)
                .map(|_| rng.random_range(0..vocab))
                .filter(|&id| !tok.is_special(id))
                .collect();
            Ok(tok.decode(&ids, true)?)
        }
        None => Ok((0..len)
            .map(|_| WORDS[rng.random_range(0..WORDS.len())])
            .collect::<Vec<_>>()
            .join(" ")),
    }
}

fn count_tokens(tokenizer: Option<&Tokenizer>, text: &str) -> Result<usize, ServeBenchError> {
    match tokenizer {
        Some(tok) => Ok(tok.encode(text, false)?.len()),
        None => Ok(text.split_whitespace().count()),
    }
}

/// Random prompts with a shared prefix of `prefix_len` tokens.
#[allow(clippy::too_many_arguments)]
pub fn random(
    tokenizer: Option<&Tokenizer>,
    num_prompts: usize,
    input_len: usize,
    output_len: usize,
    range_ratio: f64,
    prefix_len: usize,
    seed: u64,
) -> Result<Vec<SampleRequest>, ServeBenchError> {
    if !(0.0..1.0).contains(&range_ratio) {
        return Err(ServeBenchError::Args(format!(
            "--random-range-ratio must be in [0, 1), got {range_ratio}"
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let prefix = if prefix_len > 0 {
        random_text(&mut rng, tokenizer, prefix_len)?
    } else {
        String::new()
    };
    let mut out = Vec::with_capacity(num_prompts);
    for _ in 0..num_prompts {
        let in_len = sample_len(&mut rng, input_len, range_ratio);
        let body = random_text(&mut rng, tokenizer, in_len)?;
        let prompt = if prefix.is_empty() {
            body
        } else {
            format!("{prefix} {body}")
        };
        let prompt_len = count_tokens(tokenizer, &prompt)?;
        out.push(SampleRequest {
            prompt,
            prompt_len,
            output_len: sample_len(&mut rng, output_len, range_ratio),
        });
    }
    Ok(out)
}

/// ShareGPT conversations: the first human turn is the prompt, the first reply's length is
/// `max_tokens`; too-short pairs are skipped, as vLLM does.
pub fn sharegpt(
    path: &Path,
    tokenizer: Option<&Tokenizer>,
    num_prompts: usize,
    seed: u64,
) -> Result<Vec<SampleRequest>, ServeBenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| ServeBenchError::Dataset {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let data: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ServeBenchError::Dataset {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    let mut pairs: Vec<(String, String)> = data
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|entry| {
            let turns = entry.get("conversations")?.as_array()?;
            let prompt = turns.first()?.get("value")?.as_str()?.to_string();
            let reply = turns.get(1)?.get("value")?.as_str()?.to_string();
            Some((prompt, reply))
        })
        .collect();
    pairs.shuffle(&mut StdRng::seed_from_u64(seed));
    let mut out = Vec::with_capacity(num_prompts);
    for (prompt, reply) in pairs {
        if out.len() == num_prompts {
            break;
        }
        let prompt_len = count_tokens(tokenizer, &prompt)?;
        let output_len = count_tokens(tokenizer, &reply)?;
        if prompt_len < 4 || output_len < 4 || prompt_len > 1024 || prompt_len + output_len > 2048 {
            continue;
        }
        out.push(SampleRequest {
            prompt,
            prompt_len,
            output_len,
        });
    }
    if out.is_empty() {
        return Err(ServeBenchError::Dataset {
            path: path.to_path_buf(),
            reason: "no usable conversations".into(),
        });
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn random_prompts_are_deterministic_and_within_range() {
        let a = random(None, 20, 100, 50, 0.5, 10, 3).unwrap();
        let b = random(None, 20, 100, 50, 0.5, 10, 3).unwrap();
        assert_eq!(a, b);
        for s in &a {
            assert!((60..=160).contains(&s.prompt_len), "{}", s.prompt_len);
            assert!((25..=75).contains(&s.output_len));
        }
        let exact = random(None, 3, 8, 4, 0.0, 0, 1).unwrap();
        assert!(exact.iter().all(|s| s.prompt_len == 8 && s.output_len == 4));
        assert!(random(None, 1, 8, 4, 1.5, 0, 1).is_err());
    }

    #[test]
    fn sharegpt_takes_first_turns_and_skips_short_pairs() {
        let dir = std::env::temp_dir().join(format!("omni-sharegpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.json");
        let data = serde_json::json!([
            {"conversations": [{"from": "human", "value": "one two three four five"},
                               {"from": "gpt", "value": "a b c d e f"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"conversations": [{"from": "human", "value": "only one turn here ok"}]}
        ]);
        std::fs::write(&path, data.to_string()).unwrap();
        let s = sharegpt(&path, None, 10, 0).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].prompt_len, s[0].output_len), (5, 6));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
