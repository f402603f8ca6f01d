//! Serving-benchmark statistics (vLLM's definitions) and the result block users compare.

use serde::Serialize;

pub use super::omni_stats::AudioMetrics;

/// What one request measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOutcome {
    /// Whether it completed.
    pub success: bool,
    /// Why it failed.
    pub error: Option<String>,
    /// Prompt tokens (from `usage` when the server sends it, else the dataset's count).
    pub prompt_len: usize,
    /// Output tokens (from `usage`, else the number of content chunks).
    pub output_len: usize,
    /// Time to first token, seconds.
    pub ttft: f64,
    /// Gaps between content chunks, seconds.
    pub itl: Vec<f64>,
    /// End-to-end latency, seconds.
    pub latency: f64,
    /// When it started, seconds after the start of the run.
    pub start: f64,
    /// The audio of an omni request (`None` without audio).
    pub audio: Option<AudioOutcome>,
}

/// What one omni request measured of its audio (vLLM-Omni's client definitions).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AudioOutcome {
    /// Time to first packet: the first SSE chunk with `modality: "audio"` and non-empty content
    /// after the request started, seconds.
    pub ttfp: f64,
    /// PCM sample frames of all decoded audio chunks divided by their sample rate, seconds.
    pub duration: f64,
    /// PCM sample frames of all audio chunks.
    pub frames: u64,
    /// Real-time factor: (arrival of the last audio chunk - start) / `duration`.
    pub rtf: f64,
}

/// Mean, median, P99 and standard deviation of one metric, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub median_ms: f64,
    /// 99th percentile (linear interpolation, like numpy).
    pub p99_ms: f64,
    /// Population standard deviation.
    pub std_ms: f64,
}

/// Percentile `p` (0..=100) of sorted `v` with numpy's default linear interpolation.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = p / 100.0 * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

impl Summary {
    /// Summarizes values in seconds; an empty set is all zeros (as vLLM reports).
    pub fn of_seconds(values: &[f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        let mut v: Vec<f64> = values.iter().map(|s| s * 1000.0).collect();
        v.sort_by(f64::total_cmp);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        Self {
            mean_ms: mean,
            median_ms: percentile(&v, 50.0),
            p99_ms: percentile(&v, 99.0),
            std_ms: var.sqrt(),
        }
    }
}

/// The benchmark's figures (also the `--save-result` JSON).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ServeBenchResult {
    /// Completed requests.
    pub completed: usize,
    /// Failed requests.
    pub failed: usize,
    /// `--max-concurrency`, if set.
    pub max_concurrency: Option<usize>,
    /// `--request-rate` (`inf` serializes as null).
    pub request_rate: Option<f64>,
    /// Wall time of the whole run, seconds.
    pub duration: f64,
    /// Prompt tokens of completed requests.
    pub total_input_tokens: usize,
    /// Output tokens of completed requests.
    pub total_output_tokens: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Prompt plus output tokens per second.
    pub total_token_throughput: f64,
    /// Time to first token.
    pub ttft: Summary,
    /// Time per output token, first token excluded (per request, then summarized).
    pub tpot: Summary,
    /// Inter-token latency (every gap of every request).
    pub itl: Summary,
    /// End-to-end latency.
    pub e2el: Summary,
    /// Most output tokens that arrived within one second of the run (vLLM's peak).
    pub max_output_tokens_per_s: f64,
    /// Most requests in flight within one second of the run (vLLM's peak).
    pub max_concurrent_requests: f64,
    /// The Audio Result of an omni run (vLLM-Omni's names in the JSON); `None` without audio.
    #[serde(flatten)]
    pub audio: Option<AudioMetrics>,
    /// The first few error messages.
    pub errors: Vec<String>,
}

/// vLLM's `max_output_tokens_per_s` and `max_concurrent_requests`: the run cut into one-second
/// buckets from the first start; a token counts in the bucket it arrived in (first at TTFT, the
/// others ITL apart), a request in every bucket from its start to its end.
fn peaks(ok: &[&RequestOutcome]) -> (f64, f64) {
    let Some(t0) = ok.iter().map(|o| o.start).min_by(f64::total_cmp) else {
        return (0.0, 0.0);
    };
    let end = ok.iter().map(|o| o.start + o.latency).fold(t0, f64::max);
    let buckets = (end - t0).ceil() as usize + 1;
    let mut tokens = vec![0usize; buckets];
    let mut running = vec![0usize; buckets];
    for o in ok {
        let mut t = o.start + o.ttft;
        let mut times = vec![t];
        for gap in &o.itl {
            t += gap;
            times.push(t);
        }
        for t in times {
            if let Some(b) = tokens.get_mut((t - t0).max(0.0) as usize) {
                *b += 1;
            }
        }
        let first = (o.start - t0) as usize;
        let last = ((o.start + o.latency - t0) as usize).min(buckets - 1);
        for r in &mut running[first.min(last)..=last] {
            *r += 1;
        }
    }
    let max = |v: &[usize]| v.iter().copied().max().unwrap_or(0) as f64;
    (max(&tokens), max(&running))
}

impl ServeBenchResult {
    /// vLLM's definitions over the outcomes of a run that took `duration` seconds.
    pub fn compute(
        outcomes: &[RequestOutcome],
        duration: f64,
        max_concurrency: Option<usize>,
        request_rate: f64,
    ) -> Self {
        let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.success).collect();
        let total_input_tokens = ok.iter().map(|o| o.prompt_len).sum();
        let total_output_tokens = ok.iter().map(|o| o.output_len).sum();
        let ttfts: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
        let tpots: Vec<f64> = ok
            .iter()
            .filter(|o| o.output_len > 1)
            .map(|o| (o.latency - o.ttft) / (o.output_len - 1) as f64)
            .collect();
        let itls: Vec<f64> = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
        let e2els: Vec<f64> = ok.iter().map(|o| o.latency).collect();
        let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
        let (max_output_tokens_per_s, max_concurrent_requests) = peaks(&ok);
        Self {
            completed: ok.len(),
            failed: outcomes.len() - ok.len(),
            max_concurrency,
            request_rate: request_rate.is_finite().then_some(request_rate),
            duration,
            total_input_tokens,
            total_output_tokens,
            request_throughput: per_s(ok.len() as f64),
            output_throughput: per_s(total_output_tokens as f64),
            total_token_throughput: per_s((total_input_tokens + total_output_tokens) as f64),
            ttft: Summary::of_seconds(&ttfts),
            tpot: Summary::of_seconds(&tpots),
            itl: Summary::of_seconds(&itls),
            e2el: Summary::of_seconds(&e2els),
            max_output_tokens_per_s,
            max_concurrent_requests,
            audio: AudioMetrics::compute(&ok, duration),
            errors: outcomes
                .iter()
                .filter_map(|o| o.error.clone())
                .take(10)
                .collect(),
        }
    }

    /// The `============ Serving Benchmark Result ============` block, for the metrics named in
    /// `percentile_metrics` (`ttft`, `tpot`, `itl`, `e2el`), like `vllm bench serve` prints it.
    pub fn format_block(&self, percentile_metrics: &[String]) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let row = |s: &mut String, name: &str, value: String| {
            let _ = writeln!(s, "{name:<40} {value:<10}");
        };
        let _ = writeln!(s, "{:=^50}", " Serving Benchmark Result ");
        row(&mut s, "Successful requests:", self.completed.to_string());
        row(&mut s, "Failed requests:", self.failed.to_string());
        if let Some(c) = self.max_concurrency {
            row(&mut s, "Maximum request concurrency:", c.to_string());
        }
        row(
            &mut s,
            "Benchmark duration (s):",
            format!("{:.2}", self.duration),
        );
        row(
            &mut s,
            "Total input tokens:",
            self.total_input_tokens.to_string(),
        );
        row(
            &mut s,
            "Total generated tokens:",
            self.total_output_tokens.to_string(),
        );
        row(
            &mut s,
            "Request throughput (req/s):",
            format!("{:.2}", self.request_throughput),
        );
        row(
            &mut s,
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        row(
            &mut s,
            "Total Token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        let sections: [(&str, &str, &str, &Summary); 4] = [
            ("ttft", "Time to First Token", "TTFT", &self.ttft),
            (
                "tpot",
                "Time per Output Token (excl. 1st token)",
                "TPOT",
                &self.tpot,
            ),
            ("itl", "Inter-token Latency", "ITL", &self.itl),
            ("e2el", "End-to-end Latency", "E2EL", &self.e2el),
        ];
        for (key, title, short, summary) in sections {
            if !percentile_metrics.iter().any(|m| m == key) {
                continue;
            }
            let _ = writeln!(s, "{title:-^50}");
            row(
                &mut s,
                &format!("Mean {short} (ms):"),
                format!("{:.2}", summary.mean_ms),
            );
            row(
                &mut s,
                &format!("Median {short} (ms):"),
                format!("{:.2}", summary.median_ms),
            );
            row(
                &mut s,
                &format!("P99 {short} (ms):"),
                format!("{:.2}", summary.p99_ms),
            );
        }
        let _ = writeln!(s, "{}", "=".repeat(50));
        s
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-9);
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    fn outcome(ttft: f64, latency: f64, output_len: usize, itl: Vec<f64>) -> RequestOutcome {
        RequestOutcome {
            success: true,
            prompt_len: 10,
            output_len,
            ttft,
            itl,
            latency,
            error: None,
            start: 0.0,
            audio: None,
        }
    }

    #[test]
    fn compute_follows_vllm_definitions() {
        let outcomes = vec![
            outcome(0.1, 1.1, 11, vec![0.1; 10]),
            outcome(0.3, 0.7, 5, vec![0.1; 4]),
            outcome(0.2, 0.2, 1, vec![]),
            RequestOutcome {
                error: Some("HTTP 500".into()),
                ..RequestOutcome::default()
            },
        ];
        let r = ServeBenchResult::compute(&outcomes, 2.0, Some(4), f64::INFINITY);
        assert_eq!((r.completed, r.failed), (3, 1));
        assert_eq!(r.total_input_tokens, 30);
        assert_eq!(r.total_output_tokens, 17);
        assert_eq!(r.request_throughput, 1.5);
        assert_eq!(r.output_throughput, 8.5);
        assert_eq!(r.total_token_throughput, 23.5);
        assert!((r.ttft.mean_ms - 200.0).abs() < 1e-9);
        assert!((r.ttft.median_ms - 200.0).abs() < 1e-9);
        // TPOT: (1.1-0.1)/10 = 100 ms and (0.7-0.3)/4 = 100 ms; one-token requests excluded.
        assert!((r.tpot.mean_ms - 100.0).abs() < 1e-9);
        assert_eq!(r.itl.mean_ms.round(), 100.0);
        assert_eq!(r.request_rate, None);
        assert_eq!(r.errors, ["HTTP 500"]);
    }

    #[test]
    fn block_matches_vllm_layout() {
        let r = ServeBenchResult {
            completed: 32,
            failed: 0,
            max_concurrency: Some(8),
            duration: 150.8712,
            total_input_tokens: 65536,
            total_output_tokens: 65536,
            request_throughput: 0.2121,
            output_throughput: 434.4,
            total_token_throughput: 868.8,
            ttft: Summary {
                mean_ms: 7279.561,
                median_ms: 7099.88,
                p99_ms: 10999.46,
                std_ms: 0.0,
            },
            ..ServeBenchResult::default()
        };
        let metrics: Vec<String> = ["ttft", "tpot", "itl"].map(String::from).to_vec();
        let block = r.format_block(&metrics);
        let lines: Vec<&str> = block.lines().collect();
        assert_eq!(
            lines[0],
            "============ Serving Benchmark Result ============"
        );
        assert_eq!(
            lines[1],
            "Successful requests:                     32        "
        );
        assert_eq!(
            lines[2],
            "Failed requests:                         0         "
        );
        assert_eq!(
            lines[3],
            "Maximum request concurrency:             8         "
        );
        assert_eq!(
            lines[4],
            "Benchmark duration (s):                  150.87    "
        );
        assert_eq!(
            lines[8],
            "Output token throughput (tok/s):         434.40    "
        );
        assert_eq!(
            lines[9],
            "Total Token throughput (tok/s):          868.80    "
        );
        assert_eq!(
            lines[10],
            "---------------Time to First Token----------------"
        );
        assert_eq!(
            lines[11],
            "Mean TTFT (ms):                          7279.56   "
        );
        assert_eq!(
            lines[14],
            "-----Time per Output Token (excl. 1st token)------"
        );
        assert_eq!(
            lines[18],
            "---------------Inter-token Latency----------------"
        );
        assert_eq!(*lines.last().unwrap(), "=".repeat(50));
        assert_eq!(lines.len(), 23);
        assert!(!block.contains("E2EL"));
        assert!(r.format_block(&["e2el".into()]).contains("Mean E2EL (ms):"));
    }
}
