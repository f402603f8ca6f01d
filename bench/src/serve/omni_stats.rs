//! The omni run's figures and result block (vLLM-Omni's `benchmarks/metrics/metrics.py`
//! `print_metrics` for a generation task): the serving summary with end-to-end latency, then
//! `Text Result` and `Audio Result` (time to first packet, real-time factor, and the audio
//! duration per request when asked for), the `--save-result` JSON under vLLM-Omni's names.

use std::fmt::Write;

use serde::Serialize;

use super::stats::{RequestOutcome, ServeBenchResult, Summary};

/// The Audio Result of a run, over its successful requests with audio.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct AudioMetrics {
    /// Seconds of audio of all requests.
    pub total_audio_duration_s: f64,
    /// PCM sample frames of all requests.
    pub total_audio_frames: u64,
    /// Seconds of audio per second of the run.
    pub audio_throughput: f64,
    /// Requests with a first packet.
    pub num_audio_ttfp_samples: usize,
    /// Requests with a real-time factor (audio longer than zero).
    pub num_audio_rtf_samples: usize,
    /// Time to first packet, ms.
    pub mean_audio_ttfp_ms: f64,
    /// Time to first packet, ms.
    pub median_audio_ttfp_ms: f64,
    /// Time to first packet, ms.
    pub std_audio_ttfp_ms: f64,
    /// Time to first packet, ms.
    pub p99_audio_ttfp_ms: f64,
    /// Real-time factor.
    pub mean_audio_rtf: f64,
    /// Real-time factor.
    pub median_audio_rtf: f64,
    /// Real-time factor.
    pub std_audio_rtf: f64,
    /// Real-time factor.
    pub p99_audio_rtf: f64,
    /// Audio per request, seconds.
    pub mean_audio_duration_s: f64,
    /// Audio per request, seconds.
    pub median_audio_duration_s: f64,
    /// Audio per request, seconds.
    pub std_audio_duration_s: f64,
    /// Audio per request, seconds.
    pub p99_audio_duration_s: f64,
}

/// Mean, median, P99 and population standard deviation, in the values' own unit.
fn summarize(values: &[f64]) -> Summary {
    let ms = Summary::of_seconds(values);
    Summary {
        mean_ms: ms.mean_ms / 1000.0,
        median_ms: ms.median_ms / 1000.0,
        p99_ms: ms.p99_ms / 1000.0,
        std_ms: ms.std_ms / 1000.0,
    }
}

impl AudioMetrics {
    /// Over `ok` (successful requests) of a run of `duration` seconds; `None` when none had
    /// audio.
    pub fn compute(ok: &[&RequestOutcome], duration: f64) -> Option<Self> {
        let audio: Vec<_> = ok.iter().filter_map(|o| o.audio).collect();
        if audio.is_empty() {
            return None;
        }
        let total: f64 = audio.iter().map(|a| a.duration).sum();
        let ttfp = Summary::of_seconds(&audio.iter().map(|a| a.ttfp).collect::<Vec<_>>());
        let rtfs: Vec<f64> = audio
            .iter()
            .filter(|a| a.duration > 0.0)
            .map(|a| a.rtf)
            .collect();
        let rtf = summarize(&rtfs);
        let durations = summarize(&audio.iter().map(|a| a.duration).collect::<Vec<_>>());
        Some(Self {
            total_audio_duration_s: total,
            total_audio_frames: audio.iter().map(|a| a.frames).sum(),
            audio_throughput: if duration > 0.0 {
                total / duration
            } else {
                0.0
            },
            num_audio_ttfp_samples: audio.len(),
            num_audio_rtf_samples: rtfs.len(),
            mean_audio_ttfp_ms: ttfp.mean_ms,
            median_audio_ttfp_ms: ttfp.median_ms,
            std_audio_ttfp_ms: ttfp.std_ms,
            p99_audio_ttfp_ms: ttfp.p99_ms,
            mean_audio_rtf: rtf.mean_ms,
            median_audio_rtf: rtf.median_ms,
            std_audio_rtf: rtf.std_ms,
            p99_audio_rtf: rtf.p99_ms,
            mean_audio_duration_s: durations.mean_ms,
            median_audio_duration_s: durations.median_ms,
            std_audio_duration_s: durations.std_ms,
            p99_audio_duration_s: durations.p99_ms,
        })
    }
}

fn row(s: &mut String, name: &str, value: impl std::fmt::Display) {
    let _ = writeln!(s, "{name:<40} {:<10}", value.to_string());
}

fn section(s: &mut String, title: &str, label: &str, unit: &str, [mean, median, p99]: [f64; 3]) {
    let _ = writeln!(s, "{title:-^50}");
    row(s, &format!("Mean {label}{unit}:"), format!("{mean:.2}"));
    row(s, &format!("Median {label}{unit}:"), format!("{median:.2}"));
    row(s, &format!("P99 {label}{unit}:"), format!("{p99:.2}"));
}

fn ms(x: &Summary) -> [f64; 3] {
    [x.mean_ms, x.median_ms, x.p99_ms]
}

impl ServeBenchResult {
    /// vLLM-Omni's result block, for the metrics named in `percentile_metrics` (`ttft`, `tpot`,
    /// `itl`, `e2el`, `audio_ttfp`, `audio_rtf`, `audio_duration`; the audio ones in the order
    /// given). The Audio Result appears when the run produced audio.
    pub fn format_omni_block(&self, percentile_metrics: &[String]) -> String {
        let wants = |m: &str| percentile_metrics.iter().any(|x| x == m);
        let mut s = String::new();
        let _ = writeln!(s, "{:=^50}", " Serving Benchmark Result ");
        row(&mut s, "Successful requests:", self.completed);
        row(&mut s, "Failed requests:", self.failed);
        if let Some(c) = self.max_concurrency {
            row(&mut s, "Maximum request concurrency:", c);
        }
        if let Some(r) = self.request_rate {
            row(&mut s, "Request rate configured (RPS):", format!("{r:.2}"));
        }
        row(
            &mut s,
            "Benchmark duration (s):",
            format!("{:.2}", self.duration),
        );
        let peak_running = format!("{:.2}", self.max_concurrent_requests);
        row(
            &mut s,
            "Request throughput (req/s):",
            format!("{:.2}", self.request_throughput),
        );
        row(&mut s, "Peak concurrent requests:", &peak_running);
        if wants("e2el") {
            section(
                &mut s,
                "End-to-end Latency",
                "E2EL",
                " (ms)",
                ms(&self.e2el),
            );
        }
        let _ = writeln!(s, "{:=^50}", " Text Result ");
        row(&mut s, "Total input tokens:", self.total_input_tokens);
        row(&mut s, "Total generated tokens:", self.total_output_tokens);
        row(
            &mut s,
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        row(
            &mut s,
            "Peak output token throughput (tok/s):",
            format!("{:.2}", self.max_output_tokens_per_s),
        );
        row(&mut s, "Peak concurrent requests:", &peak_running);
        row(
            &mut s,
            "Total Token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        if self.total_output_tokens > 0 {
            let text = [
                ("ttft", "Time to First Token", "TTFT", &self.ttft),
                (
                    "tpot",
                    "Time per Output Token (excl. 1st token)",
                    "TPOT",
                    &self.tpot,
                ),
                ("itl", "Inter-token Latency", "ITL", &self.itl),
            ];
            for (key, title, label, summary) in text {
                if wants(key) {
                    section(&mut s, title, label, " (ms)", ms(summary));
                }
            }
        }
        if let Some(a) = self
            .audio
            .filter(|a| a.total_audio_duration_s > 0.0 || a.total_audio_frames > 0)
        {
            a.format(&mut s, percentile_metrics);
        }
        let _ = writeln!(s, "{}", "=".repeat(50));
        s
    }
}

impl AudioMetrics {
    fn format(&self, s: &mut String, percentile_metrics: &[String]) {
        let _ = writeln!(s, "{:=^50}", " Audio Result ");
        row(
            s,
            "Total audio duration generated(s):",
            format!("{:.2}", self.total_audio_duration_s),
        );
        row(s, "Total audio frames generated:", self.total_audio_frames);
        row(
            s,
            "Audio throughput(audio duration/s):",
            format!("{:.2}", self.audio_throughput),
        );
        for m in percentile_metrics {
            match m.as_str() {
                "audio_ttfp" if self.num_audio_ttfp_samples > 0 => section(
                    s,
                    "Time to First Packet",
                    "AUDIO_TTFP",
                    " (ms)",
                    [
                        self.mean_audio_ttfp_ms,
                        self.median_audio_ttfp_ms,
                        self.p99_audio_ttfp_ms,
                    ],
                ),
                "audio_rtf" if self.num_audio_rtf_samples > 0 => section(
                    s,
                    "Real Time Factor",
                    "AUDIO_RTF",
                    "",
                    [
                        self.mean_audio_rtf,
                        self.median_audio_rtf,
                        self.p99_audio_rtf,
                    ],
                ),
                "audio_duration" => section(
                    s,
                    "Audio Duration",
                    "AUDIO_DURATION",
                    " (s)",
                    [
                        self.mean_audio_duration_s,
                        self.median_audio_duration_s,
                        self.p99_audio_duration_s,
                    ],
                ),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::stats::{AudioOutcome, percentile};
    use super::*;

    fn p99(v: &mut [f64]) -> f64 {
        v.sort_by(f64::total_cmp);
        percentile(v, 99.0)
    }

    fn outcome(start: f64, ttfp: f64, duration: f64, last: f64) -> RequestOutcome {
        RequestOutcome {
            success: true,
            prompt_len: 10,
            output_len: 8,
            ttft: 0.1,
            itl: vec![0.05; 7],
            latency: last + 0.01,
            start,
            audio: Some(AudioOutcome {
                ttfp,
                duration,
                frames: (duration * 24_000.0) as u64,
                rtf: last / duration,
            }),
            error: None,
        }
    }

    #[test]
    fn audio_metrics_follow_vllm_omni_definitions() {
        let outcomes = [
            outcome(0.0, 0.2, 0.5, 0.6),
            outcome(0.0, 0.4, 1.0, 0.8),
            outcome(1.5, 0.3, 0.5, 0.4),
            RequestOutcome {
                error: Some("no audio".into()),
                ..RequestOutcome::default()
            },
        ];
        let r = ServeBenchResult::compute(&outcomes, 2.0, Some(2), f64::INFINITY);
        let a = r.audio.unwrap();
        assert_eq!((r.completed, r.failed), (3, 1));
        assert!((a.total_audio_duration_s - 2.0).abs() < 1e-12);
        assert_eq!(a.total_audio_frames, 48_000);
        assert!((a.audio_throughput - 1.0).abs() < 1e-12);
        assert!((a.mean_audio_ttfp_ms - 300.0).abs() < 1e-9);
        assert!((a.median_audio_ttfp_ms - 300.0).abs() < 1e-9);
        assert!((a.mean_audio_rtf - (1.2 + 0.8 + 0.8) / 3.0).abs() < 1e-12);
        assert!((a.p99_audio_rtf - p99(&mut [1.2, 0.8, 0.8])).abs() < 1e-12);
        assert!((a.median_audio_duration_s - 0.5).abs() < 1e-12);
        // Two requests in flight in the first second, 8 tokens each; the third in the next.
        assert_eq!(r.max_concurrent_requests, 2.0);
        assert_eq!(r.max_output_tokens_per_s, 16.0);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["total_audio_frames"], 48_000);
        assert!(json["mean_audio_ttfp_ms"].as_f64().unwrap() > 0.0);
        assert!(json.get("audio").is_none(), "flattened");
        let none = ServeBenchResult::compute(&outcomes[3..], 1.0, None, f64::INFINITY);
        assert_eq!(none.audio, None);
    }

    #[test]
    fn omni_block_matches_vllm_omni_layout() {
        let outcomes = [outcome(0.0, 0.2, 0.5, 0.6), outcome(0.0, 0.4, 1.0, 0.8)];
        let r = ServeBenchResult::compute(&outcomes, 4.0, Some(2), 8.0);
        let metrics: Vec<String> = "ttft,tpot,itl,e2el,audio_ttfp,audio_rtf"
            .split(',')
            .map(String::from)
            .collect();
        let block = r.format_omni_block(&metrics);
        let lines: Vec<&str> = block.lines().map(str::trim_end).collect();
        let want_start = [
            "============ Serving Benchmark Result ============",
            "Successful requests:                     2",
            "Failed requests:                         0",
            "Maximum request concurrency:             2",
            "Request rate configured (RPS):           8.00",
            "Benchmark duration (s):                  4.00",
            "Request throughput (req/s):              0.50",
            "Peak concurrent requests:                2.00",
            "----------------End-to-end Latency----------------",
        ];
        assert_eq!(lines[..want_start.len()], want_start);
        let text = lines
            .iter()
            .position(|l| l.contains(" Text Result "))
            .unwrap();
        assert_eq!(
            lines[text],
            "================== Text Result ==================="
        );
        assert_eq!(
            lines[text + 1],
            "Total input tokens:                      20"
        );
        assert_eq!(
            lines[text + 4],
            "Peak output token throughput (tok/s):    16.00"
        );
        let audio = lines
            .iter()
            .position(|l| l.contains(" Audio Result "))
            .unwrap();
        let want_audio = [
            "================== Audio Result ==================",
            "Total audio duration generated(s):       1.50",
            "Total audio frames generated:            36000",
            "Audio throughput(audio duration/s):      0.38",
            "---------------Time to First Packet---------------",
            "Mean AUDIO_TTFP (ms):                    300.00",
            "Median AUDIO_TTFP (ms):                  300.00",
            "P99 AUDIO_TTFP (ms):                     398.00",
            "-----------------Real Time Factor-----------------",
            "Mean AUDIO_RTF:                          1.00",
            "Median AUDIO_RTF:                        1.00",
            "P99 AUDIO_RTF:                           1.20",
            "==================================================",
        ];
        assert_eq!(lines[audio..], want_audio);
        assert!(text < audio);
        assert!(block.contains("Mean TTFT (ms):"));
        let with_duration = r.format_omni_block(&["audio_duration".into()]);
        assert!(with_duration.contains("Mean AUDIO_DURATION (s):                 0.75"));
        assert!(!with_duration.contains("E2EL"));
    }
}
