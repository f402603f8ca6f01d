//! Weight-loading progress for the person starting the engine: an indicatif bar (tensors read /
//! total) on stderr when stderr is a terminal, otherwise an `info` line at every quarter. Only
//! rank 0 reports (every rank reads every tensor, and the workers share the parent's stderr).
//!
//! Cost: one relaxed atomic add and one comparison per tensor; the bar redraws at most 20 times a
//! second (indicatif's default rate limit).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How loading progress is shown.
#[derive(Debug)]
pub struct LoadProgress {
    mode: Mode,
    started: Instant,
}

#[derive(Debug)]
enum Mode {
    /// Not shown (ranks other than 0).
    Silent,
    /// A bar on stderr, created at the first tensor (when the total is known).
    Bar(std::sync::OnceLock<ProgressBar>),
    /// An `info` line each time another quarter is done; holds the quarters logged.
    Log(AtomicUsize),
}

impl LoadProgress {
    /// Rank `rank`'s reporter: a bar if stderr is a terminal, log lines if not, nothing for
    /// ranks other than 0.
    pub fn for_rank(rank: u32) -> Self {
        let mode = if rank != 0 {
            Mode::Silent
        } else if std::io::stderr().is_terminal() {
            Mode::Bar(std::sync::OnceLock::new())
        } else {
            Mode::Log(AtomicUsize::new(0))
        };
        Self {
            mode,
            started: Instant::now(),
        }
    }

    /// A reporter that logs every quarter whatever stderr is (for tests).
    pub fn logging() -> Self {
        Self {
            mode: Mode::Log(AtomicUsize::new(0)),
            started: Instant::now(),
        }
    }

    /// `done` of `total` tensors are read.
    pub fn on_load(&self, done: usize, total: usize) {
        match &self.mode {
            Mode::Silent => {}
            Mode::Bar(bar) => {
                let bar = bar.get_or_init(|| new_bar(total));
                bar.set_position(done as u64);
                if done >= total && !bar.is_finished() {
                    // Cleared rather than left: the log lines that follow start on a clean line.
                    bar.finish_and_clear();
                    tracing::info!(
                        tensors = total,
                        elapsed_s = %format_args!("{:.2}", self.started.elapsed().as_secs_f64()),
                        "weights loaded"
                    );
                }
            }
            Mode::Log(logged) => {
                let quarter = quarters_done(done, total);
                // Relaxed: loading is one thread; fetch_max only keeps a line from repeating.
                if quarter > logged.fetch_max(quarter, Ordering::Relaxed) {
                    tracing::info!(
                        tensors = done,
                        total,
                        elapsed_s = %format_args!("{:.2}", self.started.elapsed().as_secs_f64()),
                        "loading weights: {}%",
                        quarter * 25
                    );
                }
            }
        }
    }
}

/// Whole quarters of `total` that `done` covers (0..=4).
fn quarters_done(done: usize, total: usize) -> usize {
    if total == 0 {
        return 4;
    }
    (done.min(total) * 4) / total
}

fn new_bar(total: usize) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "loading weights {wide_bar:.cyan/blue} {pos}/{len} tensors [{elapsed_precise}, eta {eta}]",
    ) {
        bar.set_style(style);
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quarters_are_crossed_once_each() {
        let total = 10;
        let crossed: Vec<usize> = (0..=total).map(|d| quarters_done(d, total)).collect();
        assert_eq!(crossed, vec![0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4]);
        assert_eq!(quarters_done(0, 0), 4);
        assert_eq!(quarters_done(12, 10), 4);
    }

    #[test]
    fn logging_reporter_takes_every_tensor_without_panicking() {
        let p = LoadProgress::logging();
        for d in 1..=7 {
            p.on_load(d, 7);
        }
        let Mode::Log(logged) = &p.mode else {
            unreachable!()
        };
        assert_eq!(logged.load(Ordering::Relaxed), 4);
    }
}
