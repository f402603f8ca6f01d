//! Descriptors of tensors that travel beside a message as out-of-band byte buffers.

use serde::{Deserialize, Serialize};

use crate::RequestId;

/// Element type of an out-of-band tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    Bf16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::I64 => 8,
            DType::U8 => 1,
        }
    }
}

/// Names one tensor whose bytes are the `buffer_index`-th out-of-band buffer of the same IPC
/// message (row-major, little-endian, no padding). Buffer 0 is the serde header itself, so
/// tensor buffers start at 1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRef {
    /// What the tensor is, e.g. `"thinker.hidden_states.24"` or `"audio_features"`.
    pub name: String,
    /// The request it belongs to, when it belongs to one.
    pub request_id: Option<RequestId>,
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// Index of the out-of-band buffer holding the bytes.
    pub buffer_index: u32,
}

impl TensorRef {
    /// Number of elements (product of the shape; 1 for a scalar).
    pub fn num_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Size the out-of-band buffer must have, in bytes.
    pub fn num_bytes(&self) -> u64 {
        self.num_elements() * self.dtype.size_in_bytes() as u64
    }
}
