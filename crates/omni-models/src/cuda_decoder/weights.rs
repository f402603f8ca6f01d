//! The decoder's weights on the device: [`Uploader`] copies a host checkpoint's (already
//! sharded) layers as bf16, [`DummyMaker`] makes random ones of the right shapes on the device.

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{CudaContext, RouterSplit, bf16};

use crate::ModelError;
use crate::decoder::{DecoderLayer, DecoderLinear, DecoderSpec, HeadLayout, Mlp};

#[derive(Debug)]
pub(super) struct DLinear {
    pub(super) w: CudaSlice<bf16>,
    pub(super) b: Option<CudaSlice<bf16>>,
    pub(super) out: usize,
    pub(super) inp: usize,
}

#[derive(Debug)]
pub(super) enum DMlp {
    Dense {
        gate_up: DLinear,
        down: DLinear,
        inter: usize,
    },
    Moe {
        /// `[E, H]` in f32: routing is a top-k over nearly equal logits, computed in f32 from
        /// the unrounded normed hidden state so it picks the experts the f32 reference picks.
        router: CudaSlice<f32>,
        /// The same router for steps longer than the small-batch router takes: f32-accurate
        /// logits on tensor cores ([`omni_backend::cuda::RouterSplit`]).
        router_split: RouterSplit,
        /// `[E, 2 I, H]`: per expert, I gate rows then I up rows.
        w13: CudaSlice<bf16>,
        /// `[E, H, I]`.
        w2: CudaSlice<bf16>,
        inter: usize,
        num_experts: usize,
        top_k: usize,
        renormalize: bool,
        /// The gated shared expert (Qwen3-Omni's Talker), if any.
        shared: Option<Box<DShared>>,
    },
}

/// A shared expert every token goes through beside the routed ones, its output scaled by
/// `sigmoid(gate . x)` (`x` the unrounded normed input).
#[derive(Debug)]
pub(super) struct DShared {
    /// `[2 I, H]`: I gate rows then I up rows (this rank's slice).
    pub(super) gate_up: DLinear,
    /// `[H, I]` (row-parallel).
    pub(super) down: DLinear,
    pub(super) inter: usize,
    /// `[H]` in f32 (replicated): the scale decides as much as a routing weight.
    pub(super) gate: CudaSlice<f32>,
}

#[derive(Debug)]
pub(super) struct DLayer {
    pub(super) input_norm: CudaSlice<bf16>,
    pub(super) post_norm: CudaSlice<bf16>,
    pub(super) qkv: DLinear,
    pub(super) o: DLinear,
    pub(super) qk_norm: Option<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    pub(super) mlp: DMlp,
}

/// Copies host f32 weights to the device as bf16 through a pinned staging buffer.
pub(super) struct Uploader<'a> {
    pub(super) cx: &'a CudaContext,
}

impl Uploader<'_> {
    pub(super) fn upload(&self, host: &[f32]) -> Result<CudaSlice<bf16>, ModelError> {
        let v: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
        Ok(self.cx.upload_bf16_pinned(&v)?)
    }

    fn linear(&self, l: &DecoderLinear) -> Result<DLinear, ModelError> {
        Ok(DLinear {
            // Quantized host blocks are dequantized here: the device keeps bf16.
            w: self.upload(&l.w.to_f32())?,
            b: l.bias.as_deref().map(|b| self.upload(b)).transpose()?,
            out: l.w.rows(),
            inp: l.w.cols(),
        })
    }

    pub(super) fn layer(&self, l: &DecoderLayer) -> Result<DLayer, ModelError> {
        let mlp = match &l.mlp {
            Mlp::Dense(m) => DMlp::Dense {
                gate_up: self.linear(&m.gate_up)?,
                down: self.linear(&m.down)?,
                inter: m.inter,
            },
            Mlp::Moe(m) => {
                let inter = m.experts.first().map_or(0, |e| e.inter);
                let mut w13 = Vec::new();
                let mut w2 = Vec::new();
                for e in &m.experts {
                    w13.extend_from_slice(&e.gate_up.w.to_f32());
                    w2.extend_from_slice(&e.down.w.to_f32());
                }
                let shared = match &m.shared {
                    Some((s, gate)) => Some(Box::new(DShared {
                        gate_up: self.linear(&s.gate_up)?,
                        down: self.linear(&s.down)?,
                        inter: s.inter,
                        gate: self.cx.stream().clone_htod(gate)?,
                    })),
                    None => None,
                };
                DMlp::Moe {
                    router: self.cx.stream().clone_htod(&m.router)?,
                    router_split: RouterSplit::upload(
                        self.cx,
                        &m.router,
                        m.experts.len(),
                        m.router.len() / m.experts.len().max(1),
                    )?,
                    w13: self.upload(&w13)?,
                    w2: self.upload(&w2)?,
                    inter,
                    num_experts: m.experts.len(),
                    top_k: m.top_k,
                    renormalize: m.norm_topk_prob,
                    shared,
                }
            }
        };
        Ok(DLayer {
            input_norm: self.upload(&l.input_norm)?,
            post_norm: self.upload(&l.post_norm)?,
            qkv: self.linear(&l.qkv)?,
            o: self.linear(&l.o)?,
            qk_norm: match (&l.q_norm, &l.k_norm) {
                (Some(q), Some(k)) => Some((self.upload(q)?, self.upload(k)?)),
                _ => None,
            },
            mlp,
        })
    }
}

/// Makes dummy weights on the device, one seed per tensor.
pub(super) struct DummyMaker<'a> {
    pub(super) cx: &'a CudaContext,
    pub(super) seed: u64,
    pub(super) next: u64,
}

impl DummyMaker<'_> {
    /// Where the embedding's seeds start ([`DummyMaker::at`]).
    pub(super) const EMBED: u64 = 0;
    /// Where the head's seeds start.
    pub(super) const LM_HEAD: u64 = 1 << 20;
    /// Where the final norm's seeds start.
    pub(super) const NORM: u64 = 2 << 20;

    /// Where decoder layer `i`'s seeds start (room for 2^20 tensors per part).
    pub(super) fn layer_base(i: usize) -> u64 {
        (i as u64 + 3) << 20
    }

    /// Makes the next tensors from seeds after `base`: a part's seeds do not depend on which
    /// other parts this rank makes (a pipeline stage makes only its own).
    pub(super) fn at(&mut self, base: u64) {
        self.next = base;
    }

    fn tensor(&mut self, len: usize, lo: f32, hi: f32) -> Result<CudaSlice<bf16>, ModelError> {
        let mut t = self.cx.zeros_bf16(len)?;
        self.next += 1;
        let seed = self
            .seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(self.next);
        self.cx.fill_uniform_bf16(&mut t, seed, lo, hi)?;
        Ok(t)
    }

    pub(super) fn weight(&mut self, len: usize) -> Result<CudaSlice<bf16>, ModelError> {
        self.tensor(len, -0.02, 0.02)
    }

    /// A dummy weight widened to f32 (routers and gates are kept in f32).
    pub(super) fn weight_f32(&mut self, len: usize) -> Result<CudaSlice<f32>, ModelError> {
        let w = self.weight(len)?;
        let mut out = self.cx.stream().alloc_zeros::<f32>(len)?;
        self.cx.bf16_to_f32(&w, &mut out, len)?;
        Ok(out)
    }

    pub(super) fn ones(&mut self, len: usize) -> Result<CudaSlice<bf16>, ModelError> {
        self.tensor(len, 1.0, 1.0)
    }

    fn linear(&mut self, out: usize, inp: usize, bias: bool) -> Result<DLinear, ModelError> {
        Ok(DLinear {
            w: self.weight(out * inp)?,
            b: if bias { Some(self.weight(out)?) } else { None },
            out,
            inp,
        })
    }

    pub(super) fn layer(
        &mut self,
        spec: &DecoderSpec,
        heads: &HeadLayout,
        tp_size: usize,
        i: usize,
    ) -> Result<DLayer, ModelError> {
        let (h, hd) = (spec.hidden_size, spec.head_dim);
        let qkv_out = (heads.local_heads + 2 * heads.local_kv_heads) * hd;
        let split = |n: usize, what: &str| {
            if n.is_multiple_of(tp_size) {
                Ok(n / tp_size)
            } else {
                Err(ModelError::TensorParallel(format!(
                    "{what} {n} does not split over {tp_size} ranks"
                )))
            }
        };
        let mlp = match (&spec.moe, spec.is_moe_layer(i)) {
            (Some(m), true) => {
                let inter = split(m.moe_intermediate_size, "moe_intermediate_size")?;
                let router = self.weight_f32(m.num_experts * h)?;
                let router_host = self.cx.stream().clone_dtoh(&router)?;
                let router_split = RouterSplit::upload(self.cx, &router_host, m.num_experts, h)?;
                let shared = match m.shared_expert_intermediate_size {
                    Some(si) => {
                        let si = split(si, "shared_expert_intermediate_size")?;
                        Some(Box::new(DShared {
                            gate_up: self.linear(2 * si, h, false)?,
                            down: self.linear(h, si, false)?,
                            inter: si,
                            gate: self.weight_f32(h)?,
                        }))
                    }
                    None => None,
                };
                DMlp::Moe {
                    router,
                    router_split,
                    w13: self.weight(m.num_experts * 2 * inter * h)?,
                    w2: self.weight(m.num_experts * h * inter)?,
                    inter,
                    num_experts: m.num_experts,
                    top_k: m.top_k,
                    renormalize: m.norm_topk_prob,
                    shared,
                }
            }
            _ => {
                let inter = split(spec.intermediate_size, "intermediate size")?;
                DMlp::Dense {
                    gate_up: self.linear(2 * inter, h, false)?,
                    down: self.linear(h, inter, false)?,
                    inter,
                }
            }
        };
        Ok(DLayer {
            input_norm: self.ones(h)?,
            post_norm: self.ones(h)?,
            qkv: self.linear(qkv_out, h, spec.attention_bias)?,
            o: DLinear {
                w: self.weight(h * heads.local_heads * hd)?,
                b: if spec.attention_bias {
                    Some(self.weight(h)?)
                } else {
                    None
                },
                out: h,
                inp: heads.local_heads * hd,
            },
            qk_norm: if spec.qk_norm {
                Some((self.ones(hd)?, self.ones(hd)?))
            } else {
                None
            },
            mlp,
        })
    }
}
