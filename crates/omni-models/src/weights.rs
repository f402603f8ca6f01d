//! Where a model's weights come from: one trait, implemented for safetensors directories,
//! GGUF files and random (`--load-format dummy`) weights; [`ProgressWeights`] wraps any of them
//! to report loading progress.

use std::sync::atomic::{AtomicUsize, Ordering};

use omni_backend::quant::QMatrix;

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
    /// A 2-D weight in the quantized blocks the CPU backend multiplies without upcasting
    /// ([`QMatrix`]: Q4_1, Q8_0), rows in HF order; `None` where the source holds the tensor
    /// otherwise (f32, another block type), and [`WeightSource::load`] then gives it in f32.
    fn load_quantized(&self, name: &str) -> Result<Option<QMatrix>, WeightError> {
        let _ = name;
        Ok(None)
    }
}

/// Called after each tensor a model constructor reads: `(tensors read so far, tensors the model
/// reads in all)`. A progress bar, a log line every quarter, or nothing.
pub type LoadProgressFn<'a> = &'a (dyn Fn(usize, usize) + Sync);

/// A [`WeightSource`] that counts the tensors read through it and reports each one to a
/// [`LoadProgressFn`]. One relaxed atomic add per tensor: nothing next to reading the tensor.
pub struct ProgressWeights<'a> {
    inner: &'a dyn WeightSource,
    total: usize,
    done: AtomicUsize,
    on_load: LoadProgressFn<'a>,
}

impl<'a> ProgressWeights<'a> {
    /// Wraps `inner`; `total` is how many tensors the model will read.
    pub fn new(inner: &'a dyn WeightSource, total: usize, on_load: LoadProgressFn<'a>) -> Self {
        Self {
            inner,
            total,
            done: AtomicUsize::new(0),
            on_load,
        }
    }

    /// Tensors read so far.
    pub fn loaded(&self) -> usize {
        self.done.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for ProgressWeights<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProgressWeights")
            .field("total", &self.total)
            .field("loaded", &self.loaded())
            .finish_non_exhaustive()
    }
}

impl WeightSource for ProgressWeights<'_> {
    fn tensor_names(&self) -> Vec<String> {
        self.inner.tensor_names()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        self.inner.shape(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let t = self.inner.load(name)?;
        self.count();
        Ok(t)
    }

    fn load_quantized(&self, name: &str) -> Result<Option<QMatrix>, WeightError> {
        let t = self.inner.load_quantized(name)?;
        if t.is_some() {
            self.count();
        }
        Ok(t)
    }
}

impl ProgressWeights<'_> {
    fn count(&self) {
        // Relaxed: a counter for display; no other memory is published through it.
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        (self.on_load)(done, self.total);
    }
}

/// One sub-model of a checkpoint seen under the names a single-model loader expects: `name` is
/// read as `prefix` + `name`, after `renames` (`(as the loader asks, as the checkpoint saves)`).
/// Qwen3-Omni's Talker is `SubmodelWeights::new(ws, "talker.", &[("model.embed_tokens.weight",
/// "model.codec_embedding.weight"), ("lm_head.weight", "codec_head.weight")])`.
pub struct SubmodelWeights<'a> {
    inner: &'a dyn WeightSource,
    prefix: &'a str,
    renames: &'a [(&'a str, &'a str)],
}

impl<'a> SubmodelWeights<'a> {
    /// The view of `inner` under `prefix`, with `renames`.
    pub fn new(
        inner: &'a dyn WeightSource,
        prefix: &'a str,
        renames: &'a [(&'a str, &'a str)],
    ) -> Self {
        Self {
            inner,
            prefix,
            renames,
        }
    }

    fn full(&self, name: &str) -> String {
        let saved = self
            .renames
            .iter()
            .find(|(asked, _)| *asked == name)
            .map_or(name, |(_, saved)| saved);
        format!("{}{saved}", self.prefix)
    }
}

impl std::fmt::Debug for SubmodelWeights<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubmodelWeights")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl WeightSource for SubmodelWeights<'_> {
    fn tensor_names(&self) -> Vec<String> {
        self.inner
            .tensor_names()
            .into_iter()
            .filter_map(|n| {
                let local = n.strip_prefix(self.prefix)?;
                let asked = self
                    .renames
                    .iter()
                    .find(|(_, saved)| *saved == local)
                    .map_or(local, |(asked, _)| asked);
                Some(asked.to_string())
            })
            .collect()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        self.inner.shape(&self.full(name))
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        self.inner.load(&self.full(name))
    }

    fn load_quantized(&self, name: &str) -> Result<Option<QMatrix>, WeightError> {
        self.inner.load_quantized(&self.full(name))
    }
}
