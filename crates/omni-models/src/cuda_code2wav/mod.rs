//! Qwen3-Omni's Code2Wav on one CUDA device (feature `cuda`): codec codes `[16, T]` to a 24 kHz
//! waveform of `1920 * T - 555` samples, batched across requests, with CUDA graphs per
//! (batch, frame bucket). bf16 weights and activations, f32 accumulation, f32 norms and
//! per-channel vectors; the CPU twin is [`crate::qwen3_omni::code2wav::Code2Wav`] (same weight
//! names, same results within bf16 rounding).
//!
//! One decode of `B` sequences of `T` frames (`[B, len, channels]` time-major throughout, kernels
//! in `omni_backend::cuda::audio`):
//! ```text
//! h = mean_q E[code + 2048 q]                                   f32 residual stream
//! per layer: x = rms_norm(h += s_mlp * t); qkv = x Wqkv^T; rope; window attention (72)
//!            t = attn Wo^T; x = rms_norm(h += s_attn * t); t = down(silu(x Wg) * x Wu)
//! x = rms_norm(h += s_mlp * t)                                 bf16 from here on
//! 2 x upsample: z = x Wup^T; x = col2im(z) + b; y = LN(dwconv(x)); x += g * (gelu(y W1 + b1) W2 + b2)
//! x = im2col(x) Win^T + b                                       decoder conv, 1024 -> 1536
//! 4 x block: z = snake(x) Wt^T; x = col2im(z) + b               transposed conv, trim k - s
//!            3 x unit: y = im2col(snake(x)) W1^T; y = snake(y + b1); x += b2; x += y W2^T
//! wav = clamp(conv7(snake(x)), -1, 1)                           f32
//! ```
//! Every convolution is causal and attention is causal, so a batch zero-padded to its longest
//! request (or to a graph's frame bucket, [`FRAME_BUCKETS`]) gives each request the samples of
//! its own decode, and each waveform is cut to `num_samples(T_i)`.
//!
//! Buffers are allocated once for `max_batch_frames` (`B * T_bucket` at most); every launch
//! depends only on `(B, T)` and those buffers, so `(B, T)` is captured once as a CUDA graph
//! (lazily, on first use) and replayed with new codes copied into the codes buffer.

mod forward;
mod weights;

use std::collections::HashMap;
use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::{
    CudaEvent, CudaGraph, CudaSlice, PinnedHostSlice, sys as driver_sys,
};
use omni_backend::cuda::{CudaContext, CudaError, bf16};
use omni_backend::rope::{Rope, RopeScaling};
use serde_json::Value;

use crate::ModelError;
use crate::qwen3_omni::code2wav::config::{CONV_KERNEL, CONVNEXT_EXPANSION};
use crate::qwen3_omni::code2wav::{Code2WavConfig, window_trim};
use crate::weights::WeightSource;
use forward::mark;
use weights::DWeights;

/// vLLM-Omni's CUDA-graph frame buckets for Code2Wav (`compute_capture_sizes` with 25-frame
/// chunks, 25 frames of left context and 300-frame non-streaming chunks): a window of `n`
/// frames replays the smallest bucket `>= n`. Longer windows run eagerly at their own length.
pub const FRAME_BUCKETS: [usize; 11] = [2, 4, 8, 16, 25, 32, 50, 64, 128, 256, 325];

/// GPU time of one op kind in [`CudaCode2Wav::profile`].
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The op (`"decoder block 3: conv k7 GEMM"`, ...).
    pub label: String,
    /// Milliseconds per decode (summed over the op's launches).
    pub ms: f64,
    /// Floating-point operations per decode (GEMMs and convolutions; 0 for the others).
    pub flops: f64,
}

struct Graph(CudaGraph);

// SAFETY: a graph exec is a driver handle with no thread affinity: it may be launched from any
// thread whose current context is the graph's (cudarc binds the context before launching). The
// model owning it is used by one thread at a time (`&mut self`).
unsafe impl Send for Graph {}

/// The activation buffers, sized for `cap` batch-frames.
struct Buffers {
    cap: usize,
    /// `[B, nq, T]` codes.
    codes: CudaSlice<i32>,
    /// Pre-transformer: f32 residual and sub-block output, bf16 normed rows, qkv, attention,
    /// gate-up and SiLU-mul.
    h: CudaSlice<f32>,
    t: CudaSlice<f32>,
    xn: CudaSlice<bf16>,
    qkv: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    /// `[positions, head_dim]` RoPE `[cos | sin]` for positions `0..cap`.
    cos_sin: CudaSlice<f32>,
    /// Conv stack: two activation buffers and the scratch (im2col columns, transposed-conv
    /// taps, ConvNeXt's wide rows).
    a: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    s: CudaSlice<bf16>,
    /// `[B, num_samples(T)]` f32.
    wav: CudaSlice<f32>,
    /// Page-locked copy of `wav` for the download.
    wav_host: PinnedHostSlice<f32>,
}

/// Code2Wav on the device. See the module doc.
pub struct CudaCode2Wav {
    cx: Arc<CudaContext>,
    config: Code2WavConfig,
    w: DWeights,
    buf: Buffers,
    graphs: HashMap<(usize, usize), Graph>,
    use_graphs: bool,
    /// `Some` while [`CudaCode2Wav::profile`] runs: an event after every op.
    marks: Option<Vec<(String, f64, CudaEvent)>>,
}

impl std::fmt::Debug for CudaCode2Wav {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCode2Wav")
            .field("max_batch_frames", &self.buf.cap)
            .field("graphs", &self.graphs.len())
            .finish_non_exhaustive()
    }
}

/// Elements per frame of the conv stack's activation buffers and of its scratch (upper bounds:
/// every length taken as `T * (upsampling so far)`).
fn per_frame_sizes(c: &Code2WavConfig) -> (usize, usize) {
    let h = c.hidden_size;
    let (mut act, mut scratch) = (h, 0usize);
    let mut len = 1usize;
    for &f in &c.upsampling_ratios {
        scratch = scratch.max(len * f * h);
        len *= f;
        act = act.max(len * h);
        scratch = scratch.max(len * CONVNEXT_EXPANSION * h);
    }
    scratch = scratch.max(len * CONV_KERNEL * h);
    act = act.max(len * c.decoder_dim);
    for (b, &r) in c.upsample_rates.iter().enumerate() {
        let (cin, cout) = c.block_channels(b);
        act = act.max(len * cin);
        scratch = scratch.max(len * 2 * r * cout);
        len *= r;
        act = act.max(len * cout);
        scratch = scratch.max(len * CONV_KERNEL * cout);
    }
    (act, scratch)
}

/// `2 * m * k * n`.
fn gemm_flops(m: usize, k: usize, n: usize) -> f64 {
    2.0 * m as f64 * k as f64 * n as f64
}

impl CudaCode2Wav {
    /// Loads Code2Wav from the whole `config.json` (its `code2wav_config`) and a source of the
    /// checkpoint's `code2wav.*` tensors, with buffers for batches of up to `max_batch_frames`
    /// frames in all (`B * T_bucket`). Graphs are on.
    pub fn load(
        cx: Arc<CudaContext>,
        config: &Value,
        ws: &dyn WeightSource,
        max_batch_frames: usize,
    ) -> Result<Self, ModelError> {
        let config = Code2WavConfig::from_model_config(config)?;
        if max_batch_frames == 0 {
            return Err(ModelError::Config("max_batch_frames is 0".into()));
        }
        let w = DWeights::load(&cx, &config, ws)?;
        let buf = Self::buffers(&cx, &config, max_batch_frames)?;
        Ok(Self {
            cx,
            config,
            w,
            buf,
            graphs: HashMap::new(),
            use_graphs: true,
            marks: None,
        })
    }

    fn buffers(cx: &CudaContext, c: &Code2WavConfig, cap: usize) -> Result<Buffers, ModelError> {
        let s = cx.stream();
        let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim());
        let qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd;
        let (act, scratch) = per_frame_sizes(c);
        let spf = c.samples_per_frame();
        let zb = |n: usize| cx.zeros_bf16(n);
        let zf = |n: usize| s.alloc_zeros::<f32>(n).map_err(CudaError::from);
        let rope = Rope::new(hd, c.rope_theta()?, &RopeScaling::None)?;
        let positions: Vec<usize> = (0..cap).collect();
        let mut cs = Vec::new();
        rope.cos_sin(&positions, &mut cs);
        // SAFETY: flags 0 = plain page-locked memory (read by the host after each download).
        let wav_host = unsafe { cx.raw().alloc_pinned_with_flags::<f32>(cap * spf, 0) }
            .map_err(CudaError::from)?;
        Ok(Buffers {
            cap,
            codes: s
                .alloc_zeros::<i32>(cap * c.num_quantizers)
                .map_err(CudaError::from)?,
            h: zf(cap * h)?,
            t: zf(cap * h)?,
            xn: zb(cap * h)?,
            qkv: zb(cap * qkv)?,
            attn: zb(cap * c.num_attention_heads * hd)?,
            gu: zb(cap * 2 * i)?,
            act: zb(cap * i)?,
            cos_sin: s.clone_htod(&cs).map_err(CudaError::from)?,
            a: zb(cap * act)?,
            b: zb(cap * act)?,
            s: zb(cap * scratch)?,
            wav: zf(cap * spf)?,
            wav_host,
        })
    }

    /// The parsed `code2wav_config`.
    pub fn config(&self) -> &Code2WavConfig {
        &self.config
    }

    /// The largest `B * T_bucket` one run holds.
    pub fn max_batch_frames(&self) -> usize {
        self.buf.cap
    }

    /// Bytes of device memory the activation buffers hold.
    pub fn buffer_bytes(&self) -> usize {
        let b = &self.buf;
        4 * (b.h.len() + b.t.len() + b.cos_sin.len() + b.wav.len() + b.codes.len())
            + 2 * (b.xn.len()
                + b.qkv.len()
                + b.attn.len()
                + b.gu.len()
                + b.act.len()
                + b.a.len()
                + b.b.len()
                + b.s.len())
    }

    /// Turns CUDA graphs on (the default) or off (every decode runs eagerly at the batch's
    /// longest length).
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
    }

    /// The `(batch, frames)` shapes captured so far.
    pub fn graph_shapes(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<_> = self.graphs.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Decodes one request's codes `[num_quantizers, T]` (codebook-major) to its
    /// `num_samples(T)` samples.
    pub fn decode(&mut self, codes: &[u32], frames: usize) -> Result<Vec<f32>, ModelError> {
        let mut out = self.decode_batch(&[(codes, frames)])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One streaming window of `frames` frames whose first `left_context` were already emitted:
    /// only its new audio, trimmed as vLLM-Omni's `chunked_decode_streaming` (and the CPU
    /// `Code2Wav::decode_window`) does.
    pub fn decode_window(
        &mut self,
        codes: &[u32],
        frames: usize,
        left_context: usize,
    ) -> Result<Vec<f32>, ModelError> {
        if left_context > frames {
            return Err(ModelError::Batch(format!(
                "left context of {left_context} frames in a window of {frames}"
            )));
        }
        let wav = self.decode(codes, frames)?;
        Ok(window_trim(
            wav,
            frames,
            left_context,
            self.config.samples_per_frame(),
        ))
    }

    /// Several streaming windows `(codes, frames, left_context)` decoded as one batch.
    pub fn decode_windows(
        &mut self,
        windows: &[(&[u32], usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if let Some(w) = windows.iter().find(|w| w.2 > w.1) {
            return Err(ModelError::Batch(format!(
                "left context of {} frames in a window of {}",
                w.2, w.1
            )));
        }
        let reqs: Vec<(&[u32], usize)> = windows.iter().map(|w| (w.0, w.1)).collect();
        let spf = self.config.samples_per_frame();
        Ok(self
            .decode_batch(&reqs)?
            .into_iter()
            .zip(windows)
            .map(|(wav, w)| window_trim(wav, w.1, w.2, spf))
            .collect())
    }

    /// Decodes requests `(codes [num_quantizers, T_i], T_i)` together: zero-padded to the
    /// longest `T` (rounded up to a [`FRAME_BUCKETS`] entry when graphs are on), run in as
    /// few batches of at most `max_batch_frames` frames as fit, each waveform cut to its own
    /// `num_samples(T_i)`. A request of zero frames gives an empty waveform.
    pub fn decode_batch(
        &mut self,
        requests: &[(&[u32], usize)],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.config;
        c.check_requests(requests)?;
        for (i, &(_, t)) in requests.iter().enumerate() {
            if self.padded_frames(t) > self.buf.cap {
                return Err(ModelError::Batch(format!(
                    "request {i}: {t} frames exceed the {} batch-frames of the buffers",
                    self.buf.cap
                )));
            }
        }
        let live: Vec<usize> = (0..requests.len()).filter(|&i| requests[i].1 > 0).collect();
        let mut out = vec![Vec::new(); requests.len()];
        // Greedy groups in request order whose padded batch fits the buffers.
        let mut start = 0;
        while start < live.len() {
            let mut end = start + 1;
            let mut longest = requests[live[start]].1;
            while end < live.len() {
                let l = longest.max(requests[live[end]].1);
                if (end + 1 - start) * self.padded_frames(l) > self.buf.cap {
                    break;
                }
                longest = l;
                end += 1;
            }
            let group: Vec<(&[u32], usize)> =
                live[start..end].iter().map(|&i| requests[i]).collect();
            for (wav, &i) in self.run_group(&group)?.into_iter().zip(&live[start..end]) {
                out[i] = wav;
            }
            start = end;
        }
        Ok(out)
    }

    /// Frames a request of `t` frames runs at: its bucket with graphs on, else itself.
    fn padded_frames(&self, t: usize) -> usize {
        if self.use_graphs {
            FRAME_BUCKETS.iter().copied().find(|&b| b >= t).unwrap_or(t)
        } else {
            t
        }
    }

    fn run_group(&mut self, group: &[(&[u32], usize)]) -> Result<Vec<Vec<f32>>, ModelError> {
        let nq = self.config.num_quantizers;
        let longest = group.iter().map(|r| r.1).max().unwrap_or(0);
        let frames = self.padded_frames(longest);
        let batch = group.len();
        let mut codes = vec![0i32; batch * nq * frames];
        for (b, &(c, t)) in group.iter().enumerate() {
            for q in 0..nq {
                for f in 0..t {
                    codes[(b * nq + q) * frames + f] = c[q * t + f] as i32;
                }
            }
        }
        {
            let mut dst = self.buf.codes.slice_mut(0..codes.len());
            self.cx
                .stream()
                .memcpy_htod(&codes, &mut dst)
                .map_err(CudaError::from)?;
        }
        let graphed = self.use_graphs && FRAME_BUCKETS.contains(&frames);
        if graphed {
            if !self.graphs.contains_key(&(batch, frames)) {
                self.capture(batch, frames)?;
            }
            if let Some(g) = self.graphs.get(&(batch, frames)) {
                g.0.launch().map_err(CudaError::from)?;
            }
        } else {
            self.run(batch, frames)?;
        }
        let len = self.config.num_samples(frames);
        let wav = self.download(batch * len)?;
        Ok(group
            .iter()
            .enumerate()
            .map(|(b, &(_, t))| wav[b * len..b * len + self.config.num_samples(t)].to_vec())
            .collect())
    }

    /// The first `n` samples of the wav buffer (synchronizes).
    fn download(&mut self, n: usize) -> Result<Vec<f32>, ModelError> {
        let src = self.buf.wav.slice(0..n);
        let s = self.cx.stream();
        s.memcpy_dtoh(&src, &mut self.buf.wav_host)
            .map_err(CudaError::from)?;
        s.synchronize().map_err(CudaError::from)?;
        let host = self.buf.wav_host.as_slice().map_err(CudaError::from)?;
        Ok(host[..n].to_vec())
    }

    /// Runs `(batch, frames)` once eagerly (kernels loaded, cuBLAS algorithms chosen), then
    /// captures it. The codes buffer keeps whatever it holds.
    fn capture(&mut self, batch: usize, frames: usize) -> Result<(), ModelError> {
        self.run(batch, frames)?;
        self.cx.synchronize()?;
        let stream = self.cx.stream().clone();
        stream
            .begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(CudaError::from)?;
        let run = self.run(batch, frames);
        let graph = stream
            .end_capture(driver_sys::CUgraphInstantiate_flags(0))
            .map_err(CudaError::from)?;
        run?;
        let graph = graph.ok_or_else(|| {
            ModelError::Device(format!(
                "capturing Code2Wav ({batch} x {frames}) gave no graph"
            ))
        })?;
        graph.upload().map_err(CudaError::from)?;
        self.graphs.insert((batch, frames), Graph(graph));
        Ok(())
    }

    /// Captures graphs for every `(batch, bucket)` of the lists that fits the buffers.
    pub fn capture_graphs(
        &mut self,
        batches: &[usize],
        buckets: &[usize],
    ) -> Result<Vec<(usize, usize)>, ModelError> {
        let mut done = Vec::new();
        for &b in batches {
            for &f in buckets {
                if b == 0 || f == 0 || b * f > self.buf.cap {
                    continue;
                }
                if !self.graphs.contains_key(&(b, f)) {
                    self.capture(b, f)?;
                }
                done.push((b, f));
            }
        }
        self.cx.synchronize()?;
        Ok(done)
    }

    /// Replays the captured graph of `(batch, frames)` once on whatever codes the buffer
    /// holds, without copies (benchmarks); `false` when none is captured.
    pub fn replay(&self, batch: usize, frames: usize) -> Result<bool, ModelError> {
        match self.graphs.get(&(batch, frames)) {
            Some(g) => {
                g.0.launch().map_err(CudaError::from)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Waits for queued work.
    pub fn synchronize(&self) -> Result<(), ModelError> {
        Ok(self.cx.synchronize()?)
    }

    /// Per-op GPU time of one eager `(batch, frames)` decode of the codes in the buffer (an
    /// event after every op), with each op's FLOPs; the ops of a kind are summed.
    pub fn profile(&mut self, batch: usize, frames: usize) -> Result<Vec<OpTime>, ModelError> {
        if batch * frames > self.buf.cap {
            return Err(ModelError::Batch(
                "profile shape exceeds the buffers".into(),
            ));
        }
        self.run(batch, frames)?;
        self.marks = Some(Vec::new());
        mark(&mut self.marks, &self.cx, "start", 0.0)?;
        let r = self.run(batch, frames);
        let marks = self.marks.take().unwrap_or_default();
        r?;
        self.cx.synchronize()?;
        let mut out: Vec<OpTime> = Vec::new();
        for pair in marks.windows(2) {
            let ms = f64::from(pair[0].2.elapsed_ms(&pair[1].2).map_err(CudaError::from)?);
            let (label, flops) = (&pair[1].0, pair[1].1);
            match out.iter_mut().find(|o| &o.label == label) {
                Some(o) => {
                    o.ms += ms;
                    o.flops += flops;
                }
                None => out.push(OpTime {
                    label: label.clone(),
                    ms,
                    flops,
                }),
            }
        }
        Ok(out)
    }

    /// FLOPs of one `(batch, frames)` decode: GEMMs, convolutions and attention.
    pub fn flops(&self, batch: usize, frames: usize) -> f64 {
        let c = &self.config;
        let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim());
        let rows = batch * frames;
        let qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd;
        let keys = (0..frames)
            .map(|t| (t + 1).min(c.sliding_window))
            .sum::<usize>();
        let layer = gemm_flops(rows, h, qkv)
            + gemm_flops(rows, c.num_attention_heads * hd, h)
            + gemm_flops(rows, h, 2 * i)
            + gemm_flops(rows, i, h)
            + 4.0 * (batch * keys * c.num_attention_heads * hd) as f64;
        let mut f = layer * c.num_hidden_layers as f64;
        let mut len = frames;
        for &u in &c.upsampling_ratios {
            f += gemm_flops(batch * len, h, u * h);
            len *= u;
            f += 2.0 * gemm_flops(batch * len, h, CONVNEXT_EXPANSION * h)
                + 2.0 * (batch * len * h * CONV_KERNEL) as f64;
        }
        f += gemm_flops(batch * len, CONV_KERNEL * h, c.decoder_dim);
        for (b, &r) in c.upsample_rates.iter().enumerate() {
            let (cin, cout) = c.block_channels(b);
            f += gemm_flops(batch * len, cin, 2 * r * cout);
            len = (len - 1) * r;
            f += 3.0
                * (gemm_flops(batch * len, CONV_KERNEL * cout, cout)
                    + gemm_flops(batch * len, cout, cout));
        }
        let last = c.decoder_dim >> c.upsample_rates.len();
        f + 2.0 * (batch * len * CONV_KERNEL * last) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn real() -> Code2WavConfig {
        let v: Value = serde_json::from_str(include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../bench/models/qwen3-omni-30b-a3b/config.json"
        )))
        .unwrap_or(Value::Null);
        Code2WavConfig::from_model_config(&v).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn buffer_sizes_cover_every_stage_of_the_real_shapes() {
        let c = real();
        let (act, scratch) = per_frame_sizes(&c);
        // The last block's output (1920 samples x 96 channels per frame) and its im2col
        // columns (7 taps) are the largest.
        assert_eq!(act, 1920 * 96);
        assert_eq!(scratch, 1920 * 7 * 96);
    }
}
