//! GGUF reader: metadata, tensor dequantization (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16, F32)
//! and a Hugging Face view of the checkpoint (HF tensor names and layout, a synthesized
//! `config.json`).
//!
//! Sits below `omni-models` (weights) and `omni-tokenizer` (vocabulary and chat template from
//! GGUF metadata); it knows nothing of tensors on devices. It also locates the built-in default
//! model ([`default_model`]).
//!
//! ```no_run
//! use omni_gguf::GgufFile;
//! # fn main() -> Result<(), omni_gguf::Error> {
//! let file = GgufFile::open(omni_gguf::default_model::locate_or_fetch()?)?;
//! let config = file.hf_config()?; // serde_json::Value shaped like HF's config.json
//! let q = file.load_hf_tensor("model.layers.0.self_attn.q_proj.weight")?;
//! assert_eq!(q.shape, [576, 576]);
//! # let _ = config; Ok(()) }
//! ```

pub mod default_model;
pub mod dequant;
pub mod file;
pub mod hf;
pub mod value;
pub mod writer;

use std::path::PathBuf;

pub use dequant::{DequantizeError, GgmlType, dequantize};
pub use file::{GgufFile, TensorInfo};
pub use hf::{HfRawTensor, HfTensor, gguf_to_hf_name, hf_to_gguf_name};
pub use value::{Value, ValueType};
pub use writer::GgufWriter;

/// Errors reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be opened or mapped.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The first four bytes are not "GGUF".
    #[error("not a GGUF file (magic {magic:#010x})")]
    BadMagic {
        /// What was there.
        magic: u32,
    },
    /// A version other than 2 or 3 (or a big-endian file).
    #[error("unsupported GGUF version {version} (2 and 3, little-endian, are supported)")]
    UnsupportedVersion {
        /// The version field as read.
        version: u32,
    },
    /// The file ends inside the header.
    #[error("GGUF header truncated at byte {offset} (needed {needed} more bytes)")]
    Truncated {
        /// Where reading stopped.
        offset: usize,
        /// Bytes that were needed.
        needed: usize,
    },
    /// A metadata value has an unknown type tag.
    #[error("unknown metadata value type {tag}")]
    UnknownValueType {
        /// The tag.
        tag: u32,
    },
    /// The header is inconsistent.
    #[error("malformed GGUF: {reason}")]
    Malformed {
        /// What is wrong.
        reason: String,
    },
    /// A required metadata key is absent.
    #[error("metadata key `{key}` is missing")]
    MissingMetadata {
        /// The key.
        key: String,
    },
    /// A metadata key has the wrong type.
    #[error("metadata key `{key}` is not {expected}")]
    MetadataType {
        /// The key.
        key: String,
        /// What was expected.
        expected: &'static str,
    },
    /// No tensor of that name.
    #[error("tensor `{name}` is not in the file")]
    TensorNotFound {
        /// The name asked for.
        name: String,
    },
    /// The tensor's type cannot be read by this crate.
    #[error("tensor `{name}` has unsupported type {ggml_type}")]
    UnsupportedTensorType {
        /// The tensor.
        name: String,
        /// Its type.
        ggml_type: String,
    },
    /// Dequantization failed.
    #[error("tensor `{name}`: {source}")]
    Dequantize {
        /// The tensor.
        name: String,
        /// Why.
        source: DequantizeError,
    },
    /// The architecture has no HF mapping here.
    #[error("GGUF architecture `{arch}` has no Hugging Face mapping (supported: llama, qwen2)")]
    UnsupportedArchitecture {
        /// `general.architecture`.
        arch: String,
    },
    /// The default model could not be found or fetched.
    #[error("default model: {reason}")]
    DefaultModel {
        /// Why.
        reason: String,
    },
}
