//! Qwen3-Omni's two encoder towers on one CUDA device (feature `cuda`): the vision tower
//! ([`CudaVisionEncoder`], the twin of [`crate::qwen3_omni::vision_encoder::VisionEncoder`]) and
//! the audio tower ([`CudaAudioEncoder`], the twin of
//! [`crate::qwen3_omni::audio_encoder::AudioEncoder`]), same weight names, same results within
//! bf16 rounding. Kernels in `omni_backend::cuda::encoder`.
//!
//! bf16 GEMM weights, f32 accumulation, an f32 residual stream, f32 norms, biases and tables;
//! what feeds a GEMM is bf16. One block (`block.rs`):
//! ```text
//! h = LN1(x); y = h Wqkv^T; qkv = rotary(y + b)      (vision: 2-D rotary from a cos|sin table)
//! a = attention within cu_seqlens segments           (cuBLAS strided-batched over the heads)
//! x += a Wo^T + bo; h = LN2(x); x += act(h W1^T + b1) W2^T + b2
//! ```
//! Host work per call is only geometry: segment boundaries, the bilinear taps and (row, col) of
//! each patch, the audio chunks' zero-padded input. Nothing is captured in a CUDA graph yet.
//!
//! Weights come from a [`WeightSource`] ([`CudaVisionEncoder::load`]) or are made on the device
//! from a seed ([`CudaVisionEncoder::load_dummy`], `--load-format dummy`: norms 1, biases 0,
//! matrices uniform in `±1/sqrt(fan_in)`), so real-shape benchmarks need no checkpoint.

mod audio;
mod block;
mod towers;
mod vision;

pub use audio::CudaAudioEncoder;
pub use towers::{DeviceTowers, TowerWeights};
pub use vision::{CudaVisionEncoder, CudaVisionOutput};

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{CudaContext, CudaError, bf16};

use crate::ModelError;
use crate::decoder::load_shaped;
use crate::weights::WeightSource;

/// Where the weights come from.
#[derive(Clone, Copy)]
enum Source<'a> {
    Host(&'a dyn WeightSource),
    Dummy(u64),
}

/// Uploads one tower's weights by name.
struct Up<'a> {
    cx: &'a CudaContext,
    src: Source<'a>,
}

/// FNV-1a of a tensor name: the dummy values' per-tensor seed.
fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Copies host values to a new device buffer.
fn upload<T: omni_backend::cuda::cudarc::driver::DeviceRepr>(
    cx: &CudaContext,
    v: &[T],
) -> Result<CudaSlice<T>, ModelError> {
    Ok(cx.stream().clone_htod(v).map_err(CudaError::from)?)
}

/// A zeroed f32 device buffer of `n` elements (at least one).
fn zeros_f32(cx: &CudaContext, n: usize) -> Result<CudaSlice<f32>, ModelError> {
    Ok(cx
        .stream()
        .alloc_zeros::<f32>(n.max(1))
        .map_err(CudaError::from)?)
}

impl Up<'_> {
    fn f32(&self, v: &[f32]) -> Result<CudaSlice<f32>, ModelError> {
        upload(self.cx, v)
    }

    /// A GEMM matrix: the tensors `names` (each of `shape`, stacked along rows), reordered by
    /// `reorder` on the host, as bf16. Dummy: uniform in `±1/sqrt(fan_in)` on the device.
    fn mat(
        &self,
        names: &[String],
        shape: &[usize],
        reorder: impl FnOnce(Vec<f32>) -> Vec<f32>,
    ) -> Result<CudaSlice<bf16>, ModelError> {
        match self.src {
            Source::Host(ws) => {
                let mut v = Vec::new();
                for n in names {
                    v.extend(load_shaped(ws, n, shape)?.data);
                }
                let v: Vec<bf16> = reorder(v).iter().map(|&x| bf16::from_f32(x)).collect();
                Ok(self.cx.upload_bf16_pinned(&v)?)
            }
            Source::Dummy(seed) => {
                let n = names.len() * shape.iter().product::<usize>();
                let fan_in = shape[1..].iter().product::<usize>().max(1);
                let a = 1.0 / (fan_in as f32).sqrt();
                let mut d = self.cx.zeros_bf16(n)?;
                let s = seed ^ name_hash(names.first().map_or("", String::as_str));
                self.cx.fill_uniform_bf16(&mut d, s, -a, a)?;
                Ok(d)
            }
        }
    }

    /// A per-channel vector (f32). Dummy: 1 for a norm weight (`norm`, `ln_` in the name, ending
    /// in `.weight`), else 0.
    fn vec(&self, names: &[String], len: usize) -> Result<CudaSlice<f32>, ModelError> {
        match self.src {
            Source::Host(ws) => {
                let mut v = Vec::new();
                for n in names {
                    v.extend(load_shaped(ws, n, &[len])?.data);
                }
                self.f32(&v)
            }
            Source::Dummy(_) => {
                let n = names.first().map_or("", String::as_str);
                let one = (n.contains("norm") || n.contains("ln_")) && n.ends_with(".weight");
                self.f32(&vec![if one { 1.0 } else { 0.0 }; names.len() * len])
            }
        }
    }

    /// A `(weight, bias)` LayerNorm at `prefix`.
    fn norm(
        &self,
        prefix: &str,
        len: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>), ModelError> {
        Ok((
            self.vec(&[format!("{prefix}.weight")], len)?,
            self.vec(&[format!("{prefix}.bias")], len)?,
        ))
    }

    /// An f32 table (the vision position table). Dummy: small deterministic values.
    fn table(&self, name: &str, shape: &[usize]) -> Result<CudaSlice<f32>, ModelError> {
        match self.src {
            Source::Host(ws) => self.f32(&load_shaped(ws, name, shape)?.data),
            Source::Dummy(seed) => {
                let n: usize = shape.iter().product();
                let mut s = seed ^ name_hash(name);
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        s = s
                            .wrapping_mul(6_364_136_223_846_793_005)
                            .wrapping_add(1_442_695_040_888_963_407);
                        ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04
                    })
                    .collect();
                self.f32(&v)
            }
        }
    }
}
