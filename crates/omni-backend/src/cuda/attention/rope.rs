//! Decode attention with the q/k norm + RoPE + cache write inside
//! ([`CudaContext::paged_attention_rope_bf16`]): one launch instead of
//! [`CudaContext::qkv_rope_cache_bf16`] then [`CudaContext::paged_attention_bf16`] for steps
//! whose every sequence decodes one token on the CUDA-core decode kernel (`decode.cu`,
//! `DecodeRope`). At batch 1 that kernel is a few microseconds of launch and latency per layer,
//! for a few kilobytes of work the attention CTAs can do themselves.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{AttnShape, decode_plan, prefill_cfg};
use crate::cuda::launch::{aligned16, narrow};
use crate::cuda::qkv_rope::check_qkv_buffers;
use crate::cuda::{CudaContext, CudaResult, QkvBuffers, QkvShape, bf16};

/// Set to `1`, decode steps on the CUDA-core kernel do the q/k norm + RoPE + cache write inside
/// the attention launch ([`CudaContext::decode_fuses_rope`]). Off by default: on an H100
/// (Qwen3-30B-A3B, the same bits) it beat the separate kernel only while that kernel was slow;
/// against the kernel as it was at 79dca1c it is even at batch 1 (~204 against ~206 tok/s) and
/// 5.5% slower at batch 4 (`bench/results/gpu-decode-h100-2026-12-07.md`). Read once per
/// process.
pub const DECODE_ROPE_ENV: &str = "OMNI_CUDA_DECODE_ROPE";

fn decode_rope_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::cuda::switch_opt_in(DECODE_ROPE_ENV))
}

/// `struct DecodeRope` of `decode_rope.cuh`, field for field (a kernel argument by value, or a
/// member of the one-launch attention block's arguments).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct DecodeRopeArgs {
    pub(super) qkv: u64,
    pub(super) kc_w: u64,
    pub(super) vc_w: u64,
    pub(super) positions: u64,
    pub(super) slots: u64,
    pub(super) inv_freq: u64,
    pub(super) q_norm: u64,
    pub(super) k_norm: u64,
    pub(super) mrope_axes: u64,
    pub(super) pos_stride: i64,
    pub(super) eps: f32,
}

impl CudaContext {
    /// Whether [`Self::paged_attention_rope_bf16`] serves a step of `shape`: a decode step
    /// (`max_query_len == 1`) whose plan is the CUDA-core kernel (small grids: batch 1 to ~11
    /// of the Qwen3 shapes), with [`DECODE_ROPE_ENV`] set.
    pub fn decode_fuses_rope(&self, shape: &AttnShape) -> bool {
        decode_rope_enabled() && rope_plan_fits(shape)
    }

    /// [`Self::qkv_rope_cache_bf16`] (`qkv_shape`, `bufs`; `q_out` and `prefetch` are not used:
    /// the queries stay in registers) and then [`Self::paged_attention_bf16`] of the normed,
    /// rotated queries into `out`, in one launch: each decode CTA norms and rotates its own
    /// query heads, and the CTA whose partition ends a sequence the new key (written to the
    /// cache with its value by one CTA per KV head). The same results as the two calls up to
    /// the order of the norm's sum of squares. Only for steps where [`Self::decode_fuses_rope`]
    /// (without the environment switch) holds; the same launch-only contract as
    /// [`Self::paged_attention_bf16`], and the positions, slots, M-RoPE axes and inv_freq are
    /// read before the dependency wait as in [`Self::qkv_rope_cache_bf16`].
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn paged_attention_rope_bf16<Q, O, K, V, P, S, F, N>(
        &self,
        qkv_shape: QkvShape,
        bufs: QkvBuffers<'_, Q, O, K, V, P, S, F, N>,
        out: &mut impl DevicePtrMut<bf16>,
        query_start_loc: &impl DevicePtr<i32>,
        seq_lens: &impl DevicePtr<i32>,
        block_tables: &impl DevicePtr<i32>,
        workspace: &mut impl DevicePtrMut<f32>,
        shape: &AttnShape,
    ) -> CudaResult<()>
    where
        Q: DevicePtr<bf16>,
        O: DevicePtrMut<bf16>,
        K: DevicePtrMut<bf16> + DevicePtr<bf16>,
        V: DevicePtrMut<bf16> + DevicePtr<bf16>,
        P: DevicePtr<i32>,
        S: DevicePtr<i64>,
        F: DevicePtr<f32>,
        N: DevicePtr<bf16>,
    {
        check_qkv_buffers(&qkv_shape, &bufs)?;
        let q = &qkv_shape;
        if (q.tokens, q.q_heads, q.kv_heads, q.head_dim)
            != (
                shape.num_tokens,
                shape.num_heads,
                shape.num_kv_heads,
                shape.head_dim,
            )
            || !rope_plan_fits(shape)
        {
            return Err(crate::Error::Metadata(format!(
                "cuda decode attention with RoPE: qkv {qkv_shape:?} against attention {shape:?} \
                 (the same tokens and heads, a decode step on the CUDA-core kernel)"
            ))
            .into());
        }
        // Raw addresses for the argument struct (every use is on this stream, in order).
        let s = &self.stream;
        let qkv = bufs.qkv.device_ptr(s).0;
        let kc_w = bufs.k_cache.device_ptr_mut(s).0;
        let vc_w = bufs.v_cache.device_ptr_mut(s).0;
        let positions = bufs.positions.device_ptr(s).0;
        let slots = bufs.slot_mapping.device_ptr(s).0;
        let inv_freq = bufs.inv_freq.device_ptr(s).0;
        let (q_norm, k_norm) = match &bufs.qk_norm {
            Some((qn, kn)) => (qn.device_ptr(s).0, kn.device_ptr(s).0),
            None => (0, 0),
        };
        let (mrope_axes, pos_stride) = match &bufs.mrope {
            Some(m) => (
                m.axes.device_ptr(s).0,
                narrow::<i64>("M-RoPE row stride", m.row_stride)?,
            ),
            None => (0, 0),
        };
        // The kernel reads 16-byte words of the QKV rows (a row is (heads) * head_dim bf16,
        // head_dim a multiple of 8) and of the norm weights.
        aligned16("cuda decode attention qkv", qkv)?;
        if q_norm != 0 {
            aligned16("cuda decode attention q_norm", q_norm)?;
            aligned16("cuda decode attention k_norm", k_norm)?;
        }
        let mut args = DecodeRopeArgs {
            qkv,
            kc_w,
            vc_w,
            positions,
            slots,
            inv_freq,
            q_norm,
            k_norm,
            mrope_axes,
            pos_stride,
            eps: qkv_shape.eps,
        };
        self.paged_attention_tiled(
            bufs.qkv,
            &*bufs.k_cache,
            &*bufs.v_cache,
            out,
            query_start_loc,
            seq_lens,
            block_tables,
            workspace,
            shape,
            decode_plan(shape),
            // Not used: a decode step (checked above).
            (prefill_cfg(shape.head_dim), ""),
            Some(&mut args),
        )
    }
}

/// A decode step that [`decode_plan`] puts on the CUDA-core kernel.
pub(super) fn rope_plan_fits(shape: &AttnShape) -> bool {
    shape.max_query_len == 1 && !decode_plan(shape).tc
}
