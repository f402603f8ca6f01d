//! Qwen3-Omni's Talker and code predictor on one CUDA device (feature `cuda`): bf16 weights and
//! activations, f32 accumulation, f32 RMSNorm variance and f32 RoPE angles (the kernels of
//! [`crate::cuda_decoder`]), every network batched over the requests.
//!
//! One step of a batch of rows ([`CudaTalker::step`]) turns the Talker's last logits into a
//! frame and runs the Talker once more:
//!
//! ```text
//! c0_r   = choose(repetition_penalty(logits_r, seen_r), control range suppressed but EOS)
//! frame  = code predictor (15 group steps, one CUDA graph per batch bucket)
//! x_r    = codec_sum_r + text_r                             the next input embedding
//! logits, h = Talker decode (a CUDA graph of input-embedding steps)
//! ```
//! so a frame costs one Talker step and 15 code-predictor steps, none of which returns to the
//! host until the frame's 16 codes are copied back. The prompt (projections of the Thinker's
//! states, [`crate::qwen3_omni::talker::TalkerPrompt`]) stays on the host; its input embeddings
//! and per-step text vectors are uploaded.
//!
//! Rows are fixed for the life of a batch ([`CudaTalker::start`]): row `r` of every step is
//! request `r`, with its repetition history and random stream on the device.

mod code_predictor;

use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::{CudaSlice, sys as driver_sys};
use omni_backend::cuda::{C0Rules, ChooseC0, CodeSampling, CudaContext, CudaError, Forced};
use serde_json::Value;

pub use code_predictor::CudaCodePredictor;

use crate::ModelError;
use crate::batch::ForwardBatch;
use crate::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, StepLimits};
use crate::qwen3_omni::config::OmniConfig;
use crate::qwen3_omni::talker::TALKER_RENAMES;
use crate::weights::{SubmodelWeights, WeightSource};

/// transformers' `talker_repetition_penalty` (vLLM-Omni's deploy default too).
pub const DEFAULT_REPETITION_PENALTY: f32 = 1.05;

/// How one request's codes are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TalkerSampling {
    /// Layer 0 (the Talker's codec head).
    pub layer0: CodeSampling,
    /// Groups 1.. (the code predictor's heads).
    pub residual: CodeSampling,
}

impl TalkerSampling {
    /// Argmax everywhere.
    pub fn greedy() -> Self {
        Self {
            layer0: CodeSampling::greedy(),
            residual: CodeSampling::greedy(),
        }
    }

    /// transformers' defaults: layer 0 at temperature 0.9, top-k 50; the code predictor top-k
    /// 50, top-p 0.8 at temperature 1; one stream `seed`.
    pub fn hf_default(seed: u64) -> Self {
        Self {
            layer0: CodeSampling {
                temperature: 0.9,
                top_k: 50,
                top_p: 1.0,
                seed,
            },
            residual: CodeSampling {
                temperature: 1.0,
                top_k: 50,
                top_p: 0.8,
                seed,
            },
        }
    }
}

/// Where one step's GPU time went ([`CudaTalker::step_timed`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// Layer 0's choice and the code predictor's 15 group steps.
    pub code_predictor_ms: f32,
    /// The next input and the Talker's decode step.
    pub talker_ms: f32,
}

/// The Talker on one device: its decoder, the code predictor and the per-row state.
#[derive(Debug)]
pub struct CudaTalker {
    cx: Arc<CudaContext>,
    talker: CudaDecoderModel,
    cp: CudaCodePredictor,
    vocab: usize,
    hidden: usize,
    eos: u32,
    penalty: f32,
    max_rows: usize,
    /// Rows of the running batch.
    rows: usize,
    /// `[max_rows, vocab]`: 1 where the row chose that layer-0 code before.
    seen: CudaSlice<u8>,
    /// `[max_rows * 6]` layer-0 sampling words.
    l0_params: CudaSlice<u32>,
    /// `[max_rows, hidden]` this step's text vectors.
    text: CudaSlice<f32>,
    /// `[max_rows]` frames done per row (layer 0's draw offset; the code predictor keeps its own).
    l0_frame: CudaSlice<i64>,
}

impl CudaTalker {
    /// Loads `talker.*` of a Qwen3-Omni checkpoint (`config` its `config.json`) for batches of
    /// up to `limits.max_seqs` rows; the Talker's KV cache comes with
    /// [`CudaTalker::init_cache`].
    pub fn load(
        cx: Arc<CudaContext>,
        config: &Value,
        ws: &dyn WeightSource,
        init: DeviceWeightInit,
        limits: StepLimits,
    ) -> Result<Self, ModelError> {
        let c = OmniConfig::from_json(config)?;
        let t = &c.talker_config;
        let spec = t.text_config.spec(true)?;
        let (vocab, hidden) = (spec.vocab_size, spec.hidden_size);
        if vocab > omni_backend::cuda::CHOOSE_MAX_VOCAB {
            return Err(ModelError::Config(format!(
                "Talker vocabulary {vocab} exceeds {}",
                omni_backend::cuda::CHOOSE_MAX_VOCAB
            )));
        }
        if t.code_predictor_config.hidden_size != hidden {
            return Err(ModelError::Config(format!(
                "code predictor width {} != the Talker's {hidden}",
                t.code_predictor_config.hidden_size
            )));
        }
        let talker = CudaDecoderModel::load(
            cx.clone(),
            spec,
            &SubmodelWeights::new(ws, "talker.", TALKER_RENAMES),
            init,
            0,
            1,
            None,
            limits,
            &|_, _| {},
        )?;
        let max_rows = limits.max_seqs.max(1);
        let cp = CudaCodePredictor::load(cx.clone(), t, ws, init, max_rows)?;
        let s = cx.stream().clone();
        let words: Vec<u32> = (0..max_rows)
            .flat_map(|_| CodeSampling::greedy().words())
            .collect();
        Ok(Self {
            seen: s.alloc_zeros(max_rows * vocab)?,
            l0_params: s.clone_htod(&words)?,
            text: s.alloc_zeros(max_rows * hidden)?,
            l0_frame: s.alloc_zeros(max_rows)?,
            cx,
            talker,
            cp,
            vocab,
            hidden,
            eos: t.codec_eos_token_id,
            penalty: DEFAULT_REPETITION_PENALTY,
            max_rows,
            rows: 0,
        })
    }

    /// The Talker's decoder (its logits and final-norm state after a forward).
    pub fn talker(&self) -> &CudaDecoderModel {
        &self.talker
    }

    /// The Talker's decoder, e.g. for a prefill whose rows are not one per request (every
    /// position's logits); [`CudaTalker::prefill`] is the one a frame starts from.
    pub fn talker_mut(&mut self) -> &mut CudaDecoderModel {
        &mut self.talker
    }

    /// Codes per frame.
    pub fn groups_total(&self) -> usize {
        self.cp.groups_total()
    }

    /// The Talker's width.
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// Runs the linear layers of steps of at most 8 rows (the Talker's and the code
    /// predictor's) as weight-streaming GEMVs instead of cuBLAS; drops captured graphs
    /// (capture again).
    pub fn set_small_batch_gemv(&mut self, on: bool) {
        self.talker.set_small_batch_gemv(on);
        self.cp.set_small_batch_gemv(on);
    }

    /// See [`CudaDecoderModel::set_fused_small_batch`] (the code predictor's decoder; the
    /// Talker's MoE layers never take the fused path). Drops the frame graphs.
    pub fn set_fused_small_batch(&mut self, on: bool) {
        self.talker.set_fused_small_batch(on);
        self.cp.set_fused_small_batch(on);
    }

    /// Sets the repetition penalty over each row's layer-0 history (1: off).
    pub fn set_repetition_penalty(&mut self, penalty: f32) {
        self.penalty = penalty;
    }

    /// Allocates the Talker's KV cache (drops captured graphs).
    pub fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), ModelError> {
        self.talker.init_cache(num_blocks, block_size)?;
        // The Talker's step buffers may have moved; the frame graphs read them.
        self.cp.clear_graphs();
        Ok(())
    }

    /// Captures, per batch size in `sizes`, the Talker's decode step from input embeddings and
    /// the code predictor's frame. Returns the sizes captured.
    pub fn capture_graphs(&mut self, sizes: &[usize]) -> Result<Vec<usize>, ModelError> {
        let done = self.talker.capture_decode_graphs_embeds(sizes)?;
        let hidden = self.talker.final_norm_buffer();
        let table = self
            .talker
            .embed_table()
            .ok_or_else(|| ModelError::Config("the Talker has no codec embedding".into()))?;
        self.cp.capture(&done, hidden, table)?;
        Ok(done)
    }

    /// Logs per-op GPU time of eager steps (the Talker's and the code predictor's decoder)
    /// every `every` steps of a kind; graphs are off from now on.
    pub fn enable_profiler(&mut self, every: u64) {
        self.talker.enable_profiler_named(every, "talker");
        self.cp.enable_profiler(every);
    }

    /// Starts a batch of `sampling.len()` rows: row `r` is request `r` until the next start
    /// (its repetition history cleared, its random streams at frame 0).
    pub fn start(&mut self, sampling: &[TalkerSampling]) -> Result<(), ModelError> {
        let n = sampling.len();
        if n == 0 || n > self.max_rows {
            return Err(ModelError::Batch(format!(
                "a batch of {n} rows (at most {})",
                self.max_rows
            )));
        }
        let s = self.cx.stream().clone();
        let words: Vec<u32> = sampling.iter().flat_map(|p| p.layer0.words()).collect();
        s.memcpy_htod(&words, &mut self.l0_params.slice_mut(..words.len()))
            .map_err(CudaError::from)?;
        s.memset_zeros(&mut self.seen.slice_mut(..n * self.vocab))
            .map_err(CudaError::from)?;
        s.memset_zeros(&mut self.l0_frame.slice_mut(..n))
            .map_err(CudaError::from)?;
        let residual: Vec<CodeSampling> = sampling.iter().map(|p| p.residual).collect();
        self.cp.start_rows(&residual)?;
        self.rows = n;
        Ok(())
    }

    /// The prompt: one prefill over `embeds` (`[tokens, hidden]`, the prompts of the rows in
    /// row order). `batch.output_rows()` must be each row's last position (the default), so the
    /// next [`CudaTalker::step`] chooses from them. Returns the rows.
    pub fn prefill(&mut self, batch: &ForwardBatch, embeds: &[f32]) -> Result<usize, ModelError> {
        let rows = self.talker.forward_embeds(batch, embeds)?;
        if rows != self.rows {
            return Err(ModelError::Batch(format!(
                "a prefill of {rows} output rows for a batch of {}",
                self.rows
            )));
        }
        Ok(rows)
    }

    /// One frame per row and the Talker's next step: chooses layer 0 from the last logits,
    /// runs the code predictor, feeds `codec_sum + text` (`text` `[rows, hidden]`) to the
    /// Talker at `batch` (one decode token per row, in row order). Returns the frames,
    /// `[rows, groups_total]` (synchronizes). A row whose layer-0 code is the EOS code has
    /// ended: its frame's other codes mean nothing.
    pub fn step(&mut self, batch: &ForwardBatch, text: &[f32]) -> Result<Vec<u32>, ModelError> {
        Ok(self.step_timed(batch, text, false)?.0)
    }

    /// [`CudaTalker::step`] that also returns, when `timed`, the GPU time from the start of the
    /// step to the end of the code predictor's frame and from there to the end of the Talker's
    /// step (ms; the second includes waiting for the host's metadata upload).
    pub fn step_timed(
        &mut self,
        batch: &ForwardBatch,
        text: &[f32],
        timed: bool,
    ) -> Result<(Vec<u32>, Option<StepTimes>), ModelError> {
        self.step_inner(batch, text, timed, false)
    }

    /// A teacher-forced [`CudaTalker::step`]: every row's frame is `forced` (`[rows,
    /// groups_total]`, e.g. a reference's frame; the layer-0 history, the code predictor's
    /// inputs and the next Talker input all follow it) while the device still computes its own
    /// choice of each code, which this returns (`[rows, groups_total]`). The frame runs
    /// eagerly (the frame graphs read no forced codes).
    pub fn step_forced(
        &mut self,
        batch: &ForwardBatch,
        text: &[f32],
        forced: &[u32],
    ) -> Result<Vec<u32>, ModelError> {
        let n = self.rows * self.groups_total();
        if forced.len() != n {
            return Err(ModelError::Batch(format!(
                "{} forced codes for {n} (rows x groups)",
                forced.len()
            )));
        }
        let codes: Vec<i32> = forced
            .iter()
            .map(|&c| i32::try_from(c).unwrap_or(i32::MAX))
            .collect();
        self.cx
            .stream()
            .memcpy_htod(&codes, &mut self.cp.forced.slice_mut(..n))
            .map_err(CudaError::from)?;
        self.step_inner(batch, text, false, true)?;
        let mut host = vec![0i32; n];
        self.cx
            .stream()
            .memcpy_dtoh(&self.cp.chosen.slice(..n), &mut host)
            .map_err(CudaError::from)?;
        Ok(host.into_iter().map(|c| c.max(0) as u32).collect())
    }

    fn step_inner(
        &mut self,
        batch: &ForwardBatch,
        text: &[f32],
        timed: bool,
        forced: bool,
    ) -> Result<(Vec<u32>, Option<StepTimes>), ModelError> {
        let (r, h) = (self.rows, self.hidden);
        if r == 0 || batch.input_ids.len() != r || text.len() != r * h {
            return Err(ModelError::Batch(format!(
                "a step of {} tokens and {} text values for {r} rows of width {h}",
                batch.input_ids.len(),
                text.len()
            )));
        }
        let s = self.cx.stream().clone();
        let cx = self.cx.clone();
        let event = || -> Result<_, ModelError> {
            let e = cx
                .raw()
                .new_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            e.record(&s)?;
            Ok(e)
        };
        let e0 = timed.then(event).transpose()?;
        self.choose_and_predict(forced)?;
        let e1 = timed.then(event).transpose()?;
        s.memcpy_htod(text, &mut self.text.slice_mut(..r * h))
            .map_err(CudaError::from)?;
        cx.codec_input_bf16(
            self.talker.input_embeds_mut(),
            &self.cp.codec_sum,
            &self.text,
            r * h,
        )?;
        self.talker.forward_device_embeds(batch)?;
        let e2 = timed.then(event).transpose()?;
        let codes = self.codes_to_host(r)?;
        let times = match (e0, e1, e2) {
            (Some(a), Some(b), Some(c)) => Some(StepTimes {
                code_predictor_ms: a.elapsed_ms(&b)?,
                talker_ms: b.elapsed_ms(&c)?,
            }),
            _ => None,
        };
        Ok((codes, times))
    }

    /// For a serving stage that chooses layer 0 on the host and whose rows change request
    /// between steps: completes one frame for rows `0..c0.len()` of the Talker's last forward
    /// (its output rows, in order) from their layer-0 codes, each row with its code-predictor
    /// `sampling` and draw offset `frames`. Returns the frames `[rows, groups_total]` (layer 0
    /// first) and the sums of their codec embeddings `[rows, hidden]` f32 (synchronizes).
    pub fn predict_frames(
        &mut self,
        c0: &[u32],
        sampling: &[CodeSampling],
        frames: &[u64],
    ) -> Result<(Vec<u32>, Vec<f32>), ModelError> {
        let (n, h) = (c0.len(), self.hidden);
        if n == 0 || n > self.max_rows || sampling.len() != n {
            return Err(ModelError::Batch(format!(
                "a frame of {n} rows with {} samplings (at most {} rows)",
                sampling.len(),
                self.max_rows
            )));
        }
        self.cp.set_rows(sampling, frames)?;
        let codes: Vec<i32> = c0
            .iter()
            .map(|&c| i32::try_from(c).unwrap_or(i32::MAX))
            .collect();
        let s = self.cx.stream().clone();
        s.memcpy_htod(&codes, &mut self.cp.c0.slice_mut(..n))
            .map_err(CudaError::from)?;
        let table = self
            .talker
            .embed_table()
            .ok_or_else(|| ModelError::Config("the Talker has no codec embedding".into()))?;
        self.cp
            .run_frame(n, self.talker.final_norm_buffer(), table, false)?;
        let mut frames = self.codes_to_host(n)?;
        let g = self.groups_total();
        for (r, &c) in c0.iter().enumerate() {
            frames[r * g] = c;
        }
        let mut sums = vec![0f32; n * h];
        s.memcpy_dtoh(&self.cp.codec_sum.slice(..n * h), &mut sums)
            .map_err(CudaError::from)?;
        Ok((frames, sums))
    }

    /// Captures the code predictor's frame graph for each size in `sizes` (for
    /// [`CudaTalker::predict_frames`]; the Talker's own steps then run eagerly or from the
    /// decoder's graphs). Returns the sizes captured.
    pub fn capture_frame_graphs(&mut self, sizes: &[usize]) -> Result<Vec<usize>, ModelError> {
        let table = self
            .talker
            .embed_table()
            .ok_or_else(|| ModelError::Config("the Talker has no codec embedding".into()))?;
        self.cp
            .capture(sizes, self.talker.final_norm_buffer(), table)
    }

    /// The last frame's codes of rows `0..rows` (synchronizes).
    fn codes_to_host(&self, rows: usize) -> Result<Vec<u32>, ModelError> {
        let n = rows * self.groups_total();
        let mut host = vec![0i32; n];
        self.cx
            .stream()
            .memcpy_dtoh(&self.cp.codes.slice(..n), &mut host)
            .map_err(CudaError::from)?;
        Ok(host.into_iter().map(|c| c.max(0) as u32).collect())
    }

    /// Layer 0 from the Talker's last logits, then the code predictor (asynchronous); `forced`:
    /// teacher-forced by `cp.forced`.
    fn choose_and_predict(&mut self, forced: bool) -> Result<(), ModelError> {
        let r = self.rows;
        let groups_total = self.groups_total();
        self.cx.talker_choose_c0(
            C0Rules {
                rows: r,
                vocab: self.vocab,
                penalty: self.penalty,
                eos: self.eos,
                suppress_from: self.vocab.saturating_sub(1024),
                groups_total,
            },
            ChooseC0 {
                logits: self.talker.logits_buffer(),
                seen: &mut self.seen,
                params: &self.l0_params,
                frame: &mut self.l0_frame,
                c0: &mut self.cp.c0,
                codes: &mut self.cp.codes,
                forced: forced.then_some(Forced {
                    codes: &self.cp.forced,
                    chosen: &mut self.cp.chosen,
                }),
            },
        )?;
        let table = self
            .talker
            .embed_table()
            .ok_or_else(|| ModelError::Config("the Talker has no codec embedding".into()))?;
        self.cp
            .run_frame(r, self.talker.final_norm_buffer(), table, forced)?;
        Ok(())
    }
}
