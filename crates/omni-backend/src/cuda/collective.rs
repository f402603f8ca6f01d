//! [`NcclAllReduce`]: the tensor-parallel all-reduce of the CUDA decoder, over NCCL.

use std::sync::Mutex;

use cudarc::driver::CudaViewMut;

use super::{CudaError, CudaResult, DeviceAllReduce, NcclComm};

/// A [`NcclComm`] shared by the model's layers. NCCL communicators are not thread-safe, so
/// calls are serialized by a mutex (uncontended: one worker thread steps the model).
#[derive(Debug)]
pub struct NcclAllReduce {
    comm: Mutex<NcclComm>,
    world: usize,
}

impl NcclAllReduce {
    /// Wraps a joined communicator.
    pub fn new(comm: NcclComm) -> Self {
        let world = comm.world_size();
        Self {
            comm: Mutex::new(comm),
            world,
        }
    }
}

impl DeviceAllReduce for NcclAllReduce {
    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum_f32(&self, buf: &mut CudaViewMut<'_, f32>) -> CudaResult<()> {
        let len = buf.len();
        self.comm
            .lock()
            .map_err(|_| CudaError::Poisoned)?
            .all_reduce_sum_f32_in_place(buf, len)
            .map_err(|e| CudaError::Collective(e.to_string()))
    }
}
