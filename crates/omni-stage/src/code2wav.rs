//! The Code2Wav stage: windows of codec frames from any requests, decoded together (up to
//! `max_num_seqs` windows and `max_num_batched_tokens` frames a step), each trimmed to its new
//! audio (omni.md 4.3) and sent on as that request's next [`AudioOutput`]. A request's windows
//! come out in the order they came in; its last window ends it.

use std::collections::VecDeque;

use omni_protocol::{
    AudioOutput, CodecChunk, EngineCoreOutput, FinishReason, StageInput, StageOutputs, StageSpec,
};

use crate::StageError;
use crate::nets::Code2WavNet;
use crate::profile::StepClock;
use crate::stage::{Stage, StepResult};

/// Qwen3-Omni's output rate (its config carries none; vLLM-Omni's fallback is the same).
pub const SAMPLE_RATE: u32 = 24_000;

/// Most frames one Code2Wav batch holds: its buffers scale with it (several MB a frame at the
/// real size), so the stage's `max_num_batched_tokens` is capped at 32 windows of 25 + 25.
pub const MAX_BATCH_FRAMES: u32 = 1600;

/// Frames per batch for `spec`.
pub fn frames_per_batch(spec: &StageSpec) -> usize {
    spec.max_num_batched_tokens.clamp(1, MAX_BATCH_FRAMES) as usize
}

/// See the module docs.
#[derive(Debug)]
pub struct Code2WavStage {
    model: Box<dyn Code2WavNet>,
    queue: VecDeque<CodecChunk>,
    max_windows: usize,
    max_frames: usize,
}

impl Code2WavStage {
    /// A stage over a loaded Code2Wav.
    pub fn new(model: Box<dyn Code2WavNet>, spec: &StageSpec) -> Self {
        Self {
            model,
            queue: VecDeque::new(),
            max_windows: (spec.max_num_seqs as usize).max(1),
            max_frames: frames_per_batch(spec),
        }
    }
}

impl Stage for Code2WavStage {
    fn input(&mut self, input: StageInput, _buffers: &[&[u8]], out: &mut StageOutputs) {
        match input {
            StageInput::Codec(windows) => {
                let groups = self.model.num_quantizers();
                for c in windows {
                    if c.codes.len() != groups * c.num_frames as usize
                        || c.left_context > c.num_frames
                    {
                        out.failed.push((
                            c.request_id.clone(),
                            format!(
                                "codec window {} of {} codes for {} frames of {groups} \
                                 codebooks ({} of context)",
                                c.chunk_id,
                                c.codes.len(),
                                c.num_frames,
                                c.left_context
                            ),
                        ));
                    } else {
                        self.queue.push_back(c);
                    }
                }
            }
            StageInput::Abort(ids) => self.queue.retain(|c| !ids.contains(&c.request_id)),
            StageInput::Add(_)
            | StageInput::Thinker(_)
            | StageInput::Text(_)
            | StageInput::Shutdown => {}
        }
    }

    fn has_work(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Windows waiting count as waiting requests; Code2Wav holds no KV cache.
    fn stats(&self) -> Option<omni_protocol::SchedulerStats> {
        Some(omni_protocol::SchedulerStats {
            num_waiting_reqs: self.queue.len() as u32,
            ..omni_protocol::SchedulerStats::default()
        })
    }

    fn step(&mut self, clock: &mut StepClock) -> Result<StepResult, StageError> {
        let mut out = StageOutputs::default();
        let mut batch = Vec::new();
        let mut frames = 0;
        while let Some(c) = self.queue.front() {
            let n = c.num_frames as usize;
            if !batch.is_empty()
                && (batch.len() >= self.max_windows || frames + n > self.max_frames)
            {
                break;
            }
            frames += n;
            batch.extend(self.queue.pop_front());
        }
        let windows: Vec<(&[u32], usize, usize)> = batch
            .iter()
            .map(|c| {
                (
                    c.codes.as_slice(),
                    c.num_frames as usize,
                    c.left_context as usize,
                )
            })
            .collect();
        clock.set_rows(windows.len());
        clock.lap("batch");
        let wavs = self.model.decode_windows(&windows)?;
        clock.lap("decode");
        let rate = SAMPLE_RATE;
        for (c, samples) in batch.iter().zip(wavs) {
            let audio = (c.num_frames > 0).then(|| AudioOutput {
                samples,
                sample_rate: rate,
                num_frames: c.num_frames - c.left_context,
            });
            out.outputs.push(EngineCoreOutput::bare(
                c.request_id.clone(),
                c.finished.then_some(FinishReason::Stop),
                audio,
            ));
        }
        clock.lap("outputs");
        Ok((out, Vec::new()))
    }
}
