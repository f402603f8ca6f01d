//! The staged GEMV (`gemv_staged_r*` in `kernels/gemv.cu`): the small-batch GEMV with each
//! block's weight rows copied into shared memory by the copy engine before the block's
//! dependency wait.
//!
//! A decode step of a few tokens spends much of a layer in latency-bound kernels (the input
//! norm, q/k norm + RoPE + cache, decode attention) while the memory bus idles, and the weight
//! GEMMs behind them are too short to reach the bus's rate. Launched with programmatic dependent
//! launch, a staged GEMV's blocks start while those kernels run (each of them lets its
//! dependents launch first thing) and pull their weights in under them; after the wait a block
//! reads only x. One block per SM owns a contiguous run of output rows, so its weights are one
//! region; what does not fit the shared-memory budget ([`STAGED_GEMV_KB_ENV`]) is streamed
//! after the wait as [`CudaContext::gemv_nt_bf16`] streams it. The sums are that kernel's, in
//! its order: the same bits.
//!
//! Off unless [`STAGED_GEMV_ENV`] names the most tokens a step may have to take it (sm_90 and
//! later: the copies are `cp.async.bulk`). Blocks of ~130-160 KiB of shared memory only land
//! beside the kernels they overlap when those left the SM's shared memory carve-out at its
//! largest, so while the staged GEMV is on every kernel this context loads asks for the
//! largest carve-out ([`SMEM_CARVEOUT_ENV`] overrides it).

use std::sync::OnceLock;

use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, sys};
use half::bf16;

use super::super::launch::{aligned16, at_least, max_dynamic_smem, narrow, shape_err};
use super::super::{CudaContext, CudaResult};
use super::{GEMV_MAX_ROWS, GemvIn, IN_NORM, IN_X, OUT_BF16, OUT_F32, gemv_source};

/// Steps of at most this many tokens (at most [`GEMV_MAX_ROWS`]) run their QKV and output
/// projections on the staged GEMV where its plan stages every row ([`StagedPlan::is_whole`]);
/// 0: off; unset: [`DEFAULT_STAGED_TOKENS`].
pub const STAGED_GEMV_ENV: &str = "OMNI_CUDA_STAGED_GEMV_TOKENS";
/// [`STAGED_GEMV_ENV`]'s default: one-token steps. On an H100 (Qwen3-30B-A3B) batch 1 went
/// 187.5 -> 200.1 tok/s with it, and 204 -> 212 with the RoPE inside decode attention; at 4 and
/// 8 tokens it lost (-5% at batch 4, `bench/results/gpu-decode-h100-2026-12-07.md`).
pub const DEFAULT_STAGED_TOKENS: usize = 1;
/// The staged GEMV's shared-memory budget per block, KiB (default [`DEFAULT_STAGED_KB`]).
pub const STAGED_GEMV_KB_ENV: &str = "OMNI_CUDA_STAGED_GEMV_KB";
/// Set to `0`, a staged QKV projection leaves the input norm to its own kernel.
pub const STAGED_GEMV_NORM_ENV: &str = "OMNI_CUDA_STAGED_GEMV_NORM";
/// The shared-memory carve-out (percent, 0-100) every kernel asks for; default 100 while the
/// staged GEMV is on, the driver's choice otherwise; -1: the driver's choice.
pub const SMEM_CARVEOUT_ENV: &str = "OMNI_CUDA_SMEM_CARVEOUT";
/// Default shared-memory budget of a staged block, KiB: the 30B-A3B QKV of a one-token step
/// (156 KiB of weights a block on 132 SMs, 4 KiB of input) fits, and ~60 KiB of an SM stay for
/// the blocks it overlaps.
pub const DEFAULT_STAGED_KB: usize = 168;
/// The most shared memory a block may ask for on sm_90 (227 KiB).
const SMEM_OPTIN_MAX: usize = 227 * 1024;
/// The kernel's `GS_BAR_BYTES`: its mbarriers ahead of the staged rows.
const BAR_BYTES: usize = 256;
/// The kernel's `GS_WARPS` (rows of one mbarrier group) and `GS_MAX_GROUPS`.
const WARPS: usize = 8;
const MAX_GROUPS: usize = 32;
const STAGED_FNS: [&str; 4] = [
    "gemv_staged_r1",
    "gemv_staged_r2",
    "gemv_staged_r4",
    "gemv_staged_r8",
];

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// [`STAGED_GEMV_ENV`], read once (at most [`GEMV_MAX_ROWS`]).
fn staged_tokens_env() -> usize {
    static V: OnceLock<usize> = OnceLock::new();
    *V.get_or_init(|| {
        env_usize(STAGED_GEMV_ENV)
            .unwrap_or(DEFAULT_STAGED_TOKENS)
            .min(GEMV_MAX_ROWS)
    })
}

/// [`STAGED_GEMV_KB_ENV`] in bytes, read once.
fn staged_budget() -> usize {
    static V: OnceLock<usize> = OnceLock::new();
    *V.get_or_init(|| {
        (env_usize(STAGED_GEMV_KB_ENV).unwrap_or(DEFAULT_STAGED_KB) * 1024).min(SMEM_OPTIN_MAX)
    })
}

/// The carve-out every loaded kernel asks for (see [`SMEM_CARVEOUT_ENV`]), read once.
pub(crate) fn smem_carveout() -> Option<i32> {
    static V: OnceLock<Option<i32>> = OnceLock::new();
    *V.get_or_init(|| {
        match std::env::var(SMEM_CARVEOUT_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<i32>().ok())
        {
            Some(p) if p < 0 => None,
            Some(p) => Some(p.min(100)),
            None => (staged_tokens_env() > 0).then_some(100),
        }
    })
}

/// Asks for `f`'s shared-memory carve-out when one is set ([`smem_carveout`]); a hint the
/// driver may round, so a failure is not an error.
pub(crate) fn apply_carveout(f: &CudaFunction) {
    if let Some(p) = smem_carveout() {
        let _ = f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            p,
        );
    }
}

/// How one staged GEMV is launched: a pure function of the shape, the SM count and the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedPlan {
    /// Blocks (at most one per SM).
    pub blocks: usize,
    /// Output rows per block (the last block may have fewer).
    pub rows_per_block: usize,
    /// Leading rows of each block copied into shared memory.
    pub staged_rows: usize,
    /// Shared bytes of the input rows ahead of the weights.
    pub input_bytes: usize,
}

impl StagedPlan {
    /// The plan for `n` output rows of width `k` and `rows` input rows over `sms` SMs with
    /// `budget` bytes of shared memory a block.
    pub fn new(n: usize, k: usize, rows: usize, sms: usize, budget: usize) -> Self {
        let input_bytes = input_bytes(rows, k);
        let rows_per_block = n.div_ceil(sms.max(1)).max(1);
        let fit = budget.saturating_sub(BAR_BYTES + input_bytes) / (2 * k).max(1);
        Self {
            blocks: n.div_ceil(rows_per_block),
            rows_per_block,
            staged_rows: rows_per_block.min(fit).min(WARPS * MAX_GROUPS),
            input_bytes,
        }
    }

    /// Every row of every block is staged (none streamed after the wait): the only plans
    /// measured to gain (a layer whose weights exceed the SMs' budget keeps cuBLAS).
    pub fn is_whole(&self) -> bool {
        self.staged_rows == self.rows_per_block
    }

    /// Dynamic shared memory of a block for rows of width `k`.
    pub fn smem_bytes(&self, k: usize) -> usize {
        BAR_BYTES + self.input_bytes + self.staged_rows * k * 2
    }

    /// Every output row's (block, row within the block, staged), in row order: the host mirror
    /// of the kernel's ownership.
    pub fn owners(&self, n: usize) -> Vec<(usize, usize, bool)> {
        (0..n)
            .map(|o| {
                let (b, j) = (o / self.rows_per_block, o % self.rows_per_block);
                (b, j, j < self.staged_rows)
            })
            .collect()
    }
}

/// The kernel's shared bytes for `rows` input rows of width `k` (128-byte multiples).
fn input_bytes(rows: usize, k: usize) -> usize {
    (rows * k * 2).div_ceil(128) * 128
}

/// The input of a staged GEMV, resolved to the kernel's arguments.
struct StagedIn {
    x: u64,
    residual: u64,
    norm_w: u64,
    mode: i32,
    set: i32,
    eps: f32,
}

impl StagedIn {
    /// x from memory.
    fn x(x: u64) -> Self {
        Self {
            x,
            residual: 0,
            norm_w: 0,
            mode: IN_X,
            set: 0,
            eps: 0.0,
        }
    }
}

impl CudaContext {
    /// The most tokens a step may have to run its projections on the staged GEMV (0: off,
    /// and always 0 below compute capability 9.0).
    pub fn staged_gemv_tokens(&self) -> usize {
        if self.info.compute_capability.0 >= 9 {
            staged_tokens_env()
        } else {
            0
        }
    }

    /// Whether the decoder folds its input norm into a staged QKV projection
    /// ([`CudaContext::gemv_staged_norm_bf16`]): on with the staged GEMV unless
    /// [`STAGED_GEMV_NORM_ENV`] is `0`.
    pub fn staged_gemv_folds_norm(&self) -> bool {
        static V: OnceLock<bool> = OnceLock::new();
        *V.get_or_init(|| env_usize(STAGED_GEMV_NORM_ENV) != Some(0))
    }

    /// The plan of a staged GEMV of `n` outputs of `rows` rows of width `k` on this device.
    pub fn staged_plan(&self, n: usize, k: usize, rows: usize) -> StagedPlan {
        StagedPlan::new(n, k, rows, self.info.sm_count, staged_budget())
    }

    /// [`CudaContext::gemv_nt_bf16`] (the same bits) on the staged GEMV.
    pub fn gemv_staged_bf16(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        m: usize,
        k: usize,
        n: usize,
    ) -> CudaResult<()> {
        self.gemv_staged_bf16_with(a, w, out, (m, k, n), None)
    }

    /// [`CudaContext::gemv_nt_bf16_f32`] (the same bits) on the staged GEMV.
    pub fn gemv_staged_f32(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<f32>,
        m: usize,
        k: usize,
        n: usize,
    ) -> CudaResult<()> {
        at_least("staged gemv out", out.len(), m * n)?;
        let (o, _g) = out.device_ptr_mut(&self.stream);
        self.gemv_staged_x(a, w, o, (m, k, n), OUT_F32, None)
    }

    /// The staged GEMV, bf16 out, with an explicit plan (`None`: the device's; tests take
    /// plans with few blocks and partly staged rows).
    pub fn gemv_staged_bf16_with(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        (m, k, n): (usize, usize, usize),
        plan: Option<StagedPlan>,
    ) -> CudaResult<()> {
        at_least("staged gemv out", out.len(), m * n)?;
        let (o, _g) = out.device_ptr_mut(&self.stream);
        self.gemv_staged_x(a, w, o, (m, k, n), OUT_BF16, plan)
    }

    /// The staged GEMV of bf16 rows `a` into the output at `out` (checked by the caller).
    fn gemv_staged_x(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: u64,
        (m, k, n): (usize, usize, usize),
        out_mode: i32,
        plan: Option<StagedPlan>,
    ) -> CudaResult<()> {
        at_least("staged gemv lhs", a.len(), m * k)?;
        let (x, _gx) = a.device_ptr(&self.stream);
        let plan = plan.unwrap_or_else(|| self.staged_plan(n, k, m));
        self.gemv_staged(StagedIn::x(x), w, out, (m, k, n), out_mode, plan)
    }

    /// The staged GEMV of a normalised input ([`GemvIn::Norm`] / [`GemvIn::SetNorm`], as in
    /// [`CudaContext::gemv_fused`]: the input norm's bits), bf16 out: the decoder's input norm
    /// and QKV projection in one launch. `plan` defaults to the device's.
    pub fn gemv_staged_norm_bf16(
        &self,
        w: &impl DevicePtr<bf16>,
        input: GemvIn<'_>,
        out: &mut impl DevicePtrMut<bf16>,
        (m, k, n): (usize, usize, usize),
        plan: Option<StagedPlan>,
    ) -> CudaResult<()> {
        at_least("staged gemv out", out.len(), m * n)?;
        let s = &self.stream;
        let (residual, weight, eps, init) = match input {
            GemvIn::X(_) => return Err(shape_err("staged gemv normalised input", 1, 0)),
            GemvIn::Norm {
                residual,
                weight,
                eps,
            } => (residual, weight, eps, None),
            GemvIn::SetNorm {
                init,
                residual,
                weight,
                eps,
            } => (residual, weight, eps, Some(init)),
        };
        at_least("staged gemv residual", residual.len(), m * k)?;
        crate::check_len("staged gemv norm weight", weight.len(), k)?;
        let mut x = 0u64;
        let mut guards = Vec::new();
        if let Some(init) = &init {
            at_least("staged gemv init", init.len(), m * k)?;
            let (p, g) = init.device_ptr(s);
            x = p;
            guards.push(g);
        }
        let (r, _gr) = residual.device_ptr(s);
        aligned16("staged gemv residual", r)?;
        let (nw, _gn) = weight.device_ptr(s);
        let (o, _go) = out.device_ptr_mut(s);
        let input = StagedIn {
            x,
            residual: r,
            norm_w: nw,
            mode: IN_NORM,
            set: i32::from(init.is_some()),
            eps,
        };
        let plan = plan.unwrap_or_else(|| self.staged_plan(n, k, m));
        self.gemv_staged(input, w, o, (m, k, n), OUT_BF16, plan)
    }

    fn gemv_staged(
        &self,
        input: StagedIn,
        w: &impl DevicePtr<bf16>,
        out: u64,
        (m, k, n): (usize, usize, usize),
        out_mode: i32,
        plan: StagedPlan,
    ) -> CudaResult<()> {
        if !Self::gemv_fits(m, k) {
            return Err(shape_err(
                "staged gemv rows (1..=8) / k (multiple of 8)",
                8,
                m,
            ));
        }
        crate::check_len("staged gemv weight", w.len(), n * k)?;
        if n == 0 {
            return Ok(());
        }
        if plan.rows_per_block == 0
            || plan.input_bytes != input_bytes(m, k)
            || plan.blocks * plan.rows_per_block < n
            || plan.staged_rows > plan.rows_per_block.min(WARPS * MAX_GROUPS)
            || plan.smem_bytes(k) > SMEM_OPTIN_MAX
        {
            return Err(shape_err(
                "staged gemv plan (rows per block, staged rows)",
                n,
                plan.blocks * plan.rows_per_block,
            ));
        }
        if input.mode == IN_X {
            aligned16("staged gemv lhs", input.x)?;
        }
        let (wp, _gw) = w.device_ptr(&self.stream);
        aligned16("staged gemv weight", wp)?;
        // rows is 1..=8: R = 1, 2, 4, 8 at index 0..=3.
        let bound = m.next_power_of_two().trailing_zeros() as usize;
        let f = self.function(gemv_source, STAGED_FNS[bound.min(3)])?;
        let smem = max_dynamic_smem(&f, "staged gemv shared bytes", plan.smem_bytes(k))?;
        let StagedIn {
            mut x,
            mut residual,
            mut norm_w,
            mode: mut in_mode,
            mut set,
            mut eps,
        } = input;
        let (mut wv, mut y) = (wp, out);
        let (mut rows, mut ki, mut ni): (i32, i32, i32) =
            (narrow("m", m)?, narrow("k", k)?, narrow("n", n)?);
        let mut rpb = narrow::<i32>("rows per block", plan.rows_per_block)?;
        let mut staged = narrow::<i32>("staged rows", plan.staged_rows)?;
        let mut mode = out_mode;
        let mut args = kernel_args!(
            x, residual, norm_w, wv, y, rows, ki, ni, rpb, staged, in_mode, set, eps, mode
        );
        // SAFETY: the arguments match `gemv_staged_r*(const u16*, float*, const u16*, const
        // u16*, void*, int, int, int, int, int, int, int, float, int)` in order and type, and
        // the entry's R >= rows (chosen above). The input is x (m * k bf16, 16-byte aligned)
        // or, normalised, the f32 residual (m * k, 16-byte aligned; written only by block 0
        // when set from `init`, m * k bf16) with its k norm weights, checked by the callers;
        // the weight holds n * k, out m * n of the output's type; k is a multiple of 8 and the
        // weight 16-byte aligned (the bulk copies need 16-byte sources and sizes: rows of k
        // bf16 are 16-byte multiples). The plan covers every row (blocks * rows_per_block >=
        // n; the kernel clips the last block), stages at most WARPS * MAX_GROUPS rows (one
        // mbarrier per WARPS rows), reserves the kernel's normalised-row bytes when
        // normalising (checked by the caller), and its shared bytes were allowed on the
        // function just now.
        unsafe {
            self.launch_programmatic(
                &f,
                (
                    narrow("staged gemv blocks", plan.blocks)?,
                    (WARPS * 32) as u32,
                    smem,
                ),
                &mut args,
            )
        }
    }
}
