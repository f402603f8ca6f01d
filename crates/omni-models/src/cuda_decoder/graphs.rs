//! CUDA graphs of decode steps: capture per padded batch size, and the padded inputs a replay
//! reads.

use omni_backend::cuda::CudaError;
use omni_backend::cuda::cudarc::driver::{CudaGraph, sys as driver_sys};

use super::{CudaDecoderModel, StepShape};
use crate::ModelError;

impl CudaDecoderModel {
    /// Captures decode graphs for each batch size in `sizes` that fits the limits (each is
    /// first run once eagerly, so kernels are loaded and cuBLAS has chosen its algorithms).
    /// Returns the sizes captured.
    pub fn capture_decode_graphs(&mut self, sizes: &[usize]) -> Result<Vec<usize>, ModelError> {
        self.capture(sizes, false)
    }

    /// [`CudaDecoderModel::capture_decode_graphs`] for steps that start from the input-embedding
    /// buffer ([`CudaDecoderModel::forward_device_embeds`] replays them).
    pub fn capture_decode_graphs_embeds(
        &mut self,
        sizes: &[usize],
    ) -> Result<Vec<usize>, ModelError> {
        self.capture(sizes, true)
    }

    fn capture(&mut self, sizes: &[usize], embeds: bool) -> Result<Vec<usize>, ModelError> {
        if !embeds && !self.spec.embed_and_head {
            return Err(ModelError::Batch(format!(
                "{} takes input embeddings only",
                self.spec.architecture
            )));
        }
        if self.kv.is_empty() {
            return Err(ModelError::Batch("capture before init_cache".into()));
        }
        let mut done = Vec::new();
        for &g in sizes {
            if g == 0 || g > self.limits.max_seqs || g > self.limits.max_tokens {
                continue;
            }
            let shape = self.pad_decode_inputs(g, &[], embeds)?;
            self.run_kernels(shape)?;
            self.cx.synchronize()?;
            let stream = self.cx.stream().clone();
            stream
                .begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(CudaError::from)?;
            let run = self.run_kernels(shape);
            let graph = stream
                .end_capture(driver_sys::CUgraphInstantiate_flags(0))
                .map_err(CudaError::from)?;
            run?;
            let graph = graph.ok_or_else(|| {
                ModelError::Device(format!("capturing the decode graph of {g} gave no graph"))
            })?;
            graph.upload().map_err(CudaError::from)?;
            if embeds {
                self.embed_graphs.insert(g, DecodeGraph(graph));
            } else {
                self.graphs.insert(g, DecodeGraph(graph));
            }
            done.push(g);
        }
        self.cx.synchronize()?;
        Ok(done)
    }

    /// Batch sizes with a captured decode graph: of token-id input, or of input embeddings when
    /// only those were captured.
    pub fn graph_sizes(&self) -> Vec<usize> {
        if self.graphs.is_empty() {
            self.embed_graphs.keys().copied().collect()
        } else {
            self.graphs.keys().copied().collect()
        }
    }

    /// Uploads a decode batch padded to `g` sequences (one token each): the real sequences
    /// first (`real`: (token id, position, slot, seq_len, block table) each), then padding rows
    /// that write no cache slot and read one token of block 0.
    pub(super) fn pad_decode_inputs(
        &mut self,
        g: usize,
        real: &[DecodeRow<'_>],
        embeds: bool,
    ) -> Result<StepShape, ModelError> {
        let mbps = self.limits.max_blocks_per_seq();
        let mut ids = vec![0i32; g];
        let mut pos = vec![0i32; g];
        let mut slots = vec![-1i64; g];
        let qsl: Vec<i32> = (0..=g as i32).collect();
        let mut seq_lens = vec![1i32; g];
        let mut tables = vec![0i32; g * mbps];
        let mut max_seq = 1;
        for (i, r) in real.iter().enumerate() {
            ids[i] = r.token as i32;
            pos[i] = r.position as i32;
            slots[i] = r.slot;
            seq_lens[i] = r.seq_len as i32;
            max_seq = max_seq.max(r.seq_len);
            for (j, &b) in r.block_table.iter().take(mbps).enumerate() {
                tables[i * mbps + j] = b as i32;
            }
        }
        let rows: Vec<i32> = (0..g as i32).collect();
        self.upload_inputs(&ids, &pos, &slots, &qsl, &seq_lens, &tables, &rows)?;
        Ok(StepShape {
            tokens: g,
            seqs: g,
            rows: g,
            max_query_len: 1,
            max_seq_len: if real.is_empty() {
                self.limits.max_model_len
            } else {
                max_seq
            },
            embeds,
            mrope: false,
        })
    }
}

/// A captured decode step (cudarc's graph has no `Debug`).
pub(super) struct DecodeGraph(pub(super) CudaGraph);

// SAFETY: a graph exec is a driver handle with no thread affinity: it may be launched from any
// thread whose current context is the graph's (cudarc binds the context before launching). The
// model owning it is stepped by one thread at a time (`&mut self`).
unsafe impl Send for DecodeGraph {}

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DecodeGraph")
    }
}

/// One real sequence of a padded decode batch.
#[derive(Debug, Clone, Copy)]
pub(super) struct DecodeRow<'a> {
    pub(super) token: u32,
    pub(super) position: usize,
    pub(super) slot: i64,
    pub(super) seq_len: usize,
    pub(super) block_table: &'a [u32],
}
