//! The MoE router of long steps on tensor cores, to f32 accuracy: `logits[t, e] = x[t] .
//! router[e]` where x is the post-attention norm's f32 output. Routing is a top-k over nearly
//! equal logits, so bf16 inputs would flip it; cuBLAS's SGEMM keeps f32 but runs on the CUDA
//! cores (44 µs a layer for a 2048-token Qwen3-30B-A3B prefill on an H100, the f32 rows
//! written and read on top).
//!
//! Here both sides are sums of bf16 terms whose products a bf16 GEMM forms exactly (8-bit
//! significands: 16-bit products) and adds in f32: the norm writes x = hi + mid + lo exactly
//! (`hi` its bf16 output, `[mid | lo]` through [`super::super::NormExtra::out_lo`]); the
//! router is `w = w_hi + w_lo` ([`crate::linalg::split_bf16`]), `w_lo` zero for a bf16
//! checkpoint (then left out). Three GEMMs with f32 output:
//!
//! 1. `logits = [mid | lo] . [w_hi | w_hi]^T` (K = 2 hidden),
//! 2. `logits += hi . w_hi^T`,
//! 3. `logits += hi . w_lo^T` (only with `w_lo`).
//!
//! The dropped terms (`mid . w_lo`, `lo . w_lo`, and `w` past `w_hi + w_lo`) are below 2^-16
//! of a product, and none with a bf16 checkpoint: the sums differ from the SGEMM's only in
//! their order.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::super::launch::at_least;
use super::super::layers::BlasGemm;
use super::super::{CudaContext, CudaResult};

/// A router matrix (`[num_experts, hidden]`) as [`CudaContext::moe_router_split`] reads it.
#[derive(Debug)]
pub struct RouterSplit {
    /// `[num_experts, 2 hidden]`: each row `w_hi` twice.
    pub(super) hi2: CudaSlice<bf16>,
    /// `[num_experts, hidden]`: `w - w_hi` in bf16; `None` when every weight is a bf16 value.
    pub(super) lo: Option<CudaSlice<bf16>>,
    pub(super) num_experts: usize,
    pub(super) hidden: usize,
}

impl RouterSplit {
    /// Splits and uploads the f32 router `w` (`[num_experts, hidden]`, row-major).
    pub fn upload(
        cx: &CudaContext,
        w: &[f32],
        num_experts: usize,
        hidden: usize,
    ) -> CudaResult<Self> {
        crate::check_len("cuda router", w.len(), num_experts * hidden)?;
        let (hi, lo) = crate::linalg::split_bf16(w);
        let mut hi2 = Vec::with_capacity(2 * hi.len());
        for row in hi.chunks(hidden.max(1)) {
            hi2.extend_from_slice(row);
            hi2.extend_from_slice(row);
        }
        let s = cx.stream();
        let lo = if lo.iter().all(|v| v.to_f32() == 0.0) {
            None
        } else {
            Some(s.clone_htod(&lo)?)
        };
        Ok(Self {
            hi2: s.clone_htod(&hi2)?,
            lo,
            num_experts,
            hidden,
        })
    }

    /// Whether the router had weights that are not bf16 values (a third GEMM runs).
    pub fn has_lo(&self) -> bool {
        self.lo.is_some()
    }
}

impl CudaContext {
    /// `logits[t, e]` (f32, `[tokens, num_experts]`) of the normed rows `h` (bf16,
    /// `[tokens, hidden]`) and `h_lo` (`[tokens, 2 hidden]`, the rest past `h`:
    /// [`super::super::NormExtra::out_lo`]) against `router`, to f32 accuracy (module docs).
    pub fn moe_router_split(
        &self,
        h: &impl DevicePtr<bf16>,
        h_lo: &impl DevicePtr<bf16>,
        router: &RouterSplit,
        logits: &mut impl DevicePtrMut<f32>,
        tokens: usize,
    ) -> CudaResult<()> {
        let (e, hd) = (router.num_experts, router.hidden);
        at_least("cuda router h", h.len(), tokens * hd)?;
        at_least("cuda router h_lo", h_lo.len(), tokens * 2 * hd)?;
        at_least("cuda router logits", logits.len(), tokens * e)?;
        if tokens == 0 || e == 0 {
            return Ok(());
        }
        let g = |a, lda, w, ldw, k, beta| BlasGemm {
            a,
            lda,
            w,
            ldw,
            m: tokens,
            k,
            n: e,
            beta,
        };
        let s = &self.stream;
        let (hp, _g1) = h.device_ptr(s);
        let (lp, _g2) = h_lo.device_ptr(s);
        let (wp, _g3) = router.hi2.device_ptr(s);
        let (op, _g4) = logits.device_ptr_mut(s);
        // SAFETY: for all three GEMMs, the pointers are device allocations of at least the lengths
        // checked above (h: tokens * hidden, h_lo: tokens * 2 hidden, hi2: num_experts * 2
        // hidden, lo: num_experts * hidden, logits: tokens * num_experts), and each GEMM reads
        // k <= its leading dimension elements of each row.
        unsafe {
            self.gemm_bf16_f32(g(lp, 2 * hd, wp, 2 * hd, 2 * hd, 0.0), op)?;
            self.gemm_bf16_f32(g(hp, hd, wp, 2 * hd, hd, 1.0), op)?;
            if let Some(lo) = &router.lo {
                let (lop, _g5) = lo.device_ptr(s);
                self.gemm_bf16_f32(g(hp, hd, lop, hd, hd, 1.0), op)?;
            }
        }
        Ok(())
    }
}
