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
/// message (row-major, little-endian, no padding). The index counts the message's buffers from
/// 0 and not its serde header (`omni_ipc`'s `enqueue(header, buffers)` / `buffer(i)`).
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

    /// This tensor's bytes among a message's out-of-band `buffers`, checked: the buffer exists,
    /// has [`Self::num_bytes`] bytes, and starts on a multiple of the element size (ring slots
    /// place buffers on 64 bytes; heap buffers of the overflow path on at least 16).
    pub fn view<'a>(&'a self, buffers: &[&'a [u8]]) -> Result<TensorView<'a>, TensorBufferError> {
        let bytes =
            *buffers
                .get(self.buffer_index as usize)
                .ok_or_else(|| TensorBufferError::Missing {
                    name: self.name.clone(),
                    buffer_index: self.buffer_index,
                    num_buffers: buffers.len(),
                })?;
        if bytes.len() as u64 != self.num_bytes() {
            return Err(TensorBufferError::Size {
                name: self.name.clone(),
                expected: self.num_bytes(),
                actual: bytes.len() as u64,
            });
        }
        let align = self.dtype.size_in_bytes();
        if !(bytes.as_ptr() as usize).is_multiple_of(align) {
            return Err(TensorBufferError::Misaligned {
                name: self.name.clone(),
                align,
            });
        }
        Ok(TensorView { meta: self, bytes })
    }
}

/// A tensor of a received message, borrowed from its buffer (in place in the ring slot when the
/// message came through shared memory): its [`TensorRef`] and its checked bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorView<'a> {
    /// What the tensor is.
    pub meta: &'a TensorRef,
    /// Its bytes: exactly `meta.num_bytes()`, aligned to the element size.
    pub bytes: &'a [u8],
}

/// A [`TensorRef`] that does not match the buffers of its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorBufferError {
    /// The message has no buffer of that index.
    #[error("tensor {name:?} names buffer {buffer_index}, but the message has {num_buffers}")]
    Missing {
        /// The tensor.
        name: String,
        /// The buffer it names.
        buffer_index: u32,
        /// Buffers in the message.
        num_buffers: usize,
    },
    /// The buffer's length is not what dtype and shape make.
    #[error("tensor {name:?} needs {expected} bytes, its buffer has {actual}")]
    Size {
        /// The tensor.
        name: String,
        /// Bytes of dtype x shape.
        expected: u64,
        /// Bytes of the buffer.
        actual: u64,
    },
    /// The buffer does not start on a multiple of the element size.
    #[error("tensor {name:?}: buffer not aligned to {align} bytes")]
    Misaligned {
        /// The tensor.
        name: String,
        /// The element size.
        align: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_ref(shape: Vec<u64>, buffer_index: u32) -> TensorRef {
        TensorRef {
            name: "audio_features".into(),
            request_id: None,
            dtype: DType::F32,
            shape,
            buffer_index,
        }
    }

    #[test]
    fn view_checks_index_size_and_alignment() {
        let words = [0u64; 4]; // 8-byte aligned storage
        // SAFETY: `words` is 32 initialized bytes that outlive `bytes`; u8 has no alignment.
        let bytes: &[u8] = unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), 32) };
        let buffers = [&bytes[..0], &bytes[..24]];
        let t = f32_ref(vec![2, 3], 1);
        assert_eq!(t.view(&buffers).unwrap().bytes.len(), 24);
        assert!(matches!(
            f32_ref(vec![2, 3], 2).view(&buffers),
            Err(TensorBufferError::Missing { num_buffers: 2, .. })
        ));
        assert!(matches!(
            f32_ref(vec![7], 1).view(&buffers),
            Err(TensorBufferError::Size {
                expected: 28,
                actual: 24,
                ..
            })
        ));
        let odd = [&bytes[1..25]];
        assert!(matches!(
            f32_ref(vec![6], 0).view(&odd),
            Err(TensorBufferError::Misaligned { align: 4, .. })
        ));
    }
}
