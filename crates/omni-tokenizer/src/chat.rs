//! Hugging Face chat templates rendered with minijinja.
//!
//! The environment matches what `transformers` gives a template: `trim_blocks` and
//! `lstrip_blocks` on, the variables `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token` (plus `tools` and any extra context), the function `raise_exception(msg)`,
//! `strftime_now(fmt)`, a `tojson` filter that writes like Python's `json.dumps`, and
//! Python-style string/dict methods (`.strip()`, `.startswith()`, `.items()`, ...) from
//! minijinja-contrib's pycompat.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use crate::Error;

/// A compiled chat template and the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are exposed to it as variables.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, Error> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| Error::Template {
                reason: describe(&e),
            })?;
        Ok(Self {
            env,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (anything serializing to a list of `{"role", "content", ...}` maps).
    pub fn render<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Renders with extra context variables (`tools`, `documents`, `enable_thinking`, ...),
    /// which may not override `messages` or `add_generation_prompt`.
    pub fn render_with<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, Error> {
        let mut ctx: std::collections::BTreeMap<String, Value> = extra
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        ctx.entry("bos_token".into())
            .or_insert_with(|| Value::from(self.bos_token.clone()));
        ctx.entry("eos_token".into())
            .or_insert_with(|| Value::from(self.eos_token.clone()));
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Error::Template {
                reason: describe(&e),
            })?;
        template.render(ctx).map_err(|e| Error::Template {
            reason: describe(&e),
        })
    }
}

/// The error with its chain of causes (minijinja puts the template line in the detail).
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let _ = write!(s, ": {cause}");
        source = cause.source();
    }
    s
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time with `%Y %m %d %e %H %M %S %b %B %a %A %j %%`.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    format_utc(secs, &format)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
];

/// Formats Unix time `secs` (UTC) with a subset of strftime.
fn format_utc(secs: i64, format: &str) -> String {
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian, era-based).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let month_name = MONTHS[(month - 1) as usize];
    let weekday = WEEKDAYS[days.rem_euclid(7) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:>2}"),
            Some('H') => write!(out, "{:02}", tod / 3600),
            Some('M') => write!(out, "{:02}", tod / 60 % 60),
            Some('S') => write!(out, "{:02}", tod % 60),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('B') => write!(out, "{month_name}"),
            Some('a') => write!(out, "{}", &weekday[..3]),
            Some('A') => write!(out, "{weekday}"),
            Some('j') => write!(out, "{yday:03}"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// `tojson(indent=None)`, written like Python's `json.dumps(ensure_ascii=False)`: `", "` and
/// `": "` separators, keys in insertion order, no HTML escaping.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let json = serde_json::to_value(v)
                .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string()))?;
            out.push_str(&json.to_string());
        }
        ValueKind::String | ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
            let s = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            out.push_str(&serde_json::Value::String(s).to_string());
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let k = key.as_str().map_or_else(|| key.to_string(), str::to_owned);
                out.push_str(&serde_json::Value::String(k).to_string());
                out.push_str(": ");
                write_json(out, &v.get_item(key)?, indent, depth + 1)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => out.push_str(&serde_json::Value::String(v.to_string()).to_string()),
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    /// SmolLM2-135M-Instruct's template, as stored in its GGUF (`tokenizer.chat_template`).
    pub(crate) const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_template_adds_default_system_prompt_and_generation_prompt() {
        let t = ChatTemplate::new(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>").unwrap();
        let msgs = json!([{"role": "user", "content": "What is the capital of France?"}]);
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system =
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
        assert_eq!(
            t.render(&with_system, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let err = t
            .render(&json!([{"role": "assistant", "content": "x"}]), false)
            .unwrap_err();
        assert!(err.to_string().contains("first must be user"), "{err}");
        assert_eq!(
            t.render(&json!([{"role": "user", "content": "x"}]), false)
                .unwrap(),
            "ok"
        );
    }

    #[test]
    fn blocks_are_trimmed_like_transformers() {
        // Expected text is what Python jinja2 with trim_blocks + lstrip_blocks renders.
        let src = "{% for m in messages %}\n  {{ bos_token }}{{ m.content }}\n{% endfor %}\n{{ eos_token }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(
            t.render(&json!([{"content": "a"}, {"content": "b"}]), false)
                .unwrap(),
            "  <s>a\n  <s>b\n</s>"
        );
    }

    #[test]
    fn python_string_methods_and_tojson_work() {
        let src = "{{ messages[0].content.strip().upper() }}|{{ messages[0].content.startswith('  h') }}|{{ tools | tojson }}|{% for k, v in messages[0].items() %}{{ k }}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert(
            "tools".into(),
            json!([{"name": "f<x>", "n": 1.5, "ok": true, "none": null}]),
        );
        let out = t
            .render_with(&json!([{"content": "  hi  "}]), false, &extra)
            .unwrap();
        assert_eq!(
            out,
            "HI|True|[{\"n\": 1.5, \"name\": \"f<x>\", \"none\": null, \"ok\": true}]|content"
        );
    }

    #[test]
    fn tojson_indents_like_json_dumps() {
        let t = ChatTemplate::new("{{ x | tojson(indent=2) }}", "", "").unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert("x".into(), json!({"a": [1, 2]}));
        assert_eq!(
            t.render_with(&json!([]), false, &extra).unwrap(),
            "{\n  \"a\": [\n    1,\n    2\n  ]\n}"
        );
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(
            format_utc(1_709_211_909, "%d %b %Y %H:%M:%S %A %j"),
            "29 Feb 2024 13:05:09 Thursday 060"
        );
        assert_eq!(format_utc(0, "%Y-%m-%d %B %%"), "1970-01-01 January %");
    }

    #[test]
    fn syntax_errors_are_reported_at_compile_time() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(Error::Template { .. })
        ));
    }
}
