//! Per-op GPU timing of eager steps (`--cuda-profile-steps`).

use std::collections::BTreeMap;
use std::sync::Arc;

use omni_backend::cuda::CudaContext;
use omni_backend::cuda::cudarc::driver::sys as driver_sys;

use crate::ModelError;

/// Per-kernel GPU time of eager steps (`--cuda-profile-steps <steps>`, env `OMNI_CUDA_PROFILE`,
/// arriving in the load spec): an event after every op;
/// each op's time is the gap to the previous event. Every `<steps>` steps of one kind (decode at
/// batch B, or prefill) it logs the mean time per step of each op and resets. Graph replay is
/// off while profiling, so the sum is the eager step's GPU time.
pub(super) struct StepProfiler {
    every: u64,
    /// Prefix of the logged kinds (which network, when a process profiles several).
    name: String,
    ctx: Arc<omni_backend::cuda::cudarc::driver::CudaContext>,
    marks: Vec<(&'static str, omni_backend::cuda::cudarc::driver::CudaEvent)>,
    kinds: BTreeMap<String, (u64, BTreeMap<&'static str, f64>)>,
}

impl StepProfiler {
    pub(super) fn new(cx: &CudaContext, every: u64) -> Self {
        Self {
            every,
            name: String::new(),
            ctx: cx.raw().clone(),
            marks: Vec::new(),
            kinds: BTreeMap::new(),
        }
    }

    /// Names the network in the logged kinds (`"<name>: decode batch 8"`).
    pub(super) fn named(mut self, name: &str) -> Self {
        self.name = if name.is_empty() {
            String::new()
        } else {
            format!("{name}: ")
        };
        self
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    pub(super) fn mark(
        &mut self,
        stream: &omni_backend::cuda::cudarc::driver::CudaStream,
        label: &'static str,
    ) -> Result<(), ModelError> {
        let ev = self
            .ctx
            .new_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        ev.record(stream)?;
        self.marks.push((label, ev));
        Ok(())
    }

    pub(super) fn finish(&mut self, kind: String) -> Result<(), ModelError> {
        let marks = std::mem::take(&mut self.marks);
        let Some((_, last)) = marks.last() else {
            return Ok(());
        };
        last.synchronize()?;
        let entry = self.kinds.entry(kind.clone()).or_default();
        entry.0 += 1;
        for w in marks.windows(2) {
            *entry.1.entry(w[1].0).or_default() += f64::from(w[0].1.elapsed_ms(&w[1].1)?);
        }
        if entry.0 >= self.every {
            let steps = entry.0 as f64;
            let total: f64 = entry.1.values().sum();
            let mut rows: Vec<(&str, f64)> = entry.1.iter().map(|(k, v)| (*k, *v)).collect();
            rows.sort_by(|a, b| b.1.total_cmp(&a.1));
            let table: Vec<String> = rows
                .iter()
                .map(|(k, v)| format!("{k} {:.3} ms ({:.0}%)", v / steps, 100.0 * v / total))
                .collect();
            tracing::info!(
                "profile {kind}: {:.3} ms GPU time per step over {} steps: {}",
                total / steps,
                entry.0,
                table.join(", ")
            );
            self.kinds.remove(&kind);
        }
        Ok(())
    }
}

impl std::fmt::Debug for StepProfiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepProfiler")
            .field("every", &self.every)
            .finish()
    }
}
