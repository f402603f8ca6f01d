//! The checkpoint walk: [`Loader`] reads one rank's shard of each layer by HF tensor name
//! (column-parallel rows, row-parallel columns) into host memory: weight matrices in the
//! quantized blocks the source stores them in when the CPU backend has kernels for those
//! ([`WeightSource::load_quantized`]), f32 otherwise; vectors in f32.

use omni_backend::quant::WeightMatrix;

use super::{DecoderLayer, DecoderLinear, DecoderSpec, DenseMlp, HeadLayout, Mlp, MoeMlp};
use crate::error::ModelError;
use crate::weights::{HostTensor, WeightError, WeightSource};

pub(crate) fn load_shaped(
    ws: &dyn WeightSource,
    name: &str,
    shape: &[usize],
) -> Result<HostTensor, ModelError> {
    let t = ws.load(name)?;
    if t.shape != shape {
        return Err(WeightError::Invalid {
            name: name.into(),
            reason: format!("shape {:?}, expected {:?}", t.shape, shape),
        }
        .into());
    }
    Ok(t)
}

/// The `[rows, cols]` weight `name`: its quantized blocks where the source keeps them, else f32.
pub(crate) fn load_weight(
    ws: &dyn WeightSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<WeightMatrix, ModelError> {
    if let Some(q) = ws.load_quantized(name)? {
        if (q.rows(), q.cols()) != (rows, cols) {
            return Err(WeightError::Invalid {
                name: name.into(),
                reason: format!(
                    "shape [{}, {}], expected [{rows}, {cols}]",
                    q.rows(),
                    q.cols()
                ),
            }
            .into());
        }
        return Ok(WeightMatrix::Quant(q));
    }
    Ok(WeightMatrix::f32(
        load_shaped(ws, name, &[rows, cols])?.data,
        rows,
        cols,
    )?)
}

/// Rows `start..start + len` of a 2-D (or 1-D, as a column) tensor.
fn take_rows(t: &HostTensor, start: usize, len: usize) -> Vec<f32> {
    let cols: usize = t.shape.iter().skip(1).product();
    t.data[start * cols..(start + len) * cols].to_vec()
}

pub(crate) struct Loader<'a> {
    ws: &'a dyn WeightSource,
    spec: &'a DecoderSpec,
    rank: usize,
    size: usize,
    heads: HeadLayout,
}

impl<'a> Loader<'a> {
    /// Reads rank `rank` of `size`'s shard of each layer from `ws` (host f32).
    pub(crate) fn new(
        ws: &'a dyn WeightSource,
        spec: &'a DecoderSpec,
        rank: usize,
        size: usize,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            ws,
            spec,
            rank,
            size,
            heads: spec.head_layout(rank, size)?,
        })
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        Ok(load_shaped(self.ws, name, &[len])?.data)
    }

    /// Column-parallel pieces stacked into one fused matrix: for each `(name, rows per unit,
    /// first unit, units)`, rows `first * per .. (first + units) * per` of `[n, in]`.
    fn fused_rows(
        &self,
        parts: &[(String, usize, usize, usize)],
        full_rows: &[usize],
        inp: usize,
        bias: bool,
    ) -> Result<DecoderLinear, ModelError> {
        let mut ws = Vec::with_capacity(parts.len());
        let mut b = Vec::new();
        for ((name, per, first, units), &rows) in parts.iter().zip(full_rows) {
            let w = load_weight(self.ws, &format!("{name}.weight"), rows, inp)?;
            ws.push(w.take_rows(first * per, units * per)?);
            if bias {
                let bt = load_shaped(self.ws, &format!("{name}.bias"), &[rows])?;
                b.extend(take_rows(&bt, first * per, units * per));
            }
        }
        Ok(DecoderLinear {
            w: WeightMatrix::stack(ws)?,
            bias: bias.then_some(b),
        })
    }

    /// Row-parallel: columns `start..start + len` of `[out, in_full]`.
    fn row_parallel(
        &self,
        name: &str,
        out: usize,
        in_full: usize,
        start: usize,
        len: usize,
        bias: bool,
    ) -> Result<DecoderLinear, ModelError> {
        let w = load_weight(self.ws, &format!("{name}.weight"), out, in_full)?;
        // The partial sums of all ranks are added up: the bias belongs to one of them.
        let bias = if bias && self.rank == 0 {
            Some(self.vector(&format!("{name}.bias"), out)?)
        } else {
            None
        };
        Ok(DecoderLinear {
            w: w.take_cols(start, len)?,
            bias,
        })
    }

    fn split(&self, n: usize, what: &str) -> Result<(usize, usize), ModelError> {
        if !n.is_multiple_of(self.size) {
            return Err(ModelError::TensorParallel(format!(
                "{what} {n} does not split over {} ranks",
                self.size
            )));
        }
        let l = n / self.size;
        Ok((self.rank * l, l))
    }

    fn mlp(&self, prefix: &str, inter: usize) -> Result<DenseMlp, ModelError> {
        let h = self.spec.hidden_size;
        let (start, local) = self.split(inter, "intermediate size")?;
        let gate_up = self.fused_rows(
            &[
                (format!("{prefix}.gate_proj"), local, self.rank, 1),
                (format!("{prefix}.up_proj"), local, self.rank, 1),
            ],
            &[inter, inter],
            h,
            false,
        )?;
        let down = self.row_parallel(
            &format!("{prefix}.down_proj"),
            h,
            inter,
            start,
            local,
            false,
        )?;
        Ok(DenseMlp {
            gate_up,
            down,
            inter: local,
        })
    }

    pub(crate) fn layer(&self, i: usize) -> Result<DecoderLayer, ModelError> {
        let s = self.spec;
        let (h, hd) = (s.hidden_size, s.head_dim);
        let p = format!("model.layers.{i}");
        let hl = self.heads;
        let qkv = self.fused_rows(
            &[
                (
                    format!("{p}.self_attn.q_proj"),
                    hd,
                    hl.head_start,
                    hl.local_heads,
                ),
                (
                    format!("{p}.self_attn.k_proj"),
                    hd,
                    hl.kv_head_start,
                    hl.local_kv_heads,
                ),
                (
                    format!("{p}.self_attn.v_proj"),
                    hd,
                    hl.kv_head_start,
                    hl.local_kv_heads,
                ),
            ],
            &[s.num_heads * hd, s.num_kv_heads * hd, s.num_kv_heads * hd],
            h,
            s.attention_bias,
        )?;
        let o = self.row_parallel(
            &format!("{p}.self_attn.o_proj"),
            h,
            s.num_heads * hd,
            hl.head_start * hd,
            hl.local_heads * hd,
            s.attention_bias,
        )?;
        let (q_norm, k_norm) = if s.qk_norm {
            (
                Some(self.vector(&format!("{p}.self_attn.q_norm.weight"), hd)?),
                Some(self.vector(&format!("{p}.self_attn.k_norm.weight"), hd)?),
            )
        } else {
            (None, None)
        };
        let mlp = match (&s.moe, s.is_moe_layer(i)) {
            (Some(m), true) => {
                let router = load_shaped(
                    self.ws,
                    &format!("{p}.mlp.gate.weight"),
                    &[m.num_experts, h],
                )?
                .data;
                let experts = (0..m.num_experts)
                    .map(|e| self.mlp(&format!("{p}.mlp.experts.{e}"), m.moe_intermediate_size))
                    .collect::<Result<Vec<_>, _>>()?;
                let shared = match m.shared_expert_intermediate_size {
                    Some(si) => Some((
                        self.mlp(&format!("{p}.mlp.shared_expert"), si)?,
                        load_shaped(
                            self.ws,
                            &format!("{p}.mlp.shared_expert_gate.weight"),
                            &[1, h],
                        )?
                        .data,
                    )),
                    None => None,
                };
                Mlp::Moe(MoeMlp {
                    router,
                    experts,
                    top_k: m.top_k,
                    norm_topk_prob: m.norm_topk_prob,
                    shared,
                })
            }
            _ => Mlp::Dense(self.mlp(&format!("{p}.mlp"), s.intermediate_size)?),
        };
        Ok(DecoderLayer {
            input_norm: self.vector(&format!("{p}.input_layernorm.weight"), h)?,
            post_norm: self.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            qkv,
            o,
            q_norm,
            k_norm,
            mlp,
        })
    }
}
