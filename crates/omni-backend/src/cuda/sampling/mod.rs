//! Sampling on the device: temperature, min-p, top-k, top-p and one seeded draw per row, in one
//! kernel launch with one CTA (1024 threads) per row and no sort of the vocabulary.
//!
//! The semantics follow the CPU sampler (`omni_models::sampler`): NaN logits count as `-inf`;
//! temperature below `1e-5` is greedy (argmax, lowest index on ties, other parameters ignored);
//! otherwise logits are divided by the temperature, then **min-p**, then **top-k**, then **top-p**
//! are applied, each on the distribution left by the previous one, and one token is drawn from
//! what is left. Two deliberate differences:
//!
//! * **Ties at a cut-off are all kept.** Every filter is a threshold on the logit: top-k keeps
//!   every entry whose logit is `>=` the k-th largest (so more than `k` survive when the k-th
//!   largest value is repeated), and top-p keeps every entry equal to the value at which the
//!   cumulative mass first reaches `top_p` (the CPU keeps the lowest token ids among equal
//!   values instead). `-0.0` and `0.0` are the same value.
//! * **The random stream is a different one.** The draw is a Gumbel-max over the kept entries
//!   with noise from a counter-based hash of `(seed, offset, token id)` (SplitMix64's mixer), so a
//!   row's token depends only on its logits, its parameters, `seed` and `offset`: not on its
//!   position in the batch, other rows, or the path the kernel took. It does not reproduce the
//!   CPU sampler's tokens for the same seed.
//!
//! How the cut-offs are found without sorting 150k entries:
//!
//! 1. Pass 1 over the row: max logit `m` (and argmax: greedy rows stop here), each thread's
//!    maximum, and (top-p without top-k) the softmax normaliser.
//! 2. Lower bounds on the final cut-off from the 1024 per-thread maxima (sorted in shared memory):
//!    the k-th largest thread maximum bounds the top-k cut-off from below, and the smallest set
//!    of largest maxima that already holds `top_p` of the mass bounds the top-p cut-off. min-p is
//!    a direct threshold: keep `(l - m) / T >= ln(min_p)`, i.e. `p >= min_p * p_max`.
//! 3. Pass 2 gathers the candidates above the bounds into shared memory (up to 16384). On a
//!    typical LLM distribution this is a few hundred entries, which are sorted there, and the
//!    top-k and top-p cut-offs read off directly.
//! 4. Otherwise (flat distributions, `top_k > 1024`) each cut-off is found by **binary search
//!    over the logit value range** on the global row: the search runs on the order-preserving
//!    32-bit key of the f32 logit; each step counts (top-k) or sums the probability mass of
//!    (top-p) the candidates `>= mid` and also finds the nearest candidate values on either
//!    side of `mid`, so the bracket always snaps to values present in the row: at most 32 steps,
//!    exact.
//!
//! Probability mass is summed in 2^-40 fixed point (integers; a weight below 2^-40 of the most
//! likely token's counts as zero for top-p), so sums are exact and independent of the summation
//! order: both paths find the same cut-offs bit for bit, and a seeded row is reproducible. The
//! Gumbel noise comes from 32 random bits (at most ~22.9), so probabilities below ~1e-9 are not
//! reproduced faithfully; everything else is drawn from the exactly filtered, renormalized
//! distribution.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::kernels::kernel_file;
use super::launch::{max_dynamic_smem, narrow, shape_err};
use super::{CudaContext, CudaError, CudaResult};

#[cfg(test)]
mod tests;

/// Threads per CTA (one CTA per row); the kernel's block reductions assume exactly this.
const THREADS: u32 = 1024;
/// Candidates gathered into shared memory (8 bytes each): 128 KiB of dynamic shared memory.
const SMEM_CANDIDATES: usize = 16384;

/// The sampling kernel's entry point.
const SAMPLE_FN: &str = "sample_rows_f32";

/// Per-row sampling parameters for [`CudaContext::sample_rows_f32`].
///
/// `#[repr(C)]`: 32 bytes, the layout the kernel reads (uploaded as eight `u32` words).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSamplingParams {
    /// Softmax temperature; below `1e-5` (or NaN) the row is greedy (argmax) and every other
    /// field is ignored.
    pub temperature: f32,
    /// Keep the `top_k` largest logits (ties at the cut-off kept); `<= 0` or `>= vocab` is off.
    pub top_k: i32,
    /// Keep the smallest most-likely set holding at least `top_p` of the probability mass
    /// (ties at the cut-off kept); `>= 1.0` (or NaN) is off, `<= 0` keeps only the most likely
    /// value.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p * p_max`; `<= 0` (or NaN) is off, values above 1
    /// act as 1 (keep the most likely value only).
    pub min_p: f32,
    /// The random stream: rows with the same seed, offset and logits draw the same token.
    /// Callers give unseeded requests distinct seeds (e.g. from a host RNG).
    pub seed: u64,
    /// Which draw of that seed's stream, e.g. the number of tokens generated so far.
    pub offset: u64,
}

impl DeviceSamplingParams {
    /// Greedy decoding (argmax, lowest token id on ties).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            offset: 0,
        }
    }

    /// Plain sampling at `temperature` (all filters off) from stream `seed` at draw `offset`.
    pub fn random(temperature: f32, seed: u64, offset: u64) -> Self {
        Self {
            temperature,
            seed,
            offset,
            ..Self::greedy()
        }
    }

    /// The eight `u32` words the kernel reads, in field order (little-endian halves for the
    /// 64-bit fields).
    fn words(&self) -> [u32; 8] {
        [
            self.temperature.to_bits(),
            self.top_k as u32,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.offset as u32,
            (self.offset >> 32) as u32,
        ]
    }
}

#[cfg(test)]
/// Kernel flag: take the global binary-search path even when the candidates fit in shared
/// memory (tests compare both paths).
const FLAG_FORCE_GLOBAL: i32 = 1;
#[cfg(test)]
/// Kernel flag: skip the lower bounds from the per-thread maxima (tests check they never change
/// the result).
const FLAG_NO_BOUNDS: i32 = 2;

/// The sampling kernel (`kernels/sampling.cu`; [`sampling_source`] defines `NT` and `CAP` from
/// [`THREADS`] and [`SMEM_CANDIDATES`]).
const SAMPLE_BODY: &str = kernel_file!("sampling.cu");

/// Full source of the sampling module (f32 only; no bf16 helpers needed).
pub(super) fn sampling_source() -> String {
    format!("#define NT {THREADS}\n#define CAP {SMEM_CANDIDATES}\n{SAMPLE_BODY}")
}

impl CudaContext {
    /// Samples one token per row of `logits` (`[params.len(), vocab]` f32, row-major) with that
    /// row's [`DeviceSamplingParams`], on the device: one kernel launch, one CTA per row (see the
    /// [module docs](self) for the semantics and how the cut-offs are found). The tokens are
    /// written to `out` (`[params.len()]` i32, `-1` for a row with no logit above `-inf`) and
    /// also returned (this synchronizes the stream); `None` marks such a row, as in the CPU
    /// sampler.
    pub fn sample_rows_f32<O>(
        &self,
        logits: &impl DevicePtr<f32>,
        params: &[DeviceSamplingParams],
        vocab: usize,
        out: &mut O,
    ) -> CudaResult<Vec<Option<u32>>>
    where
        O: DevicePtr<i32> + DevicePtrMut<i32>,
    {
        self.sample_rows_f32_flags(logits, params, vocab, out, 0)
    }

    /// [`CudaContext::sample_rows_f32`] with kernel flags (`FLAG_*`, for tests).
    fn sample_rows_f32_flags<O>(
        &self,
        logits: &impl DevicePtr<f32>,
        params: &[DeviceSamplingParams],
        vocab: usize,
        out: &mut O,
        flags: i32,
    ) -> CudaResult<Vec<Option<u32>>>
    where
        O: DevicePtr<i32> + DevicePtrMut<i32>,
    {
        let rows = params.len();
        if vocab == 0 {
            return Err(shape_err("cuda sampling vocab (non-zero)", 1, 0));
        }
        let total = rows.checked_mul(vocab).ok_or(CudaError::TooLarge {
            what: "rows * vocab",
            value: usize::MAX,
        })?;
        crate::check_len("cuda sampling logits", logits.len(), total)?;
        crate::check_len("cuda sampling out", out.len(), rows)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        // The grid's x dimension (at most 2^31 - 1).
        let rows_u32 = narrow::<i32>("rows", rows)? as u32;
        let vocab_i = narrow::<i32>("vocab", vocab)?;
        let words: Vec<u32> = params.iter().flat_map(|p| p.words()).collect();
        let dparams = self.stream.clone_htod(&words)?;

        let f = self.function(sampling_source, SAMPLE_FN)?;
        let smem = max_dynamic_smem(
            &f,
            "sampling shared memory",
            SMEM_CANDIDATES * std::mem::size_of::<u64>(),
        )?;
        let cfg = LaunchConfig {
            grid_dim: (rows_u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        {
            let (lp, _lg) = logits.device_ptr(&self.stream);
            let (op, _og) = out.device_ptr_mut(&self.stream);
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(&lp)
                .arg(&dparams)
                .arg(&op)
                .arg(&vocab_i)
                .arg(&flags);
            // SAFETY: the arguments match `sample_rows_f32(const float*, const u32*, int*, int,
            // int)` (device pointers passed as 64-bit values); logits holds rows * vocab f32,
            // dparams 8 words per row and out rows i32 (checked above), one CTA per row; the
            // block has exactly 1024 threads and 128 KiB of dynamic shared memory (the attribute
            // set above), as the kernel's reductions and candidate buffer require. The pointer
            // guards live until after the launch is queued.
            unsafe { launch.launch(cfg) }?;
        }
        let mut host = vec![0i32; rows];
        self.stream.memcpy_dtoh(out, &mut host)?;
        Ok(host.into_iter().map(|t| u32::try_from(t).ok()).collect())
    }
}
