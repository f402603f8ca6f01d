//! Where a worker's step time goes, for benchmarks: `OMNI_STEP_TIMING=N` makes the output rank
//! log, every `N` steps, the mean time inside `execute_model` (input preparation, the forward,
//! sampling and the copy of the tokens back: the device's share) and the mean gap between
//! one step's end and the next one's start (the engine core, the queues and the API server's
//! share), by the step's kind (decode steps, where every request schedules one token, and
//! the rest).

use std::time::{Duration, Instant};

/// The environment variable: steps per report (unset or `0`: off).
pub const STEP_TIMING_ENV: &str = "OMNI_STEP_TIMING";

/// Accumulates step and gap times; one report per `every` steps of a kind.
#[derive(Debug)]
pub struct StepTiming {
    every: u64,
    last_end: Option<Instant>,
    kinds: [Acc; 2],
}

#[derive(Debug, Default, Clone, Copy)]
struct Acc {
    steps: u64,
    tokens: u64,
    busy: Duration,
    gap: Duration,
}

impl StepTiming {
    /// From [`STEP_TIMING_ENV`]; `None` when off.
    pub fn from_env() -> Option<Self> {
        let every = std::env::var(STEP_TIMING_ENV).ok()?.parse::<u64>().ok()?;
        (every > 0).then(|| Self::new(every))
    }

    /// Reports every `every` steps of a kind.
    pub fn new(every: u64) -> Self {
        Self {
            every: every.max(1),
            last_end: None,
            kinds: [Acc::default(); 2],
        }
    }

    /// Records one step that began at `start` and ended now; `decode` when every request
    /// scheduled one token. Returns the report line when one is due.
    pub fn record(&mut self, start: Instant, tokens: u64, decode: bool) -> Option<String> {
        let end = Instant::now();
        let gap = self
            .last_end
            .map_or(Duration::ZERO, |e| start.saturating_duration_since(e));
        self.last_end = Some(end);
        let acc = &mut self.kinds[usize::from(decode)];
        acc.steps += 1;
        acc.tokens += tokens;
        acc.busy += end - start;
        acc.gap += gap;
        if acc.steps < self.every {
            return None;
        }
        let a = std::mem::take(acc);
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / a.steps as f64;
        Some(format!(
            "{} steps: {} of {:.1} tokens, {:.3} ms in the worker, {:.3} ms between steps",
            if decode { "decode" } else { "other" },
            a.steps,
            a.tokens as f64 / a.steps as f64,
            ms(a.busy),
            ms(a.gap)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_every_n_steps_of_a_kind_with_means() {
        let mut t = StepTiming::new(2);
        let s = Instant::now();
        assert!(t.record(s, 4, true).is_none());
        assert!(t.record(Instant::now(), 100, false).is_none());
        let line = t
            .record(Instant::now(), 6, true)
            .expect("second decode step reports");
        assert!(line.starts_with("decode steps: 2 of 5.0 tokens"), "{line}");
        // The accumulator restarts after a report.
        assert!(t.record(Instant::now(), 4, true).is_none());
    }
}
