//! Part-of-speech tags (Penn Treebank) from an averaged-perceptron model (`tagger.json.gz`): a
//! word with one dominant tag is answered from the tag dictionary, every other from the summed
//! weights of its features (suffix, prefix, shape, neighbours, the two previous tags).
//!
//! Only the lexicon's part-of-speech entries and function-word rules read the tags.

use std::collections::{HashMap, HashSet};

use serde::Deserialize;

use super::pystr::{is_alpha, is_digit, is_lower, is_upper, last_chars, tail};

const START: [&str; 2] = ["-START2-", "-START-"];
const END: [&str; 2] = ["-END-", "-END2-"];

/// The model file's layout.
#[derive(Debug, Deserialize)]
pub struct TaggerModel {
    tags: Vec<String>,
    tagdict: HashMap<String, String>,
    vocab: Option<Vec<String>>,
    weights: HashMap<String, HashMap<String, f64>>,
}

#[derive(Debug)]
pub struct Tagger {
    tags: Vec<String>,
    tagdict: HashMap<String, String>,
    vocab: Option<HashSet<String>>,
    weights: HashMap<String, Vec<(usize, f64)>>,
}

fn norm(w: &str) -> String {
    if w.contains('-') && !w.starts_with('-') {
        return "!HYPHEN".into();
    }
    if is_digit(w) && w.chars().count() == 4 {
        return "!YEAR".into();
    }
    if w.chars().next().is_some_and(super::pystr::is_digit_char) {
        return "!DIGITS".into();
    }
    w.to_lowercase()
}

fn shape(w: &str) -> String {
    if is_alpha(w) {
        if is_lower(w) {
            return "x".into();
        }
        if is_upper(w) {
            return if w.chars().count() > 1 { "XX" } else { "X1" }.into();
        }
        if w.chars().next().is_some_and(char::is_uppercase) && is_lower(tail(w)) {
            return "Xx".into();
        }
        return "xX".into();
    }
    if is_digit(w) {
        return "d".into();
    }
    w.chars()
        .take(4)
        .map(|c| {
            if super::pystr::is_digit_char(c) {
                'd'
            } else if c.is_alphabetic() {
                'x'
            } else {
                c
            }
        })
        .collect()
}

impl Tagger {
    pub fn new(model: TaggerModel) -> Self {
        let index: HashMap<&str, usize> = model
            .tags
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i))
            .collect();
        let weights = model
            .weights
            .into_iter()
            .map(|(feat, ws)| {
                let ws = ws
                    .into_iter()
                    .filter_map(|(t, w)| index.get(t.as_str()).map(|&i| (i, w)))
                    .collect();
                (feat, ws)
            })
            .collect();
        Self {
            weights,
            vocab: model.vocab.map(|v| v.into_iter().collect()),
            tagdict: model.tagdict,
            tags: model.tags,
        }
    }

    fn context(&self, words: &[String]) -> Vec<String> {
        let mut out: Vec<String> = START.iter().map(|s| s.to_string()).collect();
        for w in words {
            let n = norm(w);
            let known = self.vocab.as_ref().is_none_or(|v| v.contains(&n));
            out.push(if known { n } else { format!("<{}>", shape(w)) });
        }
        out.extend(END.iter().map(|s| s.to_string()));
        out
    }

    fn predict(&self, feats: &[String]) -> String {
        let mut scores: Vec<Option<f64>> = vec![None; self.tags.len()];
        for f in feats {
            if let Some(ws) = self.weights.get(f) {
                for &(t, w) in ws {
                    scores[t] = Some(scores[t].unwrap_or(0.0) + w);
                }
            }
        }
        if scores.iter().all(Option::is_none) {
            return "NN".into();
        }
        // The highest score; ties go to the greater tag name.
        let mut best: Option<(f64, &str)> = None;
        for (t, tag) in self.tags.iter().enumerate() {
            let s = scores[t].unwrap_or(0.0);
            let better = match best {
                None => true,
                Some((bs, bt)) => s > bs || (s == bs && tag.as_str() > bt),
            };
            if better {
                best = Some((s, tag));
            }
        }
        best.map_or_else(|| "NN".into(), |(_, t)| t.to_string())
    }

    /// One tag per word.
    pub fn tag(&self, words: &[String]) -> Vec<String> {
        let ctx = self.context(words);
        let mut prev = START[1].to_string();
        let mut prev2 = START[0].to_string();
        let mut tags = Vec::with_capacity(words.len());
        for (i, w) in words.iter().enumerate() {
            let tag = match self.tagdict.get(w) {
                Some(t) => t.clone(),
                None => {
                    let j = i + 2;
                    let first: String = w.chars().take(1).collect();
                    let feats = [
                        "b".to_string(),
                        format!("s3={}", last_chars(w, 3)),
                        format!("p1={first}"),
                        format!("w={}", ctx[j]),
                        format!("sh={}", shape(w)),
                        if i == 0 { "i0" } else { "i+" }.to_string(),
                        format!("t-1={prev}"),
                        format!("t-2={prev2}"),
                        format!("t-12={prev},{prev2}"),
                        format!("w-1={}", ctx[j - 1]),
                        format!("s3-1={}", last_chars(&ctx[j - 1], 3)),
                        format!("w-2={}", ctx[j - 2]),
                        format!("w+1={}", ctx[j + 1]),
                        format!("s3+1={}", last_chars(&ctx[j + 1], 3)),
                        format!("w+2={}", ctx[j + 2]),
                    ];
                    self.predict(&feats)
                }
            };
            prev2 = std::mem::replace(&mut prev, tag.clone());
            tags.push(tag);
        }
        tags
    }
}
