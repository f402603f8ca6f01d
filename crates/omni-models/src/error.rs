//! The crate's error type.

use crate::weights::WeightError;

/// Errors building or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Reading weights failed.
    #[error(transparent)]
    Weight(#[from] WeightError),
    /// A backend op rejected its inputs.
    #[error(transparent)]
    Backend(#[from] omni_backend::Error),
    /// `config.json` could not be parsed.
    #[error("config.json: {0}")]
    ConfigParse(#[from] serde_json::Error),
    /// `config.json` parsed but describes something unsupported or inconsistent.
    #[error("config: {0}")]
    Config(String),
    /// No architecture of this name is registered.
    #[error("unsupported architecture `{name}` (supported: {supported})")]
    UnknownArchitecture {
        /// The `architectures[0]` string from `config.json`.
        name: String,
        /// Comma-separated registered names.
        supported: String,
    },
    /// The model cannot be split this way.
    #[error("tensor parallel: {0}")]
    TensorParallel(String),
    /// The forward batch is inconsistent (lengths, KV cache count).
    #[error("batch: {0}")]
    Batch(String),
    /// The GPU backend failed (a CUDA, cuBLAS, NVRTC or NCCL error).
    #[error("device: {0}")]
    Device(String),
    /// An I/O error outside weight files (reading `config.json`).
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
}
