//! GGUF checkpoints as a [`crate::weights::WeightSource`].
//!
//! Tensor names and layout are Hugging Face's: `omni-gguf` maps llama.cpp names
//! (`blk.0.attn_q.weight`) to HF names (`model.layers.0.self_attn.q_proj.weight`), dequantizes
//! to f32 and undoes llama.cpp's Q/K row permutation, so a model's constructor walks a GGUF file
//! exactly as it walks a safetensors directory. [`GgufWeights::hf_config`] gives the matching
//! `config.json`. 2-D Q4_1 and Q8_0 weights are also served as their blocks
//! ([`WeightSource::load_quantized`]), so the CPU backend keeps them quantized. Tied embeddings: when the file has no `output.weight`, `lm_head.weight` is
//! absent and the config says `tie_word_embeddings: true`.

use std::path::Path;

use omni_backend::quant::{QMatrix, QuantType};
use omni_gguf::{GgmlType, GgufFile};

use crate::weights::{HostTensor, WeightError, WeightSource};

/// A memory-mapped GGUF file seen through HF names.
#[derive(Debug)]
pub struct GgufWeights {
    file: GgufFile,
    names: Vec<String>,
}

impl GgufWeights {
    /// Opens and parses `path` (tensor data stays mapped until loaded).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, WeightError> {
        let path = path.as_ref();
        let file = GgufFile::open(path).map_err(|e| match e {
            omni_gguf::Error::Io { source, .. } => WeightError::Io {
                path: path.display().to_string(),
                source,
            },
            other => WeightError::Invalid {
                name: path.display().to_string(),
                reason: other.to_string(),
            },
        })?;
        Ok(Self::from_file(file))
    }

    /// Wraps an already-parsed file.
    pub fn from_file(file: GgufFile) -> Self {
        let names = file.hf_tensor_names();
        Self { file, names }
    }

    /// The underlying file (metadata, tokenizer keys, raw tensors).
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// A Hugging Face `config.json` synthesized from the metadata.
    pub fn hf_config(&self) -> Result<serde_json::Value, WeightError> {
        self.file.hf_config().map_err(|e| WeightError::Invalid {
            name: "config.json".into(),
            reason: e.to_string(),
        })
    }
}

fn convert(name: &str, e: omni_gguf::Error) -> WeightError {
    match e {
        omni_gguf::Error::TensorNotFound { .. } => WeightError::Missing { name: name.into() },
        other => WeightError::Invalid {
            name: name.into(),
            reason: other.to_string(),
        },
    }
}

impl WeightSource for GgufWeights {
    fn tensor_names(&self) -> Vec<String> {
        self.names.clone()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        self.file
            .hf_tensor_shape(name)
            .map_err(|e| convert(name, e))
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let t = self
            .file
            .load_hf_tensor(name)
            .map_err(|e| convert(name, e))?;
        Ok(HostTensor {
            shape: t.shape,
            data: t.data,
        })
    }

    fn load_quantized(&self, name: &str) -> Result<Option<QMatrix>, WeightError> {
        let info = omni_gguf::hf_to_gguf_name(name)
            .and_then(|g| self.file.tensor(&g))
            .ok_or_else(|| WeightError::Missing { name: name.into() })?;
        let ty = match info.ggml_type {
            GgmlType::Q4_1 => QuantType::Q4_1,
            GgmlType::Q8_0 => QuantType::Q8_0,
            _ => return Ok(None),
        };
        let [rows, cols] = info.shape()[..] else {
            return Ok(None);
        };
        let raw = self.file.load_hf_raw(name).map_err(|e| convert(name, e))?;
        QMatrix::new(ty, rows, cols, raw.data)
            .map(Some)
            .map_err(|e| WeightError::Invalid {
                name: name.into(),
                reason: e.to_string(),
            })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use omni_gguf::{GgufWriter, Value};

    fn tiny() -> GgufWeights {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()));
        w.metadata("llama.embedding_length", Value::U32(4));
        w.metadata("llama.feed_forward_length", Value::U32(8));
        w.metadata("llama.block_count", Value::U32(1));
        w.metadata("llama.attention.head_count", Value::U32(1));
        w.metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-6));
        w.metadata("llama.context_length", Value::U32(16));
        w.metadata("llama.vocab_size", Value::U32(10));
        // One head of dim 4: llama.cpp stores HF rows [0, 1, 2, 3] as [0, 2, 1, 3].
        let hf_rows = [[0.0f32; 4], [1.0; 4], [2.0; 4], [3.0; 4]];
        let stored: Vec<f32> = [0, 2, 1, 3].iter().flat_map(|&r| hf_rows[r]).collect();
        w.tensor_f32("blk.0.attn_q.weight", &[4, 4], &stored);
        w.tensor_f32("output_norm.weight", &[4], &[1.0, 2.0, 3.0, 4.0]);
        GgufWeights::from_file(GgufFile::from_bytes(w.to_bytes()).unwrap())
    }

    #[test]
    fn gguf_weights_serve_hf_names_in_hf_layout() {
        let w = tiny();
        assert_eq!(
            w.tensor_names(),
            [
                "model.layers.0.self_attn.q_proj.weight",
                "model.norm.weight"
            ]
        );
        assert_eq!(w.shape("model.norm.weight").unwrap(), [4]);
        let q = w.load("model.layers.0.self_attn.q_proj.weight").unwrap();
        assert_eq!(q.shape, [4, 4]);
        let first_col: Vec<f32> = q.data.iter().step_by(4).copied().collect();
        assert_eq!(first_col, [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(
            w.hf_config().unwrap()["architectures"][0],
            "LlamaForCausalLM"
        );
    }

    #[test]
    fn q8_0_weights_are_served_as_blocks_in_hf_row_order() {
        // One head of dim 4, 32 columns: HF row r is all r (scale 1), stored as rows [0, 2, 1, 3].
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()));
        w.metadata("llama.attention.head_count", Value::U32(1));
        let block = |r: u8| {
            let mut b = half::f16::from_f32(1.0).to_le_bytes().to_vec();
            b.extend([r; 32]);
            b
        };
        let stored: Vec<u8> = [0, 2, 1, 3].iter().flat_map(|&r| block(r)).collect();
        w.tensor_raw("blk.0.attn_q.weight", &[32, 4], GgmlType::Q8_0, stored);
        w.tensor_f32("output_norm.weight", &[4], &[1.0; 4]);
        let ws = GgufWeights::from_file(GgufFile::from_bytes(w.to_bytes()).unwrap());
        let name = "model.layers.0.self_attn.q_proj.weight";
        let q = ws.load_quantized(name).unwrap().unwrap();
        assert_eq!((q.ty(), q.rows(), q.cols()), (QuantType::Q8_0, 4, 32));
        assert_eq!(q.dequantize(), ws.load(name).unwrap().data);
        assert_eq!(q.dequantize()[2 * 32], 2.0);
        assert!(ws.load_quantized("model.norm.weight").unwrap().is_none());
        assert!(matches!(
            ws.load_quantized("lm_head.weight"),
            Err(WeightError::Missing { .. })
        ));
    }

    #[test]
    fn missing_tensors_are_reported_as_missing() {
        let w = tiny();
        assert!(matches!(
            w.load("lm_head.weight"),
            Err(WeightError::Missing { .. })
        ));
        assert!(matches!(
            w.shape("not.a.tensor"),
            Err(WeightError::Missing { .. })
        ));
    }
}
