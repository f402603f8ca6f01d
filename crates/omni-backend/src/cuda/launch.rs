//! The checks every kernel launcher makes before it queues work, in one place: buffer lengths
//! ([`at_least`], [`shape_err`]), 16-byte alignment of device pointers ([`aligned16`]), host
//! sizes narrowed to the integer types kernels and grids take ([`narrow`], [`grid_yz`]), and the
//! two launch shapes several kernels share ([`elementwise_cfg`], [`block_threads`]).

use cudarc::driver::sys::CUfunction_attribute_enum as FnAttr;
use cudarc::driver::{CudaFunction, LaunchConfig};

use super::{CudaError, CudaResult};

/// The shape error for operand `what`: `expected` elements (or the value a dimension must
/// have), `got` given.
pub(crate) fn shape_err(what: &'static str, expected: usize, got: usize) -> CudaError {
    crate::Error::Shape {
        what,
        expected,
        got,
    }
    .into()
}

/// `got >= want`, for buffers sized for a maximum batch.
pub(crate) fn at_least(what: &'static str, got: usize, want: usize) -> CudaResult<()> {
    if got < want {
        return Err(shape_err(what, want, got));
    }
    Ok(())
}

/// A raw device pointer is 16-byte aligned (the kernels move 16-byte vectors).
pub(crate) fn aligned16(what: &'static str, ptr: u64) -> CudaResult<()> {
    if !ptr.is_multiple_of(16) {
        return Err(CudaError::Misaligned { what, ptr });
    }
    Ok(())
}

/// `value` as the integer type a kernel parameter or grid dimension takes (`i32`, `i64`, `u32`),
/// or [`CudaError::TooLarge`] naming `what`.
pub(crate) fn narrow<T: TryFrom<usize>>(what: &'static str, value: usize) -> CudaResult<T> {
    T::try_from(value).map_err(|_| CudaError::TooLarge { what, value })
}

/// A grid y or z dimension (at most 65535).
pub(crate) fn grid_yz(what: &'static str, value: usize) -> CudaResult<u32> {
    if value > 65_535 {
        return Err(CudaError::TooLarge { what, value });
    }
    narrow(what, value)
}

/// Threads of a block that gives each of `work` items a thread where it can: a multiple of 32,
/// at least 32 and at most `max` (itself a multiple of 32).
pub(crate) fn block_threads(work: usize, max: usize) -> u32 {
    (work.div_ceil(32).clamp(1, max / 32) * 32) as u32
}

/// Launch shape for the grid-stride element-wise kernels: 256 threads, enough blocks to cover
/// `n` up to a cap (the loop covers the rest).
pub(crate) fn elementwise_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Raises `f`'s dynamic shared memory limit to `bytes` (named `what` in the error when that
/// does not fit an int) and returns them as a launch's `u32`. A host-side function attribute:
/// legal during stream capture.
pub(crate) fn max_dynamic_smem(
    f: &CudaFunction,
    what: &'static str,
    bytes: usize,
) -> CudaResult<u32> {
    f.set_attribute(
        FnAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        narrow::<i32>(what, bytes)?,
    )?;
    narrow::<u32>(what, bytes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_operand() {
        assert!(at_least("x", 4, 4).is_ok());
        let e = at_least("cuda x", 3, 4).unwrap_err().to_string();
        assert_eq!(e, "cuda x: expected 4 elements, got 3");
        assert!(aligned16("q", 0x1000).is_ok());
        let e = aligned16("cuda q", 0x1008).unwrap_err().to_string();
        assert!(e.starts_with("cuda q: device pointer 0x1008"), "{e}");
        assert_eq!(narrow::<i32>("m", 7).ok(), Some(7));
        assert!(matches!(
            narrow::<i32>("m", 1 << 31),
            Err(CudaError::TooLarge { what: "m", .. })
        ));
        assert_eq!(grid_yz("seqs", 65_535).ok(), Some(65_535));
        assert!(grid_yz("seqs", 65_536).is_err());
        assert_eq!((block_threads(0, 1024), block_threads(33, 1024)), (32, 64));
        assert_eq!(block_threads(5000, 256), 256);
        assert_eq!(elementwise_cfg(1 << 30).grid_dim.0, 65_535);
    }
}
