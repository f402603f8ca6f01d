//! The small-batch MoE layer (steps of at most [`MOE_SMALL_MAX_TOKENS`] tokens): three
//! weight-streaming kernels (`kernels/moe/small.cu`) in place of the post-attention norm, the
//! router GEMM, the top-k softmax, the four launches of [`CudaContext::fused_moe_bf16`] and the
//! residual add:
//!
//! 1. [`CudaContext::moe_route`]: RMSNorm of the f32 residual (the bits of
//!    [`CudaContext::fused_add_rms_norm_f32_out`]), the f32 router logits from the unrounded
//!    normed row, then [`CudaContext::moe_topk_softmax`]'s routing (the same warp code) by the
//!    last of each token tile's blocks; grid `tiles * groups` (`groups = ceil(E / warps)`, one
//!    warp per expert; tiles of 1 token for one, else 4) of the norm's `block_threads(hidden /
//!    4)` threads. It takes any token count: the unfused decode path runs it too, adding the
//!    attention output into the residual first (`MoeRouteBuffers::delta`).
//! 2. [`CudaContext::moe_small_gate_up`]: `act[pair] = silu(gate_e(h[t])) * up_e(h[t])`; grid
//!    `pairs * ceil(inter / 8)` blocks of 8 warps, one warp per intermediate column. The first
//!    pair routed to an expert streams that expert's rows once for every pair routed to it (at
//!    batch 1 there is one pair per expert; at 8 tokens shared experts are read once).
//! 3. [`CudaContext::moe_small_down`]: `residual[t] += sum_slot w * down_e(act[pair])`; grid
//!    `ceil(hidden / 8)` blocks of 8 warps, each warp owning one output row and streaming the
//!    distinct routed experts' w2 rows in pair order, `MS_DOWN_SLOTS / V` at a time (the first
//!    group before it waits for gate_up), then summing each token's slots in order.
//!
//! All three read routing from device memory only (CUDA-graph capturable), use no float
//! atomics and sum in a fixed order (deterministic), and are launched with programmatic
//! dependent launch like the fused GEMVs. The expert results round where the grouped-GEMM path
//! rounds (`act`, each pair's `y`, the weighted sum to bf16), so the two paths differ only by the
//! order of f32 accumulation inside the dot products.
//!
//! Beside the launch shapes, test-only functions mirror the kernels' de-duplication of experts
//! on the host; the tests' emulators (`small_tests.rs`) run the kernels' loops with them.

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, SyncOnDrop,
};

#[cfg(doc)]
use super::MOE_MAX_EXPERTS;
use super::MoeShape;
use super::launch::check_routing;
use super::source::topk_warp;
use crate::cuda::gemv::GEMV_COMMON;
use crate::cuda::kernels::{BF16_HELPERS, kernel_file};
use crate::cuda::launch::{aligned16, at_least, block_threads, narrow, shape_err};
use crate::cuda::{CudaContext, CudaResult, L2Prefetch, bf16};

/// The most tokens the small-batch MoE kernels take (the GEMV's rows).
pub const MOE_SMALL_MAX_TOKENS: usize = crate::cuda::GEMV_MAX_ROWS;
/// The most `(token, slot)` pairs (`tokens * top_k`): one thread per pair in the down kernel.
pub const MOE_SMALL_MAX_PAIRS: usize = 256;
/// The largest hidden size: the router block has `hidden / 4` threads (at most 512, so a lane
/// holds its prefetched router row in registers).
pub const MOE_SMALL_MAX_HIDDEN: usize = 2048;
/// The largest expert intermediate size: a lane holds its share of a w2 row in registers.
pub const MOE_SMALL_MAX_INTER: usize = 8 * 32 * 8;

/// Output rows per block of the down kernel (`MS_DOWN_ROWS`: one per warp).
pub(crate) const DOWN_ROWS: usize = 8;
/// The 16-byte w2 chunks a lane of the down kernel holds in flight (`MS_DOWN_SLOTS`): the
/// rows of `DOWN_SLOTS / V` experts at a time, `V` = [`down_chunks_per_lane`].
#[cfg(test)]
pub(crate) const DOWN_SLOTS: usize = 24;
/// Warps per block of the gate_up and down kernels.
pub(crate) const EXPERT_WARPS: usize = 8;

const SMALL: &str = kernel_file!("moe/small.cu");
/// The router entries by tokens per block (1, [`ROUTE_TILE`]).
const ROUTE_FNS: [&str; 2] = ["moe_route_r1", "moe_route_r4"];
/// The gate_up entries by the bound on an expert's members (1, 2, 4, 8 = tokens rounded up to
/// a power of two).
const GATE_UP_FNS: [&str; 4] = [
    "moe_small_gate_up_r1",
    "moe_small_gate_up_r2",
    "moe_small_gate_up_r4",
    "moe_small_gate_up_r8",
];
/// [`GATE_UP_FNS`]' twins that prefetch w2 into L2.
const GATE_UP_PF_FNS: [&str; 4] = [
    "moe_small_gate_up_r1_pf",
    "moe_small_gate_up_r2_pf",
    "moe_small_gate_up_r4_pf",
    "moe_small_gate_up_r8_pf",
];
/// The down entries by [`down_chunks_per_lane`] (1..=8).
const DOWN_FNS: [&str; 8] = [
    "moe_small_down_v1",
    "moe_small_down_v2",
    "moe_small_down_v3",
    "moe_small_down_v4",
    "moe_small_down_v5",
    "moe_small_down_v6",
    "moe_small_down_v7",
    "moe_small_down_v8",
];

/// Full source of the small-batch MoE module.
pub(crate) fn moe_small_source() -> String {
    format!("{BF16_HELPERS}{GEMV_COMMON}{}{SMALL}", topk_warp())
}

/// Elements of the `act` buffer (`[tokens * top_k, inter]` bf16) between
/// [`CudaContext::moe_small_gate_up`] and [`CudaContext::moe_small_down`].
pub fn moe_small_act_len(shape: MoeShape) -> usize {
    shape.tokens * shape.top_k * shape.inter
}

/// The buffers of [`CudaContext::moe_route`].
#[derive(Debug)]
pub struct MoeRouteBuffers<'a> {
    /// The f32 residual stream `[tokens, hidden]`: read, and with `delta` also written (the
    /// sum).
    pub residual: &'a mut CudaSlice<f32>,
    /// The attention output `[tokens, hidden]` to add into the residual first (the unfused
    /// path's `fused_add_rms_norm_f32_out`); `None` when the residual already holds it (the
    /// fused o_proj GEMV added it).
    pub delta: Option<CudaView<'a, f32>>,
    /// The post-attention norm's weight `[hidden]`.
    pub norm_weight: &'a CudaSlice<bf16>,
    /// The router `[num_experts, hidden]` in f32.
    pub router: &'a CudaSlice<f32>,
    /// Out: the normed rows in bf16 `[tokens, hidden]` (the experts' input).
    pub h: CudaViewMut<'a, bf16>,
    /// Out: the f32 router logits `[tokens, num_experts]`.
    pub logits: CudaViewMut<'a, f32>,
    /// Out: the routed experts `[tokens, top_k]`, in decreasing probability.
    pub topk_ids: CudaViewMut<'a, i32>,
    /// Out: their weights `[tokens, top_k]`.
    pub topk_weights: CudaViewMut<'a, f32>,
    /// At least `tokens` counters, zero before the first call (e.g. `alloc_zeros`); every call
    /// leaves them zero.
    pub counters: &'a mut CudaSlice<i32>,
}

/// The router kernel's launch for `tokens` rows: tokens per block (`RT`: 1 for one token,
/// else 4), token tiles, groups per tile, threads per block and dynamic shared bytes. Warp `w`
/// of group `g` owns expert `g * warps + w`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RouteLaunch {
    pub rt: usize,
    pub tiles: usize,
    pub groups: usize,
    pub threads: u32,
    pub smem: usize,
}

pub(crate) fn route_launch(tokens: usize, hidden: usize, num_experts: usize) -> RouteLaunch {
    let threads = block_threads(hidden.div_ceil(4), 1024);
    let warps = threads as usize / 32;
    let rt = if tokens <= 1 { 1 } else { ROUTE_TILE };
    RouteLaunch {
        rt,
        tiles: tokens.div_ceil(rt),
        groups: num_experts.div_ceil(warps),
        threads,
        smem: rt * (hidden + num_experts) * 4,
    }
}

/// Tokens per block of the router kernel for steps of more than one token (`moe_route_r4`).
const ROUTE_TILE: usize = 4;
/// The router kernel's dynamic shared memory limit (the default, no opt-in; its static part is
/// under 1 KiB).
const ROUTE_SMEM_MAX: usize = 47 * 1024;

/// The 16-byte chunks of a w2 row (`inter` bf16) one lane of the down kernel holds: its
/// template's `V` (`inter <=` [`MOE_SMALL_MAX_INTER`] keeps it within 1..=8).
pub(crate) fn down_chunks_per_lane(inter: usize) -> usize {
    (inter / 8).div_ceil(32).max(1)
}

/// The most bytes of `act` rows the down kernel copies into shared memory (below it every
/// block stages all of them; above, they are read from L2).
const DOWN_ACT_SMEM: usize = 32 * 1024;

/// Dynamic shared bytes of the down kernel for `shape`: its pairs' act rows when they fit in
/// [`DOWN_ACT_SMEM`], else none.
pub(crate) fn down_act_smem(shape: &MoeShape) -> usize {
    let bytes = shape.tokens * shape.top_k * shape.inter * 2;
    if bytes <= DOWN_ACT_SMEM { bytes } else { 0 }
}

/// Distinct experts the down kernel streams at a time (its `G`).
#[cfg(test)]
pub(crate) fn down_group(inter: usize) -> usize {
    DOWN_SLOTS / down_chunks_per_lane(inter)
}

/// Blocks per pair of the gate_up kernel (one warp per intermediate column).
pub(crate) fn gate_up_col_blocks(inter: usize) -> usize {
    inter.div_ceil(EXPERT_WARPS)
}

#[cfg(test)]
/// Whether `id` names an expert.
fn valid(id: i32, num_experts: usize) -> bool {
    usize::try_from(id).is_ok_and(|e| e < num_experts)
}

#[cfg(test)]
/// The pairs the gate_up block of pair `p` computes (`ms_members`): every pair `q >= p` routed
/// to `p`'s expert, in order, when `p` is the first pair routed to it; otherwise (or when `p`'s
/// id is no expert) none.
pub(crate) fn pair_members(ids: &[i32], p: usize, num_experts: usize) -> Vec<usize> {
    let e = ids[p];
    if !valid(e, num_experts) || ids[..p].contains(&e) {
        return Vec::new();
    }
    (p..ids.len()).filter(|&q| ids[q] == e).collect()
}

#[cfg(test)]
/// The first pair routed to each distinct expert, in pair order (the down kernel's owners).
pub(crate) fn distinct_owners(ids: &[i32], num_experts: usize) -> Vec<usize> {
    (0..ids.len())
        .filter(|&q| valid(ids[q], num_experts) && !ids[..q].contains(&ids[q]))
        .collect()
}

impl CudaContext {
    /// Whether [`CudaContext::moe_small_route`], [`CudaContext::moe_small_gate_up`] and
    /// [`CudaContext::moe_small_down`] take `shape`: `1..=`[`MOE_SMALL_MAX_TOKENS`] tokens,
    /// at most [`MOE_SMALL_MAX_PAIRS`] pairs, `hidden` and `inter` positive multiples of 8 up
    /// to [`MOE_SMALL_MAX_HIDDEN`] / [`MOE_SMALL_MAX_INTER`], `1 <= top_k <= num_experts <=`
    /// [`MOE_MAX_EXPERTS`].
    pub fn moe_small_fits(shape: &MoeShape) -> bool {
        check_small(shape).is_ok()
    }

    /// Whether [`CudaContext::moe_route`] takes `shape` (any token count; `hidden` a positive
    /// multiple of 8 up to [`MOE_SMALL_MAX_HIDDEN`], `1 <= top_k <= num_experts <=`
    /// [`MOE_MAX_EXPERTS`], and its rows within the default shared memory limit).
    pub fn moe_route_fits(shape: &MoeShape) -> bool {
        check_route(shape).is_ok()
    }

    /// Post-attention RMSNorm + router + top-k softmax of `shape.tokens` rows in one launch
    /// (any token count): the residual plus `delta` when given (written back), then
    /// `h = bf16(rms_norm(residual) * norm_weight)` (bit for bit
    /// [`CudaContext::fused_add_rms_norm_f32_out`]'s, the add included), `logits =
    /// normed_f32 @ router^T` in f32 (a warp's fixed-order dot product: a token's logits are
    /// the same bits at any batch size), and the routing of [`CudaContext::moe_topk_softmax`]
    /// (the same code; `renormalize` is `norm_topk_prob`). Errors: `hidden` not a positive
    /// multiple of 8 or above [`MOE_SMALL_MAX_HIDDEN`], bad expert counts, more shared memory
    /// than the default limit (`4 * (hidden + num_experts)` floats), short buffers.
    pub fn moe_route(
        &self,
        shape: MoeShape,
        renormalize: bool,
        eps: f32,
        b: MoeRouteBuffers<'_>,
    ) -> CudaResult<()> {
        check_route(&shape)?;
        let MoeShape {
            tokens: t,
            hidden: h,
            num_experts: e,
            top_k: k,
            ..
        } = shape;
        let MoeRouteBuffers {
            residual,
            delta,
            norm_weight,
            router,
            h: mut h_out,
            mut logits,
            mut topk_ids,
            mut topk_weights,
            counters,
        } = b;
        at_least("moe route residual", residual.len(), t * h)?;
        if let Some(d) = &delta {
            at_least("moe route delta", d.len(), t * h)?;
        }
        crate::check_len("moe route norm weight", norm_weight.len(), h)?;
        crate::check_len("moe route router", router.len(), e * h)?;
        at_least("moe route h", h_out.len(), t * h)?;
        at_least("moe route logits", logits.len(), t * e)?;
        at_least("moe route topk ids", topk_ids.len(), t * k)?;
        at_least("moe route topk weights", topk_weights.len(), t * k)?;
        at_least("moe route counters", counters.len(), t)?;
        if t == 0 {
            return Ok(());
        }
        let l = route_launch(t, h, e);
        let s = &self.stream;
        let (res, _g0) = residual.device_ptr_mut(s);
        let (dp, _g9) = optional_ptr(delta.as_ref(), s);
        let (nw, _g1) = norm_weight.device_ptr(s);
        let (rw, _g2) = router.device_ptr(s);
        let (hp, _g3) = h_out.device_ptr_mut(s);
        let (lp, _g4) = logits.device_ptr_mut(s);
        let (ip, _g5) = topk_ids.device_ptr_mut(s);
        let (wp, _g6) = topk_weights.device_ptr_mut(s);
        let (cp, _g7) = counters.device_ptr_mut(s);
        aligned16("moe route residual", res)?;
        aligned16("moe route delta", dp)?;
        aligned16("moe route router", rw)?;
        let f = self.function(moe_small_source, ROUTE_FNS[usize::from(l.rt > 1)])?;
        let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7, mut a8) =
            (res, dp, nw, rw, hp, lp, ip, wp, cp);
        let (mut a9, mut a10, mut a11, mut a12, mut a13, mut a14, mut a15) = (
            narrow::<i32>("tokens", t)?,
            narrow::<i32>("hidden", h)?,
            narrow::<i32>("num_experts", e)?,
            narrow::<i32>("top_k", k)?,
            narrow::<i32>("moe route groups", l.groups)?,
            i32::from(renormalize),
            eps,
        );
        let mut args = kernel_args!(
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15
        );
        // SAFETY: the arguments match `moe_route_r*(float*, const float*, const u16*, const
        // float*, u16*, float*, int*, float*, int*, int, int, int, int, int, int, float)` in
        // order and type, `delta` null or t * h floats. Every buffer was checked against the
        // shape above (residual, delta and h t * h, router e * h, logits t * e, ids / weights
        // t * k, counters t >= the tiles); hidden is a multiple of 8 and the float4-accessed
        // residual, delta and router are 16-byte aligned; the grid is tiles * groups blocks of
        // block_threads(h / 4) <= 512 threads (the entries' launch bound) with the entry's RT
        // rows of (h + e) floats of dynamic shared memory (checked against the default
        // limit); warps past the experts only join the barriers; the residual is written only
        // by a tile's last block, after every block of the tile counted itself past its reads.
        unsafe {
            self.launch_programmatic(
                &f,
                (
                    narrow("moe route blocks", l.tiles * l.groups)?,
                    l.threads,
                    l.smem as u32,
                ),
                &mut args,
            )
        }
    }

    /// `act[p] = bf16(silu(gate_e(x[t])) * up_e(x[t]))` for each pair `p = t * top_k + slot`
    /// with `e = topk_ids[p]` (ids outside `0..num_experts` are skipped: their rows are not
    /// written), `w13[e]` `[2 * inter, hidden]` (gate rows then up rows) as in
    /// [`CudaContext::fused_moe_bf16`]. `x` is `[tokens, hidden]` bf16, `act`
    /// [`moe_small_act_len`] elements. Each routed expert's rows are streamed once per call.
    pub fn moe_small_gate_up(
        &self,
        shape: MoeShape,
        x: &impl DevicePtr<bf16>,
        w13: &impl DevicePtr<bf16>,
        topk_ids: &impl DevicePtr<i32>,
        act: &mut impl DevicePtrMut<bf16>,
    ) -> CudaResult<()> {
        self.gate_up(shape, x, w13, None, topk_ids, act)
    }

    /// [`CudaContext::moe_small_gate_up`] that also prefetches the routed experts' rows of
    /// `w2` (the [`CudaContext::moe_small_down`] weights that follow, `[num_experts, hidden,
    /// inter]`) into L2 while it streams the gate and up rows (those loads marked
    /// evict-first), so that the down kernel reads them from L2. The same values.
    pub fn moe_small_gate_up_prefetch_w2(
        &self,
        shape: MoeShape,
        x: &impl DevicePtr<bf16>,
        w13: &impl DevicePtr<bf16>,
        w2: &impl DevicePtr<bf16>,
        topk_ids: &impl DevicePtr<i32>,
        act: &mut impl DevicePtrMut<bf16>,
    ) -> CudaResult<()> {
        crate::check_len(
            "moe gate_up w2",
            w2.len(),
            shape.num_experts * shape.hidden * shape.inter,
        )?;
        let (w2p, _g) = w2.device_ptr(&self.stream);
        aligned16("moe gate_up w2", w2p)?;
        self.gate_up(shape, x, w13, Some(w2p), topk_ids, act)
    }

    /// The gate_up launch; `w2p`: the w2 weights to prefetch (checked by the caller).
    fn gate_up(
        &self,
        shape: MoeShape,
        x: &impl DevicePtr<bf16>,
        w13: &impl DevicePtr<bf16>,
        w2p: Option<u64>,
        topk_ids: &impl DevicePtr<i32>,
        act: &mut impl DevicePtrMut<bf16>,
    ) -> CudaResult<()> {
        check_small(&shape)?;
        let MoeShape {
            tokens: t,
            hidden: h,
            inter: i,
            num_experts: e,
            top_k: k,
        } = shape;
        at_least("moe gate_up x", x.len(), t * h)?;
        crate::check_len("moe gate_up w13", w13.len(), e * 2 * i * h)?;
        at_least("moe gate_up topk ids", topk_ids.len(), t * k)?;
        at_least("moe gate_up act", act.len(), moe_small_act_len(shape))?;
        let s = &self.stream;
        let (xp, _g0) = x.device_ptr(s);
        let (wp, _g1) = w13.device_ptr(s);
        let (ip, _g2) = topk_ids.device_ptr(s);
        let (ap, _g3) = act.device_ptr_mut(s);
        aligned16("moe gate_up x", xp)?;
        aligned16("moe gate_up w13", wp)?;
        let col_blocks = gate_up_col_blocks(i);
        let r = t.next_power_of_two().trailing_zeros() as usize;
        let f = self.function(
            moe_small_source,
            if w2p.is_some() {
                GATE_UP_PF_FNS[r]
            } else {
                GATE_UP_FNS[r]
            },
        )?;
        let (mut a0, mut a1, mut a2, mut a3) = (xp, wp, ip, ap);
        let mut a10 = w2p.unwrap_or(0);
        let (mut a4, mut a5, mut a6, mut a7, mut a8, mut a9) = (
            narrow::<i32>("pairs", t * k)?,
            narrow::<i32>("top_k", k)?,
            narrow::<i32>("hidden", h)?,
            narrow::<i32>("inter", i)?,
            narrow::<i32>("num_experts", e)?,
            narrow::<i32>("moe gate_up column blocks", col_blocks)?,
        );
        let mut args = kernel_args!(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10);
        // SAFETY: the arguments match `moe_small_gate_up_r*(const u16*, const u16*, const int*,
        // u16*, int, int, int, int, int, int, const u16*)` in order and type (the `_pf`
        // entries, the only ones that read the last, get a w2 of e * h * i elements, 16-byte
        // aligned, checked by `moe_small_gate_up_prefetch_w2`; the bound R >= t:
        // top-k routes a token to an expert once, so an expert has at most t members); x holds t * h, w13 e * 2i * h
        // and act t * k * i elements, ids t * k (checked above); expert ids are range-checked
        // by the kernel before they index w13 and pair indices stay below t * k <= 256 (its
        // shared member list); h and i are multiples of 8 and x, w13 16-byte aligned for the
        // uint4 loads (act rows of i bf16 stay 2-byte aligned); 256 threads (its launch bounds).
        unsafe {
            self.launch_programmatic(
                &f,
                (
                    narrow("moe gate_up blocks", t * k * col_blocks)?,
                    (EXPERT_WARPS * 32) as u32,
                    0,
                ),
                &mut args,
            )
        }
    }

    /// `residual[t] += bf16(sum_slot topk_weights[p] * bf16(act[p] @ w2[e]^T))` in slot order
    /// for `p = t * top_k + slot`, `e = topk_ids[p]` (ids outside `0..num_experts` contribute
    /// nothing), `w2[e]` `[hidden, inter]` as in [`CudaContext::fused_moe_bf16`]: the expert
    /// block's output added straight into the f32 residual stream (where the next layer's
    /// fused QKV GEMV normalises it). Each routed expert's rows are streamed once per call.
    ///
    /// Queue it right after the [`CudaContext::moe_small_gate_up`] that wrote `act` from the
    /// same `topk_ids`: the kernel reads the ids and starts streaming w2 before it waits for
    /// that launch, which lets it start only once everything queued before it is complete.
    pub fn moe_small_down(
        &self,
        shape: MoeShape,
        act: &impl DevicePtr<bf16>,
        w2: &impl DevicePtr<bf16>,
        topk_ids: &impl DevicePtr<i32>,
        topk_weights: &impl DevicePtr<f32>,
        residual: &mut CudaSlice<f32>,
    ) -> CudaResult<()> {
        let bufs = (act, w2, topk_ids, topk_weights);
        self.moe_small_down_prefetch(shape, bufs, residual, L2Prefetch::NONE)
    }

    /// [`CudaContext::moe_small_down`] (`(act, w2, topk_ids, topk_weights)`) whose threads
    /// also issue `prefetch` (a later kernel's weights, e.g. the next layer's QKV) into L2
    /// before the kernel waits for the gate_up launch.
    pub fn moe_small_down_prefetch(
        &self,
        shape: MoeShape,
        (act, w2, topk_ids, topk_weights): (
            &impl DevicePtr<bf16>,
            &impl DevicePtr<bf16>,
            &impl DevicePtr<i32>,
            &impl DevicePtr<f32>,
        ),
        residual: &mut CudaSlice<f32>,
        prefetch: L2Prefetch,
    ) -> CudaResult<()> {
        check_small(&shape)?;
        let MoeShape {
            tokens: t,
            hidden: h,
            inter: i,
            num_experts: e,
            top_k: k,
        } = shape;
        at_least("moe down act", act.len(), moe_small_act_len(shape))?;
        crate::check_len("moe down w2", w2.len(), e * h * i)?;
        at_least("moe down topk ids", topk_ids.len(), t * k)?;
        at_least("moe down topk weights", topk_weights.len(), t * k)?;
        at_least("moe down residual", residual.len(), t * h)?;
        let s = &self.stream;
        let (ap, _g0) = act.device_ptr(s);
        let (wp, _g1) = w2.device_ptr(s);
        let (ip, _g2) = topk_ids.device_ptr(s);
        let (tp, _g3) = topk_weights.device_ptr(s);
        let (rp, _g4) = residual.device_ptr_mut(s);
        aligned16("moe down act", ap)?;
        aligned16("moe down w2", wp)?;
        let f = self.function(moe_small_source, DOWN_FNS[down_chunks_per_lane(i) - 1])?;
        let (mut a0, mut a1, mut a2, mut a3, mut a4) = (ap, wp, ip, tp, rp);
        let smem = down_act_smem(&shape);
        let (mut a5, mut a6, mut a7, mut a8, mut a9, mut a10) = (
            narrow::<i32>("tokens", t)?,
            narrow::<i32>("top_k", k)?,
            narrow::<i32>("hidden", h)?,
            narrow::<i32>("inter", i)?,
            narrow::<i32>("num_experts", e)?,
            i32::from(smem > 0),
        );
        let blocks = narrow("moe down blocks", h.div_ceil(DOWN_ROWS))?;
        let (grid, (mut pf0, mut pf0_bytes, mut pf1, mut pf1_bytes, mut pf_work)) =
            prefetch.launch(blocks, self.info.sm_count);
        let mut args = kernel_args!(
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, pf0, pf0_bytes, pf1, pf1_bytes, pf_work
        );
        // SAFETY: the arguments match `moe_small_down_v*(const u16*, const u16*, const int*,
        // const float*, float*, int, int, int, int, int, int, L2_PREFETCH_ARGS)` in order and
        // type (the prefetch regions: u64 device addresses and byte counts, only ever
        // prefetched, never dereferenced; blocks past the working ones only prefetch and
        // exit; staging act
        // only with t * k * i * 2 bytes of dynamic shared memory, <= 32 KiB beside its 10 KiB
        // of static); act holds t * k *
        // i, w2 e * h * i, ids / weights t * k and residual t * h elements (checked above);
        // expert ids are range-checked by the kernel before they index w2; t * k <= 256 = the
        // block size (one thread per pair), t <= 8 < 32 (one lane per token) and the entry's V
        // covers a w2 row's i / 8 chunks in 32 * V (i <= MOE_SMALL_MAX_INTER); i is a multiple
        // of 8 and act, w2 16-byte aligned for the uint4 loads; each residual element is added
        // by one lane of one warp. The kernel reads the ids before its dependency wait: every
        // launcher queues it after `moe_small_gate_up`, which triggers it only after its own
        // wait, when every earlier launch (the ids' writer) is complete.
        unsafe {
            self.launch_programmatic(
                &f,
                (grid, MOE_SMALL_MAX_PAIRS as u32, smem as u32),
                &mut args,
            )
        }
    }
}

/// The device address of an optional buffer (0 for none) and the guard that keeps its stream
/// order.
pub(super) fn optional_ptr<'a>(
    v: Option<&'a CudaView<'_, f32>>,
    s: &'a CudaStream,
) -> (u64, Option<SyncOnDrop<'a>>) {
    match v {
        Some(d) => {
            let (p, g) = d.device_ptr(s);
            (p, Some(g))
        }
        None => (0, None),
    }
}

/// The router's shape check (see [`CudaContext::moe_route_fits`]).
fn check_route(s: &MoeShape) -> CudaResult<()> {
    check_hidden(s.hidden)?;
    check_routing(s.num_experts, s.top_k)?;
    let smem = route_launch(s.tokens.max(2), s.hidden, s.num_experts).smem;
    if smem > ROUTE_SMEM_MAX {
        return Err(shape_err("moe route shared bytes", ROUTE_SMEM_MAX, smem));
    }
    Ok(())
}

/// `hidden` as the small-batch kernels take it (their lanes hold a row's share in registers).
fn check_hidden(h: usize) -> CudaResult<()> {
    if h == 0 || !h.is_multiple_of(8) || h > MOE_SMALL_MAX_HIDDEN {
        return Err(shape_err(
            "small-batch moe hidden (a positive multiple of 8, at most MOE_SMALL_MAX_HIDDEN)",
            h.div_ceil(8).clamp(1, MOE_SMALL_MAX_HIDDEN / 8) * 8,
            h,
        ));
    }
    Ok(())
}

/// The shape check of every small-batch MoE launcher (see [`CudaContext::moe_small_fits`]).
pub(super) fn check_small(s: &MoeShape) -> CudaResult<()> {
    if s.tokens == 0 || s.tokens > MOE_SMALL_MAX_TOKENS {
        return Err(shape_err(
            "small-batch moe tokens (1..=MOE_SMALL_MAX_TOKENS)",
            MOE_SMALL_MAX_TOKENS,
            s.tokens,
        ));
    }
    check_hidden(s.hidden)?;
    if s.inter == 0 || !s.inter.is_multiple_of(8) || s.inter > MOE_SMALL_MAX_INTER {
        return Err(shape_err(
            "small-batch moe inter (a positive multiple of 8, at most MOE_SMALL_MAX_INTER)",
            s.inter.div_ceil(8).clamp(1, MOE_SMALL_MAX_INTER / 8) * 8,
            s.inter,
        ));
    }
    check_routing(s.num_experts, s.top_k)?;
    if s.tokens * s.top_k > MOE_SMALL_MAX_PAIRS {
        return Err(shape_err(
            "small-batch moe tokens * top_k (at most MOE_SMALL_MAX_PAIRS)",
            MOE_SMALL_MAX_PAIRS,
            s.tokens * s.top_k,
        ));
    }
    Ok(())
}
