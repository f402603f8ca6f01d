//! A device copy of one of the Talker's input projections (`fc2(silu(fc1(x) + b1)) + b2`,
//! Thinker width -> Talker width), so a stage builds prompts without host GEMMs: a 160-token
//! prompt is ~2 GFLOP through `text_projection`, tens of milliseconds on one host core and the
//! Talker stage's largest input cost at high concurrency.
//!
//! bf16 weights and activations with f32 accumulation, as the rest of the CUDA Talker. The
//! activation runs through the fused SiLU-and-mul kernel: fc1 is uploaded with as many zero
//! rows again and its bias with as many ones, so the "up" half of every row is exactly 1.

use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{CudaContext, bf16};
use omni_models::ModelError;
use omni_models::qwen3_omni::talker::ResizeMlp;

fn dev_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Device(format!("cuda projection: {e}"))
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct DeviceResizeMlp {
    cx: Arc<CudaContext>,
    /// `[2 * mid, inp]`: fc1's rows, then zero rows.
    fc1: CudaSlice<bf16>,
    /// `[2 * mid]`: fc1's bias, then ones.
    fc1_bias: CudaSlice<bf16>,
    /// `[out, mid]`.
    fc2: CudaSlice<bf16>,
    /// `[out]`.
    fc2_bias: CudaSlice<bf16>,
    inp: usize,
    mid: usize,
    out: usize,
}

impl DeviceResizeMlp {
    /// Uploads `mlp`'s weights.
    pub(crate) fn upload(cx: Arc<CudaContext>, mlp: &ResizeMlp) -> Result<Self, ModelError> {
        let [(w1, b1, mid, inp), (w2, b2, out, mid2)] = mlp.layers();
        if mid2 != mid || w1.len() != mid * inp || w2.len() != out * mid {
            return Err(ModelError::Config(format!(
                "a projection of fc1 [{mid}, {inp}] and fc2 [{out}, {mid2}]"
            )));
        }
        let bias = |b: &[f32], n: usize| -> Vec<f32> {
            if b.is_empty() {
                vec![0.0; n]
            } else {
                b.to_vec()
            }
        };
        let mut fc1 = to_bf16(w1);
        fc1.resize(2 * mid * inp, bf16::ZERO);
        let mut fc1_bias = to_bf16(&bias(b1, mid));
        fc1_bias.resize(2 * mid, bf16::ONE);
        Ok(Self {
            fc1: cx.upload_bf16(&fc1).map_err(dev_err)?,
            fc1_bias: cx.upload_bf16(&fc1_bias).map_err(dev_err)?,
            fc2: cx.upload_bf16(&to_bf16(w2)).map_err(dev_err)?,
            fc2_bias: cx.upload_bf16(&to_bf16(&bias(b2, out))).map_err(dev_err)?,
            cx,
            inp,
            mid,
            out,
        })
    }

    /// Checks the copy against `mlp` on the host over a few fixed rows: the largest
    /// difference relative to the largest host value, an error past `tolerance` (a layout
    /// mistake, not bf16 rounding, which stays near 1e-2).
    pub(crate) fn check_against(&self, mlp: &ResizeMlp, tolerance: f32) -> Result<f32, ModelError> {
        let x: Vec<f32> = (0..4 * self.inp)
            .map(|i| ((i as f32) * 0.37).sin())
            .collect();
        let (host, dev) = (mlp.forward(&x)?, self.forward(&x)?);
        let scale = host.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let diff = host
            .iter()
            .zip(&dev)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let rel = diff / scale;
        if rel.is_nan() || rel > tolerance || host.len() != dev.len() {
            return Err(ModelError::Device(format!(
                "the device projection differs from the host's by {rel} (relative)"
            )));
        }
        Ok(rel)
    }

    /// Projects `[rows, inp]` to `[rows, out]` (synchronizes: the result comes back).
    pub(crate) fn forward(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        let (inp, mid, out) = (self.inp, self.mid, self.out);
        let rows = x.len() / inp.max(1);
        if rows * inp != x.len() {
            return Err(ModelError::Batch(format!(
                "{} values are not rows of width {inp}",
                x.len()
            )));
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let cx = &self.cx;
        let xs = cx.upload_bf16(&to_bf16(x)).map_err(dev_err)?;
        let mut gate_up = cx.zeros_bf16(rows * 2 * mid).map_err(dev_err)?;
        cx.matmul_nt_bf16(&xs, &self.fc1, &mut gate_up, rows, inp, 2 * mid)
            .map_err(dev_err)?;
        cx.add_bias_bf16(&mut gate_up, &self.fc1_bias, rows)
            .map_err(dev_err)?;
        let mut act = cx.zeros_bf16(rows * mid).map_err(dev_err)?;
        cx.silu_and_mul_bf16(&gate_up, &mut act, mid)
            .map_err(dev_err)?;
        let mut y = cx.zeros_bf16(rows * out).map_err(dev_err)?;
        cx.matmul_nt_bf16(&act, &self.fc2, &mut y, rows, mid, out)
            .map_err(dev_err)?;
        cx.add_bias_bf16(&mut y, &self.fc2_bias, rows)
            .map_err(dev_err)?;
        let mut y32 = cx
            .stream()
            .alloc_zeros::<f32>(rows * out)
            .map_err(dev_err)?;
        cx.bf16_to_f32(&y, &mut y32, rows * out).map_err(dev_err)?;
        let mut host = vec![0f32; rows * out];
        cx.stream().memcpy_dtoh(&y32, &mut host).map_err(dev_err)?;
        Ok(host)
    }
}
