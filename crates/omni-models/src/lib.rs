//! Model architectures (one file each) and weight loading (safetensors, GGUF, dummy).
//!
//! Layer L2: depends on `omni-backend` for tensors and ops; knows nothing of processes or IPC.

pub mod gguf;
pub mod sampler;
pub mod weights;
