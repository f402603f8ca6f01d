//! Stop-string matching for generated text, streaming included.
//!
//! After each detokenized delta, [`StopStrings::find`] looks for a stop string in the new tail
//! of the text (a match may start before the delta); [`StopStrings::safe_len`] says how much of
//! the text can be streamed without emitting the beginning of a stop string that later tokens
//! might complete.

/// A match of a stop string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// Index into the stop-string list.
    pub stop_index: usize,
    /// Byte offset where the stop string starts in the text.
    pub start: usize,
    /// Length the text should be truncated to (the stop string is excluded unless
    /// `include_in_output`).
    pub truncate_to: usize,
}

/// A request's stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    include_in_output: bool,
}

impl StopStrings {
    /// Empty strings are ignored.
    pub fn new(stops: impl IntoIterator<Item = String>, include_in_output: bool) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            include_in_output,
        }
    }

    /// Whether there are no stop strings.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// The earliest stop string in `text` that overlaps its last `new_bytes` bytes (text before
    /// that was checked on earlier steps). Ties at one position go to the longer string.
    pub fn find(&self, text: &str, new_bytes: usize) -> Option<StopMatch> {
        let new_start = text.len().saturating_sub(new_bytes);
        let mut best: Option<StopMatch> = None;
        for (stop_index, stop) in self.stops.iter().enumerate() {
            let mut from = new_start.saturating_sub(stop.len() - 1);
            while !text.is_char_boundary(from) {
                from -= 1;
            }
            let Some(pos) = text[from..].find(stop.as_str()) else {
                continue;
            };
            let start = from + pos;
            let better = match &best {
                None => true,
                Some(b) => {
                    start < b.start
                        || (start == b.start && stop.len() > self.stops[b.stop_index].len())
                }
            };
            if better {
                let truncate_to = if self.include_in_output {
                    start + stop.len()
                } else {
                    start
                };
                best = Some(StopMatch {
                    stop_index,
                    start,
                    truncate_to,
                });
            }
        }
        best
    }

    /// How many leading bytes of `text` can be streamed now: all but the longest suffix that is
    /// a proper prefix of some stop string (on a character boundary).
    pub fn safe_len(&self, text: &str) -> usize {
        let mut hold = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(text.len());
            for n in (hold + 1..=max).rev() {
                let start = text.len() - n;
                if text.is_char_boundary(start)
                    && stop.as_bytes().starts_with(&text.as_bytes()[start..])
                {
                    hold = n;
                    break;
                }
            }
        }
        text.len() - hold
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn stops(s: &[&str], include: bool) -> StopStrings {
        StopStrings::new(s.iter().map(|s| s.to_string()), include)
    }

    #[test]
    fn stop_string_spanning_deltas_is_found_and_truncated() {
        let s = stops(&["\nUser:"], false);
        let text = "Paris.\nUs";
        assert_eq!(s.find(text, 3), None);
        let text = "Paris.\nUser: more";
        let m = s.find(text, 8).unwrap();
        assert_eq!((m.stop_index, m.start, m.truncate_to), (0, 6, 6));
        assert_eq!(&text[..m.truncate_to], "Paris.");
    }

    #[test]
    fn include_in_output_keeps_the_stop_string() {
        let s = stops(&["END"], true);
        let m = s.find("abcEND", 3).unwrap();
        assert_eq!(m.truncate_to, 6);
    }

    #[test]
    fn earliest_match_wins_over_list_order() {
        let s = stops(&["world", "hello"], false);
        let m = s.find("say hello world", 15).unwrap();
        assert_eq!(m.stop_index, 1);
        assert_eq!(m.start, 4);
    }

    #[test]
    fn matches_wholly_in_old_text_are_not_reported_again() {
        let s = stops(&["ab"], false);
        assert_eq!(s.find("ab cdef", 2), None);
    }

    #[test]
    fn safe_len_holds_back_a_possible_stop_prefix() {
        let s = stops(&["<|im_end|>", "###"], false);
        assert_eq!(s.safe_len("Paris<|im_"), 5);
        assert_eq!(s.safe_len("Paris#"), 5);
        assert_eq!(s.safe_len("Paris"), 5);
        assert_eq!(s.safe_len("a < b"), 5);
        assert_eq!(stops(&[], false).safe_len("abc"), 3);
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let s = stops(&["é!"], false);
        assert_eq!(s.safe_len("café"), "caf".len());
        let m = s.find("café!", 1).unwrap();
        assert_eq!(m.truncate_to, "caf".len());
    }
}
