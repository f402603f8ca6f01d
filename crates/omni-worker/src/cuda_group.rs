//! Where a CUDA rank runs and how it joins its tensor-parallel group: [`CudaPlace`] (its device
//! and coordinates) and the NCCL unique id of its group ([`NcclIdSource`]).
//!
//! # NCCL set-up
//! NCCL needs one 128-byte unique id on every rank of a group; the group's TP rank 0 makes it.
//! - A group on one node: rank 0 publishes it in the group's all-reduce segment
//!   (`omni.<instance>.allreduce<pp_rank>`, created 0600 by the executor or the node's launcher
//!   and removed by it; the CPU backend uses the same segment for its shared-memory all-reduce):
//!   bytes `64..192` hold the id, then rank 0 stores `1` into the `u32` at offset 0 with release
//!   ordering. The other ranks poll that word with acquire ordering (so the id bytes they read
//!   after seeing `1` are the ones written before it), for at most [`NCCL_ID_TIMEOUT`].
//! - A group spread over nodes: rank 0 sends it on its partial-sum queue (TCP to the other
//!   nodes; the queue's handle went through the master rendezvous), which every other rank of
//!   the group reads ([`crate::peers::QueueAllReduce::broadcast_from_first`]).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use omni_backend::cuda::NcclComm;
use omni_ipc::shm::ShmSegment;
use omni_models::PipelineStage;
use omni_protocol::ParallelLayout;

use crate::WorkerError;
use crate::peers::QueueAllReduce;

/// How long ranks other than 0 wait for the NCCL id.
pub const NCCL_ID_TIMEOUT: Duration = Duration::from_secs(120);

use crate::SHARE_DEVICES_ENV;

/// Where a CUDA rank runs: its device and its places in the tensor- and pipeline-parallel
/// groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaPlace {
    /// The engine-wide rank.
    pub rank: usize,
    /// The CUDA device ordinal (the rank's index among its node's ranks).
    pub device: usize,
    /// Its index in its tensor-parallel group.
    pub tp_rank: usize,
    /// The group's size.
    pub tp_size: usize,
    /// Its pipeline stage.
    pub stage: PipelineStage,
}

impl CudaPlace {
    /// One rank on device 0, no parallelism.
    pub fn single() -> Self {
        Self {
            rank: 0,
            device: 0,
            tp_rank: 0,
            tp_size: 1,
            stage: PipelineStage::default(),
        }
    }

    /// `rank`'s place in `layout`: device = its local index on its node (vLLM's `local_rank`).
    pub fn of(layout: &ParallelLayout, rank: usize) -> Result<Self, WorkerError> {
        let local = layout
            .ranks_on(layout.node(rank))
            .iter()
            .position(|&r| r == rank)
            .unwrap_or(0);
        let device = if local == 0 {
            0
        } else {
            let count = omni_backend::cuda::driver_status()
                .map_err(|e| WorkerError::Load(e.to_string()))?
                .device_count;
            device_of_local_rank(local, count, crate::share_devices())?
        };
        Ok(Self {
            rank,
            device,
            tp_rank: layout.tp_rank(rank),
            tp_size: layout.tp_group(rank).len(),
            stage: PipelineStage {
                rank: layout.pp_rank(rank),
                size: layout.pipeline_parallel_size.max(1) as usize,
            },
        })
    }
}

/// The device of a node's `local`-th rank when the node has `count` devices.
pub fn device_of_local_rank(local: usize, count: usize, share: bool) -> Result<usize, WorkerError> {
    match (local < count, share && count > 0) {
        (true, _) => Ok(local),
        (false, true) => {
            tracing::warn!(
                local,
                count,
                "more ranks than GPUs on this node: sharing devices ({SHARE_DEVICES_ENV}=1)"
            );
            Ok(local % count)
        }
        (false, false) => Err(WorkerError::Load(format!(
            "local rank {local} needs GPU {local}, but this node has {count} (one GPU per rank; \
             {SHARE_DEVICES_ENV}=1 shares them)"
        ))),
    }
}

/// How a rank learns its tensor-parallel group's NCCL unique id (see the module docs).
#[derive(Debug)]
pub enum NcclIdSource {
    /// A group of one: no NCCL.
    None,
    /// Through the group's all-reduce segment on this node.
    Segment(String),
    /// Over the group's partial-sum queues (a group spread over nodes).
    Queues(Box<QueueAllReduce>),
}

/// Publishes (rank 0) or reads (other ranks) the NCCL unique id through the tensor-parallel
/// segment (see the module docs for the protocol).
fn exchange_nccl_id(segment: &str, tp_rank: usize) -> Result<[u8; 128], WorkerError> {
    let seg = ShmSegment::open(segment)
        .map_err(|e| WorkerError::Load(format!("opening {segment} for the NCCL id: {e}")))?;
    if seg.len() < 192 {
        return Err(WorkerError::Load(format!(
            "segment {segment} is too small ({} bytes) for the NCCL id",
            seg.len()
        )));
    }
    let base = seg.as_ptr();
    // SAFETY: the mapping is at least 192 bytes and page-aligned, so offset 0 is a valid,
    // 4-byte-aligned u32 for the segment's lifetime (`seg` outlives `flag`); every process
    // touches it only atomically.
    let flag = unsafe { AtomicU32::from_ptr(base.cast::<u32>()) };
    // SAFETY: bytes 64..192 lie inside the mapping; they are written only by rank 0 before it
    // publishes the flag (release) and read by the others only after they observe it (acquire).
    let id_bytes = unsafe { std::slice::from_raw_parts_mut(base.add(64), 128) };
    if tp_rank == 0 {
        let id = NcclComm::unique_id().map_err(|e| WorkerError::Load(e.to_string()))?;
        id_bytes.copy_from_slice(&id);
        flag.store(1, Ordering::Release);
        return Ok(id);
    }
    let deadline = Instant::now() + NCCL_ID_TIMEOUT;
    while flag.load(Ordering::Acquire) != 1 {
        if Instant::now() > deadline {
            return Err(WorkerError::Load(format!(
                "rank 0 did not publish the NCCL id in {NCCL_ID_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut id = [0u8; 128];
    id.copy_from_slice(id_bytes);
    Ok(id)
}

/// The NCCL unique id of `place`'s group: made by its TP rank 0, learnt by the others.
pub(crate) fn group_nccl_id(
    place: &CudaPlace,
    source: &NcclIdSource,
) -> Result<[u8; 128], WorkerError> {
    match source {
        NcclIdSource::None => Err(WorkerError::Load(format!(
            "{} tensor-parallel ranks on CUDA but no way to share the NCCL id",
            place.tp_size
        ))),
        NcclIdSource::Segment(name) => exchange_nccl_id(name, place.tp_rank),
        NcclIdSource::Queues(q) => {
            let mine = if place.tp_rank == 0 {
                Some(NcclComm::unique_id().map_err(|e| WorkerError::Load(e.to_string()))?)
            } else {
                None
            };
            let got = q.broadcast_from_first(mine.as_ref().map(|id| &id[..]))?;
            got.try_into().map_err(|b: Vec<u8>| {
                WorkerError::Load(format!("the NCCL id from TP rank 0 has {} bytes", b.len()))
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::device_of_local_rank;

    #[test]
    fn a_rank_gets_its_local_device_or_a_shared_one_only_when_asked() {
        assert_eq!(device_of_local_rank(0, 1, false).unwrap(), 0);
        assert_eq!(device_of_local_rank(3, 8, false).unwrap(), 3);
        let e = device_of_local_rank(1, 1, false).unwrap_err().to_string();
        assert!(
            e.contains("local rank 1 needs GPU 1") && e.contains("has 1"),
            "{e}"
        );
        assert_eq!(device_of_local_rank(1, 1, true).unwrap(), 0);
        assert_eq!(device_of_local_rank(5, 2, true).unwrap(), 1);
        assert!(device_of_local_rank(1, 0, true).is_err());
    }
}
