//! Text to misaki-style English phonemes (the alphabet Kokoro-82M and so hibari read), without
//! spaCy or espeak-ng: normalise -> tokenize (spaCy's rules) -> tag (perceptron) -> lexicon with
//! part-of-speech and context rules -> the OOV net for unknown words -> stress of compounds.
//!
//! ```text
//! "Hello there."  ->  "həlˈO ðˈɛɹ."
//! ```

pub mod lexicon;
pub mod normalize;
pub mod numbers;
pub mod oov;
pub mod pystr;
pub mod reading;
pub mod stress;
pub mod tagger;
pub mod token;
pub mod tokenize;

use fancy_regex::Regex;

use self::lexicon::{Context, Lexicon, currency_units};
use self::normalize::Normalizer;
use self::oov::Oov;
use self::stress::{CONSONANTS, PRIMARY, VOWELS, apply_stress, stress_weight};
use self::tagger::Tagger;
use self::token::{Tok, merge_tokens};
use self::tokenize::{Tokenizer, compile};
use crate::Error;

const SUBTOKEN: &str = r"^['‘’]+|[A-ZÀ-ÖØ-Þ](?=[A-ZÀ-ÖØ-Þ][a-zß-öø-ÿ])|(?:^-)?(?:\d?[,.]?\d)+|[-_]+|['‘’]{2,}|[^\W\d_]*?(?:['‘’][^\W\d_])*?[a-zß-öø-ÿ](?=[A-ZÀ-ÖØ-Þ])|[^\W\d_]+(?:['‘’][^\W\d_])*|[^\w\-'‘’]|['‘’]+$";
const LINK: &str = r"\[([^\]]+)\]\(([^\)]*)\)";
const FALLBACK_PIECE: &str = r"[^\W\d_]+(?:['’][^\W\d_]+)*|\d+(?:[,.]\d+)*|[^\w\s]+";
const SUBTOKEN_JUNKS: &str = "',-._‘’/";
const PUNCTS: &str = ";:,.!?—…\"“”";
const NON_QUOTE_PUNCTS: &str = ";:,.!?—…";
const PUNCT_TAGS: [&str; 10] = [
    ".", ",", "-LRB-", "-RRB-", "``", "\"\"", "''", ":", "$", "#",
];
const PUNCT_TAG_NFP: &str = "NFP";

fn punct_tag_phonemes(tag: &str) -> Option<&'static str> {
    match tag {
        "-LRB-" => Some("("),
        "-RRB-" => Some(")"),
        "``" => Some("“"),
        "\"\"" | "''" => Some("”"),
        _ => None,
    }
}

/// What espeak-ng said for symbols in the reference pipeline.
fn symbol_phonemes(c: char) -> &'static str {
    match c {
        '/' => "slˈæʃ",
        '=' => "ˈikwᵊlz",
        '+' => "plˈʌs",
        '&' => "ænd",
        '@' => "æt",
        '%' => "pəɹsˈɛnt",
        '#' => "hˈæʃ",
        '*' => "ˈæstəɹˌɪsk",
        '~' => "tˈɪldə",
        '^' => "kˈɛɹət",
        '<' => "lˈɛs ðən",
        '>' => "ɡɹˈATəɹ ðən",
        '—' => "—",
        _ => "",
    }
}

fn is_junk(text: &str) -> bool {
    text.chars().all(|c| SUBTOKEN_JUNKS.contains(c))
}

fn is_non_quote_punct(text: &str) -> bool {
    let mut cs = text.chars();
    matches!((cs.next(), cs.next()), (Some(c), None) if NON_QUOTE_PUNCTS.contains(c))
}

/// A word of the sentence: one token, or the sub-tokens of one written word.
#[derive(Debug)]
enum Word {
    One(Tok),
    Many(Vec<Tok>),
}

/// The whole grapheme-to-phoneme pipeline of one voice.
#[derive(Debug)]
pub struct G2p {
    pub(crate) normalizer: Normalizer,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) tagger: Tagger,
    pub(crate) lexicon: Lexicon,
    pub(crate) oov: Oov,
    subtoken: Regex,
    link: Regex,
    fallback_piece: Regex,
}

impl G2p {
    pub fn new(
        normalizer: Normalizer,
        tokenizer: Tokenizer,
        tagger: Tagger,
        lexicon: Lexicon,
        oov: Oov,
    ) -> Result<Self, Error> {
        Ok(Self {
            normalizer,
            tokenizer,
            tagger,
            lexicon,
            oov,
            subtoken: compile("g2p subtoken", SUBTOKEN)?,
            link: compile("g2p link", LINK)?,
            fallback_piece: compile("g2p fallback", FALLBACK_PIECE)?,
        })
    }

    /// The phoneme string of one sentence.
    pub fn phonemize(&self, text: &str) -> Result<String, Error> {
        let text = self.normalizer.normalize(text);
        let tokens = self.phonemize_tokens(self.tokenize(&text))?;
        let mut out = String::new();
        for tk in &tokens {
            out.push_str(tk.phonemes.as_deref().unwrap_or(""));
            if tk.whitespace {
                out.push(' ');
            }
        }
        Ok(out.trim().to_string())
    }

    /// Tagged tokens; `[text](/phonemes/)` gives a token its phonemes directly.
    fn tokenize(&self, text: &str) -> Vec<Tok> {
        let mut toks = Vec::new();
        let mut pos = 0;
        for caps in self.link.captures_iter(text).flatten() {
            let (Some(whole), Some(word), Some(f)) = (caps.get(0), caps.get(1), caps.get(2)) else {
                continue;
            };
            toks.extend(self.plain_tokens(&text[pos..whole.start()]));
            let f = f.as_str();
            let ps = (f.chars().count() > 1 && f.starts_with('/') && f.ends_with('/'))
                .then(|| f[1..].trim_end_matches('/').to_string());
            let ws = text[whole.end()..]
                .chars()
                .next()
                .is_some_and(char::is_whitespace);
            let mut tk = Tok::new(word.as_str(), "NN", ws);
            tk.phonemes = ps;
            toks.push(tk);
            pos = whole.end();
        }
        toks.extend(self.plain_tokens(&text[pos..]));
        toks
    }

    fn plain_tokens(&self, text: &str) -> Vec<Tok> {
        let pairs = self.tokenizer.tokenize(text);
        if pairs.is_empty() {
            return Vec::new();
        }
        let words: Vec<String> = pairs.iter().map(|(t, _)| t.clone()).collect();
        let tags = self.tagger.tag(&words);
        pairs
            .into_iter()
            .zip(tags)
            .map(|((t, ws), tag)| Tok::new(t, tag, ws))
            .collect()
    }

    /// Splits tokens into sub-tokens, marks punctuation and currency, and groups the sub-tokens
    /// of each written word.
    fn retokenize(&self, tokens: &[Tok]) -> Vec<Word> {
        let mut words: Vec<Word> = Vec::new();
        let mut currency: Option<String> = None;
        for (i, token) in tokens.iter().enumerate() {
            let mut tks: Vec<Tok> = if token.alias.is_none() && token.phonemes.is_none() {
                self.subtoken
                    .find_iter(&token.text)
                    .flatten()
                    .map(|m| Tok {
                        text: m.as_str().to_string(),
                        whitespace: false,
                        is_head: true,
                        prespace: false,
                        ..token.clone()
                    })
                    .collect()
            } else {
                vec![token.clone()]
            };
            let Some(last) = tks.last_mut() else {
                continue;
            };
            last.whitespace = token.whitespace;
            let n = tks.len();
            for j in 0..n {
                let neighbours_alpha = j > 0 && j + 1 < n && {
                    let a = tks[j - 1].text.chars().last();
                    let b = tks[j + 1].text.chars().next();
                    a.zip(b)
                        .is_some_and(|(a, b)| a.is_alphabetic() && b.is_alphabetic())
                };
                let next_is_cd = tokens.get(i + 1).is_some_and(|t| t.tag == "CD");
                let mut tk = tks[j].clone();
                if tk.alias.is_some() || tk.phonemes.is_some() {
                } else if tk.tag == "$" && currency_units(&tk.text).is_some() {
                    currency = Some(tk.text.clone());
                    tk.phonemes = Some(String::new());
                } else if tk.tag == ":" && (tk.text == "-" || tk.text == "–") {
                    tk.phonemes = Some("—".to_string());
                } else if (PUNCT_TAGS.contains(&tk.tag.as_str()) || tk.tag == PUNCT_TAG_NFP)
                    && !tk
                        .text
                        .chars()
                        .all(|c| c.to_lowercase().all(|l| l.is_ascii_lowercase()))
                {
                    tk.phonemes = Some(match punct_tag_phonemes(&tk.tag) {
                        Some(p) => p.to_string(),
                        None => tk.text.chars().filter(|c| PUNCTS.contains(*c)).collect(),
                    });
                } else if currency.is_some() {
                    if tk.tag != "CD" {
                        currency = None;
                    } else if j + 1 == n && !next_is_cd {
                        tk.currency = currency.clone();
                    }
                } else if neighbours_alpha && tk.text == "2" {
                    tk.alias = Some("to".to_string());
                }
                if tk.alias.is_some() || tk.phonemes.is_some() {
                    words.push(Word::One(tk));
                } else if let Some(Word::Many(group)) = words.last_mut()
                    && group.last().is_some_and(|g| !g.whitespace)
                {
                    tk.is_head = false;
                    group.push(tk);
                } else if tk.whitespace {
                    words.push(Word::One(tk));
                } else {
                    words.push(Word::Many(vec![tk]));
                }
            }
        }
        words
            .into_iter()
            .map(|w| match w {
                Word::Many(mut g) if g.len() == 1 => Word::One(g.remove(0)),
                w => w,
            })
            .collect()
    }

    fn token_context(ctx: &Context, ps: Option<&str>, token: &Tok) -> Context {
        let mut vowel = ctx.future_vowel;
        // The first vowel, consonant or punctuation of the phonemes decides.
        let decisive = ps.and_then(|ps| {
            ps.chars().find(|&c| {
                VOWELS.contains(c) || CONSONANTS.contains(c) || NON_QUOTE_PUNCTS.contains(c)
            })
        });
        if let Some(c) = decisive {
            vowel = if NON_QUOTE_PUNCTS.contains(c) {
                None
            } else {
                Some(VOWELS.contains(c))
            };
        }
        let future_to = matches!(token.text.as_str(), "to" | "To")
            || (token.text == "TO" && matches!(token.tag.as_str(), "TO" | "IN"));
        Context {
            future_vowel: vowel,
            future_to,
        }
    }

    /// Stress and spacing of a word read in parts ("CPU-bound", "2nd").
    fn resolve_tokens(tokens: &mut [Tok]) {
        let mut text = String::new();
        for (i, tk) in tokens.iter().enumerate() {
            text.push_str(&tk.text);
            if i + 1 < tokens.len() && tk.whitespace {
                text.push(' ');
            }
        }
        let classes: std::collections::HashSet<u8> = text
            .chars()
            .filter(|c| !SUBTOKEN_JUNKS.contains(*c))
            .map(|c| {
                if c.is_alphabetic() {
                    0
                } else if c.is_ascii_digit() {
                    1
                } else {
                    2
                }
            })
            .collect();
        let prespace = text.contains(' ') || text.contains('/') || classes.len() > 1;
        let last = tokens.len() - 1;
        for (i, tk) in tokens.iter_mut().enumerate() {
            if tk.phonemes.is_none() {
                if i == last && is_non_quote_punct(&tk.text) {
                    tk.phonemes = Some(tk.text.clone());
                } else if is_junk(&tk.text) {
                    tk.phonemes = Some(String::new());
                }
            } else if i > 0 {
                tk.prespace = prespace;
            }
        }
        if prespace {
            return;
        }
        let mut indices: Vec<(bool, usize, usize)> = tokens
            .iter()
            .enumerate()
            .filter_map(|(i, tk)| {
                let ps = tk.phonemes.as_deref().filter(|p| !p.is_empty())?;
                Some((ps.contains(PRIMARY), stress_weight(ps), i))
            })
            .collect();
        let demote = |tk: &mut Tok| {
            if let Some(ps) = tk.phonemes.as_deref() {
                tk.phonemes = Some(apply_stress(ps, Some(-0.5)));
            }
        };
        if indices.len() == 2 && tokens[indices[0].2].text.chars().count() == 1 {
            demote(&mut tokens[indices[1].2]);
            return;
        }
        let primaries = indices.iter().filter(|x| x.0).count();
        if indices.len() < 2 || primaries <= indices.len().div_ceil(2) {
            return;
        }
        indices.sort();
        let half = indices.len() / 2;
        for &(_, _, i) in &indices[..half] {
            demote(&mut tokens[i]);
        }
    }

    /// An unknown word: letters go to the OOV net, digit runs to the number reader, symbols to a
    /// small table.
    fn fallback(&self, tk: &Tok) -> Result<String, Error> {
        let mut out = Vec::new();
        for m in self.fallback_piece.find_iter(&tk.text).flatten() {
            let piece = m.as_str();
            let Some(first) = piece.chars().next() else {
                continue;
            };
            let ps = if pystr::is_digit_char(first) {
                reading::get_number(&self.lexicon, piece, None, false)
            } else if first.is_alphabetic() {
                self.oov.phonemize(piece)?
            } else {
                Some(piece.chars().map(symbol_phonemes).collect())
            };
            if let Some(ps) = ps.filter(|p| !p.is_empty()) {
                out.push(ps);
            }
        }
        Ok(out.join(" "))
    }

    /// Fills in every token's phonemes (right to left: a word's reading depends on the next).
    fn phonemize_tokens(&self, tokens: Vec<Tok>) -> Result<Vec<Tok>, Error> {
        let mut words = self.retokenize(&tokens);
        let mut ctx = Context::default();
        for w in words.iter_mut().rev() {
            match w {
                Word::One(tk) => {
                    if tk.phonemes.is_none() {
                        tk.phonemes = self.lexicon.phonemize(tk, &ctx);
                    }
                    if tk.phonemes.is_none() {
                        tk.phonemes = Some(self.fallback(tk)?);
                    }
                    ctx = Self::token_context(&ctx, tk.phonemes.as_deref(), tk);
                }
                Word::Many(w) => {
                    let (mut left, mut right) = (0, w.len());
                    let mut should_fallback = false;
                    while left < right {
                        let fixed = w[left..right]
                            .iter()
                            .any(|t| t.alias.is_some() || t.phonemes.is_some());
                        let tk = (!fixed).then(|| merge_tokens(&w[left..right], None));
                        let ps = tk.as_ref().and_then(|tk| self.lexicon.phonemize(tk, &ctx));
                        if let (Some(ps), Some(tk)) = (ps, tk.as_ref()) {
                            ctx = Self::token_context(&ctx, Some(&ps), tk);
                            w[left].phonemes = Some(ps);
                            for x in &mut w[left + 1..right] {
                                x.phonemes = Some(String::new());
                            }
                            right = left;
                            left = 0;
                        } else if left + 1 < right {
                            left += 1;
                        } else {
                            right -= 1;
                            let tk = &mut w[right];
                            if tk.phonemes.is_none() {
                                if is_junk(&tk.text) {
                                    tk.phonemes = Some(String::new());
                                } else {
                                    should_fallback = true;
                                    break;
                                }
                            }
                            left = 0;
                        }
                    }
                    if should_fallback {
                        let tk = merge_tokens(w, None);
                        w[0].phonemes = Some(self.fallback(&tk)?);
                        for x in &mut w[1..] {
                            x.phonemes = Some(String::new());
                        }
                    } else {
                        Self::resolve_tokens(w);
                    }
                }
            }
        }
        Ok(words
            .into_iter()
            .map(|w| {
                let mut tk = match w {
                    Word::One(tk) => tk,
                    Word::Many(g) => merge_tokens(&g, Some("")),
                };
                if let Some(ps) = tk.phonemes.as_mut() {
                    *ps = ps.replace('ɾ', "T").replace('ʔ', "t");
                }
                tk
            })
            .collect())
    }
}
