//! A MoE layer's MLP on the fused small-batch path ([`CudaDecoderModel::set_fused_small_batch`]):
//! after the o_proj GEMV has added the attention output into the f32 residual stream, three
//! launches instead of eight: [`CudaContext::moe_route`] (post-attention norm, f32 router,
//! top-k softmax), [`CudaContext::moe_small_gate_up`] (gate_up + SiLU-and-mul over the routed
//! experts) and [`CudaContext::moe_small_down`] (down, the weighted sum over a token's experts
//! and the residual add), so the next layer's fused QKV GEMV normalises the sum as on a dense
//! layer. Layers with a shared expert stay on the unfused path.
//!
//! Decode steps of up to [`MOE_ROUTE_MAX_TOKENS`] tokens on the unfused path route with
//! [`CudaContext::moe_route`] too, adding the attention output into the residual first: one
//! launch instead of the norm, the router GEMM and the top-k.

use omni_backend::cuda::{CudaContext, L2Prefetch, MoeBlock1Buffers, MoeRouteBuffers, MoeShape};

use super::CudaDecoderModel;
use super::buffers::Activations;
use super::weights::{DLayer, DMlp};
use crate::ModelError;

/// The shape of a routed-expert MLP at `tokens` tokens, if `mlp` is one without a shared
/// expert.
fn moe_shape(mlp: &DMlp, tokens: usize, hidden: usize) -> Option<MoeShape> {
    match mlp {
        DMlp::Moe {
            inter,
            num_experts,
            top_k,
            shared: None,
            ..
        } => Some(MoeShape {
            tokens,
            hidden,
            inter: *inter,
            num_experts: *num_experts,
            top_k: *top_k,
        }),
        _ => None,
    }
}

/// The most tokens a step routes with [`CudaContext::moe_route`] on the unfused path (decode
/// batches; prefills keep the router GEMM, which reads the router once for every token).
pub(super) const MOE_ROUTE_MAX_TOKENS: usize = 64;

impl CudaDecoderModel {
    /// Whether the unfused path routes layer `l`'s `tokens` tokens with
    /// [`CudaContext::moe_route`] (a routed-expert MLP without a shared expert, a shape it
    /// takes, at most [`MOE_ROUTE_MAX_TOKENS`] tokens).
    pub(super) fn routes_fused(mlp: &DMlp, tokens: usize, hidden: usize) -> bool {
        tokens <= MOE_ROUTE_MAX_TOKENS
            && moe_shape(mlp, tokens, hidden).is_some_and(|s| CudaContext::moe_route_fits(&s))
    }

    /// Whether a MoE layer's MLP runs on the fused small-batch path at `tokens` tokens: no
    /// shared expert, and a shape the small-batch MoE kernels take.
    pub(super) fn small_moe_fits(mlp: &DMlp, tokens: usize, hidden: usize) -> bool {
        moe_shape(mlp, tokens, hidden).is_some_and(|s| CudaContext::moe_small_fits(&s))
    }

    /// Post-attention norm + router + top-k of layer `l` (a MoE layer that
    /// [`Self::small_moe_fits`] or [`Self::routes_fused`]): `a.h`, `a.router_logits`,
    /// `a.topk_ids`, `a.topk_weights`; with `add_proj` the attention output in `a.proj` is
    /// added into the residual `a.x` first (the unfused path).
    pub(super) fn small_moe_route(
        cx: &CudaContext,
        a: &mut Activations,
        l: &DLayer,
        (tokens, hidden): (usize, usize),
        eps: f32,
        add_proj: bool,
    ) -> Result<(), ModelError> {
        let (shape, router, renormalize) = match (&l.mlp, moe_shape(&l.mlp, tokens, hidden)) {
            (
                DMlp::Moe {
                    router,
                    renormalize,
                    ..
                },
                Some(s),
            ) => (s, router, *renormalize),
            _ => return Err(not_small_moe()),
        };
        let (t, e, k) = (tokens, shape.num_experts, shape.top_k);
        cx.moe_route(
            shape,
            renormalize,
            eps,
            MoeRouteBuffers {
                residual: &mut a.x,
                delta: add_proj.then(|| a.proj.slice(..t * hidden)),
                norm_weight: &l.post_norm,
                router,
                h: a.h.slice_mut(..t * hidden),
                logits: a.router_logits.slice_mut(..t * e),
                topk_ids: a.topk_ids.slice_mut(..t * k),
                topk_weights: a.topk_weights.slice_mut(..t * k),
                counters: &mut a.moe_counters,
            },
        )?;
        Ok(())
    }

    /// The routed experts of layer `l` on the routing [`Self::small_moe_route`] left, added
    /// into the residual stream `a.x`; the down kernel issues `prefetch` (a later kernel's
    /// weights) into L2, and with `w2_prefetch` the gate_up kernel the routed experts' down
    /// weights ([`CudaDecoderModel::set_moe_w2_prefetch`]).
    pub(super) fn small_moe_experts(
        cx: &CudaContext,
        a: &mut Activations,
        l: &DLayer,
        (tokens, hidden): (usize, usize),
        prefetch: L2Prefetch,
        w2_prefetch: bool,
    ) -> Result<(), ModelError> {
        let (shape, w13, w2) = match (&l.mlp, moe_shape(&l.mlp, tokens, hidden)) {
            (DMlp::Moe { w13, w2, .. }, Some(s)) => (s, w13, w2),
            _ => return Err(not_small_moe()),
        };
        let pairs = tokens * shape.top_k;
        let (h, ids) = (a.h.slice(..tokens * hidden), a.topk_ids.slice(..pairs));
        if w2_prefetch {
            cx.moe_small_gate_up_prefetch_w2(shape, &h, w13, w2, &ids, &mut a.moe_act)?;
        } else {
            cx.moe_small_gate_up(shape, &h, w13, &ids, &mut a.moe_act)?;
        }
        cx.moe_small_down_prefetch(
            shape,
            (
                &a.moe_act,
                w2,
                &a.topk_ids.slice(..pairs),
                &a.topk_weights.slice(..pairs),
            ),
            &mut a.x,
            prefetch,
        )?;
        Ok(())
    }

    /// Whether layer `l`'s MoE block at `tokens` tokens runs as one launch
    /// ([`CudaContext::moe_block1_fits`]: one token, no shared expert, a device and shape it
    /// takes).
    pub(super) fn moe_block1_fits(
        cx: &CudaContext,
        mlp: &DMlp,
        tokens: usize,
        hidden: usize,
    ) -> bool {
        moe_shape(mlp, tokens, hidden).is_some_and(|s| cx.moe_block1_fits(&s))
    }

    /// Layer `l`'s MoE block of a one-token step in one launch: the attention output in
    /// `a.proj` and the block's output added into the residual `a.x` (with `a.h`, the router
    /// logits and the routing written as [`Self::small_moe_route`] writes them); the experts'
    /// rows evict-first in L2 with `evict_first`.
    pub(super) fn moe_block1(
        cx: &CudaContext,
        a: &mut Activations,
        l: &DLayer,
        (hidden, eps): (usize, f32),
        evict_first: bool,
    ) -> Result<(), ModelError> {
        let (shape, router, w13, w2, renormalize) = match (&l.mlp, moe_shape(&l.mlp, 1, hidden)) {
            (
                DMlp::Moe {
                    router,
                    w13,
                    w2,
                    renormalize,
                    ..
                },
                Some(s),
            ) => (s, router, w13, w2, *renormalize),
            _ => return Err(not_small_moe()),
        };
        let (e, k, i) = (shape.num_experts, shape.top_k, shape.inter);
        cx.moe_block1(
            shape,
            (renormalize, eps),
            MoeBlock1Buffers {
                residual: &mut a.x,
                delta: Some(a.proj.slice(..hidden)),
                norm_weight: &l.post_norm,
                router,
                w13,
                w2,
                h: a.h.slice_mut(..hidden),
                logits: a.router_logits.slice_mut(..e),
                topk_ids: a.topk_ids.slice_mut(..k),
                topk_weights: a.topk_weights.slice_mut(..k),
                act: a.moe_act.slice_mut(..k * i),
                barrier: &mut a.moe_barrier,
            },
            evict_first,
        )?;
        Ok(())
    }
}

fn not_small_moe() -> ModelError {
    ModelError::Batch(
        "the fused small-batch MoE path got a layer without routed experts only".into(),
    )
}
