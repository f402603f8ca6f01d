//! Benchmark prompts: random (vocabulary runs fitted to an exact token count by a tokenizer, or
//! random words) and ShareGPT.

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
    /// A system turn before the prompt (chat endpoints only; Seed-TTS's instruction).
    pub system: Option<String>,
    /// Image data URLs sent after the prompt as `image_url` parts (chat endpoints only; the
    /// `random-mm` dataset).
    pub images: Vec<String>,
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

fn count_tokens(tokenizer: Option<&Tokenizer>, text: &str) -> Result<usize, ServeBenchError> {
    match tokenizer {
        Some(tok) => Ok(tok.encode(text, false)?.len()),
        None => Ok(text.split_whitespace().count()),
    }
}

/// How many rounds of re-encode and cut or pad [`fit_to_len`] tries (vLLM tries 10).
const MAX_FIT_ROUNDS: usize = 16;

/// Random prompts with a shared prefix of `prefix_len` tokens.
///
/// With a tokenizer, vLLM's `RandomDataset`: each prompt is a run of consecutive vocabulary ids
/// ([`ordinary_tokens`]) from a random offset, after `prefix_len` random ids shared by every
/// prompt; the ids are decoded, and the text re-encoded and cut or padded until it encodes to
/// exactly the wanted count ([`fit_to_len`]). The count is the server's for a completion prompt:
/// the special tokens the tokenizer adds (a BOS) are part of `input_len`, so the server counts
/// `prefix_len + input_len` prompt tokens (a chat template adds its own on top). Without one,
/// prompts are random words and the lengths are word counts (an estimate).
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
    let Some(tok) = tokenizer else {
        return Ok(random_words(
            &mut rng,
            num_prompts,
            input_len,
            output_len,
            range_ratio,
            prefix_len,
        ));
    };
    let added = special_tokens_added(tok)?;
    let body_len = input_len.saturating_sub(added);
    if prefix_len + ((body_len as f64) * (1.0 - range_ratio)).floor() as usize == 0 {
        return Err(ServeBenchError::Args(format!(
            "--random-input-len {input_len} leaves no prompt token: the tokenizer adds {added} \
             special token(s); raise --random-input-len or --random-prefix-len"
        )));
    }
    let allowed = ordinary_tokens(tok)?;
    if allowed.is_empty() {
        return Err(ServeBenchError::Args(
            "the tokenizer has no ordinary tokens".into(),
        ));
    }
    let prefix: Vec<u32> = (0..prefix_len)
        .map(|_| allowed[rng.random_range(0..allowed.len())])
        .collect();
    // Every random draw but the padding's, in order, so the prompts of a seed do not depend on
    // how many threads fit them.
    let plans: Vec<Plan> = (0..num_prompts)
        .map(|i| {
            // Only a prefix when the special tokens take the whole length.
            let len = match body_len {
                0 => 0,
                n => sample_len(&mut rng, n, range_ratio),
            };
            let offset = rng.random_range(0..tok.vocab_size());
            let mut ids = prefix.clone();
            ids.extend((0..len).map(|k| allowed[(offset + i + k) % allowed.len()]));
            Plan {
                ids,
                target: prefix_len + len,
                output_len: sample_len(&mut rng, output_len, range_ratio),
                pad_seed: rng.random(),
            }
        })
        .collect();
    let fitted = fit_all(tok, &plans, &allowed)?;
    let mut mismatch = 0i64;
    let out = plans
        .iter()
        .zip(fitted)
        .map(|(plan, (prompt, got))| {
            mismatch += got as i64 - plan.target as i64;
            SampleRequest {
                prompt,
                prompt_len: got + added,
                output_len: plan.output_len,
                system: None,
                images: Vec::new(),
            }
        })
        .collect();
    if mismatch != 0 {
        tracing::warn!(
            "across all random prompts there are {} {} tokens than asked: re-encoding did not \
             settle for some",
            mismatch.abs(),
            if mismatch > 0 { "more" } else { "fewer" }
        );
    }
    Ok(out)
}

/// One random prompt before fitting.
struct Plan {
    /// Prefix and vocabulary run.
    ids: Vec<u32>,
    /// Tokens wanted, special tokens not counted.
    target: usize,
    output_len: usize,
    /// Seeds the padding ids of [`fit_to_len`].
    pad_seed: u64,
}

/// [`fit_to_len`] for every plan, spread over the machine's cores (encoding a thousand prompts
/// of a thousand tokens takes seconds on one).
fn fit_all(
    tok: &Tokenizer,
    plans: &[Plan],
    allowed: &[u32],
) -> Result<Vec<(String, usize)>, ServeBenchError> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = plans.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let parts: Vec<_> = plans
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|p| {
                            let mut rng = StdRng::seed_from_u64(p.pad_seed);
                            fit_to_len(tok, &p.ids, p.target, allowed, &mut rng)
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(plans.len());
        for part in parts {
            let fitted = part
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
            out.extend(fitted);
        }
        Ok(out)
    })
}

/// How many special tokens the tokenizer adds to an encoded text (vLLM's
/// `num_special_tokens_to_add`: a BOS for most checkpoints that have one, else 0).
fn special_tokens_added(tok: &Tokenizer) -> Result<usize, ServeBenchError> {
    let with = tok.encode("a", true)?.len();
    let without = tok.encode("a", false)?.len();
    Ok(with.saturating_sub(without))
}

/// The ids a random prompt is made of: not special, and whole text on their own (a byte-level
/// vocabulary's lone bytes of a multi-byte character decode to U+FFFD, whose re-encoding is
/// several tokens, so a prompt cut next to one would never settle at its length).
fn ordinary_tokens(tok: &Tokenizer) -> Result<Vec<u32>, ServeBenchError> {
    let mut ids = Vec::new();
    for id in 0..tok.vocab_size() as u32 {
        if tok.is_special(id) || tok.id_to_token(id).is_none() {
            continue;
        }
        let text = tok.decode(&[id], false)?;
        if !text.is_empty() && !text.contains(char::REPLACEMENT_CHARACTER) {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// vLLM's `gen_prompt_decode_to_target_len`, cutting text rather than ids: decodes `ids`, then
/// until the text encodes (without special tokens) to exactly `target` ids or
/// [`MAX_FIT_ROUNDS`] pass, cuts a text of too many tokens where its `target`th token ends and
/// appends the text of random ordinary ids to one of too few. Needed because consecutive ids
/// need not come back as themselves: GPT-2's `[6880, 6881]` (`Ġcalls`, `here`) re-encodes as
/// `Ġcall`, `sh`, `ere`. A text still too long then is cut to its longest prefix that fits
/// ([`longest_prefix_within`]). Returns the text and its token count.
fn fit_to_len(
    tok: &Tokenizer,
    ids: &[u32],
    target: usize,
    allowed: &[u32],
    rng: &mut StdRng,
) -> Result<(String, usize), ServeBenchError> {
    let mut text = tok.decode(ids, false)?;
    for _ in 0..MAX_FIT_ROUNDS {
        let ends = token_ends(tok, &text)?;
        if ends.len() == target {
            return Ok((text, target));
        }
        if ends.len() > target {
            let mut cut = target.checked_sub(1).map_or(0, |last| ends[last]);
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        } else {
            let pad: Vec<u32> = (ends.len()..target)
                .map(|_| allowed[rng.random_range(0..allowed.len())])
                .collect();
            text.push_str(&tok.decode(&pad, false)?);
        }
    }
    if tok.encode(&text, false)?.len() > target {
        text = longest_prefix_within(tok, &text, target)?;
    }
    let len = tok.encode(&text, false)?.len();
    Ok((text, len))
}

/// Where each token of `text` ends, in bytes of `text` (special tokens not added).
fn token_ends(tok: &Tokenizer, text: &str) -> Result<Vec<usize>, ServeBenchError> {
    let encoding =
        tok.inner()
            .encode(text, false)
            .map_err(|e| omni_tokenizer::Error::Tokenizer {
                reason: e.to_string(),
            })?;
    Ok(encoding.get_offsets().iter().map(|&(_, end)| end).collect())
}

/// The longest prefix of `text`, cut at a character boundary, that encodes to at most `target`
/// tokens (a binary search: the count grows with the prefix, give or take a merge).
fn longest_prefix_within(
    tok: &Tokenizer,
    text: &str,
    target: usize,
) -> Result<String, ServeBenchError> {
    let cuts: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain(std::iter::once(text.len()))
        .collect();
    // Invariant: the cut at `lo` fits (the empty prefix does), the one at `hi` does not.
    let (mut lo, mut hi) = (0, cuts.len() - 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if tok.encode(&text[..cuts[mid]], false)?.len() <= target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(text[..cuts[lo]].to_string())
}

/// Prompts of random words when there is no tokenizer; lengths are word counts.
fn random_words(
    rng: &mut StdRng,
    num_prompts: usize,
    input_len: usize,
    output_len: usize,
    range_ratio: f64,
    prefix_len: usize,
) -> Vec<SampleRequest> {
    fn words(rng: &mut StdRng, n: usize) -> String {
        (0..n)
            .map(|_| WORDS[rng.random_range(0..WORDS.len())])
            .collect::<Vec<_>>()
            .join(" ")
    }
    let prefix = words(rng, prefix_len);
    (0..num_prompts)
        .map(|_| {
            let in_len = sample_len(rng, input_len, range_ratio);
            let body = words(rng, in_len);
            let prompt = if prefix.is_empty() {
                body
            } else {
                format!("{prefix} {body}")
            };
            SampleRequest {
                prompt_len: prefix_len + in_len,
                prompt,
                output_len: sample_len(rng, output_len, range_ratio),
                system: None,
                images: Vec::new(),
            }
        })
        .collect()
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
            system: None,
            images: Vec::new(),
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
