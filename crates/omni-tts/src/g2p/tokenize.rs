//! Word tokenizer following spaCy's English rules (MIT): special cases (contractions, "Mr.",
//! "10am", from `tokenizer_exceptions.json`), then prefixes and suffixes peeled off each
//! whitespace-separated chunk, then infixes (hyphens, slashes) split what is left; finally
//! adjacent pieces that spell a special case are joined back ("Sept" + "." -> "Sept.").

use std::collections::HashMap;

use fancy_regex::Regex;

use crate::Error;

const LETTER: &str = r"[^\W\d_]";
const LOWER: &str = "a-zß-öø-ÿ";
const UPPER: &str = "A-ZÀ-ÖØ-Þ";
const QUOTES: &str = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》〈〉";
const PUNCT: &str = "…,:;!?¿¡()[]{}<>_#*&。？！，、；：～·";
const ICONS: &str = "™®©°§¶†‡•";
const CURRENCY: &str = r"\$|£|€|¥|฿|US\$|C\$|A\$|₽|₹|₩|₪|₺|₴|₦|₫|₱|₲|₵|₸|₼|₾|₿";
const UNITS: &str = "km|km²|km³|m|m²|m³|dm|dm²|dm³|cm|cm²|cm³|mm|mm²|mm³|ha|µm|nm|yd|in|ft|kg|g|mg|µg|t|lb|oz|m/s|km/h\
|kmh|mph|hPa|Pa|mbar|mb|MB|kb|KB|gb|GB|tb|TB|T|G|M|K|%";
const URL: &str = r"(?i)^(?:(?:https?|ftp)://|www\.)\S+$|^[\w.+-]+@[\w-]+(?:\.[\w-]+)+$|^(?:[\w-]+\.)+(?:com|org|net|edu|gov|io|co|uk|de|fr|info|biz|us|ca|au|tv|me|ly|ai)(?:/\S*)?$";

/// A regex-safe spelling of one character: ASCII punctuation escaped, except `<` and `>` (whose
/// escapes are word boundaries in the regex crate; they are plain characters unescaped).
pub(crate) fn escape_char(c: char) -> String {
    if c.is_ascii_punctuation() && c != '<' && c != '>' {
        format!("\\{c}")
    } else {
        c.to_string()
    }
}

pub(crate) fn escape(s: &str) -> String {
    s.chars().map(escape_char).collect()
}

pub(crate) fn compile(name: &'static str, pattern: &str) -> Result<Regex, Error> {
    Regex::new(pattern).map_err(|e| Error::Pattern {
        name,
        reason: e.to_string(),
    })
}

#[derive(Debug)]
pub struct Tokenizer {
    special: HashMap<String, Vec<String>>,
    prefix: Regex,
    suffix: Regex,
    infix: Regex,
    url: Regex,
}

impl Tokenizer {
    pub fn new(special: HashMap<String, Vec<String>>) -> Result<Self, Error> {
        let punct: Vec<String> = PUNCT.chars().map(escape_char).collect();
        let quotes: Vec<String> = QUOTES.chars().map(escape_char).collect();
        let icons = format!("[{}]", escape(ICONS));
        let mut prefixes: Vec<String> = ["§", "%", "=", "—", "–", r"\+(?![0-9])", "…", "……"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        prefixes.extend(punct.iter().cloned());
        prefixes.extend([r"\.\.+".to_string(), "…".to_string()]);
        prefixes.extend(quotes.iter().cloned());
        prefixes.push(CURRENCY.to_string());
        prefixes.push(icons.clone());

        let (ep, eq) = (escape(PUNCT), escape(QUOTES));
        let mut suffixes: Vec<String> = vec!["…".into(), "……".into()];
        suffixes.extend(punct.iter().cloned());
        suffixes.extend([r"\.\.+".to_string(), "…".to_string()]);
        suffixes.extend(quotes.iter().cloned());
        suffixes.push(icons.clone());
        suffixes.extend(
            ["'s", "'S", "’s", "’S", "—", "–"]
                .iter()
                .map(|s| s.to_string()),
        );
        suffixes.extend([
            r"(?<=[0-9])\+".to_string(),
            r"(?<=°[FfCcKk])\.".to_string(),
            format!("(?<=[0-9])(?:{CURRENCY})"),
            format!("(?<=[0-9])(?:{UNITS})"),
            format!(r"(?<=[0-9{LOWER}%²\-\+{ep}{eq}])\."),
            format!(r"(?<=[{UPPER}][{UPPER}])\."),
        ]);
        let infixes = [
            r"\.\.+".to_string(),
            "…".to_string(),
            icons,
            r"(?<=[0-9])[+\-\*^](?=[0-9-])".to_string(),
            format!(r"(?<=[{LOWER}{eq}])\.(?=[{UPPER}{eq}])"),
            format!("(?<={LETTER}),(?={LETTER})"),
            format!(r"(?<=[^\W_])(?:-|–|—|--|---|——|~)(?={LETTER})"),
            format!(r"(?<=[^\W_])[:<>=/](?={LETTER})"),
        ];
        let join = |parts: &[String], f: &dyn Fn(&String) -> String| {
            parts.iter().map(f).collect::<Vec<_>>().join("|")
        };
        Ok(Self {
            special,
            prefix: compile(
                "tokenizer prefix",
                &join(&prefixes, &|p| format!("^(?:{p})")),
            )?,
            suffix: compile(
                "tokenizer suffix",
                &join(&suffixes, &|s| format!("(?:{s})$")),
            )?,
            infix: compile("tokenizer infix", &join(&infixes, &|i| format!("(?:{i})")))?,
            url: compile("tokenizer url", URL)?,
        })
    }

    /// `(token text, followed by whitespace)` for every token of `text`.
    pub fn tokenize(&self, text: &str) -> Vec<(String, bool)> {
        let mut out = Vec::new();
        let mut pos = 0;
        let bytes_len = text.len();
        while pos < bytes_len {
            let rest = &text[pos..];
            let Some(start_off) = rest.find(|c: char| !c.is_whitespace()) else {
                break;
            };
            let start = pos + start_off;
            let end = text[start..]
                .find(char::is_whitespace)
                .map_or(bytes_len, |e| start + e);
            let toks = self.split(&text[start..end]);
            let n = toks.len();
            for (i, t) in toks.into_iter().enumerate() {
                out.push((t, i + 1 == n && end < bytes_len));
            }
            pos = end;
        }
        out
    }

    fn find_end(re: &Regex, s: &str) -> usize {
        match re.find(s) {
            Ok(Some(m)) => m.end() - m.start(),
            _ => 0,
        }
    }

    fn split(&self, chunk: &str) -> Vec<String> {
        let special = &self.special;
        if let Some(t) = special.get(chunk) {
            return t.clone();
        }
        let mut s = chunk.to_string();
        let (mut pre, mut suf): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
        let mut last = usize::MAX;
        while !s.is_empty() && s.len() != last && !special.contains_key(&s) {
            last = s.len();
            let pre_len = Self::find_end(&self.prefix, &s);
            if pre_len > 0 {
                let minus_pre = &s[pre_len..];
                if !minus_pre.is_empty() && special.contains_key(minus_pre) {
                    pre.push(s[..pre_len].to_string());
                    s = minus_pre.to_string();
                    break;
                }
            }
            let suf_len = Self::find_end(&self.suffix, &s[pre_len..]);
            if suf_len > 0 {
                let minus_suf = &s[..s.len() - suf_len];
                if !minus_suf.is_empty() && special.contains_key(minus_suf) {
                    suf.push(s[s.len() - suf_len..].to_string());
                    s = minus_suf.to_string();
                    break;
                }
            }
            if pre_len > 0 && suf_len > 0 && pre_len + suf_len <= s.len() {
                pre.push(s[..pre_len].to_string());
                suf.push(s[s.len() - suf_len..].to_string());
                s = s[pre_len..s.len() - suf_len].to_string();
            } else if pre_len > 0 {
                pre.push(s[..pre_len].to_string());
                s = s[pre_len..].to_string();
            } else if suf_len > 0 {
                suf.push(s[s.len() - suf_len..].to_string());
                s = s[..s.len() - suf_len].to_string();
            }
        }
        let mut toks = pre;
        if !s.is_empty() {
            if let Some(t) = special.get(&s) {
                toks.extend(t.iter().cloned());
            } else if self.url.is_match(&s).unwrap_or(false) {
                toks.push(s);
            } else {
                let mut start = 0;
                for m in self.infix.find_iter(&s).flatten() {
                    if m.start() == 0 || m.start() == m.end() {
                        continue;
                    }
                    if m.start() > start {
                        toks.push(s[start..m.start()].to_string());
                    }
                    toks.push(m.as_str().to_string());
                    start = m.end();
                }
                if start < s.len() {
                    toks.push(s[start..].to_string());
                }
            }
        }
        toks.extend(suf.into_iter().rev());
        if toks.len() > 1 {
            self.rejoin(toks)
        } else {
            toks
        }
    }

    /// spaCy's special-case pass over the split pieces: "Sept" "." -> "Sept.".
    fn rejoin(&self, toks: Vec<String>) -> Vec<String> {
        let mut out = Vec::new();
        let mut i = 0;
        'outer: while i < toks.len() {
            for k in [3, 2] {
                if i + k <= toks.len() {
                    let joined: String = toks[i..i + k].concat();
                    if let Some(t) = self.special.get(&joined) {
                        out.extend(t.iter().cloned());
                        i += k;
                        continue 'outer;
                    }
                }
            }
            out.push(toks[i].clone());
            i += 1;
        }
        out
    }
}
