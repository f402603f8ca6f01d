//! Sentence and clause splitting: what the voice synthesizes in one model call, and the streaming
//! splitter that turns text arriving in pieces (a text stage's detokenized output) into sentences.
//!
//! A sentence ends at `.`, `!`, `?` or `…` (closing quotes and brackets may follow) before
//! whitespace and more text, except a period after a title or an initial ("Dr. Smith",
//! "J. K. Rowling") and before a lowercase word; line breaks end paragraphs. Phoneme strings longer
//! than [`MAX_PHONEMES`] are cut at clause punctuation.

use std::collections::HashSet;

/// Phoneme strings longer than this are split at clause punctuation before synthesis.
pub const MAX_PHONEMES: usize = 400;

const SENTENCE_END: &[char] = &['.', '!', '?', '…'];
const CLOSERS: &[char] = &['"', '”', '’', ')', ']'];
const CLAUSE_END: &[char] = &[',', ';', ':', '—'];

/// Sentence splitting rules (the titles that a period does not end a sentence after).
#[derive(Debug, Clone, Default)]
pub struct SentenceSplitter {
    titles: HashSet<String>,
}

impl SentenceSplitter {
    pub fn new(titles: impl IntoIterator<Item = String>) -> Self {
        Self {
            titles: titles.into_iter().collect(),
        }
    }

    /// Byte ranges of the sentences of one paragraph (no line breaks inside), in order; the last
    /// range runs to the paragraph's end.
    fn cuts(&self, para: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut cut = 0;
        let chars: Vec<(usize, char)> = para.char_indices().collect();
        let mut i = 1;
        while i < chars.len() {
            if !SENTENCE_END.contains(&chars[i - 1].1) {
                i += 1;
                continue;
            }
            // closers*, then at least one whitespace, then a non-space character.
            let mut j = i;
            while j < chars.len() && CLOSERS.contains(&chars[j].1) {
                j += 1;
            }
            let mut k = j;
            while k < chars.len() && chars[k].1.is_whitespace() {
                k += 1;
            }
            if k == j || k == chars.len() {
                i += 1;
                continue;
            }
            let start = chars[i].0;
            if self.ends_sentence(para, start, chars[k].1) {
                out.push((cut, start));
                cut = chars[k].0;
            }
            i = k + 1;
        }
        out.push((cut, para.len()));
        out
    }

    /// False for a period after a title or a single capital, or before a lowercase word.
    fn ends_sentence(&self, para: &str, end: usize, next: char) -> bool {
        if next.is_lowercase() {
            return false;
        }
        let before = &para[..end];
        if !before.ends_with('.') {
            return true;
        }
        let word_start = before.rfind(' ').map_or(0, |p| p + 1);
        let word =
            before[word_start..before.len() - 1].trim_start_matches(['(', '"', '“', '\'', '‘']);
        let single_capital = {
            let mut cs = word.chars();
            matches!((cs.next(), cs.next()), (Some(c), None) if c.is_uppercase())
        };
        !(self.titles.contains(word) || single_capital)
    }

    /// The sentences of `text`: paragraphs (line breaks) and sentence ends; empty ones dropped.
    pub fn split(&self, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        for para in text.trim().split('\n') {
            let para = para.trim();
            for (a, b) in self.cuts(para) {
                let s = &para[a..b];
                if !s.trim().is_empty() {
                    out.push(s.to_string());
                }
            }
        }
        out
    }
}

/// Joins the clauses of a long phoneme string into chunks of at most [`MAX_PHONEMES`] characters
/// where the clauses allow (a clause longer than that stays whole).
pub fn chunk_phonemes(ps: &str) -> Vec<String> {
    if ps.chars().count() <= MAX_PHONEMES {
        return vec![ps.to_string()];
    }
    // Clauses: split at whitespace that follows clause punctuation.
    let mut parts = Vec::new();
    let mut start = 0;
    let chars: Vec<(usize, char)> = ps.char_indices().collect();
    let mut i = 0;
    while i < chars.len() {
        if i > 0 && CLAUSE_END.contains(&chars[i - 1].1) && chars[i].1.is_whitespace() {
            let mut k = i;
            while k < chars.len() && chars[k].1.is_whitespace() {
                k += 1;
            }
            parts.push(&ps[start..chars[i].0]);
            start = if k < chars.len() {
                chars[k].0
            } else {
                ps.len()
            };
            i = k;
            continue;
        }
        i += 1;
    }
    parts.push(&ps[start..]);
    let mut chunks = Vec::new();
    let mut cur = String::new();
    for part in parts {
        let cur_len = cur.chars().count();
        if !cur.is_empty() && cur_len + part.chars().count() + 1 > MAX_PHONEMES {
            chunks.push(std::mem::take(&mut cur));
            cur.push_str(part);
        } else if cur.is_empty() {
            cur.push_str(part);
        } else {
            cur.push(' ');
            cur.push_str(part);
        }
    }
    if !cur.is_empty() {
        chunks.push(cur);
    }
    chunks
}

/// Streaming sentence splitter: push text as it arrives, take the sentences that are complete.
///
/// A sentence is complete once the text after it has started (its end needs the next word to be
/// told apart from "Dr. Smith"), or at a line break; [`SentenceStream::finish`] hands out the rest.
///
/// With [`SentenceStream::flush_clauses_after`], a sentence that grows past a length is also cut
/// at its last clause break (`,` `;` `:` `—` before whitespace), so that speech can start before
/// a long sentence ends; the audio then differs from whole-text synthesis at those cuts.
#[derive(Debug, Clone)]
pub struct SentenceStream {
    splitter: SentenceSplitter,
    pending: String,
    clause_flush: Option<usize>,
}

impl SentenceStream {
    pub fn new(splitter: SentenceSplitter) -> Self {
        Self {
            splitter,
            pending: String::new(),
            clause_flush: None,
        }
    }

    /// Also hands out the clauses of an unfinished sentence once it is longer than `chars`.
    pub fn flush_clauses_after(mut self, chars: usize) -> Self {
        self.clause_flush = Some(chars);
        self
    }

    /// Changes the clause limit of [`SentenceStream::flush_clauses_after`] from now on (`None`:
    /// whole sentences only); e.g. a short limit for a stream's first piece of speech, a
    /// longer one after it.
    pub fn set_clause_flush(&mut self, chars: Option<usize>) {
        self.clause_flush = chars;
    }

    /// The end of the last clause break of `text` (after its punctuation), if any.
    fn last_clause_break(text: &str) -> Option<usize> {
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        (1..chars.len())
            .rev()
            .find(|&i| CLAUSE_END.contains(&chars[i - 1].1) && chars[i].1.is_whitespace())
            .map(|i| chars[i].0)
    }

    /// Appends `text` and returns the sentences completed by it, in order.
    pub fn push(&mut self, text: &str) -> Vec<String> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        // Whole paragraphs first: everything before the last line break is final.
        if let Some(nl) = self.pending.rfind('\n') {
            let done: String = self.pending[..nl].to_string();
            self.pending.drain(..=nl);
            out.extend(self.splitter.split(&done));
        }
        let lead = self.pending.len() - self.pending.trim_start().len();
        let para = &self.pending[lead..];
        let cuts = self.splitter.cuts(para);
        if cuts.len() > 1 {
            for &(a, b) in &cuts[..cuts.len() - 1] {
                let s = &para[a..b];
                if !s.trim().is_empty() {
                    out.push(s.to_string());
                }
            }
            let keep_from = lead + cuts[cuts.len() - 1].0;
            self.pending.drain(..keep_from);
        }
        if let Some(limit) = self.clause_flush
            && self.pending.trim().chars().count() > limit
            && let Some(end) = Self::last_clause_break(&self.pending)
        {
            let clause = self.pending[..end].trim().to_string();
            self.pending.drain(..end);
            if !clause.is_empty() {
                out.push(clause);
            }
        }
        out
    }

    /// The sentences still buffered (the end of the text has been reached).
    pub fn finish(&mut self) -> Vec<String> {
        let rest = std::mem::take(&mut self.pending);
        self.splitter.split(&rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splitter() -> SentenceSplitter {
        SentenceSplitter::new(["Dr".to_string(), "Mr".to_string()])
    }

    #[test]
    fn splits_at_sentence_ends_but_not_after_titles_or_initials() {
        let s = splitter();
        assert_eq!(
            s.split("Dr. Smith came. J. K. Rowling wrote! Did she? \"Yes.\" Then e.g. this."),
            vec![
                "Dr. Smith came.",
                "J. K. Rowling wrote!",
                "Did she?",
                // The closing quote after a sentence end goes with the break (as in the
                // reference), not with either sentence.
                "\"Yes.",
                "Then e.g. this."
            ]
        );
        assert_eq!(s.split("One.\n\nTwo\nThree"), vec!["One.", "Two", "Three"]);
    }

    #[test]
    fn stream_gives_the_same_sentences_as_whole_text() {
        let text = "Hello there. Dr. Smith is in. Is it ready? Yes!\nA new line. The end";
        let whole = splitter().split(text);
        for step in [1, 2, 3, 7] {
            let mut stream = SentenceStream::new(splitter());
            let mut got = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(step) {
                got.extend(stream.push(&piece.iter().collect::<String>()));
            }
            got.extend(stream.finish());
            assert_eq!(got, whole, "step {step}");
        }
    }

    #[test]
    fn a_long_unfinished_sentence_is_flushed_at_clause_breaks() {
        let mut stream = SentenceStream::new(splitter()).flush_clauses_after(20);
        let mut got = stream.push("We walked along the river, past the mill");
        assert_eq!(got, vec!["We walked along the river,"]);
        got = stream.push(" and the old bridge. Then home.");
        assert_eq!(got, vec!["past the mill and the old bridge."]);
        assert_eq!(stream.finish(), vec!["Then home."]);
    }

    #[test]
    fn long_phoneme_strings_are_cut_at_clauses() {
        let clause = "a".repeat(150);
        let ps = format!("{clause}, {clause}, {clause}; {clause}.");
        let chunks = chunk_phonemes(&ps);
        assert_eq!(chunks.len(), 2);
        assert!(chunks.iter().all(|c| c.chars().count() <= MAX_PHONEMES));
        assert_eq!(chunks.join(" "), ps);
    }
}
