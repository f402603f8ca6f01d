//! Collective hooks for tensor parallelism.
//!
//! A tensor-parallel model calls [`AllReduce::all_reduce_sum`] after each row-parallel layer
//! (`o_proj`, `down_proj`). [`IdentityAllReduce`] serves `tp_size = 1`; [`InProcessAllReduce`]
//! connects ranks that run as threads of one process (tests, and a CPU stand-in for NCCL).

use std::sync::{Arc, Barrier, Mutex};

use crate::{Error, Result};

/// Sums a buffer element-wise across all ranks of a group; every rank gets the sum.
pub trait AllReduce: Send + Sync + std::fmt::Debug {
    /// Replaces `x` by the element-wise sum of every rank's `x` (same length on every rank).
    fn all_reduce_sum(&self, x: &mut [f32]) -> Result<()>;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
}

/// The all-reduce of a group of one: leaves the buffer as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdentityAllReduce;

impl AllReduce for IdentityAllReduce {
    fn all_reduce_sum(&self, _x: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn world_size(&self) -> usize {
        1
    }
}

#[derive(Debug)]
struct Shared {
    acc: Mutex<Vec<f32>>,
    barrier: Barrier,
    size: usize,
}

/// One rank's handle on an all-reduce among threads of one process. Every rank must call
/// [`AllReduce::all_reduce_sum`] the same number of times with buffers of equal length, each from
/// its own thread; the calls block until all ranks have arrived.
#[derive(Debug, Clone)]
pub struct InProcessAllReduce {
    shared: Arc<Shared>,
}

impl InProcessAllReduce {
    /// Handles for a group of `size` ranks, one per rank.
    pub fn group(size: usize) -> Vec<Self> {
        let shared = Arc::new(Shared {
            acc: Mutex::new(Vec::new()),
            barrier: Barrier::new(size),
            size,
        });
        (0..size)
            .map(|_| Self {
                shared: shared.clone(),
            })
            .collect()
    }
}

impl AllReduce for InProcessAllReduce {
    fn all_reduce_sum(&self, x: &mut [f32]) -> Result<()> {
        let poisoned = |_| Error::AllReduce("a peer panicked during all-reduce".into());
        let mut mismatch = false;
        {
            let mut acc = self.shared.acc.lock().map_err(poisoned)?;
            if acc.is_empty() {
                acc.resize(x.len(), 0.0);
            }
            if acc.len() == x.len() {
                acc.iter_mut().zip(x.iter()).for_each(|(a, b)| *a += b);
            } else {
                mismatch = true;
            }
        }
        // Phase 1: every rank has added its part.
        self.shared.barrier.wait();
        let copied = {
            let acc = self.shared.acc.lock().map_err(poisoned)?;
            let ok = !mismatch && acc.len() == x.len();
            if ok {
                x.copy_from_slice(&acc);
            }
            ok
        };
        // Phase 2: every rank has read the sum; the leader resets the accumulator.
        if self.shared.barrier.wait().is_leader() {
            self.shared.acc.lock().map_err(poisoned)?.clear();
        }
        // Phase 3: nobody starts the next round before the reset.
        self.shared.barrier.wait();
        if copied {
            Ok(())
        } else {
            Err(Error::AllReduce(format!(
                "buffer lengths differ across ranks (this rank: {})",
                x.len()
            )))
        }
    }

    fn world_size(&self) -> usize {
        self.shared.size
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn in_process_group_sums_across_threads_repeatedly() {
        let group = InProcessAllReduce::group(3);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .enumerate()
                .map(|(r, h)| {
                    s.spawn(move || {
                        let mut last = Vec::new();
                        for round in 0..5 {
                            let mut x = vec![r as f32 + round as f32, 1.0];
                            h.all_reduce_sum(&mut x).unwrap();
                            last = x;
                        }
                        last
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            assert_eq!(r, vec![0.0 + 1.0 + 2.0 + 12.0, 3.0]);
        }
    }

    #[test]
    fn identity_leaves_buffer_unchanged() {
        let mut x = vec![1.0, 2.0];
        IdentityAllReduce.all_reduce_sum(&mut x).unwrap();
        assert_eq!(x, vec![1.0, 2.0]);
    }
}
