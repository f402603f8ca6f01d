//! L2 prefetch hints. A one-token decode step is a chain of short kernels: memory-bound GEMMs
//! (QKV, o_proj, the experts) between latency-bound ones (norms, RoPE, attention, the router),
//! and a GEMM only starts pulling its weights once its predecessor has finished. Some of our
//! kernels take an [`L2Prefetch`]: up to two regions of read-only device data (a later
//! kernel's weights) that their threads issue as bulk L2 prefetches before their dependency
//! wait (`l2_prefetch` in kernels/bf16.cuh), so the weights stream in while the chain is busy
//! with latency and the GEMM that reads them finds them in L2. Hints only: a kernel computes the
//! same values with or without one.

use cudarc::driver::{CudaStream, DevicePtr};

/// Alignment the bulk prefetch needs of a region's start and length.
const ALIGN: u64 = 16;

/// `L2_PREFETCH_ARGS` in order: region 0's pointer and bytes, region 1's, the working blocks.
pub(super) type PrefetchArgs = (u64, u64, u64, u64, i32);

/// Up to two regions for a kernel to prefetch into L2 (`NONE`: nothing). Each region is
/// read-only device data no kernel of the step writes: the kernel issues the prefetch before it
/// waits for its predecessor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct L2Prefetch {
    regions: [(u64, u64); 2],
    budget: u64,
}

impl L2Prefetch {
    /// Prefetches nothing.
    pub const NONE: Self = Self {
        regions: [(0, 0); 2],
        budget: 0,
    };

    /// An empty hint that takes regions up to `budget` bytes in all (the first bytes of a
    /// region past the budget).
    pub fn with_budget(budget: usize) -> Self {
        Self {
            budget: budget as u64,
            ..Self::NONE
        }
    }

    /// Adds the `T` elements of `data` (or their first bytes within what is left of the
    /// budget) in the first free slot. Ignored when both slots are taken, nothing is left of
    /// the budget, or `data` does not start 16-byte aligned; its length is rounded down to a
    /// multiple of 16 bytes.
    pub fn and<T>(self, data: &impl DevicePtr<T>, stream: &CudaStream) -> Self {
        let bytes = (data.len() * std::mem::size_of::<T>()) as u64;
        let (ptr, _guard) = data.device_ptr(stream);
        self.push(ptr, bytes)
    }

    /// [`L2Prefetch::and`] on a raw device address and length.
    fn push(mut self, ptr: u64, bytes: u64) -> Self {
        let n = bytes.min(self.budget) & !(ALIGN - 1);
        if n == 0 || !ptr.is_multiple_of(ALIGN) {
            return self;
        }
        if let Some(slot) = self.regions.iter_mut().find(|r| r.1 == 0) {
            *slot = (ptr, n);
            self.budget -= n;
        }
        self
    }

    /// Bytes the hint names.
    pub fn bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.1).sum()
    }

    /// (pointer, bytes) of each slot, 0 when free.
    #[cfg(test)]
    fn args(&self) -> [(u64, u64); 2] {
        self.regions
    }

    /// The grid of a kernel with `work_blocks` blocks of work on a GPU of `sm_count` SMs:
    /// with a region to prefetch, at least one block per SM (the extra ones only prefetch:
    /// the bulk prefetch's rate is per SM), else `work_blocks`; and the kernel's
    /// `L2_PREFETCH_ARGS` (pointer and bytes of each slot, then `work_blocks`).
    pub(super) fn launch(&self, work_blocks: u32, sm_count: usize) -> (u32, PrefetchArgs) {
        let grid = if self.bytes() > 0 {
            work_blocks.max(u32::try_from(sm_count).unwrap_or(u32::MAX))
        } else {
            work_blocks
        };
        let [(p0, b0), (p1, b1)] = self.regions;
        // A grid over i32::MAX blocks is refused by the launch itself; clamp the count.
        let work = i32::try_from(work_blocks).unwrap_or(i32::MAX);
        (grid, (p0, b0, p1, b1, work))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_take_the_budget_aligned_in_two_slots() {
        assert_eq!(L2Prefetch::NONE.args(), [(0, 0); 2]);
        assert_eq!(L2Prefetch::NONE.push(256, 4096).bytes(), 0, "no budget");
        let h = L2Prefetch::with_budget(1024);
        assert_eq!(h.push(8, 64).args(), [(0, 0); 2], "unaligned start");
        assert_eq!(h.push(256, 10).args(), [(0, 0); 2], "under 16 bytes");
        let h = h.push(256, 608).push(4096, 999).push(8192, 16);
        // 608 bytes, then 999 clamped to the 416 left; the third finds no budget.
        assert_eq!(h.args(), [(256, 608), (4096, 416)]);
        assert_eq!(h.bytes(), 1024);
        let h = L2Prefetch::with_budget(1 << 20)
            .push(256, 33)
            .push(512, 48)
            .push(1024, 64);
        // Lengths round down to 16 bytes; no third slot.
        assert_eq!(h.args(), [(256, 32), (512, 48)]);
        // One block per SM at least when there is something to prefetch; the working blocks
        // are passed as they are.
        assert_eq!(h.launch(1, 132), (132, (256, 32, 512, 48, 1)));
        assert_eq!(h.launch(256, 132).0, 256);
        assert_eq!(L2Prefetch::NONE.launch(1, 132), (1, (0, 0, 0, 0, 1)));
    }
}
