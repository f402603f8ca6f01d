//! The crate's error type: what can fail while loading a voice or running it.

use std::path::PathBuf;

/// Loading or running a voice failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A voice file is missing or unreadable.
    #[error("cannot read voice file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A voice data file (JSON, gzipped JSON) does not parse or lacks a field.
    #[error("voice data file {path} is malformed: {reason}")]
    Data { path: PathBuf, reason: String },
    /// The ONNX Runtime shared library could not be loaded (see `scripts/fetch-voice.sh`).
    #[error("cannot load the ONNX Runtime library {path}: {reason}")]
    RuntimeLoad { path: PathBuf, reason: String },
    /// ONNX Runtime rejected a model file or a run.
    #[error("ONNX Runtime failed on {model}: {reason}")]
    Onnx { model: String, reason: String },
    /// A model returned outputs of an unexpected shape.
    #[error("{model} returned {what}")]
    Shape { model: String, what: String },
    /// The built-in voice is not in the cache and fetching it failed.
    #[error("the built-in voice: {reason}")]
    Fetch { reason: String },
    /// A built-in pattern failed to compile (a bug, reported rather than panicking).
    #[error("pattern {name} does not compile: {reason}")]
    Pattern { name: &'static str, reason: String },
}

impl Error {
    pub(crate) fn data(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Self {
        Self::Data {
            path: path.into(),
            reason: reason.to_string(),
        }
    }

    pub(crate) fn onnx(model: &str, reason: impl std::fmt::Display) -> Self {
        Self::Onnx {
            model: model.to_string(),
            reason: reason.to_string(),
        }
    }
}
