//! A decoder whose weights stay in Q4_1 / Q8_0 blocks gives the logits of the same decoder run
//! in f32 on the dequantized weights: exactly (up to GEMM order) on the prefill path, which
//! dequantizes tiles; within the Q8 activation rounding on the decode path. With tensor
//! parallelism too (row-parallel columns cut on block edges).

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use half::f16;
use omni_backend::quant::{QMatrix, QuantType};
use omni_models::hf_dir::SafetensorsDir;
use omni_models::registry::build_model;
use omni_models::weights::{HostTensor, WeightError, WeightSource};
use omni_models::{InProcessAllReduce, TpContext};

/// ggml's Q4_1 of one 32-value block: `d = (max - min) / 15`, `m = min`.
fn q4_1_block(x: &[f32], out: &mut Vec<u8>) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = f16::from_f32((max - min) / 15.0);
    let m = f16::from_f32(min);
    let id = if d.to_f32() > 0.0 {
        1.0 / d.to_f32()
    } else {
        0.0
    };
    let q = |v: f32| ((v - m.to_f32()) * id).round().clamp(0.0, 15.0) as u8;
    out.extend(d.to_le_bytes());
    out.extend(m.to_le_bytes());
    out.extend((0..16).map(|j| q(x[j]) | q(x[j + 16]) << 4));
}

/// ggml's Q8_0 of one block: `d = max|x| / 127`.
fn q8_0_block(x: &[f32], out: &mut Vec<u8>) {
    let d = f16::from_f32(x.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 127.0);
    let id = if d.to_f32() > 0.0 {
        1.0 / d.to_f32()
    } else {
        0.0
    };
    out.extend(d.to_le_bytes());
    out.extend(
        x.iter()
            .map(|v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8),
    );
}

/// The llama fixture with its projections in Q4_1 and its (tied) embedding in Q8_0: blocks
/// through `load_quantized`, their dequantized values through `load`.
struct Quantized {
    inner: SafetensorsDir,
}

impl Quantized {
    fn kind(name: &str) -> Option<QuantType> {
        if name.ends_with("_proj.weight") {
            Some(QuantType::Q4_1)
        } else if name == "model.embed_tokens.weight" {
            Some(QuantType::Q8_0)
        } else {
            None
        }
    }

    fn blocks(&self, name: &str) -> Result<Option<QMatrix>, WeightError> {
        let Some(ty) = Self::kind(name) else {
            return Ok(None);
        };
        let t = self.inner.load(name)?;
        let mut bytes = Vec::new();
        for b in t.data.chunks_exact(32) {
            match ty {
                QuantType::Q4_1 => q4_1_block(b, &mut bytes),
                QuantType::Q8_0 => q8_0_block(b, &mut bytes),
            }
        }
        Ok(Some(
            QMatrix::new(ty, t.shape[0], t.shape[1], bytes).unwrap(),
        ))
    }
}

impl WeightSource for Quantized {
    fn tensor_names(&self) -> Vec<String> {
        self.inner.tensor_names()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        self.inner.shape(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        match self.blocks(name)? {
            Some(q) => Ok(HostTensor {
                shape: vec![q.rows(), q.cols()],
                data: q.dequantize(),
            }),
            None => self.inner.load(name),
        }
    }

    fn load_quantized(&self, name: &str) -> Result<Option<QMatrix>, WeightError> {
        self.blocks(name)
    }
}

/// Prefill of all but the last token (38 rows: the f32-tile path), then the last token as a
/// decode step (1 row: the integer path), on every rank of `tp_size`; rank 0's logits.
fn logits(ws: &dyn WeightSource, tp_size: usize, ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let config = config("llama");
    let group = InProcessAllReduce::group(tp_size);
    let table = Blocks::new().table(ids.len());
    let mut outs: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, ar)| {
                let (table, config) = (&table, &config);
                s.spawn(move || {
                    let tp = TpContext::new(rank, tp_size, Arc::new(ar));
                    let model = build_model(config, ws, tp).unwrap();
                    let mut kv = fresh_cache(model.as_ref());
                    let n = ids.len();
                    let prefill = run_all(model.as_ref(), &mut kv, &[(&ids[..n - 1], 0, table)]);
                    let decode = run_all(model.as_ref(), &mut kv, &[(&ids[n - 1..], n - 1, table)]);
                    (prefill, decode)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    outs.swap_remove(0)
}

#[test]
fn quantized_weights_give_the_dequantized_f32_logits() {
    let ids = &reference("llama").input_ids[2];
    assert!(
        ids.len() > omni_backend::quant::F32_MIN_ROWS,
        "the prefill must take the f32 tiles"
    );
    let q = Quantized {
        inner: SafetensorsDir::open(&dir("llama")).unwrap(),
    };
    let (want_prefill, want_decode) = logits(&F32View(&q), 1, ids);
    for tp in [1, 2] {
        let (prefill, decode) = logits(&q, tp, ids);
        let err = rel_err(&prefill, &want_prefill);
        assert!(err <= 1e-5, "tp {tp} prefill: rel err {err}");
        // Activations rounded to 127 steps of their block maximum: each product moves by at
        // most half a step per value; through two layers this stays near 1% of the logits.
        let err = rel_err(&decode, &want_decode);
        println!("tp {tp}: decode rel err {err}");
        assert!(err <= 2e-2, "tp {tp} decode: rel err {err}");
        assert!(err > 0.0, "the decode step did not take the integer path");
        assert_eq!(argmax(&decode), argmax(&want_decode), "tp {tp}");
    }
}
