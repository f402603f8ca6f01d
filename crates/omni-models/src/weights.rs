//! Where a model's weights come from: one trait, implemented for safetensors directories,
//! GGUF files and random (`--load-format dummy`) weights.

/// A host tensor in f32, row-major, in Hugging Face layout (`[out, in]` for linear weights).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major.
    pub data: Vec<f32>,
}

/// Errors while reading weights.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The checkpoint has no tensor of this name.
    #[error("tensor `{name}` is not in the checkpoint")]
    Missing {
        /// Hugging Face tensor name.
        name: String,
    },
    /// The tensor exists but cannot be decoded.
    #[error("tensor `{name}`: {reason}")]
    Invalid {
        /// Hugging Face tensor name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An I/O error reading the checkpoint.
    #[error("reading {path}: {source}")]
    Io {
        /// The file being read.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// A source of named weights in Hugging Face naming and layout
/// (`model.layers.{i}.self_attn.q_proj.weight`, `[out_features, in_features]`).
pub trait WeightSource: Send + Sync {
    /// Every tensor name the source holds.
    fn tensor_names(&self) -> Vec<String>;
    /// The shape of one tensor, without reading its data.
    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError>;
    /// The whole tensor, upcast to f32, in HF layout.
    fn load(&self, name: &str) -> Result<HostTensor, WeightError>;
}
