//! Numbers read by the lexicon layer (misaki's rules): cardinals, ordinals ("3rd"), years ("1999"),
//! digit-by-digit reading inside words, decimals, amounts after `$` / `£` / `€` in units and
//! cents, and the -s / -ed / -ing endings of numbers ("1990s").

use super::lexicon::{Lexicon, currency_units};
use super::numbers;
use super::pystr::{drop_last, is_ascii_digits as is_digit};

const ORDINALS: [&str; 4] = ["st", "nd", "rd", "th"];

fn is_ordinal(suffix: Option<&str>) -> bool {
    suffix.is_some_and(|s| ORDINALS.contains(&s))
}

/// Whether `word` reads as a number: digits with `,` / `.` (a leading `-` at the head of a word)
/// and at most one ending such as "th", "s", "'s", "ed", "ing".
pub fn is_number(word: &str, is_head: bool) -> bool {
    if !word.chars().any(|c| c.is_ascii_digit()) {
        return false;
    }
    let mut w = word;
    for s in ["ing", "'d", "ed", "'s", "st", "nd", "rd", "th", "s"] {
        if let Some(stem) = w.strip_suffix(s) {
            w = stem;
            break;
        }
    }
    w.chars()
        .enumerate()
        .all(|(i, c)| c.is_ascii_digit() || c == ',' || c == '.' || (is_head && i == 0 && c == '-'))
}

fn is_currency_amount(word: &str) -> bool {
    match word.split_once('.') {
        None => true,
        Some((_, cents)) => !cents.contains('.') && cents.chars().count() < 3,
    }
}

/// Splits on runs of non-letters (`re.split("[^a-z]+", text)`, empty pieces kept).
fn split_words(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut in_sep = false;
    let mut piece_start = 0;
    for (i, c) in text.char_indices() {
        let letter = c.is_ascii_lowercase();
        if !letter && !in_sep {
            out.push(&text[piece_start..i]);
            in_sep = true;
        } else if letter && in_sep {
            piece_start = i;
            in_sep = false;
        }
        start = i + c.len_utf8();
    }
    if in_sep {
        out.push(&text[start..start]);
    } else {
        out.push(&text[piece_start..]);
    }
    out
}

struct Reader<'a> {
    lexicon: &'a Lexicon,
    parts: Vec<Option<String>>,
}

impl Reader<'_> {
    /// Looks up every word of `words` ("and" skipped; "point" unstressed).
    fn words(&mut self, words: &str) {
        for w in split_words(words) {
            if w != "and" {
                let stress = if w == "point" { Some(-2.0) } else { None };
                self.parts.push(self.lexicon.lookup(w, None, stress, None));
            }
        }
    }

    fn cardinal(&mut self, n: u128) -> Option<()> {
        let words = numbers::cardinal(n)?;
        self.words(&words);
        Some(())
    }

    fn digits(&mut self, digits: &str) -> Option<()> {
        for d in digits.chars() {
            self.cardinal(u128::from(d.to_digit(10)?))?;
        }
        Some(())
    }
}

/// The phonemes of a number token, or `None`.
pub fn get_number(
    lexicon: &Lexicon,
    word: &str,
    currency: Option<&str>,
    is_head: bool,
) -> Option<String> {
    let suffix_len = word
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_lowercase() || *c == '\'')
        .count();
    let suffix = (suffix_len > 0).then(|| &word[word.len() - suffix_len..]);
    let mut word = drop_last(word, suffix_len);
    let mut r = Reader {
        lexicon,
        parts: Vec::new(),
    };
    if let Some(rest) = word.strip_prefix('-') {
        r.parts.push(lexicon.lookup("minus", None, None, None));
        word = rest;
    }
    let units = currency.and_then(currency_units);
    if is_digit(word) && is_ordinal(suffix) {
        r.words(&numbers::ordinal(word.parse().ok()?)?);
    } else if r.parts.is_empty() && word.chars().count() == 4 && units.is_none() && is_digit(word) {
        r.words(&numbers::year(word.parse().ok()?)?);
    } else if !is_head && !word.contains('.') {
        let num = word.replace(',', "");
        let cs: Vec<char> = num.chars().collect();
        if cs.first() == Some(&'0') || cs.len() > 3 {
            r.digits(&num)?;
        } else if cs.len() == 3 && !num.ends_with("00") {
            r.digits(&num[..1])?;
            if cs[1] == '0' {
                r.parts.push(lexicon.lookup("O", None, Some(-2.0), None));
                r.digits(&num[2..])?;
            } else {
                r.cardinal(num[1..].parse().ok()?)?;
            }
        } else {
            r.cardinal(num.parse().ok()?)?;
        }
    } else if word.matches('.').count() > 1 || !is_head {
        for num in word.replace(',', "").split('.') {
            if num.is_empty() {
                continue;
            }
            let cs: Vec<char> = num.chars().collect();
            if cs[0] == '0' || (cs.len() != 2 && cs[1..].iter().any(|&c| c != '0')) {
                r.digits(num)?;
            } else {
                r.cardinal(num.parse().ok()?)?;
            }
        }
    } else if let Some((unit, cent)) = units.filter(|_| is_currency_amount(word)) {
        let plain = word.replace(',', "");
        let mut pairs: Vec<(u128, &str)> = plain
            .split('.')
            .zip([unit, cent])
            .map(|(num, unit)| Some((if num.is_empty() { 0 } else { num.parse().ok()? }, unit)))
            .collect::<Option<_>>()?;
        if pairs.len() > 1 {
            if pairs[1].0 == 0 {
                pairs.truncate(1);
            } else if pairs[0].0 == 0 {
                pairs.remove(0);
            }
        }
        for (i, (num, unit)) in pairs.into_iter().enumerate() {
            if i > 0 {
                r.parts.push(lexicon.lookup("and", None, None, None));
            }
            r.cardinal(num)?;
            r.parts.push(if num != 1 && unit != "pence" {
                lexicon.stem_s(&format!("{unit}s"), None, None, None)
            } else {
                lexicon.lookup(unit, None, None, None)
            });
        }
    } else {
        let words = if is_digit(word) {
            numbers::cardinal(word.parse().ok()?)?
        } else if !word.contains('.') {
            let n: u128 = word.replace(',', "").parse().ok()?;
            if is_ordinal(suffix) {
                numbers::ordinal(n)?
            } else {
                numbers::cardinal(n)?
            }
        } else {
            let plain = word.replace(',', "");
            if let Some(frac) = plain.strip_prefix('.') {
                let mut w = "point".to_string();
                for d in frac.chars() {
                    w.push(' ');
                    w.push_str(&numbers::cardinal(u128::from(d.to_digit(10)?))?);
                }
                w
            } else {
                numbers::decimal(&plain)?
            }
        };
        r.words(&words);
    }
    if r.parts.is_empty() {
        return None;
    }
    let parts: Vec<String> = r.parts.into_iter().collect::<Option<_>>()?;
    let result = parts.join(" ");
    match suffix {
        Some("s" | "'s") => Lexicon::suffix_s(Some(result)),
        Some("ed" | "'d") => Lexicon::suffix_ed(Some(result)),
        Some("ing") => Lexicon::suffix_ing(Some(result)),
        _ => Some(result),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_python_re_split() {
        assert_eq!(
            split_words("one thousand, two"),
            vec!["one", "thousand", "two"]
        );
        assert_eq!(split_words("twenty-one"), vec!["twenty", "one"]);
        assert_eq!(split_words("-a-"), vec!["", "a", ""]);
        assert_eq!(split_words("a"), vec!["a"]);
    }

    #[test]
    fn numbers_are_recognised() {
        assert!(is_number("1990s", true));
        assert!(is_number("-5", true));
        assert!(!is_number("-5", false));
        assert!(is_number("1,250", true));
        assert!(!is_number("abc", true));
    }
}
