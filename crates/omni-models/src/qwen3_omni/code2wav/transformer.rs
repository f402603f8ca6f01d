//! Code2Wav's pre-transformer (transformers' `Qwen3OmniMoeCode2WavTransformerModel`): pre-norm
//! layers `h += s_attn * Attn(RMSNorm(h)); h += s_mlp * MLP(RMSNorm(h))` with per-channel
//! LayerScale vectors, causal sliding-window attention with RoPE on positions `0..T` (every
//! decode starts at 0), no q/k norm, a SiLU-gated MLP, and a final RMSNorm.

use omni_backend::linalg::matmul_nt;
use omni_backend::ops::{add_bias_inplace, rms_norm_inplace, silu_and_mul};
use omni_backend::rope::{Rope, RopeScaling};
use omni_backend::window_attention::{WindowAttentionShape, causal_window_attention};

use super::config::Code2WavConfig;
use super::load_vec;
use crate::error::ModelError;
use crate::weights::WeightSource;

/// A linear layer `[out, in]` with an optional bias.
#[derive(Debug, Clone)]
struct Linear {
    w: Vec<f32>,
    bias: Option<Vec<f32>>,
    out: usize,
    inp: usize,
}

impl Linear {
    fn load(
        ws: &dyn WeightSource,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            w: load_vec(ws, &format!("{name}.weight"), &[out, inp])?,
            bias: if bias {
                Some(load_vec(ws, &format!("{name}.bias"), &[out])?)
            } else {
                None
            },
            out,
            inp,
        })
    }

    fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, ModelError> {
        let mut y = vec![0.0; rows * self.out];
        matmul_nt(x, &self.w, &mut y, rows, self.inp, self.out)?;
        if let Some(b) = &self.bias {
            add_bias_inplace(&mut y, b)?;
        }
        Ok(y)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// `[gate; up]` stacked: `[2 * intermediate, hidden]`.
    gate_up: Vec<f32>,
    down: Vec<f32>,
    attn_scale: Vec<f32>,
    mlp_scale: Vec<f32>,
}

/// The pre-transformer's weights and geometry.
#[derive(Debug, Clone)]
pub(super) struct PreTransformer {
    layers: Vec<Layer>,
    norm: Vec<f32>,
    rope: Rope,
    hidden: usize,
    inter: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: usize,
    eps: f32,
}

/// `h[r, :] += scale * y[r, :]` for every row.
fn add_scaled_rows(h: &mut [f32], y: &[f32], scale: &[f32]) {
    for (hr, yr) in h
        .chunks_exact_mut(scale.len())
        .zip(y.chunks_exact(scale.len()))
    {
        for ((a, b), s) in hr.iter_mut().zip(yr).zip(scale) {
            *a += s * b;
        }
    }
}

impl PreTransformer {
    pub(super) fn load(c: &Code2WavConfig, ws: &dyn WeightSource) -> Result<Self, ModelError> {
        let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim());
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let bias = c.attention_bias;
        let layers = (0..c.num_hidden_layers)
            .map(|l| {
                let p = format!("code2wav.pre_transformer.layers.{l}");
                let a = format!("{p}.self_attn");
                let mut gate_up = load_vec(ws, &format!("{p}.mlp.gate_proj.weight"), &[i, h])?;
                gate_up.extend(load_vec(ws, &format!("{p}.mlp.up_proj.weight"), &[i, h])?);
                Ok(Layer {
                    input_norm: load_vec(ws, &format!("{p}.input_layernorm.weight"), &[h])?,
                    post_norm: load_vec(ws, &format!("{p}.post_attention_layernorm.weight"), &[h])?,
                    q: Linear::load(ws, &format!("{a}.q_proj"), nh * hd, h, bias)?,
                    k: Linear::load(ws, &format!("{a}.k_proj"), nkv * hd, h, bias)?,
                    v: Linear::load(ws, &format!("{a}.v_proj"), nkv * hd, h, bias)?,
                    o: Linear::load(ws, &format!("{a}.o_proj"), h, nh * hd, bias)?,
                    gate_up,
                    down: load_vec(ws, &format!("{p}.mlp.down_proj.weight"), &[h, i])?,
                    attn_scale: load_vec(ws, &format!("{p}.self_attn_layer_scale.scale"), &[h])?,
                    mlp_scale: load_vec(ws, &format!("{p}.mlp_layer_scale.scale"), &[h])?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Self {
            layers,
            norm: load_vec(ws, "code2wav.pre_transformer.norm.weight", &[h])?,
            rope: Rope::new(hd, c.rope_theta()?, &RopeScaling::None)?,
            hidden: h,
            inter: i,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            window: c.sliding_window,
            eps: c.rms_norm_eps as f32,
        })
    }

    /// Runs `h` (`[batch, frames, hidden]`, each sequence at positions `0..frames`) in place.
    pub(super) fn forward(
        &self,
        h: &mut [f32],
        batch: usize,
        frames: usize,
    ) -> Result<(), ModelError> {
        let (hs, hd) = (self.hidden, self.head_dim);
        let rows = batch * frames;
        let positions: Vec<usize> = (0..batch).flat_map(|_| 0..frames).collect();
        let mut cos_sin = Vec::new();
        self.rope.cos_sin(&positions, &mut cos_sin);
        let shape = WindowAttentionShape {
            seq_len: frames,
            num_heads: self.heads,
            num_kv_heads: self.kv_heads,
            head_dim: hd,
            window: Some(self.window),
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let (q_row, kv_row) = (self.heads * hd, self.kv_heads * hd);
        let mut x = vec![0.0; rows * hs];
        let mut attn = vec![0.0; rows * q_row];
        let mut act = vec![0.0; rows * self.inter];
        for layer in &self.layers {
            x.copy_from_slice(h);
            rms_norm_inplace(&mut x, &layer.input_norm, hs, self.eps)?;
            let mut q = layer.q.forward(&x, rows)?;
            let mut k = layer.k.forward(&x, rows)?;
            let v = layer.v.forward(&x, rows)?;
            self.rope.apply(&mut q, self.heads, &cos_sin)?;
            self.rope.apply(&mut k, self.kv_heads, &cos_sin)?;
            for b in 0..batch {
                let (qs, ks) = (b * frames * q_row, b * frames * kv_row);
                causal_window_attention(
                    &q[qs..qs + frames * q_row],
                    &k[ks..ks + frames * kv_row],
                    &v[ks..ks + frames * kv_row],
                    &shape,
                    scale,
                    &mut attn[qs..qs + frames * q_row],
                )?;
            }
            let o = layer.o.forward(&attn, rows)?;
            add_scaled_rows(h, &o, &layer.attn_scale);

            x.copy_from_slice(h);
            rms_norm_inplace(&mut x, &layer.post_norm, hs, self.eps)?;
            let mut gu = vec![0.0; rows * 2 * self.inter];
            matmul_nt(&x, &layer.gate_up, &mut gu, rows, hs, 2 * self.inter)?;
            // The fused product's rows are [gate | up] per token, as silu_and_mul wants.
            silu_and_mul(&gu, &mut act, self.inter)?;
            let mut down = vec![0.0; rows * hs];
            matmul_nt(&act, &layer.down, &mut down, rows, self.inter, hs)?;
            add_scaled_rows(h, &down, &layer.mlp_scale);
        }
        rms_norm_inplace(h, &self.norm, hs, self.eps)?;
        Ok(())
    }
}
