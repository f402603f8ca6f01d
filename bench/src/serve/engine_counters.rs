//! The engine's own IPC counters, scraped from the server's `/metrics` before and after the
//! timed run: broadcast messages, overflow messages and bytes, ring bytes, per engine step
//! (omni-engine's `omni:` counters; a server without them, vLLM's, prints nothing).

use serde_json::{Value, json};

/// The counters read, in this order.
const NAMES: [&str; 5] = [
    "omni:engine_steps_total",
    "omni:mq_broadcast_messages_total",
    "omni:mq_overflow_messages_total",
    "omni:mq_overflow_bytes_total",
    "omni:mq_ring_bytes_total",
];

/// One reading of the counters (or the difference of two).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct EngineCounters {
    pub steps: f64,
    pub messages: f64,
    pub overflow_messages: f64,
    pub overflow_bytes: f64,
    pub ring_bytes: f64,
}

impl EngineCounters {
    /// Reads the counters from exposition text; `None` unless every one is there.
    pub fn parse(text: &str) -> Option<Self> {
        let mut v = [0.0; NAMES.len()];
        for (slot, name) in v.iter_mut().zip(NAMES) {
            *slot = sample_sum(text, name)?;
        }
        let [
            steps,
            messages,
            overflow_messages,
            overflow_bytes,
            ring_bytes,
        ] = v;
        Some(Self {
            steps,
            messages,
            overflow_messages,
            overflow_bytes,
            ring_bytes,
        })
    }

    /// What moved between `before` and `self`.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            steps: self.steps - before.steps,
            messages: self.messages - before.messages,
            overflow_messages: self.overflow_messages - before.overflow_messages,
            overflow_bytes: self.overflow_bytes - before.overflow_bytes,
            ring_bytes: self.ring_bytes - before.ring_bytes,
        }
    }

    fn per_step(&self, x: f64) -> f64 {
        if self.steps > 0.0 {
            x / self.steps
        } else {
            0.0
        }
    }

    /// The result-block section, in vLLM's style.
    pub fn format_block(&self) -> String {
        let mut s = format!("{:-^50}\n", "Engine IPC (omni:, during the run)");
        let mut line = |k: &str, v: String| s.push_str(&format!("{k:<40} {v:<10}\n"));
        line("Engine steps:", format!("{:.0}", self.steps));
        line("Broadcast messages:", format!("{:.0}", self.messages));
        line(
            "Overflow messages:",
            format!("{:.0}", self.overflow_messages),
        );
        line(
            "Overflow messages per step:",
            format!("{:.4}", self.per_step(self.overflow_messages)),
        );
        line(
            "Overflow bytes per step:",
            format!("{:.0}", self.per_step(self.overflow_bytes)),
        );
        line(
            "Ring bytes per step:",
            format!("{:.0}", self.per_step(self.ring_bytes)),
        );
        s.push_str(&format!("{}\n", "=".repeat(50)));
        s
    }

    /// The `--save-result` keys.
    pub fn add_to_json(&self, json: &mut Value) {
        json["engine_steps"] = json!(self.steps);
        json["mq_broadcast_messages"] = json!(self.messages);
        json["mq_overflow_messages"] = json!(self.overflow_messages);
        json["mq_overflow_bytes"] = json!(self.overflow_bytes);
        json["mq_ring_bytes"] = json!(self.ring_bytes);
        json["mq_overflow_messages_per_step"] = json!(self.per_step(self.overflow_messages));
        json["mq_overflow_bytes_per_step"] = json!(self.per_step(self.overflow_bytes));
        json["mq_ring_bytes_per_step"] = json!(self.per_step(self.ring_bytes));
    }
}

/// The sum of `name`'s samples (every label set), if it has any.
fn sample_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = match rest.as_bytes().first() {
            Some(b'{') => rest.rsplit_once('}').map(|(_, v)| v),
            Some(b' ') => Some(rest),
            _ => None,
        };
        if let Some(x) = value.and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += x;
        }
    }
    found
}

/// The counters on `base`'s `/metrics`, if it serves them.
pub(super) async fn scrape(http: &reqwest::Client, base: &str) -> Option<EngineCounters> {
    let resp = http.get(format!("{base}/metrics")).send().await.ok()?;
    EngineCounters::parse(&resp.text().await.ok()?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP omni:engine_steps Batches\n\
        # TYPE omni:engine_steps counter\n\
        omni:engine_steps_total{model_name=\"mm\"} 200\n\
        omni:mq_broadcast_messages_total{model_name=\"mm\"} 205\n\
        omni:mq_overflow_messages_total{model_name=\"mm\"} 50\n\
        omni:mq_overflow_messages_total_other 7\n\
        omni:mq_overflow_bytes_total{model_name=\"mm\"} 5.0e8\n\
        omni:mq_ring_bytes_total 1000\n";

    #[test]
    fn counters_parse_and_turn_into_per_step_figures() {
        let after = EngineCounters::parse(TEXT).unwrap();
        assert_eq!(after.overflow_messages, 50.0);
        assert_eq!(after.ring_bytes, 1000.0);
        let before = EngineCounters {
            steps: 100.0,
            overflow_messages: 25.0,
            ..EngineCounters::default()
        };
        let d = after.since(&before);
        let mut json = json!({});
        d.add_to_json(&mut json);
        assert_eq!(json["mq_overflow_messages_per_step"], 0.25);
        assert_eq!(json["mq_overflow_bytes_per_step"], 5.0e6);
        assert!(d.format_block().contains("Overflow messages per step:"));
        assert!(EngineCounters::parse("vllm:num_requests_running 1\n").is_none());
    }
}
