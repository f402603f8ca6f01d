//! The MoE block of a one-token step in one launch (`kernels/moe/block1.cu`): what
//! [`CudaContext::moe_route`], [`CudaContext::moe_small_gate_up`] and
//! [`CudaContext::moe_small_down`] do for one token (post-attention norm, f32 router, top-k
//! softmax, gate_up + SiLU-and-mul over the routed experts, down, the weighted sum and the
//! residual add), with the same arithmetic in the same order (the same bits), on a grid of one
//! CTA per SM that meets at two grid barriers. Every CTA copies the routed experts' down rows
//! of its output rows into shared memory while the gate and up rows stream, so the down weights
//! load under gate_up rather than after it, and the two launch gaps between the three kernels
//! go away.
//!
//! The grid barriers need every CTA resident at once: the grid is the SM count and the
//! shared memory (the down rows: `ceil(hidden / SMs) * top_k * inter` bf16, about 210 KiB for
//! Qwen3-30B-A3B on 132 SMs) leaves room for one CTA per SM; the kernel lets its dependents
//! launch only once all of its CTAs have met, and traps (a launch error) rather than hang if a
//! barrier waits for seconds. Compute capability 9.0 only (its shared memory and programmatic
//! dependent launch).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

use super::MoeShape;
use super::small::{check_small, optional_ptr};
use super::source::topk_warp;
use crate::cuda::gemv::GEMV_COMMON;
use crate::cuda::kernels::{BF16_HELPERS, GRID_SYNC, kernel_file};
use crate::cuda::launch::{aligned16, at_least, max_dynamic_smem, narrow, shape_err};
use crate::cuda::{CudaContext, CudaResult, bf16};

/// How one-token MoE steps of a CUDA worker run (`omni_models::cuda_decoder::MoeOneLaunch`):
/// `0` on the three small-batch launches, `plain` in one launch where
/// [`CudaContext::moe_block1_fits`], `1` or `ef` that with the experts' rows read evict-first
/// in L2; unset: the model's default (`ef`).
pub const MOE_ONE_LAUNCH_ENV: &str = "OMNI_CUDA_MOE_ONE_LAUNCH";

const BLOCK1: &str = kernel_file!("moe/block1.cu");
const BLOCK1_FN: &str = "moe_block1";
/// The entry reading the experts' rows evict-first in L2 (`EF`).
const BLOCK1_EF_FN: &str = "moe_block1_ef";
/// Threads per CTA (`MB1_THREADS`).
pub(super) const THREADS: u32 = 512;
/// The most routed experts per token (`MB1_MAX_TOPK`, shared arrays).
const MAX_TOPK: usize = 32;

/// The dynamic shared memory a CTA may have on compute capability 9.0 (227 KiB less the
/// kernel's ~0.4 KiB of static shared memory, rounded down).
const SMEM_MAX: usize = 226 * 1024;

/// Per-CTA timestamps a stamped launch records (`MB1_STAMPS`): entry, after the dependency
/// wait, the logits written, after barrier 1, routed, the gate_up share done, the w2 copies
/// landed, after barrier 2, the end.
#[cfg(test)]
pub(crate) const STAMPS: usize = 9;

/// The one-launch block's grid barriers take one atomic a CTA and nothing after the last arrival
/// (the top bit of the arrival word flips when every CTA has arrived), unless this is `count`
/// (the count reset, fence and generation bump of the first form). The flip form is the default
/// since measured (H100, 2026-12-07: batch-1 decode +1%). Read once per process.
pub const MOE_BLOCK1_BARRIER_ENV: &str = "OMNI_CUDA_MOE_BLOCK1_BARRIER";

/// The define that selects the count barrier (prepended to the module's source).
pub(crate) const COUNT_BARRIER_DEFINE: &str = "#define GRID_COUNT_BARRIER\n";

/// Whether the flip barrier runs ([`MOE_BLOCK1_BARRIER_ENV`] is not `count`).
pub(crate) fn flip_barrier() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(
        || !matches!(std::env::var(MOE_BLOCK1_BARRIER_ENV), Ok(v) if v.trim() == "count"),
    )
}

/// Full source of the one-launch MoE module.
pub(crate) fn moe_block1_source() -> String {
    let count = if flip_barrier() {
        ""
    } else {
        COUNT_BARRIER_DEFINE
    };
    format!(
        "{count}{BF16_HELPERS}{GRID_SYNC}{GEMV_COMMON}{}{BLOCK1}",
        topk_warp()
    )
}

/// The buffers of [`CudaContext::moe_block1`].
#[derive(Debug)]
pub struct MoeBlock1Buffers<'a> {
    /// The f32 residual stream `[hidden]`: read, then written with the attention output (when
    /// `delta` is given) and the block's output added.
    pub residual: &'a mut CudaSlice<f32>,
    /// The attention output `[hidden]` to add into the residual first, or `None` when the
    /// residual already holds it.
    pub delta: Option<CudaView<'a, f32>>,
    /// The post-attention norm's weight `[hidden]`.
    pub norm_weight: &'a CudaSlice<bf16>,
    /// The router `[num_experts, hidden]` in f32.
    pub router: &'a CudaSlice<f32>,
    /// The experts' gate and up rows `[num_experts, 2 * inter, hidden]`.
    pub w13: &'a CudaSlice<bf16>,
    /// The experts' down rows `[num_experts, hidden, inter]`.
    pub w2: &'a CudaSlice<bf16>,
    /// Out: the normed row in bf16 `[hidden]` (what [`CudaContext::moe_route`] writes).
    pub h: CudaViewMut<'a, bf16>,
    /// Out (and scratch between the CTAs): the f32 router logits `[num_experts]`.
    pub logits: CudaViewMut<'a, f32>,
    /// Out: the routed experts `[top_k]`, in decreasing probability.
    pub topk_ids: CudaViewMut<'a, i32>,
    /// Out: their weights `[top_k]`.
    pub topk_weights: CudaViewMut<'a, f32>,
    /// Scratch: `[top_k, inter]` bf16 (the SiLU-and-mul outputs).
    pub act: CudaViewMut<'a, bf16>,
    /// The grid barrier's state: at least 2 entries, zero before the first call (e.g.
    /// `alloc_zeros`); every call leaves the first at zero. Not shared by launches that may
    /// run at the same time.
    pub barrier: &'a mut CudaSlice<i32>,
}

/// The launch of [`CudaContext::moe_block1`] on a device of `sms` SMs: output rows per CTA
/// and dynamic shared bytes.
pub(super) fn block1_launch(s: &MoeShape, sms: usize) -> (usize, usize) {
    let rows = s.hidden.div_ceil(sms.max(1));
    let w2 = rows * s.top_k * s.inter * 2;
    let xa = (s.hidden * 4)
        .max(s.top_k * s.inter * 2)
        .next_multiple_of(16);
    (rows, w2 + xa + s.hidden * 2 + s.num_experts * 4)
}

impl CudaContext {
    /// Whether [`CudaContext::moe_block1`] takes `shape` on this device: one token, a shape
    /// the small-batch kernels take, at most 32 routed experts, compute capability 9.0, and
    /// the down rows of a CTA's share of the output within its shared memory.
    pub fn moe_block1_fits(&self, shape: &MoeShape) -> bool {
        self.check_block1(shape).is_ok()
    }

    /// The shape check of [`CudaContext::moe_block1_fits`]; the launch's rows per CTA and
    /// dynamic shared bytes when it passes.
    fn check_block1(&self, s: &MoeShape) -> CudaResult<(usize, usize)> {
        if s.tokens != 1 {
            return Err(shape_err("one-launch moe tokens", 1, s.tokens));
        }
        check_small(s)?;
        if s.top_k > MAX_TOPK {
            return Err(shape_err("one-launch moe top_k", MAX_TOPK, s.top_k));
        }
        if self.info.compute_capability != (9, 0) {
            return Err(crate::Error::Metadata(format!(
                "the one-launch MoE kernel needs compute capability 9.0, not {:?}",
                self.info.compute_capability
            ))
            .into());
        }
        let (rows, smem) = block1_launch(s, self.info.sm_count);
        if smem > SMEM_MAX {
            return Err(shape_err("one-launch moe shared bytes", SMEM_MAX, smem));
        }
        Ok((rows, smem))
    }

    /// The MoE block of one token in one launch: `residual += delta` (when given), `h =
    /// bf16(rms_norm(residual) * norm_weight)`, the f32 router logits, the routing of
    /// [`CudaContext::moe_topk_softmax`] (`renormalize` is `norm_topk_prob`), then `residual
    /// += bf16(sum_slot w * bf16(down_e(bf16(silu(gate_e(h)) * up_e(h)))))`: bit for bit what
    /// [`CudaContext::moe_route`], [`CudaContext::moe_small_gate_up`] and
    /// [`CudaContext::moe_small_down`] compute and write (h, logits, ids, weights, residual).
    /// With `evict_first` the routed experts' rows are read with the evict-first L2 policy
    /// (the same values). Errors: a shape [`CudaContext::moe_block1_fits`] refuses, short
    /// buffers.
    pub fn moe_block1(
        &self,
        shape: MoeShape,
        (renormalize, eps): (bool, f32),
        b: MoeBlock1Buffers<'_>,
        evict_first: bool,
    ) -> CudaResult<()> {
        self.launch_block1(shape, (renormalize, eps), b, evict_first, 0)
    }

    /// [`CudaContext::moe_block1`] recording each CTA's [`STAMPS`] timestamps (ns) into
    /// `stamps` (`sm_count * STAMPS`).
    #[cfg(test)]
    pub(crate) fn moe_block1_stamped(
        &self,
        shape: MoeShape,
        b: MoeBlock1Buffers<'_>,
        stamps: &mut CudaSlice<u64>,
    ) -> CudaResult<()> {
        at_least(
            "moe block stamps",
            stamps.len(),
            self.info.sm_count * STAMPS,
        )?;
        let (sp, _g) = stamps.device_ptr_mut(&self.stream);
        self.launch_block1(shape, (true, 1e-6), b, false, sp)
    }

    /// The launch; `stamps`: 0 or a device buffer of `sm_count * STAMPS` u64.
    fn launch_block1(
        &self,
        shape: MoeShape,
        (renormalize, eps): (bool, f32),
        b: MoeBlock1Buffers<'_>,
        evict_first: bool,
        stamps: u64,
    ) -> CudaResult<()> {
        let (rows, smem) = self.check_block1(&shape)?;
        let MoeShape {
            hidden: h,
            inter: i,
            num_experts: e,
            top_k: k,
            ..
        } = shape;
        let MoeBlock1Buffers {
            residual,
            delta,
            norm_weight,
            router,
            w13,
            w2,
            h: mut h_out,
            mut logits,
            mut topk_ids,
            mut topk_weights,
            mut act,
            barrier,
        } = b;
        at_least("moe block residual", residual.len(), h)?;
        if let Some(d) = &delta {
            at_least("moe block delta", d.len(), h)?;
        }
        crate::check_len("moe block norm weight", norm_weight.len(), h)?;
        crate::check_len("moe block router", router.len(), e * h)?;
        crate::check_len("moe block w13", w13.len(), e * 2 * i * h)?;
        crate::check_len("moe block w2", w2.len(), e * h * i)?;
        at_least("moe block h", h_out.len(), h)?;
        at_least("moe block logits", logits.len(), e)?;
        at_least("moe block topk ids", topk_ids.len(), k)?;
        at_least("moe block topk weights", topk_weights.len(), k)?;
        at_least("moe block act", act.len(), k * i)?;
        at_least("moe block barrier", barrier.len(), 2)?;
        let s = &self.stream;
        let (res, _g0) = residual.device_ptr_mut(s);
        let (dp, _g1) = optional_ptr(delta.as_ref(), s);
        let (nw, _g2) = norm_weight.device_ptr(s);
        let (rw, _g3) = router.device_ptr(s);
        let (w13p, _g4) = w13.device_ptr(s);
        let (w2p, _g5) = w2.device_ptr(s);
        let (hp, _g6) = h_out.device_ptr_mut(s);
        let (lp, _g7) = logits.device_ptr_mut(s);
        let (ip, _g8) = topk_ids.device_ptr_mut(s);
        let (wp, _g9) = topk_weights.device_ptr_mut(s);
        let (ap, _g10) = act.device_ptr_mut(s);
        let (bp, _g11) = barrier.device_ptr_mut(s);
        for (what, p) in [
            ("moe block residual", res),
            ("moe block delta", dp),
            ("moe block router", rw),
            ("moe block w13", w13p),
            ("moe block w2", w2p),
            ("moe block h", hp),
            ("moe block act", ap),
        ] {
            aligned16(what, p)?;
        }
        let name = if evict_first { BLOCK1_EF_FN } else { BLOCK1_FN };
        let f = self.function(moe_block1_source, name)?;
        let smem = max_dynamic_smem(&f, "moe block shared bytes", smem)?;
        let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (res, dp, nw, rw, w13p, w2p);
        let (mut a6, mut a7, mut a8, mut a9, mut a10, mut a11) = (hp, lp, ip, wp, ap, bp);
        let (mut a12, mut a13, mut a14, mut a15, mut a16, mut a17, mut a18) = (
            narrow::<i32>("hidden", h)?,
            narrow::<i32>("inter", i)?,
            narrow::<i32>("num_experts", e)?,
            narrow::<i32>("top_k", k)?,
            i32::from(renormalize),
            eps,
            narrow::<i32>("moe block rows per CTA", rows)?,
        );
        let grid = narrow::<u32>("moe block CTAs", self.info.sm_count)?;
        let mut a19 = stamps;
        let mut args = kernel_args!(
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18,
            a19
        );
        // SAFETY: the arguments match `moe_block1` / `moe_block1_ef` (MB1_PARAMS: float*,
        // const float*, const u16*, const float*, const u16*, const u16*, u16*, float*, int*,
        // float*, u16*, unsigned*, int x4, int, float, int, u64*) in order and type (`stamps`
        // null or sm_count * MB1_STAMPS u64, checked by `moe_block1_stamped`), `delta` null or
        // h floats. Every buffer was
        // checked against the shape above (residual, delta, h: h elements; router e * h; w13
        // e * 2i * h; w2 e * h * i; logits e; ids / weights k <= MB1_MAX_TOPK; act k * i;
        // barrier 2 i32, read as unsigned); h and i are multiples of 8 and every vector-accessed
        // buffer is 16-byte aligned; expert ids are range-checked by the kernel before they
        // index w13 / w2. The grid is the SM count of CTAs of 512 threads (its launch bound,
        // one CTA per SM) with `block1_launch`'s dynamic shared bytes (within the opt-in limit
        // just set, checked); CTA c's output rows c * rows .. clipped to h cover 0..h once, so
        // each residual element is written by one lane. The grid barriers need every CTA
        // resident: one CTA per SM fits, the kernel triggers its dependents only after the
        // first barrier, and a barrier that waits for seconds traps instead of hanging.
        unsafe { self.launch_programmatic(&f, (grid, THREADS, smem), &mut args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-30B-A3B's block: 16 output rows a CTA and ~209 KiB of shared memory on the 132
    /// SMs of an H100 SXM / H200, within the limit; on 114 SMs (H100 PCIe) 18 rows no longer
    /// fit, so such a device keeps the three launches.
    #[test]
    fn launch_shape_of_the_30b_block() {
        let s = MoeShape {
            tokens: 1,
            hidden: 2048,
            inter: 768,
            num_experts: 128,
            top_k: 8,
        };
        let (rows, smem) = block1_launch(&s, 132);
        assert_eq!(rows, 16);
        assert_eq!(smem, 16 * 8 * 768 * 2 + 8 * 768 * 2 + 2048 * 2 + 128 * 4);
        assert!(smem <= SMEM_MAX);
        let (rows, smem) = block1_launch(&s, 114);
        assert_eq!(rows, 18);
        assert!(smem > SMEM_MAX);
        assert!(check_small(&s).is_ok());
    }
}
