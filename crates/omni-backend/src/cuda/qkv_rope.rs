//! The q/k norm + RoPE + KV-cache write of the decoder on the GPU
//! ([`CudaContext::qkv_rope_cache_bf16`], `kernels/layers.cu`): splits the fused QKV projection,
//! applies the optional per-head RMSNorm of Qwen3 and RoPE from a precomputed `inv_freq` table (so
//! every scaling variant of [`crate::rope::Rope`] works), writes Q out and K/V into the paged cache
//! (vLLM's `rotary_embedding` + `reshape_and_cache` in one launch). Three entries: a head a warp
//! (decode, short prefills), several heads a warp, and the wide form of long prefills.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::launch::{aligned16, at_least, narrow, shape_err};
use super::layers::layers_source;
use super::{CudaContext, CudaResult, L2Prefetch};

const QKV_ROPE_CACHE_FN: &str = "qkv_rope_cache_bf16";
/// The same with several heads a warp (`hpw > 1`).
const QKV_ROPE_CACHE_GROUPED_FN: &str = "qkv_rope_cache_grouped_bf16";
/// Warps per block of `qkv_rope_cache_bf16` (its `QKR_WARPS`).
const QKV_ROPE_WARPS: usize = 4;
/// Heads per warp of `qkv_rope_cache_bf16` from [`QKV_ROPE_GROUP_TOKENS`] tokens (one below):
/// a warp computes its token's RoPE angles once for all its heads and loads all their words
/// before it norms the first, then does the heads one after another. On an H100
/// (Qwen3-30B-A3B, 40 heads) 8 a warp took a 2048-token prefill's kernel from 41 to 33 µs a
/// layer (loading head by head), and a batch-1 decode's from 6.8 to 10.5. At most the kernel's
/// `QKR_MAX_HEADS` (8): a warp's heads past it would be left undone.
const QKV_ROPE_HEADS: usize = 8;
const _: () = assert!(QKV_ROPE_HEADS <= 8, "QKR_MAX_HEADS of kernels/layers.cu");
/// Steps of at least this many tokens group [`QKV_ROPE_HEADS`] heads a warp.
const QKV_ROPE_GROUP_TOKENS: usize = 256;
/// Heads a warp of long prefills takes instead of [`QKV_ROPE_HEADS`] (1 to 8; read once per
/// process): a tuning knob for measuring the grouping on a device.
pub const QKV_ROPE_HEADS_ENV: &str = "OMNI_CUDA_QKV_ROPE_HEADS";

/// The wide form of the q/k norm + RoPE kernel for long prefills at head_dim 128: 4 heads a
/// round, 8 lanes a head with 16-byte words (`qkv_rope_cache_wide_bf16`).
const QKV_ROPE_CACHE_WIDE_FN: &str = "qkv_rope_cache_wide_bf16";
/// Rounds of 4 heads a warp of the wide form takes (the kernel's `QKW_ROUNDS`).
const QKV_ROPE_WIDE_ROUNDS: usize = 5;
/// Steps of at least [`QKV_ROPE_GROUP_TOKENS`] tokens at head_dim 128 run the wide form (two
/// 16-byte loads a lane a round of 4 heads, the value heads copied in the same rounds, the head's
/// sum of squares over 8 lanes) unless this is `0`. On by default since measured (H100,
/// 2026-12-07: the kernel 2.57 -> 1.05 ms a 2048-token prefill, the prefill 3% faster). Read
/// once per process.
pub const QKV_ROPE_WIDE_ENV: &str = "OMNI_CUDA_QKV_ROPE_WIDE";

/// Whether the wide form may run ([`QKV_ROPE_WIDE_ENV`] is not `0`).
fn qkv_rope_wide() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::cuda::switch_on(QKV_ROPE_WIDE_ENV))
}

/// [`QKV_ROPE_HEADS`], or [`QKV_ROPE_HEADS_ENV`] when it holds 1 to 8.
fn qkv_rope_heads() -> usize {
    static HEADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *HEADS.get_or_init(|| {
        std::env::var(QKV_ROPE_HEADS_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|n| (1..=QKV_ROPE_HEADS).contains(n))
            .unwrap_or(QKV_ROPE_HEADS)
    })
}
/// Largest head_dim of `qkv_rope_cache_bf16` (`QKR_MAX_PAIRS` rotary pairs a lane).
const QKV_ROPE_MAX_HEAD_DIM: usize = 256;
/// The shape of one [`CudaContext::qkv_rope_cache_bf16`] call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QkvShape {
    /// Tokens in the batch.
    pub tokens: usize,
    /// Query heads on this rank.
    pub q_heads: usize,
    /// KV heads on this rank.
    pub kv_heads: usize,
    /// Elements per head (even, at most 256).
    pub head_dim: usize,
    /// Epsilon of the per-head RMSNorm (unused without norm weights).
    pub eps: f32,
}

/// Device buffers one [`CudaContext::qkv_rope_cache_bf16`] call reads and writes.
#[derive(Debug)]
pub struct QkvBuffers<'a, Q, O, K, V, P, S, F, N>
where
    Q: DevicePtr<bf16>,
    O: DevicePtrMut<bf16>,
    K: DevicePtrMut<bf16>,
    V: DevicePtrMut<bf16>,
    P: DevicePtr<i32>,
    S: DevicePtr<i64>,
    F: DevicePtr<f32>,
    N: DevicePtr<bf16>,
{
    /// `[tokens, (q_heads + 2 kv_heads) * head_dim]`: the fused projection output.
    pub qkv: &'a Q,
    /// `[tokens, q_heads, head_dim]`: normed, rotated queries.
    pub q_out: &'a mut O,
    /// One layer's K cache, `[num_blocks, block_size, kv_heads, head_dim]`.
    pub k_cache: &'a mut K,
    /// One layer's V cache, same layout.
    pub v_cache: &'a mut V,
    /// `[tokens]` absolute positions.
    pub positions: &'a P,
    /// `[tokens]` cache slots (`block * block_size + offset`), negative = skip.
    pub slot_mapping: &'a S,
    /// `[head_dim / 2]` RoPE inverse frequencies (with any scaling applied).
    pub inv_freq: &'a F,
    /// Qwen3's per-head RMSNorm weights for queries and keys (`[head_dim]` each), or `None`.
    pub qk_norm: Option<(&'a N, &'a N)>,
    /// M-RoPE: `positions` holds three rows and frequency `i` turns by row `axes[i]`; `None`:
    /// one row.
    pub mrope: Option<MropeAxes<'a>>,
    /// A later kernel's weights to prefetch into L2 ([`L2Prefetch::NONE`]: none).
    pub prefetch: L2Prefetch,
}

/// The checks [`CudaContext::qkv_rope_cache_bf16`] and the decode attention that does the same
/// work inside (`paged_attention_rope_bf16`) make of `bufs` for `shape` (all but `q_out`):
/// lengths, head_dim even and at most [`QKV_ROPE_MAX_HEAD_DIM`].
#[allow(clippy::type_complexity)]
pub(crate) fn check_qkv_buffers<Q, O, K, V, P, S, F, N>(
    shape: &QkvShape,
    bufs: &QkvBuffers<'_, Q, O, K, V, P, S, F, N>,
) -> CudaResult<()>
where
    Q: DevicePtr<bf16>,
    O: DevicePtrMut<bf16>,
    K: DevicePtrMut<bf16>,
    V: DevicePtrMut<bf16>,
    P: DevicePtr<i32>,
    S: DevicePtr<i64>,
    F: DevicePtr<f32>,
    N: DevicePtr<bf16>,
{
    let QkvShape {
        tokens,
        q_heads,
        kv_heads,
        head_dim,
        ..
    } = *shape;
    if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > QKV_ROPE_MAX_HEAD_DIM {
        return Err(shape_err(
            "cuda qkv rope head_dim (even, at most 256)",
            QKV_ROPE_MAX_HEAD_DIM,
            head_dim,
        ));
    }
    at_least(
        "cuda qkv input",
        bufs.qkv.len(),
        tokens * (q_heads + 2 * kv_heads) * head_dim,
    )?;
    match &bufs.mrope {
        None => at_least("cuda qkv positions", bufs.positions.len(), tokens)?,
        Some(m) => {
            crate::check_len("cuda qkv M-RoPE axes", m.axes.len(), head_dim / 2)?;
            at_least("cuda qkv M-RoPE row stride", m.row_stride, tokens)?;
            at_least(
                "cuda qkv positions",
                bufs.positions.len(),
                2 * m.row_stride + tokens,
            )?;
        }
    }
    at_least("cuda qkv slot_mapping", bufs.slot_mapping.len(), tokens)?;
    crate::check_len("cuda qkv inv_freq", bufs.inv_freq.len(), head_dim / 2)?;
    crate::check_len("cuda qkv v_cache", bufs.v_cache.len(), bufs.k_cache.len())?;
    if let Some((qn, kn)) = &bufs.qk_norm {
        crate::check_len("cuda qkv q_norm", qn.len(), head_dim)?;
        crate::check_len("cuda qkv k_norm", kn.len(), head_dim)?;
    }
    Ok(())
}

/// The M-RoPE side of a [`QkvBuffers`]: which position row turns each frequency.
#[derive(Debug, Clone, Copy)]
pub struct MropeAxes<'a> {
    /// `[head_dim / 2]`, each 0 (temporal), 1 (height) or 2 (width):
    /// [`crate::rope::MropeLayout::axes`].
    pub axes: &'a CudaSlice<u8>,
    /// Elements from one position row to the next (`>= tokens`).
    pub row_stride: usize,
}

impl CudaContext {
    /// Splits the fused QKV rows, applies Qwen3's per-head RMSNorm (when given) and RoPE
    /// (`rotate_half` convention, angles `position * inv_freq[i]` in f32) to queries and keys,
    /// writes queries to `q_out` and keys / values to their cache slots.
    ///
    /// Launched with programmatic dependent launch: `positions`, `slot_mapping`, the M-RoPE
    /// axes and `inv_freq` are read before the wait for the previous kernel, so no
    /// kernel of the stream may write them since its last host copy or ordinary launch (the
    /// decoder uploads them with the step's inputs); `qkv` and the outputs are read and written
    /// after it.
    #[allow(clippy::type_complexity)]
    pub fn qkv_rope_cache_bf16<Q, O, K, V, P, S, F, N>(
        &self,
        shape: QkvShape,
        bufs: QkvBuffers<'_, Q, O, K, V, P, S, F, N>,
    ) -> CudaResult<()>
    where
        Q: DevicePtr<bf16>,
        O: DevicePtrMut<bf16>,
        K: DevicePtrMut<bf16>,
        V: DevicePtrMut<bf16>,
        P: DevicePtr<i32>,
        S: DevicePtr<i64>,
        F: DevicePtr<f32>,
        N: DevicePtr<bf16>,
    {
        let QkvShape {
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            eps,
        } = shape;
        check_qkv_buffers(&shape, &bufs)?;
        at_least(
            "cuda qkv q_out",
            bufs.q_out.len(),
            tokens * q_heads * head_dim,
        )?;
        let wide = tokens >= QKV_ROPE_GROUP_TOKENS && head_dim == 128 && qkv_rope_wide();
        let hpw = if wide {
            QKV_ROPE_WIDE_ROUNDS
        } else if tokens >= QKV_ROPE_GROUP_TOKENS {
            qkv_rope_heads()
        } else {
            1
        };
        // The wide form's warps take `hpw` rounds of 4 heads (q, k, then v heads); the others'
        // `hpw` q / k heads.
        let warps = if wide {
            tokens * (q_heads + 2 * kv_heads).div_ceil(4).div_ceil(hpw)
        } else {
            tokens * (q_heads + kv_heads).div_ceil(hpw)
        };
        if warps == 0 {
            return Ok(());
        }
        let grid = narrow::<u32>("qkv rope warps / 4", warps.div_ceil(QKV_ROPE_WARPS))?;
        let mut hpw_i = narrow::<i32>("heads per warp", hpw)?;
        let mut tokens_i = narrow::<i32>("tokens", tokens)?;
        let (mut lq, mut lkv, mut hd) = (
            narrow::<i32>("q_heads", q_heads)?,
            narrow::<i32>("kv_heads", kv_heads)?,
            narrow::<i32>("head_dim", head_dim)?,
        );
        let f = self.function(
            layers_source,
            if wide {
                QKV_ROPE_CACHE_WIDE_FN
            } else if hpw > 1 {
                QKV_ROPE_CACHE_GROUPED_FN
            } else {
                QKV_ROPE_CACHE_FN
            },
        )?;
        let s = &self.stream;
        let (mut qkv, _g1) = bufs.qkv.device_ptr(s);
        let (mut q, _g2) = bufs.q_out.device_ptr_mut(s);
        let (mut kc, _g3) = bufs.k_cache.device_ptr_mut(s);
        let (mut vc, _g4) = bufs.v_cache.device_ptr_mut(s);
        let (mut pos, _g5) = bufs.positions.device_ptr(s);
        let (mut slots, _g6) = bufs.slot_mapping.device_ptr(s);
        let (mut freq, _g7) = bufs.inv_freq.device_ptr(s);
        let (mut qn, mut kn) = match &bufs.qk_norm {
            Some((qn, kn)) => (qn.device_ptr(s).0, kn.device_ptr(s).0),
            None => (0u64, 0u64),
        };
        if wide {
            // 16-byte words of the norms' rows (null when there is no q/k norm).
            aligned16("cuda qkv q_norm", qn)?;
            aligned16("cuda qkv k_norm", kn)?;
            aligned16("cuda qkv", qkv)?;
            aligned16("cuda qkv q_out", q)?;
            aligned16("cuda qkv k_cache", kc)?;
            aligned16("cuda qkv v_cache", vc)?;
        }
        let (mut axes, mut stride) = match &bufs.mrope {
            Some(m) => (
                m.axes.device_ptr(s).0,
                narrow::<i64>("M-RoPE row stride", m.row_stride)?,
            ),
            None => (0u64, 0i64),
        };
        let mut eps = eps;
        let block = 32 * QKV_ROPE_WARPS as u32;
        let (grid, (mut pf0, mut pf0_bytes, mut pf1, mut pf1_bytes, mut pf_work)) =
            bufs.prefetch.launch(grid, self.info.sm_count);
        let mut args = kernel_args!(
            qkv, q, kc, vc, pos, slots, freq, qn, kn, axes, stride, tokens_i, lq, lkv, hd, eps,
            hpw_i, pf0, pf0_bytes, pf1, pf1_bytes, pf_work
        );
        // SAFETY: the arguments match the parameter list (`QKR_ARGS`) of the three entries,
        // `qkv_rope_cache_bf16`, `qkv_rope_cache_grouped_bf16` (taken when hpw > 1, the heads
        // the former's warps would leave undone) and `qkv_rope_cache_wide_bf16` (head_dim 128
        // only, checked above: 16-byte words of rows whose offsets are multiples of 128
        // elements, the norms' 128 entries 16-byte aligned device allocations; its warps take
        // `hpw` rounds of 4 of the q + 2 kv heads, as counted in `warps`); their prefetch
        // regions as in `fused_add_rms_norm_prefetch`); qkv, q_out,
        // positions and slot_mapping hold at least `tokens` rows (checked above); inv_freq holds
        // head_dim / 2 and the norms head_dim entries (or are null, which the kernel tests);
        // with M-RoPE the axes hold head_dim / 2 values in 0..3 (from `MropeLayout`) and the
        // positions three rows of `row_stride >= tokens` (checked above). The
        // caller guarantees every non-negative slot is inside the caches (they are produced by
        // the block manager from block ids validated against the cache size). One warp per
        // (token, group of `hpw` >= 1 heads), QKV_ROPE_WARPS per block as the kernel's
        // QKR_WARPS (warps past the groups return; blocks past the working ones only
        // prefetch), head_dim <= 256 (checked above; QKR_MAX_PAIRS pairs a lane) and even
        // (4-byte words of every row). Before its wait the kernel reads only the prefetch
        // regions and what the doc above says no kernel of the stream writes, and writes
        // nothing, as a programmatic launch requires.
        unsafe { self.launch_programmatic(&f, (grid, block, 0), &mut args) }
    }
}
