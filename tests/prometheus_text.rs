//! A small parser of the Prometheus text exposition (0.0.4) and OpenMetrics text formats, for
//! tests that read `/metrics` the way a scraper does: `# TYPE` and `# HELP` lines, samples with
//! labels (escapes included), `+Inf` / `NaN` values, optional timestamps, `# EOF`.
//!
//! Each sample is filed under its metric family: the family of its own name, else the family
//! its name minus a suffix of that family's type belongs to (`_total` / `_created` of a counter,
//! `_bucket` / `_sum` / `_count` / `_created` of a histogram, `_sum` / `_count` of a summary,
//! `_info` of an info), so `# TYPE vllm:prompt_tokens counter` (OpenMetrics) and
//! `# TYPE vllm:prompt_tokens_total counter` (0.0.4) both make `vllm:prompt_tokens_total` a
//! counter sample. A sample of no declared family is `Untyped`.
#![allow(dead_code)]

use std::collections::BTreeMap;

/// A metric family's type, as its `# TYPE` line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
    GaugeHistogram,
    Summary,
    Info,
    StateSet,
    Untyped,
}

impl MetricType {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "counter" => Self::Counter,
            "gauge" => Self::Gauge,
            "histogram" => Self::Histogram,
            "gaugehistogram" => Self::GaugeHistogram,
            "summary" => Self::Summary,
            "info" => Self::Info,
            "stateset" => Self::StateSet,
            "untyped" | "unknown" => Self::Untyped,
            _ => return None,
        })
    }

    /// The sample-name suffixes a family of this type may add to its name.
    fn suffixes(self) -> &'static [&'static str] {
        match self {
            Self::Counter => &["_total", "_created"],
            Self::Histogram | Self::GaugeHistogram => &["_bucket", "_sum", "_count", "_created"],
            Self::Summary => &["_sum", "_count", "_created"],
            Self::Info => &["_info"],
            _ => &[],
        }
    }
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A metric family: its type, help and samples in order.
#[derive(Debug, Clone)]
pub struct Family {
    pub name: String,
    pub kind: MetricType,
    pub help: Option<String>,
    pub samples: Vec<Sample>,
}

impl Family {
    /// The samples named exactly `name`.
    pub fn named(&self, name: &str) -> Vec<&Sample> {
        self.samples.iter().filter(|s| s.name == name).collect()
    }
}

/// A parsed exposition.
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    pub families: BTreeMap<String, Family>,
}

impl Exposition {
    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.get(name)
    }

    /// The family a sample called `sample_name` belongs to (see the module docs).
    pub fn family_of_sample(&self, sample_name: &str) -> Option<&Family> {
        if let Some(f) = self.families.get(sample_name) {
            return Some(f);
        }
        self.families.values().find(|f| {
            f.kind.suffixes().iter().any(|sfx| {
                sample_name
                    .strip_suffix(sfx)
                    .is_some_and(|base| base == f.name)
            })
        })
    }

    /// Every sample called exactly `sample_name`.
    pub fn samples(&self, sample_name: &str) -> Vec<&Sample> {
        self.family_of_sample(sample_name)
            .map(|f| f.named(sample_name))
            .unwrap_or_default()
    }
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
    chars.next().is_some_and(ok_first) && chars.all(|c| ok_first(c) || c.is_ascii_digit())
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse().map_err(|_| format!("bad value {s:?}")),
    }
}

/// `{a="x",b="y\"z"}` from just after `{`; returns the labels and the rest after `}`.
fn parse_labels(mut s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((labels, rest));
        }
        let eq = s.find('=').ok_or("label without '='")?;
        let name = s[..eq].trim();
        if !is_name(name, false) {
            return Err(format!("bad label name {name:?}"));
        }
        let quoted = s[eq + 1..]
            .trim_start()
            .strip_prefix('"')
            .ok_or_else(|| format!("label {name} value is not quoted"))?;
        let mut value = String::new();
        let mut rest = None;
        let mut chars = quoted.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => {
                    rest = Some(&quoted[i + 1..]);
                    break;
                }
                '\\' => match chars.next().map(|(_, c)| c) {
                    Some('\\') => value.push('\\'),
                    Some('"') => value.push('"'),
                    Some('n') => value.push('\n'),
                    other => return Err(format!("bad escape \\{other:?} in label {name}")),
                },
                c => value.push(c),
            }
        }
        let rest = rest.ok_or_else(|| format!("label {name} value is not closed"))?;
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} given twice"));
        }
        s = rest.trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err("expected ',' or '}' after a label".into());
        }
    }
}

/// Parses an exposition; any malformed line is an error naming its line number.
pub fn parse(text: &str) -> Result<Exposition, String> {
    let mut exp = Exposition::default();
    let mut eof = false;
    for (n, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if eof {
            return Err(at("text after # EOF".into()));
        }
        if line.trim().is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let mut parts = comment.trim_start().splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("EOF"), None, None) => eof = true,
                (Some("TYPE"), Some(name), Some(kind)) => {
                    let kind = MetricType::parse(kind.trim())
                        .ok_or_else(|| at(format!("unknown type {kind:?}")))?;
                    if !is_name(name, true) {
                        return Err(at(format!("bad metric name {name:?}")));
                    }
                    let f = exp.families.entry(name.to_string()).or_insert(Family {
                        name: name.to_string(),
                        kind,
                        help: None,
                        samples: Vec::new(),
                    });
                    if !f.samples.is_empty() || (f.kind != kind && f.kind != MetricType::Untyped) {
                        return Err(at(format!("TYPE of {name} after its samples or twice")));
                    }
                    f.kind = kind;
                }
                (Some("HELP"), Some(name), help) => {
                    let f = exp.families.entry(name.to_string()).or_insert(Family {
                        name: name.to_string(),
                        kind: MetricType::Untyped,
                        help: None,
                        samples: Vec::new(),
                    });
                    f.help = Some(help.unwrap_or("").to_string());
                }
                _ => {} // any other comment
            }
            continue;
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| at("a sample without a value".into()))?;
        let name = &line[..name_end];
        if !is_name(name, true) {
            return Err(at(format!("bad metric name {name:?}")));
        }
        let (labels, rest) = match line[name_end..].strip_prefix('{') {
            Some(after) => parse_labels(after).map_err(at)?,
            None => (BTreeMap::new(), &line[name_end..]),
        };
        let mut fields = rest.split_whitespace();
        let value = parse_value(fields.next().ok_or_else(|| at("no value".into()))?).map_err(at)?;
        if let Some(ts) = fields.next() {
            ts.parse::<f64>()
                .map_err(|_| at(format!("bad timestamp {ts:?}")))?;
        }
        if fields.next().is_some() {
            return Err(at("trailing fields".into()));
        }
        let sample = Sample {
            name: name.to_string(),
            labels,
            value,
        };
        let family = exp.family_of_sample(name).map(|f| f.name.clone());
        let family = family.unwrap_or_else(|| name.to_string());
        exp.families
            .entry(family.clone())
            .or_insert(Family {
                name: family,
                kind: MetricType::Untyped,
                help: None,
                samples: Vec::new(),
            })
            .samples
            .push(sample);
    }
    Ok(exp)
}

type LabelSet = Vec<(String, String)>;

/// Checks that `family` is a well-formed histogram: per label set, `_bucket` samples with
/// parseable, increasing `le` bounds ending at `+Inf` and non-decreasing counts, and `_count`
/// equal to the `+Inf` bucket, and a `_sum`. Returns the total `_count` over label sets.
pub fn check_histogram(family: &Family) -> Result<f64, String> {
    let name = &family.name;
    // Per label set (without `le`): its (le, cumulative count) buckets.
    let mut series: BTreeMap<LabelSet, Vec<(f64, f64)>> = BTreeMap::new();
    for s in family.named(&format!("{name}_bucket")) {
        let le = s
            .labels
            .get("le")
            .ok_or_else(|| format!("{name}_bucket without le"))?;
        let le = parse_value(le)?;
        let key: Vec<_> = s
            .labels
            .iter()
            .filter(|(k, _)| k.as_str() != "le")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        series.entry(key).or_default().push((le, s.value));
    }
    if series.is_empty() {
        return Err(format!("{name} has no _bucket samples"));
    }
    let mut total = 0.0;
    for (key, buckets) in &series {
        for w in buckets.windows(2) {
            if w[1].0 <= w[0].0 || w[1].1 < w[0].1 {
                return Err(format!("{name}{key:?}: buckets out of order: {buckets:?}"));
            }
        }
        let (last_le, inf_count) = *buckets.last().ok_or("no buckets")?;
        if last_le != f64::INFINITY {
            return Err(format!("{name}{key:?}: no le=\"+Inf\" bucket"));
        }
        let labels_match = |s: &&Sample| {
            s.labels.len() == key.len() && key.iter().all(|(k, v)| s.labels.get(k) == Some(v))
        };
        let count = family
            .named(&format!("{name}_count"))
            .into_iter()
            .find(labels_match)
            .ok_or_else(|| format!("{name}{key:?}: no _count"))?;
        if count.value != inf_count {
            return Err(format!(
                "{name}{key:?}: _count {} != +Inf bucket {inf_count}",
                count.value
            ));
        }
        family
            .named(&format!("{name}_sum"))
            .into_iter()
            .find(labels_match)
            .ok_or_else(|| format!("{name}{key:?}: no _sum"))?;
        total += count.value;
    }
    Ok(total)
}

#[test]
fn prometheus_text_parser_files_samples_under_their_families() {
    let text = "# HELP c A counter.\n# TYPE c counter\nc_total{a=\"x\"} 3\nc_created{a=\"x\"} 1.7e9\n\
                # TYPE old_total counter\nold_total 2\n\
                # TYPE g gauge\ng{path=\"C:\\\\dir\",q=\"say \\\"hi\\\"\",nl=\"a\\nb\",} -1.5 1700000000\n\
                # TYPE h histogram\nh_bucket{le=\"0.5\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.75\nh_count 2\n\
                stray 1\n# EOF\n";
    let exp = parse(text).unwrap();
    assert_eq!(
        exp.family_of_sample("c_total").unwrap().kind,
        MetricType::Counter
    );
    assert_eq!(exp.family_of_sample("c_created").unwrap().name, "c");
    assert_eq!(
        exp.family_of_sample("old_total").unwrap().kind,
        MetricType::Counter
    );
    assert_eq!(exp.family("c").unwrap().help.as_deref(), Some("A counter."));
    let g = &exp.samples("g")[0];
    assert_eq!(g.value, -1.5);
    assert_eq!(g.labels["path"], "C:\\dir");
    assert_eq!(g.labels["q"], "say \"hi\"");
    assert_eq!(g.labels["nl"], "a\nb");
    assert_eq!(check_histogram(exp.family("h").unwrap()), Ok(2.0));
    assert_eq!(exp.family("stray").unwrap().kind, MetricType::Untyped);
    assert!(
        exp.family_of_sample("g_total").is_none(),
        "gauges take no suffix"
    );
}

#[test]
fn prometheus_text_parser_rejects_malformed_lines_and_histograms() {
    for bad in [
        "x{a=\"1\" 2\n",
        "x{a=1} 2\n",
        "x{a=\"1\",a=\"2\"} 2\n",
        "x two\n",
        "x 1 2 3\n",
        "1x 1\n",
        "# TYPE x nonsense\n",
        "x 1\n# TYPE x gauge\n",
        "# EOF\nx 1\n",
    ] {
        assert!(parse(bad).is_err(), "accepted {bad:?}");
    }
    let no_inf = parse("# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n").unwrap();
    assert!(check_histogram(no_inf.family("h").unwrap()).is_err());
    let decreasing =
        "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n";
    assert!(check_histogram(parse(decreasing).unwrap().family("h").unwrap()).is_err());
    let bad_count = "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 3\n";
    assert!(check_histogram(parse(bad_count).unwrap().family("h").unwrap()).is_err());
}
