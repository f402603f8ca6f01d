//! `omni-engine bench latency` (vLLM's `bench latency`, with roofline fractions): the report
//! and its table, the distinct prompts, and the arithmetic that turns timings into rates. The
//! binary drives the engine and fills these in; the bounds come from [`crate::roofline`].
//!
//! Decode of batch `B`: `B` requests of `input_len` prompt tokens and `output_len` output tokens
//! are submitted together. The decode window runs from the moment every request has its first
//! token (`t_all_first`) to the last token (`t_end`); `ms/step = window / (output_len − 1)`
//! (the last request to start decoding makes one token per step), and `decode tok/s` = tokens
//! received in the window / window (`B × (output_len − 1)` when every prefill finished in one
//! step; fewer when the prefills were spread over several steps, as early requests then decode
//! while later ones prefill).

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::roofline::{DecodeRoofline, ModelShape, PrefillRoofline, RankCeilings};

/// Prompts of random token ids whose first KV blocks all differ, so the prefix cache never
/// serves one prompt from another's blocks.
#[derive(Debug)]
pub struct DistinctPrompts {
    rng: StdRng,
    vocab_size: u32,
    block_size: usize,
    seen: HashSet<Vec<u32>>,
}

impl DistinctPrompts {
    /// Token ids in `0..vocab_size` (at least 2), drawn from `seed`; prefixes are compared over
    /// `block_size` tokens (the KV block, the prefix cache's unit).
    pub fn new(seed: u64, vocab_size: usize, block_size: usize) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            vocab_size: u32::try_from(vocab_size).unwrap_or(u32::MAX).max(2),
            block_size: block_size.max(1),
            seen: HashSet::new(),
        }
    }

    /// A `len`-token prompt whose first block no earlier prompt shares.
    pub fn next_prompt(&mut self, len: usize) -> Vec<u32> {
        loop {
            let p: Vec<u32> = (0..len)
                .map(|_| self.rng.random_range(0..self.vocab_size))
                .collect();
            let head = p[..len.min(self.block_size)].to_vec();
            // Prompts shorter than a block are never cached, so repeats of those are harmless
            // (and a short prompt over a tiny vocabulary may have no fresh value left).
            if len < self.block_size || self.seen.insert(head) {
                return p;
            }
        }
    }
}

/// When things happened in one measured decode iteration, seconds after submission.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeTiming {
    /// The first request's first token.
    pub first_first_s: f64,
    /// Every request has its first token.
    pub all_first_s: f64,
    /// The last token of the last request.
    pub end_s: f64,
    /// Tokens received after `all_first_s`.
    pub decode_tokens: usize,
    /// The first request has its last token: until then every request of the batch is in
    /// every step (after it, the batch thins out as the early starters finish).
    pub first_done_s: f64,
    /// Tokens received after `all_first_s` up to `first_done_s`.
    pub full_batch_tokens: usize,
}

/// Fewest steps of the whole batch (`full_batch_tokens / batch`) for a decode rate to come
/// from that window rather than from everything after the last first token.
pub const MIN_FULL_BATCH_STEPS: usize = 4;

/// Which stretch of a decode iteration its rate comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeWindow {
    /// From the last request's first token to the first request's last: every step holds the
    /// whole batch, as the roofline assumes.
    FullBatch,
    /// From the last request's first token to the end (the full-batch stretch was shorter than
    /// [`MIN_FULL_BATCH_STEPS`]): requests that started early finish inside it, so its steps
    /// hold fewer than `batch` requests on average.
    Tail,
}

/// One batch size's result.
#[derive(Debug, Clone, Serialize)]
pub struct DecodeRow {
    /// Requests in the batch (`B`).
    pub batch: usize,
    /// Prompt tokens per request.
    pub input_len: usize,
    /// Output tokens per request.
    pub output_len: usize,
    /// Mean context over the decode steps, `input_len + output_len / 2` (the roofline's).
    pub context: f64,
    /// Every request has its first token, seconds after submission.
    pub t_all_first_s: f64,
    /// All done, seconds after submission.
    pub t_end_s: f64,
    /// `t_all_first - ` the first request's first token (0 when every prefill ended together).
    pub first_token_spread_s: f64,
    /// Tokens received in the decode window.
    pub decode_tokens: usize,
    /// Length of the decode window, `t_end - t_all_first`.
    pub decode_s: f64,
    /// Decode tokens per second over `window`.
    pub decode_tok_per_s: f64,
    /// Milliseconds per step over `window`.
    pub ms_per_step: f64,
    /// Where the rate comes from.
    pub window: DecodeWindow,
    /// Tokens and seconds of the full-batch window.
    pub full_batch_tokens: usize,
    /// `first_done - t_all_first`.
    pub full_batch_s: f64,
    /// `decode_tokens / decode_s`: the whole window after the last first token, tail included
    /// (the rate this report gave before it had the full-batch window).
    pub tail_decode_tok_per_s: f64,
    /// The bound this batch size is compared with.
    pub roofline: DecodeRoofline,
    /// The bound's milliseconds per step.
    pub roofline_ms_per_step: Option<f64>,
    /// `decode_tok_per_s / roofline.tok_per_s`.
    pub fraction: Option<f64>,
    /// Prompt tokens the prefix cache served in the measured iteration (should be 0).
    pub prefix_cache_hit_tokens: u64,
    /// Preemptions during the measured iteration (should be 0).
    pub preemptions: u64,
}

impl DecodeRow {
    /// The row of `batch` requests from its timing and bound.
    pub fn new(
        batch: usize,
        input_len: usize,
        output_len: usize,
        timing: DecodeTiming,
        roofline: DecodeRoofline,
    ) -> Self {
        let decode_s = (timing.end_s - timing.all_first_s).max(0.0);
        let steps = output_len.saturating_sub(1).max(1) as f64;
        let rate = |tokens: usize, s: f64| if s > 0.0 { tokens as f64 / s } else { 0.0 };
        let tail_decode_tok_per_s = rate(timing.decode_tokens, decode_s);
        let full_batch_s = (timing.first_done_s - timing.all_first_s).max(0.0);
        let full_steps = timing.full_batch_tokens / batch.max(1);
        let (window, decode_tok_per_s, ms_per_step) =
            if full_steps >= MIN_FULL_BATCH_STEPS && full_batch_s > 0.0 {
                (
                    DecodeWindow::FullBatch,
                    rate(timing.full_batch_tokens, full_batch_s),
                    full_batch_s * batch as f64 / timing.full_batch_tokens as f64 * 1e3,
                )
            } else {
                (
                    DecodeWindow::Tail,
                    tail_decode_tok_per_s,
                    decode_s / steps * 1e3,
                )
            };
        Self {
            batch,
            input_len,
            output_len,
            context: context_len(input_len, output_len),
            t_all_first_s: timing.all_first_s,
            t_end_s: timing.end_s,
            first_token_spread_s: (timing.all_first_s - timing.first_first_s).max(0.0),
            decode_tokens: timing.decode_tokens,
            decode_s,
            decode_tok_per_s,
            ms_per_step,
            window,
            full_batch_tokens: timing.full_batch_tokens,
            full_batch_s,
            tail_decode_tok_per_s,
            roofline,
            roofline_ms_per_step: roofline.step_s.map(|s| s * 1e3),
            fraction: roofline
                .tok_per_s
                .filter(|r| *r > 0.0)
                .map(|r| decode_tok_per_s / r),
            prefix_cache_hit_tokens: 0,
            preemptions: 0,
        }
    }
}

/// The mean context of the decode steps: `input_len + output_len / 2`.
pub fn context_len(input_len: usize, output_len: usize) -> f64 {
    input_len as f64 + output_len as f64 / 2.0
}

/// The prefill result.
#[derive(Debug, Clone, Serialize)]
pub struct PrefillRow {
    /// Prompt tokens.
    pub tokens: usize,
    /// The prompt is longer than one step's token budget (`max_num_batched_tokens`), so it
    /// was prefilled in several steps.
    pub chunked: bool,
    /// Time to first token of each try, seconds.
    pub ttft_s: Vec<f64>,
    /// The best of them.
    pub best_ttft_s: f64,
    /// `tokens / best_ttft_s`.
    pub tok_per_s: f64,
    /// The bound.
    pub roofline: PrefillRoofline,
    /// `tok_per_s / roofline.tok_per_s`.
    pub fraction: Option<f64>,
    /// Prompt tokens the prefix cache served (should be 0).
    pub prefix_cache_hit_tokens: u64,
}

impl PrefillRow {
    /// The row of a `tokens`-long prompt timed `ttft_s` (one entry per try).
    pub fn new(tokens: usize, chunked: bool, ttft_s: Vec<f64>, roofline: PrefillRoofline) -> Self {
        let best = ttft_s
            .iter()
            .copied()
            .filter(|t| *t > 0.0)
            .fold(f64::INFINITY, f64::min);
        let tok_per_s = if best.is_finite() {
            tokens as f64 / best
        } else {
            0.0
        };
        Self {
            tokens,
            chunked,
            ttft_s,
            best_ttft_s: if best.is_finite() { best } else { 0.0 },
            tok_per_s,
            roofline,
            fraction: roofline
                .tok_per_s
                .filter(|r| *r > 0.0)
                .map(|r| tok_per_s / r),
            prefix_cache_hit_tokens: 0,
        }
    }
}

/// The device ceilings the bounds use, and where they came from.
#[derive(Debug, Clone, Serialize)]
pub struct Ceilings {
    /// Bandwidth of one device (a GPU; or the whole CPU), bytes/s.
    pub bandwidth_bytes_per_s: Option<f64>,
    /// How it was obtained (e.g. `cuda memcpy_dtod, read+write`, `--copy-bw-gbs`).
    pub bandwidth_source: String,
    /// Dense GEMM rate of one device, FLOP/s.
    pub gemm_flops_per_s: Option<f64>,
    /// How it was obtained.
    pub gemm_source: String,
    /// What one tensor-parallel rank gets (CPU ranks share the machine's bandwidth).
    pub per_rank: RankCeilings,
}

/// The device the engine ran on.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceSummary {
    /// `cuda` or `cpu`.
    pub kind: String,
    /// GPU or CPU model name.
    pub name: String,
}

/// The engine settings that shape the measurement.
#[derive(Debug, Clone, Serialize)]
pub struct EngineSummary {
    /// Tensor-parallel ranks.
    pub tensor_parallel_size: usize,
    /// Bytes per weight and KV element on the device (2 for bf16 on a GPU; 4 for the CPU's f32).
    pub elem_bytes: usize,
    /// `--load-format`.
    pub load_format: String,
    /// One step's token budget.
    pub max_num_batched_tokens: usize,
    /// Most requests in a batch.
    pub max_num_seqs: usize,
    /// Longest sequence.
    pub max_model_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks per rank.
    pub num_kv_blocks: usize,
    /// CUDA graphs off.
    pub enforce_eager: bool,
}

/// The benchmark's parameters.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyParams {
    /// Batch sizes measured.
    pub batch_sizes: Vec<usize>,
    /// Prompt tokens per decode request.
    pub input_len: usize,
    /// Output tokens per decode request.
    pub output_len: usize,
    /// Prompt tokens of the prefill measurement.
    pub prefill_len: usize,
    /// Unmeasured iterations before each measured one.
    pub warmup_iters: usize,
    /// Seed of the prompts.
    pub seed: u64,
}

/// Everything `bench latency` measured (its `--json`).
#[derive(Debug, Clone, Serialize)]
pub struct LatencyReport {
    /// When, UTC, ISO 8601.
    pub date: String,
    /// The command line.
    pub command: String,
    /// The model path.
    pub model: String,
    /// The model's shapes.
    pub config: ModelShape,
    /// The device.
    pub device: DeviceSummary,
    /// The engine's settings.
    pub engine: EngineSummary,
    /// The benchmark's parameters.
    pub params: LatencyParams,
    /// The ceilings.
    pub ceilings: Ceilings,
    /// One row per batch size.
    pub decode: Vec<DecodeRow>,
    /// The prefill measurement (`None` when skipped).
    pub prefill: Option<PrefillRow>,
}

fn opt(v: Option<f64>, width: usize, prec: usize) -> String {
    match v {
        Some(x) => format!("{x:>width$.prec$}"),
        None => format!("{:>width$}", "n/a"),
    }
}

impl LatencyReport {
    /// The human-readable table: a header naming model, device and ceilings, one row per batch
    /// size, then the prefill row.
    pub fn format_table(&self) -> String {
        let c = &self.config;
        let mut s = String::new();
        let experts = c.moe.as_ref().map_or(String::new(), |m| {
            format!(", {} experts top-{}", m.num_experts, m.top_k)
        });
        let _ = writeln!(
            s,
            "bench latency: {} ({} layers, hidden {}, {}/{} heads{}) on {} ({}), tp {}",
            c.architecture,
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            experts,
            self.device.kind,
            self.device.name,
            self.engine.tensor_parallel_size
        );
        let bw = self
            .ceilings
            .bandwidth_bytes_per_s
            .map_or("n/a".into(), |b| {
                format!("{:.1} GB/s ({})", b / 1e9, self.ceilings.bandwidth_source)
            });
        let gemm = self.ceilings.gemm_flops_per_s.map_or("n/a".into(), |f| {
            format!("{:.1} TFLOP/s ({})", f / 1e12, self.ceilings.gemm_source)
        });
        let _ = writeln!(s, "ceilings: bandwidth {bw}; GEMM {gemm}");
        let p = &self.params;
        let _ = writeln!(
            s,
            "decode: input {} + output {} tokens per request (mean context {})",
            p.input_len,
            p.output_len,
            context_len(p.input_len, p.output_len)
        );
        let _ = writeln!(
            s,
            "{:>6} {:>14} {:>10} {:>16} {:>16} {:>9}",
            "B", "decode tok/s", "ms/step", "roofline tok/s", "roofline ms/step", "fraction"
        );
        for r in &self.decode {
            let _ = writeln!(
                s,
                "{:>6} {:>14.1} {:>10.3} {} {} {}",
                r.batch,
                r.decode_tok_per_s,
                r.ms_per_step,
                opt(r.roofline.tok_per_s, 16, 1),
                opt(r.roofline_ms_per_step, 16, 3),
                opt(r.fraction, 9, 3)
            );
        }
        if let Some(r) = &self.prefill {
            let _ = writeln!(
                s,
                "{:>6} {:>14} {:>10} {:>16} {:>16} {:>9}",
                "prefill", "tok/s", "TTFT ms", "roofline tok/s", "roofline ms", "fraction"
            );
            let _ = writeln!(
                s,
                "{:>6} {:>14.1} {:>10.3} {} {} {}{}",
                r.tokens,
                r.tok_per_s,
                r.best_ttft_s * 1e3,
                opt(r.roofline.tok_per_s, 16, 1),
                opt(r.roofline.time_s.map(|t| t * 1e3), 16, 3),
                opt(r.fraction, 9, 3),
                if r.chunked { "  (chunked)" } else { "" }
            );
        }
        s
    }
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs)
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian, UTC).
pub fn format_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Days to civil date (H. Hinnant's algorithm), eras of 400 years from 0000-03-01.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::roofline::{decode_roofline, prefill_roofline};

    #[test]
    fn dates_format_as_utc() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_utc(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(format_utc(1_767_225_600), "2026-01-01T00:00:00Z");
    }

    #[test]
    fn prompts_differ_in_their_first_block() {
        let mut g = DistinctPrompts::new(7, 320, 16);
        let ps: Vec<Vec<u32>> = (0..200).map(|_| g.next_prompt(40)).collect();
        let heads: HashSet<&[u32]> = ps.iter().map(|p| &p[..16]).collect();
        assert_eq!(heads.len(), 200);
        assert!(ps.iter().flatten().all(|&t| t < 320));
        assert!(ps.iter().all(|p| p.len() == 40));
        // Same seed, same prompts.
        let mut h = DistinctPrompts::new(7, 320, 16);
        assert_eq!(h.next_prompt(40), ps[0]);
        // Shorter than a block: allowed to repeat, never loops.
        let mut tiny = DistinctPrompts::new(1, 2, 16);
        for _ in 0..10 {
            assert_eq!(tiny.next_prompt(1).len(), 1);
        }
    }

    fn tiny_shape() -> ModelShape {
        ModelShape {
            architecture: "Qwen3ForCausalLM".into(),
            vocab_size: 320,
            hidden_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 32,
            intermediate_size: 128,
            attention_bias: false,
            qk_norm: true,
            tie_word_embeddings: true,
            moe: None,
        }
    }

    #[test]
    fn rows_turn_timings_into_rates_and_fractions() {
        let ceil = RankCeilings {
            bandwidth_bytes_per_s: Some(1e9),
            gemm_flops_per_s: Some(1e10),
        };
        let bound = decode_roofline(&tiny_shape(), 4, context_len(32, 8), 1, 4, ceil);
        // 4 requests, 8 tokens each: 7 decode steps in 0.07 s after the last first token.
        // Every request started together: the first one done is the end, no tail.
        let t = DecodeTiming {
            first_first_s: 0.01,
            all_first_s: 0.02,
            end_s: 0.09,
            decode_tokens: 28,
            first_done_s: 0.09,
            full_batch_tokens: 28,
        };
        let r = DecodeRow::new(4, 32, 8, t, bound);
        assert_eq!(r.window, DecodeWindow::FullBatch);
        assert!((r.decode_s - 0.07).abs() < 1e-12);
        assert!((r.decode_tok_per_s - 400.0).abs() < 1e-6);
        assert!((r.tail_decode_tok_per_s - 400.0).abs() < 1e-6);
        assert!((r.ms_per_step - 10.0).abs() < 1e-9);
        // Staggered starts: 4 full steps of 10 ms, then a tail of 3 thinning steps (3, 2, 1
        // requests, 9 ms each). The rate is the full-batch one; the tail's is kept beside it.
        let staggered = DecodeTiming {
            first_done_s: 0.06,
            full_batch_tokens: 16,
            end_s: 0.087,
            decode_tokens: 22,
            ..t
        };
        let s = DecodeRow::new(4, 32, 8, staggered, bound);
        assert_eq!(s.window, DecodeWindow::FullBatch);
        assert!((s.decode_tok_per_s - 400.0).abs() < 1e-6);
        assert!((s.ms_per_step - 10.0).abs() < 1e-9);
        assert!((s.tail_decode_tok_per_s - 22.0 / 0.067).abs() < 1e-6);
        // Fewer than MIN_FULL_BATCH_STEPS full steps: the whole window after the last first
        // token, as before.
        let short = DecodeTiming {
            first_done_s: 0.04,
            full_batch_tokens: 8,
            ..t
        };
        let w = DecodeRow::new(4, 32, 8, short, bound);
        assert_eq!(w.window, DecodeWindow::Tail);
        assert!((w.decode_tok_per_s - 400.0).abs() < 1e-6);
        assert!((w.ms_per_step - 10.0).abs() < 1e-9);
        assert!((r.first_token_spread_s - 0.01).abs() < 1e-12);
        assert_eq!(r.context, 36.0);
        let want = 400.0 / bound.tok_per_s.unwrap();
        assert!((r.fraction.unwrap() - want).abs() < 1e-12);

        let pb = prefill_roofline(&tiny_shape(), 64, 1, ceil);
        let p = PrefillRow::new(64, false, vec![0.02, 0.01, 0.04], pb);
        assert_eq!(p.best_ttft_s, 0.01);
        assert!((p.tok_per_s - 6400.0).abs() < 1e-9);
        assert!(p.fraction.is_some());

        let report = LatencyReport {
            date: utc_now(),
            command: "omni-engine bench latency".into(),
            model: "m".into(),
            config: tiny_shape(),
            device: DeviceSummary {
                kind: "cpu".into(),
                name: "test".into(),
            },
            engine: EngineSummary {
                tensor_parallel_size: 1,
                elem_bytes: 4,
                load_format: "dummy".into(),
                max_num_batched_tokens: 2048,
                max_num_seqs: 256,
                max_model_len: 2048,
                block_size: 16,
                num_kv_blocks: 100,
                enforce_eager: false,
            },
            params: LatencyParams {
                batch_sizes: vec![4],
                input_len: 32,
                output_len: 8,
                prefill_len: 64,
                warmup_iters: 1,
                seed: 0,
            },
            ceilings: Ceilings {
                bandwidth_bytes_per_s: Some(1e9),
                bandwidth_source: "test".into(),
                gemm_flops_per_s: None,
                gemm_source: "none".into(),
                per_rank: ceil,
            },
            decode: vec![r],
            prefill: Some(p),
        };
        let table = report.format_table();
        assert!(table.contains("ms/step"), "{table}");
        assert!(table.contains("   400.0"), "{table}");
        assert_eq!(table.lines().count(), 7, "{table}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["decode"][0]["batch"], 4);
        assert_eq!(
            json["ceilings"]["gemm_flops_per_s"],
            serde_json::Value::Null
        );
    }
}
