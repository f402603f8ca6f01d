//! Tensor maps of the expert weights for the TMA grouped GEMM tiles ([`TileCfg::tma`]): one
//! 2-D view `[rows, k]` of a weight tensor (w13: `E * 2I` rows of `H`; w2: `E * H` rows of
//! `I`), read in boxes of 64 rows x 64 columns (128 bytes, the widest box the 128-byte swizzle
//! takes) into shared memory with that swizzle, the layout the kernels' wgmma descriptors read.
//!
//! [`TileCfg::tma`]: super::tiles::TileCfg

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::cuda::launch::shape_err;
use crate::cuda::{CudaError, CudaResult};

/// Rows and columns of one box (the kernels' `tma_load_2d` copies).
pub(super) const BOX: u32 = 64;

/// The tensor map of a bf16 weight tensor at device address `ptr` (16-byte aligned) holding
/// `rows` rows of `k` elements.
pub(super) fn weight_map(ptr: u64, rows: usize, k: usize) -> CudaResult<sys::CUtensorMap> {
    if k == 0 || rows == 0 || !(k * 2).is_multiple_of(16) || !ptr.is_multiple_of(16) {
        return Err(shape_err(
            "moe TMA weight map: k a positive multiple of 8 (16-byte rows), aligned base",
            8,
            k,
        ));
    }
    let dims = [k as u64, rows as u64];
    let strides = [(k * 2) as u64];
    let boxes = [BOX, BOX];
    let elem_strides = [1u32, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer names a live local of the length the rank (2) needs: two dims, one
    // stride (the outer dimension's, in bytes, a multiple of 16 as checked), two box sizes and
    // two element strides; `map` is written by the call. The global address is only recorded
    // (the driver does not dereference it here); the kernels read through the map only inside
    // the tensor's bounds, zero-filling the rest.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &raw mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(CudaError::from)?;
    Ok(map)
}
