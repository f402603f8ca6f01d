//! Out-of-vocabulary words: a small character-level transformer (`oov.onnx`, with its alphabet in
//! `oov.json`) trained on espeak-ng's readings, so unknown words sound as in the reference
//! pipeline. One model run per word; the output is CTC-style (repeats collapsed, blanks dropped).

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use crate::Error;
use crate::onnx::OnnxModel;

#[derive(Debug, Deserialize)]
pub struct OovMeta {
    #[serde(rename = "in")]
    inputs: Vec<String>,
    #[serde(rename = "out")]
    outputs: Vec<String>,
    maxlen: usize,
}

#[derive(Debug)]
pub struct Oov {
    model: OnnxModel,
    chars_in: HashMap<char, i64>,
    chars_out: HashMap<i64, String>,
    maxlen: usize,
}

impl Oov {
    pub fn load(runtime: &Path, model: &Path, meta: OovMeta) -> Result<Self, Error> {
        Ok(Self {
            model: OnnxModel::load(runtime, model)?,
            chars_in: meta
                .inputs
                .iter()
                .enumerate()
                .filter_map(|(i, c)| Some((c.chars().next()?, i as i64 + 1)))
                .collect(),
            chars_out: meta
                .outputs
                .into_iter()
                .enumerate()
                .map(|(i, c)| (i as i64 + 1, c))
                .collect(),
            maxlen: meta.maxlen,
        })
    }

    /// The phonemes of an unknown word, `None` if none of its characters are in the alphabet.
    pub fn phonemize(&self, word: &str) -> Result<Option<String>, Error> {
        let ids: Vec<i64> = word
            .chars()
            .filter_map(|c| self.chars_in.get(&c).copied())
            .take(self.maxlen)
            .collect();
        if ids.is_empty() {
            return Ok(None);
        }
        let out = self.model.run_ids("chars", &ids)?;
        let mut ps = String::new();
        let mut prev = 0;
        for &i in &out.data {
            if i != prev
                && i != 0
                && let Some(c) = self.chars_out.get(&i)
            {
                ps.push_str(c);
            }
            prev = i;
        }
        Ok(Some(ps))
    }
}
