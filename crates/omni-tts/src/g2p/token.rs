//! The token record shared by the tokenizer, the tagger and the lexicon, and the merge of the
//! sub-tokens of one word.

/// One token on its way to phonemes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tok {
    pub text: String,
    pub tag: String,
    /// Followed by whitespace in the text.
    pub whitespace: bool,
    pub phonemes: Option<String>,
    /// First sub-token of a whitespace-separated word.
    pub is_head: bool,
    /// Read as this word instead ("2" between letters reads "to").
    pub alias: Option<String>,
    /// The currency symbol before this amount.
    pub currency: Option<String>,
    /// Phonemes of this sub-token get a space before them when merged.
    pub prespace: bool,
}

impl Tok {
    pub fn new(text: impl Into<String>, tag: impl Into<String>, whitespace: bool) -> Self {
        Self {
            text: text.into(),
            tag: tag.into(),
            whitespace,
            is_head: true,
            ..Self::default()
        }
    }
}

/// One token standing for `tokens` (the sub-tokens of one word). With `unk`, the phonemes are
/// the parts' joined (a space before a part marked `prespace`), `unk` for parts without any.
pub fn merge_tokens(tokens: &[Tok], unk: Option<&str>) -> Tok {
    let mut text = String::new();
    for (i, tk) in tokens.iter().enumerate() {
        text.push_str(&tk.text);
        if i + 1 < tokens.len() && tk.whitespace {
            text.push(' ');
        }
    }
    // The tag of the part with the most capital weight (first on ties).
    let weight = |tk: &Tok| -> usize {
        tk.text
            .chars()
            .map(|c| {
                if c.to_lowercase().eq(std::iter::once(c)) {
                    1
                } else {
                    2
                }
            })
            .sum()
    };
    let mut best = &tokens[0];
    for tk in &tokens[1..] {
        if weight(tk) > weight(best) {
            best = tk;
        }
    }
    let phonemes = unk.map(|unk| {
        let mut ps = String::new();
        for tk in tokens {
            let ends_in_space = ps.chars().last().is_some_and(char::is_whitespace);
            if tk.prespace
                && !ps.is_empty()
                && !ends_in_space
                && tk.phonemes.as_deref().is_some_and(|p| !p.is_empty())
            {
                ps.push(' ');
            }
            ps.push_str(tk.phonemes.as_deref().unwrap_or(unk));
        }
        ps
    });
    Tok {
        text,
        tag: best.tag.clone(),
        whitespace: tokens[tokens.len() - 1].whitespace,
        phonemes,
        is_head: tokens[0].is_head,
        alias: None,
        currency: tokens.iter().filter_map(|t| t.currency.clone()).max(),
        prespace: tokens[0].prespace,
    }
}
