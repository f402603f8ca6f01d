//! Dictionary look-up with misaki's English rules (Apache-2.0, hexgrad): the gold and silver
//! dictionaries (`lexicon_us_{gold,silver}.json.gz`), part-of-speech entries, function words
//! whose reading depends on the next word ("the" before a vowel, "to"), letters of acronyms,
//! and the -s / -ed / -ing stems. Numbers are read in [`super::reading`].

use std::collections::HashMap;

use serde::Deserialize;
use unicode_normalization::UnicodeNormalization;

use super::pystr::{capitalize, drop_last, is_alpha, lower, nth_back, tail, upper};
use super::stress::{PRIMARY, SECONDARY, apply_stress};
use super::token::Tok;

pub(crate) const US_TAUS: &str = "AIOWYiuæɑəɛɪɹʊʌ";
pub(crate) const CURRENCIES: [(&str, &str, &str); 3] = [
    ("$", "dollar", "cent"),
    ("£", "pound", "pence"),
    ("€", "euro", "cent"),
];
const SYMBOLS: [(&str, &str); 4] = [("%", "percent"), ("&", "and"), ("+", "plus"), ("@", "at")];
const ADD_SYMBOLS: [(&str, &str); 2] = [(".", "dot"), ("/", "slash")];

pub(crate) fn currency_units(sym: &str) -> Option<(&'static str, &'static str)> {
    CURRENCIES
        .iter()
        .find(|(s, _, _)| *s == sym)
        .map(|(_, a, b)| (*a, *b))
}

fn symbol_word(w: &str) -> Option<&'static str> {
    SYMBOLS.iter().find(|(s, _)| *s == w).map(|(_, v)| *v)
}

/// One dictionary entry: a reading, or readings per part-of-speech tag (a tag may map to none).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Entry {
    Plain(String),
    Tagged(HashMap<String, Option<String>>),
}

/// What the next word tells about this one.
#[derive(Debug, Clone, Copy, Default)]
pub struct Context {
    /// `Some(true)` if the next word starts with a vowel sound, `Some(false)` a consonant,
    /// `None` at the end or before punctuation.
    pub future_vowel: Option<bool>,
    /// The next word is "to".
    pub future_to: bool,
}

/// A dictionary where a lowercase key also answers to its Capitalized form and the reverse,
/// unless that form has an entry of its own.
#[derive(Debug, Default)]
pub struct Dict {
    entries: HashMap<String, Entry>,
}

impl Dict {
    pub fn new(raw: HashMap<String, Option<Entry>>) -> Self {
        Self {
            entries: raw.into_iter().filter_map(|(k, v)| Some((k, v?))).collect(),
        }
    }

    pub fn get(&self, w: &str) -> Option<&Entry> {
        if let Some(v) = self.entries.get(w) {
            return Some(v);
        }
        if w.chars().count() < 2 {
            return None;
        }
        if w == lower(w) {
            let c = capitalize(w);
            return if c != w { self.entries.get(&c) } else { None };
        }
        if w == capitalize(w) {
            return self.entries.get(&lower(w));
        }
        None
    }

    pub fn contains(&self, w: &str) -> bool {
        self.get(w).is_some()
    }

    fn plain(&self, w: &str) -> Option<String> {
        match self.get(w)? {
            Entry::Plain(s) => Some(s.clone()),
            Entry::Tagged(t) => t.get("DEFAULT").cloned().flatten(),
        }
    }
}

pub fn parent_tag(tag: Option<&str>) -> Option<String> {
    let tag = tag?;
    Some(
        if tag.starts_with("VB") {
            "VERB"
        } else if tag.starts_with("NN") {
            "NOUN"
        } else if tag.starts_with("ADV") || tag.starts_with("RB") {
            "ADV"
        } else if tag.starts_with("ADJ") || tag.starts_with("JJ") {
            "ADJ"
        } else {
            tag
        }
        .to_string(),
    )
}

fn lexicon_char(c: char) -> bool {
    c == '\'' || c == '-' || c.is_ascii_alphabetic()
}

#[derive(Debug)]
pub struct Lexicon {
    pub(crate) golds: Dict,
    pub(crate) silvers: Dict,
}

impl Lexicon {
    pub fn new(golds: Dict, silvers: Dict) -> Self {
        Self { golds, silvers }
    }

    /// Letters of an acronym or a dotted abbreviation, last stress primary.
    pub(crate) fn get_nnp(&self, word: &str) -> Option<String> {
        let mut ps = String::new();
        for c in word.chars().filter(|c| c.is_alphabetic()) {
            ps.push_str(&self.golds.plain(&c.to_uppercase().to_string())?);
        }
        let ps = apply_stress(&ps, Some(0.0));
        Some(match ps.rfind(SECONDARY) {
            Some(p) => format!("{}{PRIMARY}{}", &ps[..p], &ps[p + SECONDARY.len_utf8()..]),
            None => ps,
        })
    }

    fn special_case(
        &self,
        word: &str,
        tag: &str,
        stress: Option<f64>,
        ctx: &Context,
    ) -> Option<Option<String>> {
        let add = ADD_SYMBOLS.iter().find(|(s, _)| *s == word);
        if tag == "ADD" && add.is_some() {
            return Some(self.lookup(add?.1, None, Some(-0.5), Some(ctx)));
        }
        if let Some(w) = symbol_word(word) {
            return Some(self.lookup(w, None, None, Some(ctx)));
        }
        let inner = word.trim_matches('.');
        if inner.contains('.')
            && is_alpha(&word.replace('.', ""))
            && word
                .split('.')
                .map(|p| p.chars().count())
                .max()
                .unwrap_or(0)
                < 3
        {
            return Some(self.get_nnp(word));
        }
        match word {
            "a" | "A" => {
                return Some(Some(if tag == "DT" { "ɐ" } else { "ˈA" }.to_string()));
            }
            "am" | "Am" | "AM" => {
                if tag.starts_with("NN") {
                    return Some(self.get_nnp(word));
                }
                if ctx.future_vowel.is_none() || word != "am" || stress.is_some_and(|s| s > 0.0) {
                    return Some(self.golds.plain("am"));
                }
                return Some(Some("ɐm".to_string()));
            }
            "an" | "An" | "AN" => {
                if word == "AN" && tag.starts_with("NN") {
                    return Some(self.get_nnp(word));
                }
                return Some(Some("ɐn".to_string()));
            }
            _ => {}
        }
        if word == "I" && tag == "PRP" {
            return Some(Some(format!("{SECONDARY}I")));
        }
        if matches!(word, "by" | "By" | "BY") && parent_tag(Some(tag)).as_deref() == Some("ADV") {
            return Some(Some("bˈI".to_string()));
        }
        if matches!(word, "to" | "To") || (word == "TO" && matches!(tag, "TO" | "IN")) {
            return Some(match ctx.future_vowel {
                None => self.golds.plain("to"),
                Some(false) => Some("tə".to_string()),
                Some(true) => Some("tʊ".to_string()),
            });
        }
        if matches!(word, "in" | "In") || (word == "IN" && tag != "NNP") {
            let s = if ctx.future_vowel.is_none() || tag != "IN" {
                PRIMARY.to_string()
            } else {
                String::new()
            };
            return Some(Some(format!("{s}ɪn")));
        }
        if matches!(word, "the" | "The") || (word == "THE" && tag == "DT") {
            return Some(Some(
                if ctx.future_vowel == Some(true) {
                    "ði"
                } else {
                    "ðə"
                }
                .to_string(),
            ));
        }
        if tag == "IN" && matches!(word.to_lowercase().as_str(), "vs" | "vs.") {
            return Some(self.lookup("versus", None, None, Some(ctx)));
        }
        if matches!(word, "used" | "Used" | "USED") {
            let key = if matches!(tag, "VBD" | "JJ") && ctx.future_to {
                "VBD"
            } else {
                "DEFAULT"
            };
            return Some(match self.golds.get("used") {
                Some(Entry::Tagged(t)) => t.get(key).cloned().flatten(),
                Some(Entry::Plain(s)) => Some(s.clone()),
                None => None,
            });
        }
        None
    }

    pub(crate) fn is_known(&self, word: &str) -> bool {
        if self.golds.contains(word) || symbol_word(word).is_some() || self.silvers.contains(word) {
            return true;
        }
        if !is_alpha(word) || !word.chars().all(lexicon_char) {
            return false;
        }
        if word.chars().count() == 1 {
            return true;
        }
        if word == upper(word) && self.golds.contains(&lower(word)) {
            return true;
        }
        let t = tail(word);
        t == upper(t)
    }

    pub(crate) fn lookup(
        &self,
        word: &str,
        tag: Option<&str>,
        stress: Option<f64>,
        ctx: Option<&Context>,
    ) -> Option<String> {
        let mut word = word.to_string();
        let mut is_nnp = false;
        if word == upper(&word) && !self.golds.contains(&word) {
            word = lower(&word);
            is_nnp = tag == Some("NNP");
        }
        let mut entry = self.golds.get(&word);
        if entry.is_none() && !is_nnp {
            entry = self.silvers.get(&word);
        }
        let ps: Option<String> = match entry {
            None => None,
            Some(Entry::Plain(s)) => Some(s.clone()),
            Some(Entry::Tagged(t)) => {
                let key: Option<String> =
                    if ctx.is_some_and(|c| c.future_vowel.is_none()) && t.contains_key("None") {
                        Some("None".to_string())
                    } else if tag.is_some_and(|tg| t.contains_key(tg)) {
                        tag.map(str::to_string)
                    } else {
                        parent_tag(tag)
                    };
                match key.as_deref().and_then(|k| t.get(k)) {
                    Some(v) => v.clone(),
                    None => t.get("DEFAULT").cloned().flatten(),
                }
            }
        };
        if (ps.is_none() || (is_nnp && !ps.as_deref().is_some_and(|p| p.contains(PRIMARY))))
            && let Some(nnp) = self.get_nnp(&word)
        {
            return Some(nnp);
        }
        ps.map(|p| apply_stress(&p, stress))
    }

    pub(crate) fn suffix_s(stem: Option<String>) -> Option<String> {
        let stem = stem?;
        let last = stem.chars().last()?;
        Some(if "ptkfθ".contains(last) {
            format!("{stem}s")
        } else if "szʃʒʧʤ".contains(last) {
            format!("{stem}ᵻz")
        } else {
            format!("{stem}z")
        })
    }

    pub(crate) fn stem_s(
        &self,
        word: &str,
        tag: Option<&str>,
        stress: Option<f64>,
        ctx: Option<&Context>,
    ) -> Option<String> {
        let n = word.chars().count();
        if n < 3 || !word.ends_with('s') {
            return None;
        }
        let stem = if !word.ends_with("ss") && self.is_known(drop_last(word, 1)) {
            drop_last(word, 1).to_string()
        } else if (word.ends_with("'s")
            || (n > 4 && word.ends_with("es") && !word.ends_with("ies")))
            && self.is_known(drop_last(word, 2))
        {
            drop_last(word, 2).to_string()
        } else if n > 4
            && word.ends_with("ies")
            && self.is_known(&format!("{}y", drop_last(word, 3)))
        {
            format!("{}y", drop_last(word, 3))
        } else {
            return None;
        };
        Self::suffix_s(self.lookup(&stem, tag, stress, ctx))
    }

    pub(crate) fn suffix_ed(stem: Option<String>) -> Option<String> {
        let stem = stem?;
        let last = stem.chars().last()?;
        Some(if "pkfθʃsʧ".contains(last) {
            format!("{stem}t")
        } else if last == 'd' {
            format!("{stem}ᵻd")
        } else if last != 't' {
            format!("{stem}d")
        } else if stem.chars().count() < 2 {
            format!("{stem}ɪd")
        } else if nth_back(&stem, 2).is_some_and(|c| US_TAUS.contains(c)) {
            format!("{}ɾᵻd", drop_last(&stem, 1))
        } else {
            format!("{stem}ᵻd")
        })
    }

    fn stem_ed(
        &self,
        word: &str,
        tag: Option<&str>,
        stress: Option<f64>,
        ctx: Option<&Context>,
    ) -> Option<String> {
        let n = word.chars().count();
        if n < 4 || !word.ends_with('d') {
            return None;
        }
        let stem = if !word.ends_with("dd") && self.is_known(drop_last(word, 1)) {
            drop_last(word, 1)
        } else if n > 4
            && word.ends_with("ed")
            && !word.ends_with("eed")
            && self.is_known(drop_last(word, 2))
        {
            drop_last(word, 2)
        } else {
            return None;
        };
        Self::suffix_ed(self.lookup(stem, tag, stress, ctx))
    }

    pub(crate) fn suffix_ing(stem: Option<String>) -> Option<String> {
        let stem = stem.filter(|s| !s.is_empty())?;
        if stem.chars().count() > 1
            && stem.ends_with('t')
            && nth_back(&stem, 2).is_some_and(|c| US_TAUS.contains(c))
        {
            return Some(format!("{}ɾɪŋ", drop_last(&stem, 1)));
        }
        Some(format!("{stem}ɪŋ"))
    }

    fn stem_ing(
        &self,
        word: &str,
        tag: Option<&str>,
        stress: Option<f64>,
        ctx: Option<&Context>,
    ) -> Option<String> {
        let n = word.chars().count();
        if n < 5 || !word.ends_with("ing") {
            return None;
        }
        let base = drop_last(word, 3);
        let doubled = {
            let cs: Vec<char> = word.chars().collect();
            word.ends_with("cking")
                || (cs[n - 4] == cs[n - 5] && "bcdgklmnprstvxz".contains(cs[n - 4]))
        };
        let stem = if n > 5 && self.is_known(base) {
            base.to_string()
        } else if self.is_known(&format!("{base}e")) {
            format!("{base}e")
        } else if n > 5 && doubled && self.is_known(drop_last(word, 4)) {
            drop_last(word, 4).to_string()
        } else {
            return None;
        };
        Self::suffix_ing(self.lookup(&stem, tag, stress, ctx))
    }

    fn get_word(
        &self,
        word: &str,
        tag: &str,
        stress: Option<f64>,
        ctx: &Context,
    ) -> Option<String> {
        if let Some(ps) = self.special_case(word, tag, stress, ctx)
            && ps.is_some()
        {
            return ps;
        }
        let wl = lower(word);
        let mut word = word.to_string();
        let t = Some(tag);
        let c = Some(ctx);
        if word.chars().count() > 1
            && is_alpha(&word.replace('\'', ""))
            && word != wl
            && (tag != "NNP" || word.chars().count() > 7)
            && !self.golds.contains(&word)
            && !self.silvers.contains(&word)
            && (word == upper(&word) || tail(&word) == lower(tail(&word)))
            && (self.golds.contains(&wl)
                || self.silvers.contains(&wl)
                || self
                    .stem_s(&wl, t, stress, c)
                    .is_some_and(|p| !p.is_empty())
                || self
                    .stem_ed(&wl, t, stress, c)
                    .is_some_and(|p| !p.is_empty())
                || self
                    .stem_ing(&wl, t, stress, c)
                    .is_some_and(|p| !p.is_empty()))
        {
            word = wl;
        }
        if self.is_known(&word) {
            return self.lookup(&word, t, stress, c);
        }
        if let Some(stem) = word.strip_suffix("s'") {
            let w = format!("{stem}'s");
            if self.is_known(&w) {
                return self.lookup(&w, t, stress, c);
            }
        }
        if let Some(stem) = word.strip_suffix('\'')
            && self.is_known(stem)
        {
            return self.lookup(stem, t, stress, c);
        }
        if let Some(ps) = self.stem_s(&word, t, stress, c) {
            return Some(ps);
        }
        if let Some(ps) = self.stem_ed(&word, t, stress, c) {
            return Some(ps);
        }
        self.stem_ing(&word, t, Some(stress.unwrap_or(0.5)), c)
    }

    fn append_currency(&self, ps: String, currency: Option<&str>) -> String {
        let Some(unit) = currency.and_then(currency_units) else {
            return ps;
        };
        match self.stem_s(&format!("{}s", unit.0), None, None, None) {
            Some(c) => format!("{ps} {c}"),
            None => ps,
        }
    }

    /// The phonemes of one token (its alias if it has one), or `None` if the dictionary and the
    /// number reader cannot read it.
    pub fn phonemize(&self, tk: &Tok, ctx: &Context) -> Option<String> {
        let raw = tk.alias.as_deref().unwrap_or(&tk.text);
        let word: String = raw
            .replace(['‘', '’'], "'")
            .nfkc()
            .map(numeric_if_needed)
            .collect();
        let stress = if word == lower(&word) {
            None
        } else if word == upper(&word) {
            Some(2.0)
        } else {
            Some(0.5)
        };
        if let Some(ps) = self.get_word(&word, &tk.tag, stress, ctx) {
            return Some(self.append_currency(ps, tk.currency.as_deref()));
        }
        if super::reading::is_number(&word, tk.is_head) {
            return super::reading::get_number(self, &word, tk.currency.as_deref(), tk.is_head);
        }
        None
    }
}

/// A digit-like character as its ASCII digit (superscripts and the like); others unchanged.
fn numeric_if_needed(c: char) -> char {
    match c {
        '⁰' | '₀' => '0',
        '¹' | '₁' => '1',
        '²' | '₂' => '2',
        '³' | '₃' => '3',
        '⁴'..='⁹' => char::from(b'4' + (c as u32 - '⁴' as u32) as u8),
        '₄'..='₉' => char::from(b'4' + (c as u32 - '₄' as u32) as u8),
        _ => c,
    }
}
