//! The router of long steps and its top-k in one launch on tensor cores
//! (`kernels/moe/route_mma.cu`, opt-in [`MOE_ROUTE_MMA_ENV`]): the split-bf16 router's sums
//! (`router.rs`: `hi + mid + lo` against `w_hi` (+ `w_lo`), each product exact, summed in f32)
//! by `mma.sync` over [`ROUTE_BM`]-token blocks and [`ROUTE_KC`]-column splits of the hidden
//! dimension, the splits' partials added in split order by the block's last CTA, which then
//! routes its tokens as [`CudaContext::moe_topk_softmax`] does. It replaces the router's two
//! or three cuBLAS GEMMs (N = the expert count, 128: a narrow grid) and the top-k launch.
//!
//! The split depends on the hidden size alone, so a token's logits have the same bits in any
//! batch. A CPU emulator of the kernel's copies, `ldmatrix` fragments, MMAs, partial layout
//! and fix-up is in `route_mma_emu.rs`; the GPU test in `router_tests.rs`.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::RouterSplit;
use super::launch::check_routing;
use super::source::moe_source;
use crate::cuda::launch::{aligned16, at_least, grid_yz, max_dynamic_smem, narrow, shape_err};
use crate::cuda::{CudaContext, CudaResult};

/// `1`: MoE layers of steps of at least [`ROUTE_MMA_MIN_TOKENS`] tokens route with
/// [`CudaContext::moe_route_mma`] (one launch) instead of [`CudaContext::moe_router_split`]
/// and [`CudaContext::moe_topk_softmax`]. Off by default: measured slower end to end (H100,
/// 2026-12-07: the 2048-token prefill 42.0 against 41.0 ms, interleaved twice; the kernel's
/// 2.74 ms a step against the pair's 2.73 in the profile). Read once per process.
pub const MOE_ROUTE_MMA_ENV: &str = "OMNI_CUDA_MOE_ROUTE_MMA";

/// [`MOE_ROUTE_MMA_ENV`] as read once per process.
pub fn moe_route_mma_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::cuda::switch_opt_in(MOE_ROUTE_MMA_ENV))
}

/// Tokens a CTA takes (`MR_BM`).
pub(super) const ROUTE_BM: usize = 64;
/// Hidden columns a pipeline stage holds (`MR_BK`).
pub(super) const ROUTE_BK: usize = 32;
/// Pipeline stages (`MR_STAGES`).
pub(super) const ROUTE_STAGES: usize = 4;
/// Hidden columns of one split (`MR_KC`).
pub(super) const ROUTE_KC: usize = 512;
/// Threads of a CTA (`MR_THREADS`).
pub(super) const ROUTE_THREADS: usize = 256;
/// Most experts: the 128 weight rows a CTA covers.
pub const ROUTE_MMA_MAX_EXPERTS: usize = 128;
/// Fewest tokens the decoder routes with [`CudaContext::moe_route_mma`]: its grid is 4 CTAs a
/// 64-token block at Qwen3-30B-A3B's hidden size, too few below a few hundred tokens (a
/// batch-64 decode step would run 4 CTAs), where the GEMMs and the top-k kernel stay.
pub const ROUTE_MMA_MIN_TOKENS: usize = 256;

const ROUTE_FN: &str = "moe_route_mma";
const ROUTE_LO_FN: &str = "moe_route_mma_lo";

/// Splits of the hidden dimension (grid y).
pub(super) fn route_splits(hidden: usize) -> usize {
    hidden.div_ceil(ROUTE_KC).max(1)
}

/// Dynamic shared memory of the kernel: the stages (3 token tiles and 1 or 2 weight tiles of
/// `ROUTE_BK + 8` bf16 rows); the fix-up's `[ROUTE_BM][E]` f32 logits reuse them.
pub(super) fn route_smem_bytes(has_lo: bool) -> usize {
    let rows = 3 * ROUTE_BM + if has_lo { 2 } else { 1 } * ROUTE_MMA_MAX_EXPERTS;
    ROUTE_STAGES * rows * (ROUTE_BK + 8) * 2
}

/// Elements of the two workspaces [`CudaContext::moe_route_mma`] takes for up to `tokens`
/// tokens: the f32 partial sums (`splits x padded tokens x experts`) and the per-block counters
/// (i32, zero before the first launch; each launch leaves them zero).
pub fn moe_route_mma_workspace_len(
    tokens: usize,
    hidden: usize,
    num_experts: usize,
) -> (usize, usize) {
    let blocks = tokens.div_ceil(ROUTE_BM).max(1);
    (
        route_splits(hidden) * blocks * ROUTE_BM * num_experts,
        blocks,
    )
}

/// The device buffers of one [`CudaContext::moe_route_mma`] call.
#[derive(Debug)]
pub struct RouteMmaBuffers<'a, P, C, L, I, W> {
    /// The partial sums ([`moe_route_mma_workspace_len`]'s first length, at least).
    pub partials: &'a mut P,
    /// The per-block counters (its second length, at least; zero between launches).
    pub counters: &'a mut C,
    /// Where the logits go (`[tokens, E]` f32), or `None`.
    pub logits: Option<&'a mut L>,
    /// `[tokens, top_k]` expert ids out.
    pub ids: &'a mut I,
    /// `[tokens, top_k]` weights out.
    pub weights: &'a mut W,
}

impl CudaContext {
    /// Whether [`CudaContext::moe_route_mma`] takes `router`: at most
    /// [`ROUTE_MMA_MAX_EXPERTS`] experts and a hidden size that is a multiple of 8.
    pub fn moe_route_mma_fits(router: &RouterSplit) -> bool {
        let (e, h) = (router.num_experts, router.hidden);
        (1..=ROUTE_MMA_MAX_EXPERTS).contains(&e) && h > 0 && h.is_multiple_of(8)
    }

    /// Router logits of the normed rows `h` (bf16 `[tokens, hidden]`) and `h_lo` (`[tokens,
    /// 2 hidden]`, as [`CudaContext::moe_router_split`] takes them), to f32 accuracy, and their
    /// top-k softmax routing (as [`CudaContext::moe_topk_softmax`]: ties to the lower expert id,
    /// optional renormalisation), in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route_mma<P, C, L, I, W>(
        &self,
        h: &impl DevicePtr<bf16>,
        h_lo: &impl DevicePtr<bf16>,
        router: &RouterSplit,
        bufs: RouteMmaBuffers<'_, P, C, L, I, W>,
        tokens: usize,
        top_k: usize,
        renormalize: bool,
    ) -> CudaResult<()>
    where
        P: DevicePtrMut<f32>,
        C: DevicePtrMut<i32>,
        L: DevicePtrMut<f32>,
        I: DevicePtrMut<i32>,
        W: DevicePtrMut<f32>,
    {
        let (e, hd) = (router.num_experts, router.hidden);
        if !Self::moe_route_mma_fits(router) {
            return Err(shape_err(
                "moe route mma: experts (at most 128) and hidden (a multiple of 8)",
                ROUTE_MMA_MAX_EXPERTS,
                e,
            ));
        }
        check_routing(e, top_k)?;
        at_least("moe route mma h", h.len(), tokens * hd)?;
        at_least("moe route mma h_lo", h_lo.len(), tokens * 2 * hd)?;
        let (part_len, cnt_len) = moe_route_mma_workspace_len(tokens, hd, e);
        at_least("moe route mma partials", bufs.partials.len(), part_len)?;
        at_least("moe route mma counters", bufs.counters.len(), cnt_len)?;
        at_least("moe route mma ids", bufs.ids.len(), tokens * top_k)?;
        at_least("moe route mma weights", bufs.weights.len(), tokens * top_k)?;
        if let Some(l) = &bufs.logits {
            at_least("moe route mma logits", l.len(), tokens * e)?;
        }
        if tokens == 0 {
            return Ok(());
        }
        let has_lo = router.lo.is_some();
        let f = self.function(moe_source, if has_lo { ROUTE_LO_FN } else { ROUTE_FN })?;
        let smem = max_dynamic_smem(&f, "moe route mma shared memory", route_smem_bytes(has_lo))?;
        let cfg = LaunchConfig {
            grid_dim: (
                narrow::<u32>("moe route mma blocks", tokens.div_ceil(ROUTE_BM))?,
                grid_yz("moe route mma splits", route_splits(hd))?,
                1,
            ),
            block_dim: (ROUTE_THREADS as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        narrow::<i32>("moe route mma partials", part_len)?;
        let (t_i, h_i, e_i, k_i) = (
            narrow::<i32>("tokens", tokens)?,
            narrow::<i32>("hidden", hd)?,
            narrow::<i32>("num_experts", e)?,
            narrow::<i32>("top_k", top_k)?,
        );
        let renorm = i32::from(renormalize);
        let s = &self.stream;
        let (hp, _g0) = h.device_ptr(s);
        let (lp, _g1) = h_lo.device_ptr(s);
        let (wp, _g2) = router.hi2.device_ptr(s);
        let lo = router.lo.as_ref().map(|l| l.device_ptr(s));
        let lop = lo.as_ref().map_or(0, |(p, _)| *p);
        for (what, p) in [("moe route mma h", hp), ("moe route mma h_lo", lp)] {
            aligned16(what, p)?;
        }
        let (pp, _g3) = bufs.partials.device_ptr_mut(s);
        let (cp, _g4) = bufs.counters.device_ptr_mut(s);
        let logits = bufs.logits.map(|l| l.device_ptr_mut(s));
        let logits_p = logits.as_ref().map_or(0, |(p, _)| *p);
        // The fix-up moves the partials and logits as float4s.
        aligned16("moe route mma partials", pp)?;
        if logits_p != 0 {
            aligned16("moe route mma logits", logits_p)?;
        }
        let (ip, _g5) = bufs.ids.device_ptr_mut(s);
        let (wtp, _g6) = bufs.weights.device_ptr_mut(s);
        let mut launch = s.launch_builder(&f);
        launch
            .arg(&hp)
            .arg(&lp)
            .arg(&wp)
            .arg(&lop)
            .arg(&pp)
            .arg(&cp)
            .arg(&logits_p)
            .arg(&ip)
            .arg(&wtp)
            .arg(&t_i)
            .arg(&h_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&renorm);
        // SAFETY: the arguments match `moe_route_mma(_lo)(const u16* h, const u16* h_lo, const
        // u16* w_hi2, const u16* w_lo, float* part, int* cnt, float* logits, int* ids, float*
        // wts, int tokens, int hidden, int num_experts, int top_k, int renorm)`. Lengths are
        // checked above: h tokens * hidden, h_lo tokens * 2 hidden (16-byte aligned, as are the
        // partials and the logits, which the fix-up reads and writes as float4s; hidden a
        // multiple of 8: every 16-byte copy is aligned and inside its row), hi2 E * 2 hidden
        // and lo E * hidden (RouterSplit's own allocations; lo passed only to the `_lo` entry,
        // null otherwise and never read), the partials and counters as
        // `moe_route_mma_workspace_len` sizes them for this grid (counters zero between
        // launches: each launch's last CTAs reset them), logits tokens * E or null, ids and
        // weights tokens * top_k; 1 <= top_k <= E <= 128. Dynamic shared memory as the
        // kernel's stages need (raised above), which also holds the fix-up's 64 x E floats.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_and_workspace_depend_on_the_hidden_size() {
        assert_eq!(route_splits(2048), 4);
        assert_eq!(route_splits(512), 1);
        assert_eq!(route_splits(520), 2);
        assert_eq!(route_splits(4096), 8);
        // Qwen3-30B-A3B at 4096 tokens: 4 splits x 64 blocks x 64 rows x 128 experts.
        assert_eq!(
            moe_route_mma_workspace_len(4096, 2048, 128),
            (4 * 4096 * 128, 64)
        );
        assert_eq!(moe_route_mma_workspace_len(1, 384, 16), (64 * 16, 1));
        // The fix-up's logits fit the stages' shared memory.
        assert!(route_smem_bytes(false) >= ROUTE_BM * ROUTE_MMA_MAX_EXPERTS * 4);
        assert_eq!(route_smem_bytes(false), 102_400);
        assert_eq!(route_smem_bytes(true), 143_360);
    }
}
