//! Where a stage process spends its time: each step's host-side phases (a phase that ends in a
//! device-to-host copy includes the GPU work before it), the time spent taking inputs and
//! sending outputs, and the idle time, summed over an interval and logged as one line
//! (`stage profile <process name>: ...`), as vLLM logs its throughput every few seconds.
//!
//! The per-kernel view is `--cuda-profile-steps` (eager steps timed with events); this one
//! costs a clock read per phase and runs with graphs on, so it shows the pipeline as served.

use std::time::{Duration, Instant};

/// Laps of one step: [`StepClock::lap`] closes the phase that began at the previous lap.
#[derive(Debug)]
pub struct StepClock {
    last: Instant,
    phases: Vec<(&'static str, Duration)>,
    rows: usize,
}

impl Default for StepClock {
    fn default() -> Self {
        Self {
            last: Instant::now(),
            phases: Vec::new(),
            rows: 0,
        }
    }
}

impl StepClock {
    /// Starts a step.
    fn start(&mut self) {
        self.last = Instant::now();
        self.phases.clear();
        self.rows = 0;
    }

    /// Ends phase `name` now.
    pub fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        let d = now - self.last;
        self.last = now;
        match self.phases.iter_mut().find(|(n, _)| *n == name) {
            Some((_, t)) => *t += d,
            None => self.phases.push((name, d)),
        }
    }

    /// The step's batch size (requests or windows).
    pub fn set_rows(&mut self, rows: usize) {
        self.rows = rows;
    }
}

/// Sums over one logging interval.
#[derive(Debug)]
pub struct StageProfile {
    name: String,
    every: Duration,
    since: Instant,
    steps: u64,
    rows: u64,
    phases: Vec<(&'static str, Duration)>,
    inputs: Duration,
    sends: Duration,
    clock: StepClock,
}

impl StageProfile {
    /// A profile that logs every `every` (never when zero) under `name`.
    pub fn new(name: String, every: Duration) -> Self {
        Self {
            name,
            every,
            since: Instant::now(),
            steps: 0,
            rows: 0,
            phases: Vec::new(),
            inputs: Duration::ZERO,
            sends: Duration::ZERO,
            clock: StepClock::default(),
        }
    }

    /// The clock for the next step, started.
    pub fn step_clock(&mut self) -> &mut StepClock {
        self.clock.start();
        &mut self.clock
    }

    /// Adds the step just timed by [`Self::step_clock`]'s clock (a step that scheduled
    /// nothing has no rows and is not counted).
    pub fn end_step(&mut self) {
        if self.clock.rows == 0 {
            return;
        }
        self.steps += 1;
        self.rows += self.clock.rows as u64;
        for (name, d) in self.clock.phases.drain(..) {
            match self.phases.iter_mut().find(|(n, _)| *n == name) {
                Some((_, t)) => *t += d,
                None => self.phases.push((name, d)),
            }
        }
    }

    /// Time spent taking inputs.
    pub fn add_inputs(&mut self, d: Duration) {
        self.inputs += d;
    }

    /// Time spent sending outputs.
    pub fn add_sends(&mut self, d: Duration) {
        self.sends += d;
    }

    /// Logs and resets when the interval is over and something ran in it.
    pub fn maybe_log(&mut self) {
        if self.every.is_zero() || self.since.elapsed() < self.every {
            return;
        }
        if let Some(line) = self.summary() {
            tracing::info!("stage profile {}: {line}", self.name);
        }
        *self = Self::new(std::mem::take(&mut self.name), self.every);
    }

    /// One line: steps/s, mean rows, each phase's mean ms per step, and the shares of the wall
    /// time spent stepping, taking inputs, sending and idle. `None` when no step ran.
    pub fn summary(&self) -> Option<String> {
        if self.steps == 0 {
            return None;
        }
        let wall = self.since.elapsed().as_secs_f64().max(1e-9);
        let n = self.steps as f64;
        let stepping: f64 = self.phases.iter().map(|(_, d)| d.as_secs_f64()).sum();
        let phases: Vec<String> = self
            .phases
            .iter()
            .map(|(name, d)| format!("{name} {:.2}", d.as_secs_f64() * 1e3 / n))
            .collect();
        let pct = |s: f64| 100.0 * s / wall;
        let (inputs, sends) = (self.inputs.as_secs_f64(), self.sends.as_secs_f64());
        Some(format!(
            "{:.1} steps/s, {:.1} rows/step, {:.2} ms/step ({}); busy {:.0}% steps + {:.0}% \
             inputs + {:.0}% sends, idle {:.0}%",
            n / wall,
            self.rows as f64 / n,
            stepping * 1e3 / n,
            phases.join(", "),
            pct(stepping),
            pct(inputs),
            pct(sends),
            (100.0 - pct(stepping + inputs + sends)).max(0.0),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_phases_over_counted_steps_only() {
        let mut p = StageProfile::new("t".into(), Duration::ZERO);
        for rows in [3, 0, 5] {
            let c = p.step_clock();
            std::thread::sleep(Duration::from_millis(2));
            c.lap("forward");
            c.lap("choose");
            c.lap("forward");
            c.set_rows(rows);
            p.end_step();
        }
        assert_eq!(p.steps, 2);
        assert_eq!(p.rows, 8);
        let names: Vec<&str> = p.phases.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["forward", "choose"]);
        assert!(p.phases[0].1 >= Duration::from_millis(4));
        let line = p.summary().unwrap();
        assert!(line.contains("4.0 rows/step"), "{line}");
        assert!(line.contains("forward "), "{line}");
        // Never logs with a zero interval.
        p.maybe_log();
        assert_eq!(p.steps, 2);
    }

    #[test]
    fn no_summary_without_steps() {
        let mut p = StageProfile::new("t".into(), Duration::from_secs(1));
        p.add_inputs(Duration::from_millis(1));
        assert!(p.summary().is_none());
    }
}
