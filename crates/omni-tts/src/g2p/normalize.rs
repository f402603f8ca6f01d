//! Text normalisation before tokenizing: readings the lexicon rules cannot produce on their own
//! (times, dates, units, abbreviations, other currencies, Roman numerals, phone numbers, ranges,
//! fractions, symbols). Plain numbers (cardinals, ordinals, years, decimals, `$` / `£` / `€`
//! amounts, percents) are left to the lexicon layer. The word tables are the voice's
//! `normalize.json`.

use std::collections::HashMap;
use std::fmt;

use fancy_regex::{Captures, Regex};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

use super::numbers;
use super::tokenize::{compile, escape};
use crate::Error;

/// A JSON object read in document order (the tables' order matters: months, symbols).
#[derive(Debug, Clone, Default)]
pub struct Ordered<V>(pub Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Ordered<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
            type Value = Ordered<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = m.next_entry::<String, V>()? {
                    out.push((k, v));
                }
                Ok(Ordered(out))
            }
        }
        d.deserialize_map(V2(std::marker::PhantomData))
    }
}

/// `normalize.json`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Tables {
    pub months: Ordered<String>,
    pub titles: Ordered<String>,
    pub abbreviations: Ordered<String>,
    pub units: Ordered<(String, String)>,
    pub symbols: Ordered<String>,
    pub currency: Ordered<(String, String)>,
    pub roman_cardinal: Vec<String>,
    pub roman_ordinal: Vec<String>,
}

#[derive(Debug)]
struct Patterns {
    ws: Regex,
    time: Regex,
    date_us: Regex,
    date_iso: Regex,
    month_day: Regex,
    day_month: Regex,
    unit: Regex,
    deg: Regex,
    cents: Regex,
    currency: Regex,
    big_money: Regex,
    title: Regex,
    abbrev: Regex,
    no: Regex,
    hash: Regex,
    roman_c: Regex,
    roman_o: Regex,
    phone: Regex,
    range: Regex,
    fraction: Regex,
    plus: Regex,
    space_punct: Regex,
    /// (symbol, pattern, replacement), in table order.
    symbols: Vec<(String, Regex, String)>,
}

/// The normaliser: the tables and their compiled patterns.
#[derive(Debug)]
pub struct Normalizer {
    months: HashMap<String, String>,
    month_names: Vec<String>,
    titles: HashMap<String, String>,
    abbrev: HashMap<String, String>,
    units: HashMap<String, (String, String)>,
    currency: HashMap<String, (String, String)>,
    re: Patterns,
}

/// Alternation of `words`, longest first (ties in table order).
fn alt<'a>(words: impl IntoIterator<Item = &'a str>) -> String {
    let mut ws: Vec<&str> = words.into_iter().collect();
    ws.sort_by_key(|w| std::cmp::Reverse(w.chars().count()));
    ws.iter().map(|w| escape(w)).collect::<Vec<_>>().join("|")
}

const NUM: &str = r"\d+(?:,\d{3})*(?:\.\d+)?";
const ROMAN: &str = r"((?=[IVXLC])M{0,3}(?:CM|CD|D?C{0,3})(?:XC|XL|L?X{0,3})(?:IX|IV|V?I{0,3}))";
const FRACTIONS: [&str; 11] = [
    "", "", "half", "third", "quarter", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
];

fn group<'t>(c: &Captures<'t>, i: usize) -> &'t str {
    c.get(i).map_or("", |m| m.as_str())
}

fn plural<'a>(n_text: &str, words: &'a (String, String)) -> &'a str {
    if matches!(n_text.replace(',', "").as_str(), "1" | "1.0" | "-1") {
        &words.0
    } else {
        &words.1
    }
}

fn roman_value(s: &str) -> u128 {
    let v = |c: char| -> i64 {
        match c {
            'I' => 1,
            'V' => 5,
            'X' => 10,
            'L' => 50,
            'C' => 100,
            'D' => 500,
            'M' => 1000,
            _ => 0,
        }
    };
    let cs: Vec<char> = s.chars().collect();
    let mut total = 0i64;
    for (i, &c) in cs.iter().enumerate() {
        let x = v(c);
        total += if i + 1 < cs.len() && v(cs[i + 1]) > x {
            -x
        } else {
            x
        };
    }
    total.max(0) as u128
}

fn big_word(big: &str) -> &str {
    match big.to_lowercase().as_str() {
        "k" => "thousand",
        "m" => "million",
        "b" => "billion",
        _ => big,
    }
}

fn num(s: &str) -> u128 {
    s.parse().unwrap_or(0)
}

fn ordinal(n: u128) -> String {
    numbers::ordinal(n).unwrap_or_default()
}

fn cardinal(n: u128) -> String {
    numbers::cardinal(n).unwrap_or_default()
}

impl Normalizer {
    pub fn new(t: &Tables) -> Result<Self, Error> {
        let month_names: Vec<String> = t.months.0.iter().map(|(_, v)| v.clone()).collect();
        let caps: Vec<String> = t
            .months
            .0
            .iter()
            .map(|(k, _)| super::pystr::capitalize(k))
            .collect();
        let months_alt = alt(month_names
            .iter()
            .map(String::as_str)
            .chain(caps.iter().map(String::as_str))
            .chain(["Sept"]));
        let c = compile;
        let mut symbols = Vec::new();
        for (sym, word) in &t.symbols.0 {
            let e = escape(sym);
            let pat = if "=<>~".contains(sym.as_str()) && sym.chars().count() == 1 {
                format!(r"(?<=\S) ?{e} ?(?=\S)")
            } else {
                e
            };
            let rep = if word.is_empty() {
                " ".to_string()
            } else {
                format!(" {word} ")
            };
            symbols.push((sym.clone(), c("normalize symbol", &pat)?, rep));
        }
        let re = Patterns {
            ws: c("normalize ws", r"\s+")?,
            time: c(
                "normalize time",
                r"\b(\d{1,2}):(\d{2})(?::(\d{2}))?(?:\s?([AaPp])\.?[Mm]\.?(?![A-Za-z]))?(?!\d)",
            )?,
            date_us: c(
                "normalize date_us",
                r"\b(\d{1,2})/(\d{1,2})/(\d{4}|\d{2})\b",
            )?,
            date_iso: c("normalize date_iso", r"\b(\d{4})-(\d{2})-(\d{2})\b")?,
            month_day: c(
                "normalize month_day",
                &format!(
                    r"\b({months_alt})\.? (\d{{1,2}})(?:st|nd|rd|th)?\b(?![\d:%])(,? \d{{4}}\b)?"
                ),
            )?,
            day_month: c(
                "normalize day_month",
                &format!(r"\b(the )?(\d{{1,2}}) (?:of )?({months_alt})\b\.?"),
            )?,
            unit: c(
                "normalize unit",
                &format!(
                    r"(?<![\w.])(-?{NUM})\s?({})(?![\w])",
                    alt(t.units.0.iter().map(|(k, _)| k.as_str()))
                ),
            )?,
            deg: c(
                "normalize deg",
                &format!(r"(?<![\w.])(-?{NUM})\s?°\s?([CF])?(?![\w])"),
            )?,
            cents: c("normalize cents", &format!(r"(?<![\w.])({NUM})\s?¢"))?,
            currency: c(
                "normalize currency",
                &format!(
                    r"(?<![\w])([¥₹₩]|Rs\.?|USD|EUR|GBP)\s?({NUM})(?:\s?(hundred|thousand|million|billion|trillion|[kKmMbB]\b))?"
                ),
            )?,
            big_money: c(
                "normalize big_money",
                &format!(
                    r"([$£€])({NUM})\s?(hundred|thousand|million|billion|trillion|[kKmMbB]\b)"
                ),
            )?,
            title: c(
                "normalize title",
                &format!(
                    r"\b({})\.? (?=[A-Z])",
                    alt(t.titles.0.iter().map(|(k, _)| k.as_str()))
                ),
            )?,
            abbrev: c(
                "normalize abbrev",
                &format!(
                    r"(?<![\w.])({})(?![\w])",
                    alt(t.abbreviations.0.iter().map(|(k, _)| k.as_str()))
                ),
            )?,
            no: c("normalize no", r"\b(No|Nos)\. ?(?=\d)")?,
            hash: c("normalize hash", r"(?<![\w&])#(?=\d)")?,
            roman_c: c(
                "normalize roman_c",
                &format!(
                    r"\b({}) {ROMAN}\b(?![.'’]\w)",
                    alt(t.roman_cardinal.iter().map(String::as_str))
                ),
            )?,
            roman_o: c(
                "normalize roman_o",
                &format!(
                    r"\b({}) {ROMAN}\b(?![.'’]\w)",
                    alt(t.roman_ordinal.iter().map(String::as_str))
                ),
            )?,
            phone: c(
                "normalize phone",
                r"(?<![\w.\-])(?:\d{3}-)?\d{3}-\d{4}(?![\w.\-])",
            )?,
            range: c(
                "normalize range",
                r"(?<![\w.\-])(\d{1,4})\s?[-–]\s?(\d{1,4})(?![\w.\-%])",
            )?,
            fraction: c(
                "normalize fraction",
                r"(?<![\w./])(\d{1,2})/(\d{1,2})(?![\w./])",
            )?,
            plus: c("normalize plus", r"(?<![\w+])\+(?=\d)")?,
            space_punct: c("normalize space_punct", r" +([,.;:!?])")?,
            symbols,
        };
        Ok(Self {
            months: t.months.0.iter().cloned().collect(),
            month_names,
            titles: t.titles.0.iter().cloned().collect(),
            abbrev: t.abbreviations.0.iter().cloned().collect(),
            units: t.units.0.iter().cloned().collect(),
            currency: t.currency.0.iter().cloned().collect(),
            re,
        })
    }

    fn date(&self, y: Option<&str>, mo: u128, d: u128) -> Option<String> {
        if !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
            return None;
        }
        let name = &self.month_names[(mo - 1) as usize];
        Some(match y {
            Some(y) => format!("{name} {}, {y}", ordinal(d)),
            None => format!("{name} {}", ordinal(d)),
        })
    }

    fn month_of(&self, m: &str) -> String {
        let key: String = m.to_lowercase().chars().take(3).collect();
        self.months
            .get(&key)
            .cloned()
            .unwrap_or_else(|| m.to_string())
    }

    pub fn normalize(&self, text: &str) -> String {
        let re = &self.re;
        let text = re.ws.replace_all(text, " ");
        let text = text.trim();
        if text.is_empty() {
            return String::new();
        }
        let text = text
            .replace('\u{a0}', " ")
            .replace('’', "'")
            .replace('‒', "-")
            .replace('―', "—");
        let t0 = text.clone();
        let text = re
            .time
            .replace_all(&text, |m: &Captures| {
                let whole = group(m, 0);
                let (h, mi, sec, ap) = (num(group(m, 1)), num(group(m, 2)), m.get(3), m.get(4));
                if h > 24 || mi > 59 || sec.is_some_and(|s| num(s.as_str()) > 59) {
                    return whole.to_string();
                }
                let mut words = cardinal(h);
                if mi == 0 {
                    if ap.is_none() && sec.is_none() {
                        words.push_str(" o'clock");
                    }
                } else if mi < 10 {
                    words.push_str(&format!(" oh {}", cardinal(mi)));
                } else {
                    words.push_str(&format!(" {}", cardinal(mi)));
                }
                if let Some(s) = sec {
                    let s = num(s.as_str());
                    let unit = if s == 1 { " second" } else { " seconds" };
                    words.push_str(&format!(" and {}{unit}", cardinal(s)));
                }
                if let Some(ap) = ap {
                    let end = m.get(0).map_or(0, |x| x.end());
                    let dot = if t0[end..].starts_with('.') { "" } else { "." };
                    words.push_str(&format!(" {}.M{dot}", ap.as_str().to_uppercase()));
                }
                words
            })
            .into_owned();
        let text = re
            .date_iso
            .replace_all(&text, |m: &Captures| {
                self.date(Some(group(m, 1)), num(group(m, 2)), num(group(m, 3)))
                    .unwrap_or_else(|| group(m, 0).to_string())
            })
            .into_owned();
        let text = re
            .date_us
            .replace_all(&text, |m: &Captures| {
                let (a, b) = (num(group(m, 1)), num(group(m, 2)));
                let mut y = group(m, 3).to_string();
                if y.chars().count() == 2 {
                    y = format!("{}{y}", if num(&y) > 30 { "19" } else { "20" });
                }
                let (mo, d) = if a <= 12 { (a, b) } else { (b, a) };
                self.date(Some(&y), mo, d)
                    .unwrap_or_else(|| group(m, 0).to_string())
            })
            .into_owned();
        let text = re
            .big_money
            .replace_all(&text, |m: &Captures| {
                let words = self.currency.get(group(m, 1)).map_or("", |w| w.1.as_str());
                format!("{} {} {words}", group(m, 2), big_word(group(m, 3)))
            })
            .into_owned();
        let text = re
            .cents
            .replace_all(&text, |m: &Captures| {
                let n = group(m, 1);
                match self.currency.get("¢") {
                    Some(w) => format!("{n} {}", plural(n, w)),
                    None => group(m, 0).to_string(),
                }
            })
            .into_owned();
        let text = re
            .currency
            .replace_all(&text, |m: &Captures| {
                let sym = group(m, 1).trim_end_matches('.');
                let n = group(m, 2);
                let Some(words) = self.currency.get(sym) else {
                    return group(m, 0).to_string();
                };
                match m.get(3) {
                    Some(big) => format!("{n} {} {}", big_word(big.as_str()), words.1),
                    None => format!("{n} {}", plural(n, words)),
                }
            })
            .into_owned();
        let text = re
            .deg
            .replace_all(&text, |m: &Captures| {
                let n = group(m, 1);
                let deg = ("degree".to_string(), "degrees".to_string());
                let mut words = format!("{n} {}", plural(n, &deg));
                match group(m, 2) {
                    "C" => words.push_str(" Celsius"),
                    "F" => words.push_str(" Fahrenheit"),
                    _ => {}
                }
                words
            })
            .into_owned();
        let text = re
            .unit
            .replace_all(&text, |m: &Captures| {
                let (n, u) = (group(m, 1), group(m, 2));
                match self.units.get(u) {
                    Some(w) => format!("{n} {}", plural(n, w)),
                    None => group(m, 0).to_string(),
                }
            })
            .into_owned();
        let text = re
            .month_day
            .replace_all(&text, |m: &Captures| {
                let day = num(group(m, 2));
                if !(1..=31).contains(&day) {
                    return group(m, 0).to_string();
                }
                format!(
                    "{} {}{}",
                    self.month_of(group(m, 1)),
                    ordinal(day),
                    group(m, 3)
                )
            })
            .into_owned();
        let text = re
            .day_month
            .replace_all(&text, |m: &Captures| {
                let day = num(group(m, 2));
                if !(1..=31).contains(&day) {
                    return group(m, 0).to_string();
                }
                format!("the {} of {}", ordinal(day), self.month_of(group(m, 3)))
            })
            .into_owned();
        let text = re
            .title
            .replace_all(&text, |m: &Captures| {
                format!(
                    "{} ",
                    self.titles.get(group(m, 1)).map_or("", String::as_str)
                )
            })
            .into_owned();
        let text_len = text.len();
        let text = re
            .abbrev
            .replace_all(&text, |m: &Captures| {
                let key = group(m, 1);
                let end = m.get(0).map_or(0, |x| x.end());
                let dot = if end == text_len && key.ends_with('.') {
                    "."
                } else {
                    ""
                };
                format!("{}{dot}", self.abbrev.get(key).map_or("", String::as_str))
            })
            .into_owned();
        let text = re
            .no
            .replace_all(&text, |m: &Captures| {
                if group(m, 1) == "No" {
                    "Number "
                } else {
                    "Numbers "
                }
                .to_string()
            })
            .into_owned();
        let text = re
            .hash
            .replace_all(&text, fancy_regex::NoExpand("number "))
            .into_owned();
        let text = re
            .roman_c
            .replace_all(&text, |m: &Captures| {
                format!("{} {}", group(m, 1), roman_value(group(m, 2)))
            })
            .into_owned();
        let text = re
            .roman_o
            .replace_all(&text, |m: &Captures| {
                format!("{} the {}", group(m, 1), ordinal(roman_value(group(m, 2))))
            })
            .into_owned();
        let text = re
            .phone
            .replace_all(&text, |m: &Captures| {
                let spaced: Vec<String> = group(m, 0)
                    .replace('-', ", ")
                    .chars()
                    .map(String::from)
                    .collect();
                spaced.join(" ")
            })
            .into_owned();
        let text = re
            .fraction
            .replace_all(&text, |m: &Captures| {
                let (a, b) = (num(group(m, 1)), num(group(m, 2)));
                if 0 < a && a < b && b <= 10 {
                    let unit = FRACTIONS[b as usize];
                    if unit == "half" {
                        return if a == 1 {
                            "one half".to_string()
                        } else {
                            format!("{a} halves")
                        };
                    }
                    return format!("{a} {unit}{}", if a == 1 { "" } else { "s" });
                }
                if (1..=12).contains(&a) && (1..=31).contains(&b) {
                    return self.date(None, a, b).unwrap_or_default();
                }
                format!("{a} slash {b}")
            })
            .into_owned();
        let text = re
            .range
            .replace_all(&text, |m: &Captures| {
                format!("{} to {}", group(m, 1), group(m, 2))
            })
            .into_owned();
        let mut text = re
            .plus
            .replace_all(&text, fancy_regex::NoExpand("plus "))
            .into_owned();
        for (sym, pat, rep) in &re.symbols {
            if text.contains(sym.as_str()) {
                text = pat
                    .replace_all(&text, fancy_regex::NoExpand(rep))
                    .into_owned();
            }
        }
        let text = re.ws.replace_all(&text, " ");
        let text = re.space_punct.replace_all(&text, "$1");
        text.trim().to_string()
    }
}
