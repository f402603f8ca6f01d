//! [`CudaContext::enc_segment_attention`]: bidirectional attention within `cu_seqlens`
//! segments as the cuBLAS strided-batched GEMMs of [`segment_attention_plan`] around a row
//! softmax.

use cudarc::cublas::{result as blas_result, sys as blas_sys};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::super::launch::at_least;
use super::{
    SegmentAttnShape, StridedGemm, encoder_source, i32_of, i64_of, row_cfg, segment_attention_plan,
};
use crate::cuda::{CudaContext, CudaResult};

/// The f32 scores and bf16 probabilities of [`CudaContext::enc_segment_attention`].
#[derive(Debug)]
pub struct AttnScratch {
    scores: CudaSlice<f32>,
    probs: CudaSlice<bf16>,
}

impl AttnScratch {
    /// Scratch of `elems` elements each ([`segment_attention_scratch_len`]).
    pub fn new(cx: &CudaContext, elems: usize) -> CudaResult<Self> {
        // SAFETY: scratch: every element a step reads was written by the step's GEMM or
        // softmax before.
        let scores = unsafe { cx.stream.alloc::<f32>(elems.max(1)) }?;
        // SAFETY: as above.
        let probs = unsafe { cx.stream.alloc::<bf16>(elems.max(1)) }?;
        Ok(Self { scores, probs })
    }

    /// Elements of each buffer.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// Never true (at least one element is allocated).
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }
}

impl CudaContext {
    /// Bidirectional attention within the segments of `cu_seqlens` (host values, `[0, ..,
    /// tokens]`): `qkv` `[tokens, 3 * dim]` (q | k | v, rotated), `out` `[tokens, dim]`, through
    /// the cuBLAS calls of [`segment_attention_plan`] (f32 scores scaled by `shape.scale`, bf16
    /// probabilities, f32 accumulation).
    pub fn enc_segment_attention(
        &self,
        qkv: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        cu_seqlens: &[usize],
        shape: SegmentAttnShape,
        scratch: &mut AttnScratch,
    ) -> CudaResult<()> {
        let tokens = cu_seqlens.last().copied().unwrap_or(0);
        if cu_seqlens.first().is_some_and(|&s| s != 0) || cu_seqlens.windows(2).any(|w| w[1] < w[0])
        {
            return Err(crate::Error::Metadata(format!(
                "cu_seqlens {cu_seqlens:?}: non-decreasing from 0 expected"
            ))
            .into());
        }
        let dim = shape.heads * shape.head_dim;
        at_least("encoder attention qkv", qkv.len(), tokens * 3 * dim)?;
        at_least("encoder attention out", out.len(), tokens * dim)?;
        let steps = segment_attention_plan(cu_seqlens, shape, scratch.len());
        if steps.is_empty() {
            return Ok(());
        }
        for st in &steps {
            let [a, b, c] = st.qk.extents();
            at_least("encoder attention qkv (keys)", qkv.len(), a)?;
            at_least("encoder attention qkv (queries)", qkv.len(), b)?;
            at_least("encoder attention scores", scratch.scores.len(), c)?;
            let [a, b, c] = st.pv.extents();
            at_least("encoder attention qkv (values)", qkv.len(), a)?;
            at_least("encoder attention probs", scratch.probs.len(), b)?;
            at_least("encoder attention out", out.len(), c)?;
        }
        let softmax = self.function(encoder_source, "enc_softmax_rows")?;
        let (qp, _g1) = qkv.device_ptr(&self.stream);
        let (op, _g2) = out.device_ptr_mut(&self.stream);
        let (sp, _g3) = scratch.scores.device_ptr_mut(&self.stream);
        let (pp, _g4) = scratch.probs.device_ptr_mut(&self.stream);
        let (bf, f32t) = (
            blas_sys::cudaDataType_t::CUDA_R_16BF,
            blas_sys::cudaDataType_t::CUDA_R_32F,
        );
        for st in &steps {
            // SAFETY: every operand's last element is inside its buffer (the extents checked
            // above against qkv, the scratch and out); types as passed.
            unsafe { self.strided_gemm(&st.qk, (qp, bf), (qp, bf), (sp, f32t)) }?;
            let cols = i32_of("attention keys", st.keys)?;
            let mut l = self.stream.launch_builder(&softmax);
            l.arg(&sp).arg(&pp).arg(&cols);
            // SAFETY: matches `enc_softmax_rows(const float*, u16*, int)`; block r reads and
            // writes row r of `keys` elements, rows * keys = the qk GEMM's C extent (inside
            // both scratch buffers, checked above).
            unsafe { l.launch(row_cfg(st.softmax_rows, st.keys)?) }?;
            // SAFETY: as for the scores GEMM.
            unsafe { self.strided_gemm(&st.pv, (qp, bf), (pp, bf), (op, bf)) }?;
        }
        Ok(())
    }

    /// Queues `g` with the operands at these device pointers (element types given), f32
    /// compute.
    ///
    /// # Safety
    /// Each operand's buffer must hold at least its [`StridedGemm::extents`] elements.
    unsafe fn strided_gemm(
        &self,
        g: &StridedGemm,
        a: (u64, blas_sys::cudaDataType_t),
        b: (u64, blas_sys::cudaDataType_t),
        c: (u64, blas_sys::cudaDataType_t),
    ) -> CudaResult<()> {
        let size = |t: blas_sys::cudaDataType_t| match t {
            blas_sys::cudaDataType_t::CUDA_R_32F => 4u64,
            _ => 2u64,
        };
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (g.alpha, 0.0f32);
        let ptr = |(p, t): (u64, blas_sys::cudaDataType_t), off: usize| p + off as u64 * size(t);
        // SAFETY: the handle is bound to this context's stream; the caller guarantees the
        // operand extents; alpha and beta are f32 as CUBLAS_COMPUTE_32F requires and outlive the
        // call.
        unsafe {
            blas_result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op(g.trans_a),
                op(g.trans_b),
                i32_of("gemm m", g.m)?,
                i32_of("gemm n", g.n)?,
                i32_of("gemm k", g.k)?,
                (&alpha) as *const f32 as *const _,
                ptr(a, g.a_off) as *const _,
                a.1,
                i32_of("gemm lda", g.lda)?,
                i64_of("gemm stride a", g.stride_a)?,
                ptr(b, g.b_off) as *const _,
                b.1,
                i32_of("gemm ldb", g.ldb)?,
                i64_of("gemm stride b", g.stride_b)?,
                (&beta) as *const f32 as *const _,
                ptr(c, g.c_off) as *mut _,
                c.1,
                i32_of("gemm ldc", g.ldc)?,
                i64_of("gemm stride c", g.stride_c)?,
                i32_of("gemm batch", g.batch)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}
