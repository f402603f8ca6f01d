//! Incremental detokenization for streaming, after vLLM's `detokenize_incrementally`.
//!
//! Decoding one token at a time is wrong for byte-level BPE (a character can span tokens, so a
//! lone token decodes to U+FFFD) and for SentencePiece (a leading `▁` is dropped at the start of
//! a decode). So each step decodes a short window: `prefix_offset..read_offset` is text already
//! emitted, `prefix_offset..` is the same window plus the new tokens. The difference is the new
//! text, emitted only once it no longer ends in U+FFFD (an incomplete UTF-8 sequence); then the
//! window slides forward.
//!
//! ```text
//! ids:  [ ... prompt ... | gen0 gen1 gen2 gen3 ]
//!                 ^prefix_offset   ^read_offset   (emitted text = decode(prefix..read))
//! ```

use crate::Error;
use crate::tokenizer::Tokenizer;

/// How many prompt tokens seed the window, as in vLLM.
const INITIAL_WINDOW: usize = 5;

/// Streaming detokenizer state for one sequence.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
    output: String,
}

impl IncrementalDetokenizer {
    /// Starts after `prompt_ids` (only their last few are kept, as decoding context).
    pub fn new(prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(INITIAL_WINDOW)..];
        Self {
            ids: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
            skip_special_tokens,
            output: String::new(),
        }
    }

    /// Adds one generated token; returns the text it completes (often empty while a multi-byte
    /// character is still incomplete, sometimes several tokens' worth at once).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, Error> {
        self.ids.push(id);
        let prefix_text = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let new_text =
            tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if new_text.len() <= prefix_text.len() || new_text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = match new_text.strip_prefix(prefix_text.as_str()) {
            Some(delta) => delta.to_owned(),
            // The window's start decoded differently in context: cut at the nearest boundary.
            None => {
                let mut cut = prefix_text.len();
                while !new_text.is_char_boundary(cut) {
                    cut += 1;
                }
                new_text[cut..].to_owned()
            }
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Keep the id buffer short: everything before the window is no longer needed.
        if self.prefix_offset > 64 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        self.output.push_str(&delta);
        Ok(delta)
    }

    /// At the end of the stream: the text still held back (an incomplete character decodes to
    /// U+FFFD), so that the concatenated deltas equal a full decode.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String, Error> {
        let prefix_text = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let new_text =
            tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        let delta = new_text
            .strip_prefix(prefix_text.as_str())
            .unwrap_or_default()
            .to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.output.push_str(&delta);
        Ok(delta)
    }

    /// All text emitted so far.
    pub fn output(&self) -> &str {
        &self.output
    }
}
