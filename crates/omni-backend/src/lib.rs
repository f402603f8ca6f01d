//! Tensors and ops: the CPU backend (and later CUDA).
//!
//! Layer L1. Everything here works on plain `f32` slices in row-major order, so the model code in
//! `omni-models` owns its buffers and reuses them across layers. What this crate owns:
//!
//! - [`linalg`]: matrix products through the `gemm` crate (multi-threaded with rayon for large
//!   products), never hand-written loops;
//! - [`quant`]: linear layers over weights kept in ggml's Q4_1 / Q8_0 blocks (integer dot
//!   products against Q8-quantized activations, AVX2 when present; f32 tiles for prefill);
//! - [`ops`]: RMSNorm, SiLU-and-mul, softmax, embedding lookup, residual add;
//! - [`rope`]: rotary position embeddings (Hugging Face `rotate_half` / neox convention), with
//!   Llama-3 `rope_scaling`;
//! - [`attention`]: the paged KV cache ([`attention::LayerKvCache`]) and paged attention over a
//!   batch that mixes prefills, chunked prefills and decodes, with vLLM's metadata names;
//! - [`comm`]: the [`comm::AllReduce`] hook tensor-parallel models call after row-parallel layers;
//! - `cuda` (feature `cuda`, off by default): the CUDA backend's foundation (driver status,
//!   bf16 cuBLAS GEMM, NVRTC kernels).
//!
//! ```
//! use omni_backend::linalg::matmul_nt;
//! // out[m, n] = a[m, k] @ w[n, k]^T  (w in Hugging Face `[out_features, in_features]` layout)
//! let a = [1.0, 2.0];
//! let w = [3.0, 4.0, 5.0, 6.0];
//! let mut out = [0.0; 2];
//! matmul_nt(&a, &w, &mut out, 1, 2, 2).unwrap();
//! assert_eq!(out, [11.0, 17.0]);
//! ```

pub mod activation;
pub mod attention;
pub mod comm;
pub mod conv;
pub mod conv2d;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dense_attention;
pub mod gelu_tanh;
pub mod linalg;
pub mod ops;
pub mod quant;
pub mod rope;
pub mod spin_pool;
#[cfg(test)]
mod test_util;
pub mod varlen_attention;
pub mod window_attention;

/// Errors from backend ops: all of them are shape or argument mismatches.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A buffer is shorter (or of another length) than its dimensions need.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which operand.
        what: &'static str,
        /// The length the dimensions imply.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// Attention metadata is inconsistent (lengths, block tables, slots).
    #[error("attention metadata: {0}")]
    Metadata(String),
    /// An all-reduce failed (peer gone, length mismatch).
    #[error("all-reduce: {0}")]
    AllReduce(String),
}

/// Result alias for backend ops.
pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn check_len(what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::Shape {
            what,
            expected,
            got,
        })
    }
}
