//! The MoE launchers: [`CudaContext::moe_topk_softmax`] and [`CudaContext::fused_moe_bf16`].

use cudarc::driver::sys::CUfunction_attribute_enum as FnAttr;
use cudarc::driver::sys::CUstreamCaptureStatus as CaptureStatus;
use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::cublas::{DEFAULT_QUANTUM, cublas_enabled};
#[cfg(doc)]
use super::fused_moe_workspace_bytes;
use super::source::{
    ALIGN_FN, REDUCE_FN, TOPK_FN, WGMMA_ARCH, moe_source, moe_wgmma_source, moe_ws_source,
};
use super::tiles::{TileCfg, Wgmma, wgmma_env};
use super::tma;
use super::{Layout, MOE_MAX_EXPERTS, MoeShape};
#[cfg(doc)]
use crate::cuda::CudaError;
use crate::cuda::launch::{
    aligned16, block_threads, elementwise_cfg, grid_yz, max_dynamic_smem, narrow, shape_err,
};
use crate::cuda::{CudaContext, CudaResult, bf16};

/// Checks the expert count and top-k of a routing problem.
pub(super) fn check_routing(num_experts: usize, top_k: usize) -> CudaResult<()> {
    if num_experts == 0 || num_experts > MOE_MAX_EXPERTS {
        return Err(shape_err(
            "moe num_experts (1..=MOE_MAX_EXPERTS)",
            MOE_MAX_EXPERTS,
            num_experts,
        ));
    }
    if top_k == 0 || top_k > num_experts {
        return Err(shape_err("moe top_k (1..=num_experts)", num_experts, top_k));
    }
    Ok(())
}

/// Sets the dynamic shared memory limit (and the largest shared-memory carveout) a GEMM tile
/// needs. Host-side function attributes only: legal during stream capture.
fn set_smem(f: &CudaFunction, bytes: usize) -> CudaResult<()> {
    max_dynamic_smem(f, "moe shared memory", bytes)?;
    f.set_attribute(
        FnAttr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        100,
    )?;
    Ok(())
}

/// Average pairs per expert from which [`CudaContext::fused_moe_bf16`] takes cuBLAS: 1024
/// tokens of Qwen3-30B-A3B (128 experts, top-8), where the prefill tile takes 1.19x its time on
/// an H200 (517 vs 436 µs; 1.61x at 2048 tokens, 2.0x at 4096); at 768 tokens and below the
/// tile is faster (401 vs 416 µs at 768, 378 vs 409 at 512) and needs no host synchronization.
pub(super) const CUBLAS_MIN_PAIRS_PER_EXPERT: usize = 64;

/// Where the expert block's weighted sum goes: a device pointer to `tokens * hidden` elements
/// of bf16, or of f32 (the bf16-rounded sum widened: the residual stream's type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MoeOut {
    /// bf16 out.
    Bf16(u64),
    /// f32 out (the bf16 values).
    F32(u64),
}

impl MoeOut {
    fn ptr(self) -> u64 {
        match self {
            Self::Bf16(p) | Self::F32(p) => p,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// The output types of [`CudaContext::fused_moe_bf16`]: bf16, or f32 (the bf16 sum widened).
pub trait MoeOutElem: sealed::Sealed {
    /// Whether the sum is widened to f32.
    const WIDE: bool;
}

impl MoeOutElem for bf16 {
    const WIDE: bool = false;
}

impl MoeOutElem for f32 {
    const WIDE: bool = true;
}

/// The GEMMs of one fused MoE call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MoeGemm {
    /// The in-house grouped GEMM kernels with this tile (graph capturable).
    Tiles(TileCfg),
    /// cuBLAS, one batched GEMM per bucket of experts (`cublas.rs`; synchronizes once, not
    /// capturable), experts' rows rounded up to buckets of at least `quantum` rows.
    Cublas {
        /// The smallest bucket (`cublas::bucket_rows`).
        quantum: usize,
    },
}

impl CudaContext {
    /// Qwen3-MoE routing on the device: for each of `tokens` rows of `router_logits`
    /// (`[tokens, num_experts]` f32, as the CPU model computes them), softmax over all experts, the `top_k` most probable
    /// experts in decreasing probability (ties: lower expert id first) into `topk_ids`
    /// (`[tokens, top_k]`), and their probabilities into `topk_weights`, renormalised to sum to 1
    /// when `renormalize` (`norm_topk_prob`). The GPU twin of the routing in omni-models'
    /// `DecoderModel::moe`. `num_experts` is at most [`MOE_MAX_EXPERTS`]; one warp per token; no
    /// host synchronization (graph capturable).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_topk_softmax(
        &self,
        router_logits: &impl DevicePtr<f32>,
        topk_ids: &mut impl DevicePtrMut<i32>,
        topk_weights: &mut impl DevicePtrMut<f32>,
        tokens: usize,
        num_experts: usize,
        top_k: usize,
        renormalize: bool,
    ) -> CudaResult<()> {
        check_routing(num_experts, top_k)?;
        crate::check_len(
            "moe router logits",
            router_logits.len(),
            tokens * num_experts,
        )?;
        crate::check_len("moe topk ids", topk_ids.len(), tokens * top_k)?;
        crate::check_len("moe topk weights", topk_weights.len(), tokens * top_k)?;
        if tokens == 0 {
            return Ok(());
        }
        const WARPS: usize = 4;
        let cfg = LaunchConfig {
            grid_dim: (narrow::<u32>("moe tokens", tokens.div_ceil(WARPS))?, 1, 1),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: (WARPS * num_experts * 4) as u32,
        };
        let (t_i, e_i, k_i) = (
            narrow::<i32>("tokens", tokens)?,
            narrow::<i32>("num_experts", num_experts)?,
            narrow::<i32>("top_k", top_k)?,
        );
        let renorm = i32::from(renormalize);
        let f = self.function(moe_source, TOPK_FN)?;
        let (logits_p, _g0) = router_logits.device_ptr(&self.stream);
        let (ids_p, _g1) = topk_ids.device_ptr_mut(&self.stream);
        let (w_p, _g2) = topk_weights.device_ptr_mut(&self.stream);
        let mut launch = self.stream.launch_builder(&f);
        launch
            .arg(&logits_p)
            .arg(&ids_p)
            .arg(&w_p)
            .arg(&t_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&renorm);
        // SAFETY: the arguments match `moe_topk_softmax(const float*, int*, float*, int, int, int,
        // int)`; logits hold tokens * E elements and ids / weights tokens * k (checked above);
        // one warp per token (warps past `tokens` return), 4 warps per block with E floats of
        // dynamic shared memory each (E <= 1024: 16 KiB at most); 1 <= k <= E.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// The Qwen3-MoE expert block on the device, bf16 in and out with f32 accumulation:
    /// `out[t] = sum_s topk_weights[t, s] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` with
    /// `e = topk_ids[t, s]`, where expert `e` has `w13[e]` (`[2 * inter, hidden]`: `inter` gate
    /// rows then `inter` up rows) and `w2[e]` (`[hidden, inter]`), Hugging Face `[out, in]`
    /// layout. `x` and `out` are `[tokens, hidden]`, `topk_ids` / `topk_weights` `[tokens,
    /// top_k]` (e.g. from [`CudaContext::moe_topk_softmax`]); ids outside `0..num_experts` are
    /// skipped (their slot contributes nothing).
    ///
    /// `workspace` must hold at least [`fused_moe_workspace_bytes`]`(shape)` bytes. `hidden` and
    /// `inter` must be positive multiples of 8 (16-byte rows; other sizes are a
    /// [`CudaError::Shape`] error) and need not be multiples of the tiles (ragged edges are
    /// zero-filled and masked); `x`, `w13`, `w2`, `out` and `workspace` must be 16-byte aligned
    /// (whole allocations are). The result is
    /// deterministic (no float atomics), and the call is CUDA-graph capturable: no allocation,
    /// no host synchronization, launch grids that depend only on `shape`.
    ///
    /// `out` is bf16, or f32 (the residual stream's type: the same bf16 values widened, without
    /// a separate widening launch).
    #[allow(clippy::too_many_arguments)]
    pub fn fused_moe_bf16<O: MoeOutElem>(
        &self,
        x: &impl DevicePtr<bf16>,
        w13: &impl DevicePtr<bf16>,
        w2: &impl DevicePtr<bf16>,
        topk_ids: &impl DevicePtr<i32>,
        topk_weights: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<O>,
        workspace: &mut impl DevicePtrMut<u8>,
        shape: MoeShape,
    ) -> CudaResult<()> {
        let gemm = self.select_gemm(&shape)?;
        let len = out.len();
        let (p, _g) = out.device_ptr_mut(&self.stream);
        let out = (
            if O::WIDE {
                MoeOut::F32(p)
            } else {
                MoeOut::Bf16(p)
            },
            len,
        );
        self.fused_moe_on(
            x,
            w13,
            w2,
            topk_ids,
            topk_weights,
            out,
            workspace,
            shape,
            gemm,
        )
    }

    /// `moe_reduce` (both GEMM paths): `out[t] = sum_s w[t, s] * y[row(t * k + s)]`, slots in
    /// order, `row(p) = inv[p]` when `inv` is not 0, else `p`.
    ///
    /// # Safety
    /// `y`, `ids`, `weights`, `inv` and the output are device pointers on this context: ids and
    /// weights hold `shape.pairs()` elements, inv (when not 0) as many rows of y, y a row of
    /// `hidden` bf16 at every row a valid pair maps to (written before this launch in stream
    /// order), the output `tokens * hidden` elements of its type; `hidden` is a multiple of 8
    /// and y and the output are 16-byte aligned.
    pub(super) unsafe fn moe_reduce_launch(
        &self,
        (y, ids, weights, inv): (u64, u64, u64, u64),
        out: MoeOut,
        shape: &MoeShape,
        programmatic: bool,
    ) -> CudaResult<()> {
        let f_red = self.function(moe_source, REDUCE_FN)?;
        let cfg = elementwise_cfg(shape.tokens * (shape.hidden / 8));
        let (mut y, mut ids, mut weights, mut inv) = (y, ids, weights, inv);
        let (mut out16, mut out32) = match out {
            MoeOut::Bf16(p) => (p, 0u64),
            MoeOut::F32(p) => (0u64, p),
        };
        let (mut t_i, mut h_i, mut k_i, mut e_i) = (
            narrow::<i32>("tokens", shape.tokens)?,
            narrow::<i32>("hidden", shape.hidden)?,
            narrow::<i32>("top_k", shape.top_k)?,
            narrow::<i32>("num_experts", shape.num_experts)?,
        );
        let mut args = kernel_args![y, ids, weights, inv, out16, out32, t_i, h_i, k_i, e_i];
        // SAFETY: `args` points at the arguments of `moe_reduce(const u16*, const int*, const
        // float*, const int*, u16*, float*, int, int, int, int)` in order, one of the two
        // outputs null; the buffers hold what the caller's contract says, so every read row
        // (p, or inv[p], for pairs with a valid expert id) and every written element (below
        // tokens * hidden) is in bounds; the grid-stride loop stays below tokens * hidden / 8
        // and the vector accesses are 16-byte aligned.
        unsafe {
            self.launch_ex(
                &f_red,
                cfg.grid_dim,
                (cfg.block_dim.0, 0),
                programmatic,
                &mut args,
            )
        }
    }

    /// Which warpgroup-MMA tiles this device's MoE prefill steps run: on an sm_90 device as
    /// [`MOE_WGMMA_ENV`](super::MOE_WGMMA_ENV) says, else none.
    pub(super) fn moe_wgmma(&self) -> Wgmma {
        if self.info.compute_capability == (9, 0) {
            wgmma_env()
        } else {
            Wgmma::Off
        }
    }

    /// The GEMMs [`CudaContext::fused_moe_bf16`] runs `shape` on: the tile of
    /// [`TileCfg::select`]; off the warpgroup-MMA tile, cuBLAS (batched GEMMs per bucket of
    /// experts) for steps of at least [`CUBLAS_MIN_PAIRS_PER_EXPERT`] pairs per expert on
    /// average, outside a stream capture (the cuBLAS path reads the counts on the host) and
    /// unless [`MOE_CUBLAS_ENV`](super::MOE_CUBLAS_ENV) is `0`. The `mma.sync` tiles give the
    /// same bits for a token at any batch size; the warpgroup-MMA tile and the cuBLAS path
    /// differ from them in the last bits (their own summation orders; cuBLAS also rounds gate
    /// and up to bf16 before SiLU).
    pub(super) fn select_gemm(&self, shape: &MoeShape) -> CudaResult<MoeGemm> {
        let tile = TileCfg::select(shape, self.moe_wgmma());
        if tile.wgmma {
            return Ok(MoeGemm::Tiles(tile));
        }
        let large = shape.pairs() >= CUBLAS_MIN_PAIRS_PER_EXPERT * shape.num_experts;
        if large && cublas_enabled() {
            let status = self.stream.capture_status()?;
            if status == CaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                return Ok(MoeGemm::Cublas {
                    quantum: DEFAULT_QUANTUM,
                });
            }
        }
        Ok(MoeGemm::Tiles(tile))
    }

    /// [`CudaContext::fused_moe_bf16`] on the GEMMs chosen by the caller (tests run each path):
    /// checks, then runs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_moe_on(
        &self,
        x: &impl DevicePtr<bf16>,
        w13: &impl DevicePtr<bf16>,
        w2: &impl DevicePtr<bf16>,
        topk_ids: &impl DevicePtr<i32>,
        topk_weights: &impl DevicePtr<f32>,
        (out, out_len): (MoeOut, usize),
        workspace: &mut impl DevicePtrMut<u8>,
        shape: MoeShape,
        gemm: MoeGemm,
    ) -> CudaResult<()> {
        let MoeShape {
            tokens,
            hidden,
            inter,
            num_experts,
            top_k,
        } = shape;
        check_routing(num_experts, top_k)?;
        if hidden == 0 || !hidden.is_multiple_of(8) {
            return Err(shape_err(
                "fused moe hidden (a positive multiple of 8)",
                hidden.div_ceil(8).max(1) * 8,
                hidden,
            ));
        }
        if inter == 0 || !inter.is_multiple_of(8) {
            return Err(shape_err(
                "fused moe inter (a positive multiple of 8)",
                inter.div_ceil(8).max(1) * 8,
                inter,
            ));
        }
        let pairs = shape.pairs();
        crate::check_len("fused moe x", x.len(), tokens * hidden)?;
        crate::check_len("fused moe w13", w13.len(), num_experts * 2 * inter * hidden)?;
        crate::check_len("fused moe w2", w2.len(), num_experts * hidden * inter)?;
        crate::check_len("fused moe topk ids", topk_ids.len(), pairs)?;
        crate::check_len("fused moe topk weights", topk_weights.len(), pairs)?;
        crate::check_len("fused moe out", out_len, tokens * hidden)?;
        aligned16("fused moe out", out.ptr())?;
        let tile = match gemm {
            MoeGemm::Tiles(tile) => tile,
            MoeGemm::Cublas { quantum } => {
                return self.fused_moe_cublas(
                    x,
                    w13,
                    w2,
                    topk_ids,
                    topk_weights,
                    out,
                    workspace,
                    shape,
                    quantum,
                );
            }
        };
        let lay = Layout::new(&shape, &tile);
        if workspace.len() < lay.total {
            return Err(shape_err(
                "fused moe workspace bytes (at least fused_moe_workspace_bytes)",
                lay.total,
                workspace.len(),
            ));
        }
        if tokens == 0 {
            return Ok(());
        }
        // Every int the kernels take, and the row products they form in int.
        let (mut h_i, mut i_i, mut e_i, mut k_i) = (
            narrow::<i32>("hidden", hidden)?,
            narrow::<i32>("inter", inter)?,
            narrow::<i32>("num_experts", num_experts)?,
            narrow::<i32>("top_k", top_k)?,
        );
        narrow::<i32>("tokens", tokens)?;
        narrow::<i32>("2 * inter", 2 * inter)?;
        let mut p_i = narrow::<i32>("tokens * top_k", pairs)?;
        let mut bm_i = narrow::<i32>("moe tile rows", tile.bm)?;
        let mut mb_i = narrow::<i32>("moe row blocks", lay.max_blocks)?;
        narrow::<i32>("moe sorted rows", lay.max_blocks * tile.bm)?;
        let blocks_y = grid_yz("moe row blocks (grid y, at most 65535)", lay.max_blocks)?;

        let f_align = self.function(moe_source, ALIGN_FN)?;
        let (f_gu, f_down) = if tile.wgmma {
            let (major, minor) = self.info.compute_capability;
            if (major, minor) != (9, 0) {
                return Err(shape_err(
                    "moe warpgroup-MMA tile: compute capability (sm_90 only)",
                    90,
                    (major * 10 + minor).max(0) as usize,
                ));
            }
            let source = if tile.producer_warps > 0 {
                moe_ws_source
            } else {
                moe_wgmma_source
            };
            (
                self.function_for(source, tile.gate_up_fn, WGMMA_ARCH)?,
                self.function_for(source, tile.down_fn, WGMMA_ARCH)?,
            )
        } else {
            (
                self.function(moe_source, tile.gate_up_fn)?,
                self.function(moe_source, tile.down_fn)?,
            )
        };
        let smem = tile.smem_bytes();
        set_smem(&f_gu, smem)?;
        set_smem(&f_down, smem)?;

        let (x_p, _gx) = x.device_ptr(&self.stream);
        let (w13_p, _g13) = w13.device_ptr(&self.stream);
        let (w2_p, _g2) = w2.device_ptr(&self.stream);
        let (mut ids_p, _gi) = topk_ids.device_ptr(&self.stream);
        let (tw_p, _gw) = topk_weights.device_ptr(&self.stream);
        let (ws_p, _gws) = workspace.device_ptr_mut(&self.stream);
        aligned16("fused moe x", x_p)?;
        aligned16("fused moe w13", w13_p)?;
        aligned16("fused moe w2", w2_p)?;
        aligned16("fused moe workspace", ws_p)?;
        let mut sorted_p = ws_p + lay.sorted as u64;
        let mut bexp_p = ws_p + lay.block_expert as u64;
        let act_p = ws_p + lay.act as u64;
        let y_p = ws_p + lay.y as u64;

        // Launched with programmatic dependent launch: each kernel's first statement lets the
        // next one launch and then waits for its predecessor (`pdl_enter`), so the launch
        // gaps of the four kernels overlap their predecessors' tails.

        // 1. Alignment by expert.
        let align_threads = block_threads(pairs.max(num_experts), 1024);
        let mut args = kernel_args![ids_p, p_i, e_i, bm_i, mb_i, sorted_p, bexp_p];
        // SAFETY: `args` points at the arguments of `moe_align(const int*, int, int, int, int,
        // int*, int*)` in order (device pointers as CUdeviceptr = u64); ids hold `pairs` ints
        // (checked above); sorted_ids (max_blocks * bm ints) and block_expert (max_blocks ints)
        // lie inside the workspace (its length was checked against the layout) and every write
        // is bounded by max_blocks; one CTA of a multiple of 32 threads, at most 1024, with
        // (32 + 3 E) ints of dynamic shared memory (E <= 1024). It touches memory only after
        // its griddepcontrol.wait.
        unsafe {
            self.launch_ex(
                &f_align,
                (1, 1, 1),
                (align_threads, ((32 + 3 * num_experts) * 4) as u32),
                true,
                &mut args,
            )
        }?;

        // 2. gate_up GEMM + SiLU-and-mul into act, then 3. down GEMM into y (pair order).
        let threads = tile.threads() as u32;
        // The warp-specialized tiles are persistent: one grid row of CTAs (at most what the
        // SMs hold at once) loops over the n tiles x row blocks.
        let grid_of = |n_tiles: usize| -> CudaResult<(u32, u32, u32)> {
            if tile.producer_warps > 0 {
                let ctas = (n_tiles * lay.max_blocks).min(self.info.sm_count * tile.min_ctas);
                Ok((narrow::<u32>("moe persistent CTAs", ctas.max(1))?, 1, 1))
            } else {
                Ok((narrow::<u32>("moe N tiles", n_tiles)?, blocks_y, 1))
            }
        };
        // TMA tiles read the weights through tensor maps (the entries' last parameter).
        let (map13, map2) = if tile.tma {
            (
                tma::weight_map(w13_p, num_experts * 2 * inter, hidden)?,
                tma::weight_map(w2_p, num_experts * hidden, inter)?,
            )
        } else {
            // SAFETY: plain data; never passed to a kernel (the non-TMA entries have no such
            // parameter).
            unsafe { std::mem::zeroed() }
        };
        let nargs = 8 + usize::from(tile.producer_warps > 0) + usize::from(tile.tma);
        let gemms = [
            (&f_gu, inter.div_ceil(tile.bn / 2), x_p, w13_p, act_p, map13),
            (&f_down, hidden.div_ceil(tile.bn), act_p, w2_p, y_p, map2),
        ];
        for (f, n_tiles, a_p, w_p, dst_p, map) in gemms {
            let (mut a_p, mut w_p, mut dst_p, mut map) = (a_p, w_p, dst_p, map);
            let mut args =
                kernel_args![a_p, w_p, sorted_p, bexp_p, dst_p, h_i, i_i, k_i, mb_i, map];
            // SAFETY: `args[..nargs]` points at the arguments of the gate_up / down entry
            // `(const u16* a, const u16* w, const int*, const int*, u16* dst, int, int, int)`,
            // warp-specialized entries followed by `int max_blocks` (the row blocks the
            // alignment laid out, sorted_ids' rows / bm) and, TMA ones, the `MoeTensorMap` of w
            // (128 bytes, by value), in order. gate_up: x holds tokens * hidden and w13
            // E * 2I * H elements (checked above; its map spans exactly them) and every row read
            // is a token id p / k < tokens (p < pairs comes from the alignment) or an expert
            // e < E; act (max_blocks * bm rows of inter) lies in the workspace. down: the act
            // rows read are the sorted positions of used blocks, all written by the gate_up
            // launch before it on this stream; w2 holds E * H * I elements (its map spans
            // exactly them); y (pairs * hidden, in the workspace) is written at row p < pairs
            // only. Rows or columns past the shapes are zero-filled, not read; the grid's y is
            // max_blocks (blocks the alignment left unused, -1, exit), or a persistent grid's
            // CTAs visit each (N tile, row block) once; the block size and dynamic shared
            // memory match the template instance (attribute set above). Memory is touched only
            // after griddepcontrol.wait.
            unsafe {
                self.launch_ex(
                    f,
                    grid_of(n_tiles)?,
                    (threads, smem as u32),
                    true,
                    &mut args[..nargs],
                )
            }?;
        }

        // 4. Weighted reduction into out.
        // SAFETY: y (pairs * hidden bf16, in the workspace) is in pair order (inv 0) with the
        // rows of valid ids written by step 3; ids / weights hold pairs elements and out
        // tokens * hidden of its type (checked above); hidden is a multiple of 8 and every
        // pointer 16-byte aligned.
        unsafe { self.moe_reduce_launch((y_p, ids_p, tw_p, 0), out, &shape, true) }?;
        Ok(())
    }
}
