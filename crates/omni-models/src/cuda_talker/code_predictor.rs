//! The code predictor on the device: one frame (15 group steps) for a batch of rows as one
//! launch sequence that reads nothing from the host, captured in one CUDA graph per batch-size
//! bucket.
//!
//! ```text
//! cp_begin:      in = [h_r, E0(c0_r)] per row; codec_sum_r = E0(c0_r); step-1 metadata
//! for g in 1..=15:
//!   decoder step (tokens 2R at g = 1, then R; positions 0..g, row r in KV block r)
//!   logits = final_norm[rows] head[g-1]^T                   f32 [R, 2048]
//!   cp_choose:   c_g = argmax / top-k-top-p; codec_sum_r += E_g(c_g); in_r = E_g(c_g);
//!                step g+1 metadata (after the last group: frame counter + 1)
//! ```
//! Every step of every frame has the same host shape, so one graph per padded batch size
//! replays a whole frame; padding rows compute on whatever their inputs hold and are ignored.

use std::collections::BTreeMap;
use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::{CudaGraph, CudaSlice, sys as driver_sys};
use omni_backend::cuda::{CodeSampling, CpMetadata, CpShape, CudaContext, CudaError, Forced, bf16};

use crate::ModelError;
use crate::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, StepLimits, StepShape};
use crate::decoder::load_shaped;
use crate::qwen3_omni::config::TalkerConfig;
use crate::weights::{SubmodelWeights, WeightSource};

/// A captured frame (cudarc's graph has no `Debug`).
pub(super) struct FrameGraph(pub(super) CudaGraph);

// SAFETY: a graph exec is a driver handle with no thread affinity: it may be launched from any
// thread whose current context is the graph's (cudarc binds the context before launching). The
// owner is stepped by one thread at a time (`&mut self`).
unsafe impl Send for FrameGraph {}

impl std::fmt::Debug for FrameGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameGraph")
    }
}

/// The code predictor of a CUDA Talker, with its per-row frame state.
#[derive(Debug)]
pub struct CudaCodePredictor {
    cx: Arc<CudaContext>,
    decoder: CudaDecoderModel,
    /// `[groups, vocab, hidden]`: the codec embedding tables.
    embeds: CudaSlice<bf16>,
    /// `[groups, vocab, hidden]`: the heads.
    heads: CudaSlice<bf16>,
    /// Codes per frame (layer 0 and the predicted groups).
    groups_total: usize,
    vocab: usize,
    hidden: usize,
    max_rows: usize,
    logits: CudaSlice<f32>,
    params: CudaSlice<u32>,
    frame: CudaSlice<i64>,
    /// `[max_rows]` each row's layer-0 code (written by the Talker's choice).
    pub(super) c0: CudaSlice<i32>,
    /// `[max_rows, groups_total]` the last frame.
    pub(super) codes: CudaSlice<i32>,
    /// `[max_rows, hidden]` f32: the sum of the last frame's codec embeddings.
    pub(super) codec_sum: CudaSlice<f32>,
    /// `[max_rows, groups_total]` teacher-forced codes (read by forced frames only).
    pub(super) forced: CudaSlice<i32>,
    /// `[max_rows, groups_total]` the choices of the last forced frame.
    pub(super) chosen: CudaSlice<i32>,
    graphs: BTreeMap<usize, FrameGraph>,
}

impl CudaCodePredictor {
    /// Loads it (`talker.code_predictor.*`) for frames of up to `max_rows` rows.
    pub fn load(
        cx: Arc<CudaContext>,
        t: &TalkerConfig,
        ws: &dyn WeightSource,
        init: DeviceWeightInit,
        max_rows: usize,
    ) -> Result<Self, ModelError> {
        let c = &t.code_predictor_config;
        let spec = c.spec(false)?;
        let groups_total = t.num_code_groups;
        if groups_total < 2 {
            return Err(ModelError::Config(format!(
                "num_code_groups {groups_total}: nothing to predict"
            )));
        }
        let (v, h) = (c.vocab_size, c.hidden_size);
        if v > omni_backend::cuda::CHOOSE_MAX_VOCAB {
            return Err(ModelError::Config(format!(
                "code predictor vocabulary {v} exceeds {}",
                omni_backend::cuda::CHOOSE_MAX_VOCAB
            )));
        }
        let block = groups_total;
        let limits = StepLimits {
            max_tokens: 2 * max_rows,
            max_seqs: max_rows,
            max_model_len: groups_total,
            block_size: block,
        };
        let mut decoder = CudaDecoderModel::load(
            cx.clone(),
            spec,
            &SubmodelWeights::new(ws, "talker.code_predictor.", &[]),
            init,
            0,
            1,
            None,
            limits,
            &|_, _| {},
        )?;
        decoder.init_cache(max_rows, block)?;
        let groups = groups_total - 1;
        let (embeds, heads) = match init {
            DeviceWeightInit::Host => {
                let mut e = Vec::with_capacity(groups * v * h);
                let mut w = Vec::with_capacity(groups * v * h);
                for g in 0..groups {
                    let name = format!("talker.code_predictor.model.codec_embedding.{g}.weight");
                    e.extend(
                        load_shaped(ws, &name, &[v, h])?
                            .data
                            .iter()
                            .map(|&x| bf16::from_f32(x)),
                    );
                    let name = format!("talker.code_predictor.lm_head.{g}.weight");
                    w.extend(
                        load_shaped(ws, &name, &[v, h])?
                            .data
                            .iter()
                            .map(|&x| bf16::from_f32(x)),
                    );
                }
                (cx.upload_bf16_pinned(&e)?, cx.upload_bf16_pinned(&w)?)
            }
            DeviceWeightInit::Dummy { seed } => {
                let mut e = cx.zeros_bf16(groups * v * h)?;
                cx.fill_uniform_bf16(&mut e, seed ^ 0xC0DE_0001, -0.02, 0.02)?;
                let mut w = cx.zeros_bf16(groups * v * h)?;
                cx.fill_uniform_bf16(&mut w, seed ^ 0xC0DE_0002, -0.02, 0.02)?;
                (e, w)
            }
        };
        let s = cx.stream().clone();
        let n = max_rows.max(1);
        let params: Vec<u32> = (0..n)
            .flat_map(|_| CodeSampling::greedy().words())
            .collect();
        let me = Self {
            logits: s.alloc_zeros(n * v)?,
            params: s.clone_htod(&params)?,
            frame: s.alloc_zeros(n)?,
            c0: s.alloc_zeros(n)?,
            codes: s.alloc_zeros(n * groups_total)?,
            codec_sum: s.alloc_zeros(n * h)?,
            forced: s.alloc_zeros(n * groups_total)?,
            chosen: s.alloc_zeros(n * groups_total)?,
            cx,
            decoder,
            embeds,
            heads,
            groups_total,
            vocab: v,
            hidden: h,
            max_rows,
            graphs: BTreeMap::new(),
        };
        me.cx.synchronize()?;
        Ok(me)
    }

    /// Codes per frame.
    pub fn groups_total(&self) -> usize {
        self.groups_total
    }

    /// Codes per predicted group.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Sets rows `0..sampling.len()`'s sampling and restarts their frame counters (the draws'
    /// offsets).
    pub fn start_rows(&mut self, sampling: &[CodeSampling]) -> Result<(), ModelError> {
        if sampling.len() > self.max_rows {
            return Err(ModelError::Batch(format!(
                "{} rows exceed the code predictor's {}",
                sampling.len(),
                self.max_rows
            )));
        }
        let words: Vec<u32> = sampling.iter().flat_map(|p| p.words()).collect();
        let s = self.cx.stream().clone();
        s.memcpy_htod(&words, &mut self.params.slice_mut(..words.len()))
            .map_err(CudaError::from)?;
        let zeros = vec![0i64; sampling.len()];
        s.memcpy_htod(&zeros, &mut self.frame.slice_mut(..zeros.len()))
            .map_err(CudaError::from)?;
        Ok(())
    }

    /// Sets rows `0..sampling.len()`'s sampling and their frame counters (the draws' offsets)
    /// to `frames`: a serving stage whose batch rows change request from step to step.
    pub fn set_rows(
        &mut self,
        sampling: &[CodeSampling],
        frames: &[u64],
    ) -> Result<(), ModelError> {
        if sampling.len() > self.max_rows || frames.len() != sampling.len() {
            return Err(ModelError::Batch(format!(
                "{} rows and {} frame counters (at most {} rows)",
                sampling.len(),
                frames.len(),
                self.max_rows
            )));
        }
        let words: Vec<u32> = sampling.iter().flat_map(|p| p.words()).collect();
        let s = self.cx.stream().clone();
        s.memcpy_htod(&words, &mut self.params.slice_mut(..words.len()))
            .map_err(CudaError::from)?;
        let counters: Vec<i64> = frames
            .iter()
            .map(|&f| i64::try_from(f).unwrap_or(i64::MAX))
            .collect();
        s.memcpy_htod(&counters, &mut self.frame.slice_mut(..counters.len()))
            .map_err(CudaError::from)?;
        Ok(())
    }

    /// Queues one frame for `rows` rows (no host work: capturable). `hidden` is the Talker's
    /// final-norm buffer (rows `0..rows` the states that chose `c0`), `talker_embed` its codec
    /// embedding table. `forced`: every group continues with `self.forced`'s code and records
    /// its own choice in `self.chosen`.
    fn queue_frame(
        &mut self,
        rows: usize,
        hidden: &CudaSlice<bf16>,
        talker_embed: &CudaSlice<bf16>,
        forced: bool,
    ) -> Result<(), ModelError> {
        let (h, v) = (self.hidden, self.vocab);
        let limits = self.decoder.limits();
        let shape = CpShape {
            rows,
            dim: h,
            groups_total: self.groups_total,
            vocab: v,
            block_size: limits.block_size,
            max_blocks_per_seq: limits.max_blocks_per_seq(),
        };
        let cx = self.cx.clone();
        {
            let (inp, cp_in) = self.decoder.device_inputs();
            cx.cp_begin(
                shape,
                hidden,
                &self.c0,
                talker_embed,
                cp_in,
                &mut self.codec_sum,
                &mut self.codes,
                CpMetadata {
                    positions: &mut inp.positions,
                    slots: &mut inp.slots,
                    query_start_loc: &mut inp.query_start_loc,
                    seq_lens: &mut inp.seq_lens,
                    block_tables: &mut inp.block_tables,
                    out_rows: &mut inp.logits_rows,
                },
            )?;
        }
        for g in 1..self.groups_total {
            let first = g == 1;
            self.decoder.queue_step(StepShape {
                tokens: if first { 2 * rows } else { rows },
                seqs: rows,
                rows,
                max_query_len: if first { 2 } else { 1 },
                max_seq_len: g + 1,
                embeds: true,
                mrope: false,
            })?;
            let head = self.heads.slice((g - 1) * v * h..g * v * h);
            let mut logits = self.logits.slice_mut(..rows * v);
            let x = self.decoder.final_norm_buffer().slice(..rows * h);
            if self.decoder.small_batch_gemv() && CudaContext::gemv_fits(rows, h) {
                cx.gemv_nt_bf16_f32(&x, &head, &mut logits, rows, h, v)?;
            } else {
                cx.matmul_nt_bf16_f32(&x, &head, &mut logits, rows, h, v)?;
            }
            let (inp, cp_in) = self.decoder.device_inputs();
            cx.cp_choose(
                shape,
                g,
                &self.logits,
                &self.params,
                &mut self.frame,
                &self.embeds,
                cp_in,
                &mut self.codec_sum,
                &mut self.codes,
                CpMetadata {
                    positions: &mut inp.positions,
                    slots: &mut inp.slots,
                    query_start_loc: &mut inp.query_start_loc,
                    seq_lens: &mut inp.seq_lens,
                    block_tables: &mut inp.block_tables,
                    out_rows: &mut inp.logits_rows,
                },
                forced.then_some(Forced {
                    codes: &self.forced,
                    chosen: &mut self.chosen,
                }),
            )?;
        }
        Ok(())
    }

    /// Runs one frame for rows `0..rows`: replays the graph of the smallest captured size that
    /// holds them, or queues the frame eagerly. Asynchronous: `codes` / `codec_sum` are ready in
    /// stream order. A `forced` frame (see [`Self::queue_frame`]) always runs eagerly.
    pub(super) fn run_frame(
        &mut self,
        rows: usize,
        hidden: &CudaSlice<bf16>,
        talker_embed: &CudaSlice<bf16>,
        forced: bool,
    ) -> Result<(), ModelError> {
        if rows == 0 || rows > self.max_rows {
            return Err(ModelError::Batch(format!(
                "a frame of {rows} rows (at most {})",
                self.max_rows
            )));
        }
        if !forced && let Some((_, g)) = self.graphs.range(rows..).next() {
            g.0.launch().map_err(CudaError::from)?;
            return Ok(());
        }
        self.queue_frame(rows, hidden, talker_embed, forced)
    }

    /// Captures a frame graph for each size in `sizes` (at most `max_rows`), bound to `hidden`
    /// and `talker_embed` (the Talker's buffers, which must stay put: recapture after the
    /// Talker's step buffers change). Each size runs once eagerly first.
    pub(super) fn capture(
        &mut self,
        sizes: &[usize],
        hidden: &CudaSlice<bf16>,
        talker_embed: &CudaSlice<bf16>,
    ) -> Result<Vec<usize>, ModelError> {
        self.graphs.clear();
        let mut done = Vec::new();
        for &g in sizes {
            if g == 0 || g > self.max_rows {
                continue;
            }
            // The eager run advances the frame counters of rows 0..g; keep them.
            let mut saved = vec![0i64; g];
            let s = self.cx.stream().clone();
            s.memcpy_dtoh(&self.frame.slice(..g), &mut saved)
                .map_err(CudaError::from)?;
            self.queue_frame(g, hidden, talker_embed, false)?;
            self.cx.synchronize()?;
            s.begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(CudaError::from)?;
            let run = self.queue_frame(g, hidden, talker_embed, false);
            let graph = s
                .end_capture(driver_sys::CUgraphInstantiate_flags(0))
                .map_err(CudaError::from)?;
            run?;
            let graph = graph.ok_or_else(|| {
                ModelError::Device(format!("capturing the frame graph of {g} gave no graph"))
            })?;
            graph.upload().map_err(CudaError::from)?;
            self.graphs.insert(g, FrameGraph(graph));
            s.memcpy_htod(&saved, &mut self.frame.slice_mut(..g))
                .map_err(CudaError::from)?;
            done.push(g);
        }
        self.cx.synchronize()?;
        Ok(done)
    }

    /// See [`CudaDecoderModel::set_small_batch_gemv`] (drops the frame graphs).
    pub fn set_small_batch_gemv(&mut self, on: bool) {
        self.decoder.set_small_batch_gemv(on);
        self.graphs.clear();
    }

    /// See [`CudaDecoderModel::set_fused_small_batch`] (drops the frame graphs).
    pub fn set_fused_small_batch(&mut self, on: bool) {
        self.decoder.set_fused_small_batch(on);
        self.graphs.clear();
    }

    /// Drops the frame graphs (the buffers they read moved).
    pub(super) fn clear_graphs(&mut self) {
        self.graphs.clear();
    }

    /// Per-op timing of eager frames (graphs are not replayed while it is on).
    pub fn enable_profiler(&mut self, every: u64) {
        self.decoder.enable_profiler_named(every, "code predictor");
        if every > 0 {
            self.graphs.clear();
        }
    }
}
