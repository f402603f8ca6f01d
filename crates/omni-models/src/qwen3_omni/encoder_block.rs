//! What Qwen3-Omni's two encoder towers share: LayerNorm and linear weights read by name, the
//! activation named in their configs, and the pre-norm transformer block (LayerNorm, full
//! bidirectional attention with biases inside `cu_seqlens` segments, residual; LayerNorm, MLP
//! `fc2(act(fc1(x)))`, residual) that the audio layers and the vision blocks both are.

use omni_backend::activation::{gelu_inplace, layer_norm_inplace};
use omni_backend::gelu_tanh::gelu_tanh_inplace;
use omni_backend::ops::add_inplace;
use omni_backend::rope::Rope;
use omni_backend::varlen_attention::{HeadShape, segment_attention};

use crate::decoder::{Linear, load_shaped};
use crate::error::ModelError;
use crate::weights::WeightSource;

/// `nn.LayerNorm(dim, eps)` with its affine weight and bias.
#[derive(Debug, Clone)]
pub(crate) struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    eps: f32,
}

impl LayerNorm {
    /// Reads `{prefix}.weight` and `{prefix}.bias`, `[dim]` each.
    pub(crate) fn load(
        ws: &dyn WeightSource,
        prefix: &str,
        dim: usize,
        eps: f32,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            weight: load_shaped(ws, &format!("{prefix}.weight"), &[dim])?.data,
            bias: load_shaped(ws, &format!("{prefix}.bias"), &[dim])?.data,
            eps,
        })
    }

    /// Normalises every row of `x` in place.
    pub(crate) fn apply(&self, x: &mut [f32]) -> Result<(), ModelError> {
        Ok(layer_norm_inplace(
            x,
            &self.weight,
            &self.bias,
            self.weight.len(),
            self.eps,
        )?)
    }
}

/// `{prefix}.weight` `[out, inp]` and, with `bias`, `{prefix}.bias` `[out]`.
pub(crate) fn linear(
    ws: &dyn WeightSource,
    prefix: &str,
    out: usize,
    inp: usize,
    bias: bool,
) -> Result<Linear, ModelError> {
    Ok(Linear {
        w: load_shaped(ws, &format!("{prefix}.weight"), &[out, inp])?.data,
        out,
        inp,
        bias: if bias {
            Some(load_shaped(ws, &format!("{prefix}.bias"), &[out])?.data)
        } else {
            None
        },
    })
}

/// Several `[out_i, inp]` linears with biases stacked into one `[sum out_i, inp]`.
pub(crate) fn stacked(parts: Vec<Linear>) -> Linear {
    let inp = parts.first().map_or(0, |p| p.inp);
    let mut w = Vec::new();
    let mut b = Vec::new();
    let mut out = 0;
    for p in parts {
        w.extend(p.w);
        b.extend(p.bias.unwrap_or_else(|| vec![0.0; p.out]));
        out += p.out;
    }
    Linear {
        w,
        out,
        inp,
        bias: Some(b),
    }
}

/// The MLP activations the towers' configs name (transformers' `ACT2FN` keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// `gelu`: exact (erf) GELU.
    Gelu,
    /// `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
}

impl Activation {
    /// The activation of a config's `hidden_act` / `activation_function`.
    pub(crate) fn from_name(name: &str) -> Result<Self, ModelError> {
        match name {
            "gelu" => Ok(Self::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" => Ok(Self::GeluTanh),
            other => Err(ModelError::Config(format!(
                "encoder activation `{other}` (gelu or gelu_pytorch_tanh expected)"
            ))),
        }
    }

    /// Applies it to every element.
    pub(crate) fn apply(self, x: &mut [f32]) {
        match self {
            Self::Gelu => gelu_inplace(x),
            Self::GeluTanh => gelu_tanh_inplace(x),
        }
    }
}

/// One pre-norm encoder block with fused `[q | k | v]` projections.
#[derive(Debug, Clone)]
pub(crate) struct EncoderBlock {
    pub(crate) norm1: LayerNorm,
    /// `[3 * dim, dim]`: query rows, then key rows, then value rows (heads outermost in each).
    pub(crate) qkv: Linear,
    pub(crate) proj: Linear,
    pub(crate) norm2: LayerNorm,
    pub(crate) fc1: Linear,
    pub(crate) fc2: Linear,
    pub(crate) act: Activation,
    pub(crate) heads: usize,
}

/// Rotary embedding of the queries and keys: the table's `apply`, with `[cos | sin]` rows per
/// token.
pub(crate) struct Rotary<'a> {
    pub(crate) rope: &'a Rope,
    pub(crate) cos_sin: &'a [f32],
}

impl EncoderBlock {
    /// Runs the block on `x` (`[tokens, dim]`) in place.
    pub(crate) fn forward(
        &self,
        x: &mut [f32],
        cu_seqlens: &[usize],
        rotary: Option<&Rotary<'_>>,
    ) -> Result<(), ModelError> {
        let dim = self.proj.out;
        let tokens = x.len() / dim.max(1);
        let head_dim = dim / self.heads;
        let mut h = x.to_vec();
        self.norm1.apply(&mut h)?;
        let mut qkv = Vec::new();
        self.qkv.forward(&h, tokens, &mut qkv)?;
        let (mut q, mut k, mut v) = (
            Vec::with_capacity(tokens * dim),
            Vec::with_capacity(tokens * dim),
            Vec::with_capacity(tokens * dim),
        );
        for r in qkv.chunks_exact(3 * dim) {
            q.extend_from_slice(&r[..dim]);
            k.extend_from_slice(&r[dim..2 * dim]);
            v.extend_from_slice(&r[2 * dim..]);
        }
        if let Some(r) = rotary {
            r.rope.apply(&mut q, self.heads, r.cos_sin)?;
            r.rope.apply(&mut k, self.heads, r.cos_sin)?;
        }
        let mut attn = vec![0.0; tokens * dim];
        let shape = HeadShape {
            num_heads: self.heads,
            head_dim,
        };
        let scale = 1.0 / (head_dim as f32).sqrt();
        segment_attention(&q, &k, &v, cu_seqlens, shape, scale, &mut attn)?;
        self.proj.forward(&attn, tokens, &mut h)?;
        add_inplace(x, &h)?;

        h.clear();
        h.extend_from_slice(x);
        self.norm2.apply(&mut h)?;
        self.fc1.forward(&h, tokens, &mut qkv)?;
        self.act.apply(&mut qkv);
        self.fc2.forward(&qkv, tokens, &mut h)?;
        add_inplace(x, &h)?;
        Ok(())
    }
}
