//! Hugging Face view of a GGUF checkpoint: HF tensor names, HF layout, a synthesized
//! `config.json`.
//!
//! llama.cpp's converter renames tensors (`model.layers.3.self_attn.q_proj.weight` becomes
//! `blk.3.attn_q.weight`) and, for the `llama` architecture, reorders the rows of the Q and K
//! projections inside each head so that RoPE rotates adjacent pairs `(2i, 2i+1)` instead of HF's
//! halves `(i, i + head_dim/2)`. Its permutation, with `r = head_dim / 2`, sends HF row
//! `h*head_dim + j*r + i` to GGUF row `h*head_dim + 2*i + j` (`j` in 0..2, `i` in 0..r).
//! [`GgufFile::load_hf_tensor`] applies the inverse, so what it returns is exactly the HF
//! checkpoint's tensor (up to quantization).

use serde_json::{Value as Json, json};

use crate::Error;
use crate::dequant::GgmlType;
use crate::file::{GgufFile, TensorInfo};

/// A tensor in HF naming and layout: row-major f32 over `shape` (outermost first).
#[derive(Debug, Clone, PartialEq)]
pub struct HfTensor {
    /// Dimensions, outermost first (`[out_features, in_features]` for a linear weight).
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}

/// A 2-D tensor as stored (ggml blocks), rows in HF order.
#[derive(Debug, Clone, PartialEq)]
pub struct HfRawTensor {
    /// `[rows, cols]` in elements.
    pub shape: Vec<usize>,
    /// The block type.
    pub ggml_type: GgmlType,
    /// `rows` rows of `cols / block` blocks.
    pub data: Vec<u8>,
}

/// Per-layer tensors: llama.cpp suffix and HF suffix (after `blk.{i}.` / `model.layers.{i}.`).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Whole-model tensors: llama.cpp name and HF name (without `.weight` / `.bias`).
const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
];

/// Splits `stem.weight` / `stem.bias` into `(stem, kind)`.
fn split_kind(name: &str) -> Option<(&str, &str)> {
    let (stem, kind) = name.rsplit_once('.')?;
    matches!(kind, "weight" | "bias").then_some((stem, kind))
}

/// The HF name of a llama.cpp tensor name, `None` for tensors HF checkpoints do not have
/// (such as `rope_freqs.weight`).
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    let (stem, kind) = split_kind(name)?;
    if let Some(rest) = stem.strip_prefix("blk.") {
        let (layer, part) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == part)?;
        return Some(format!("model.layers.{layer}.{hf}.{kind}"));
    }
    let (_, hf) = GLOBAL_NAMES.iter().find(|(g, _)| *g == stem)?;
    Some(format!("{hf}.{kind}"))
}

/// The llama.cpp name of an HF tensor name.
pub fn hf_to_gguf_name(name: &str) -> Option<String> {
    let (stem, kind) = split_kind(name)?;
    if let Some(rest) = stem.strip_prefix("model.layers.") {
        let (layer, part) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (g, _) = LAYER_NAMES.iter().find(|(_, h)| *h == part)?;
        return Some(format!("blk.{layer}.{g}.{kind}"));
    }
    let (g, _) = GLOBAL_NAMES.iter().find(|(_, h)| *h == stem)?;
    Some(format!("{g}.{kind}"))
}

/// Undoes llama.cpp's per-head Q/K row permutation in place: `data` is row-major
/// `[n_heads * head_dim, row_len]` (values, or the bytes of quantized rows).
pub fn unpermute_qk_rows<T: Copy>(
    data: &mut [T],
    n_heads: usize,
    row_len: usize,
) -> Result<(), Error> {
    let rows = data.len() / row_len.max(1);
    if row_len == 0
        || n_heads == 0
        || !data.len().is_multiple_of(row_len)
        || !rows.is_multiple_of(n_heads)
        || !(rows / n_heads).is_multiple_of(2)
    {
        return Err(Error::Malformed {
            reason: format!("cannot un-permute {rows} rows of {row_len} into {n_heads} heads"),
        });
    }
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let src = data.to_vec();
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                let hf_row = h * head_dim + j * half + i;
                let gguf_row = h * head_dim + 2 * i + j;
                data[hf_row * row_len..(hf_row + 1) * row_len]
                    .copy_from_slice(&src[gguf_row * row_len..(gguf_row + 1) * row_len]);
            }
        }
    }
    Ok(())
}

/// What differs between the architectures this view knows.
struct ArchInfo {
    hf_class: &'static str,
    model_type: &'static str,
    /// Whether llama.cpp permuted Q/K rows when converting.
    permuted_qk: bool,
}

fn arch_info(arch: &str) -> Result<ArchInfo, Error> {
    match arch {
        "llama" => Ok(ArchInfo {
            hf_class: "LlamaForCausalLM",
            model_type: "llama",
            permuted_qk: true,
        }),
        "qwen2" => Ok(ArchInfo {
            hf_class: "Qwen2ForCausalLM",
            model_type: "qwen2",
            permuted_qk: false,
        }),
        other => Err(Error::UnsupportedArchitecture { arch: other.into() }),
    }
}

impl GgufFile {
    fn arch_u64(&self, arch: &str, key: &str) -> Result<u64, Error> {
        self.get_u64(&format!("{arch}.{key}"))
    }

    fn arch_u64_opt(&self, arch: &str, key: &str) -> Option<u64> {
        self.get(&format!("{arch}.{key}")).and_then(|v| v.as_u64())
    }

    /// A Hugging Face `config.json` synthesized from the metadata (architectures `llama` and
    /// `qwen2`). `tie_word_embeddings` is true when the file has no `output.weight`.
    pub fn hf_config(&self) -> Result<Json, Error> {
        let arch = self.architecture()?;
        let info = arch_info(arch)?;
        let hidden = self.arch_u64(arch, "embedding_length")?;
        let n_heads = self.arch_u64(arch, "attention.head_count")?;
        let n_kv_heads = self
            .arch_u64_opt(arch, "attention.head_count_kv")
            .unwrap_or(n_heads);
        let head_dim = self
            .arch_u64_opt(arch, "attention.key_length")
            .unwrap_or(hidden.checked_div(n_heads).unwrap_or(0));
        let vocab_size = match self.arch_u64_opt(arch, "vocab_size") {
            Some(v) => v,
            None => match self.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
                Some(tokens) => tokens.len() as u64,
                None => self
                    .tensor("token_embd.weight")
                    .and_then(|t| t.dims.get(1).copied())
                    .ok_or_else(|| Error::MissingMetadata {
                        key: format!("{arch}.vocab_size"),
                    })?,
            },
        };
        let rms_norm_eps = self.get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))?;
        let rope_theta = self
            .get(&format!("{arch}.rope.freq_base"))
            .and_then(|v| v.as_f64())
            .unwrap_or(10_000.0);
        let token_id = |key: &str| self.get(key).and_then(|v| v.as_u64());
        let mut config = json!({
            "architectures": [info.hf_class],
            "model_type": info.model_type,
            "hidden_size": hidden,
            "intermediate_size": self.arch_u64(arch, "feed_forward_length")?,
            "num_hidden_layers": self.arch_u64(arch, "block_count")?,
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": rms_norm_eps,
            "rope_theta": rope_theta,
            "rope_scaling": null,
            "max_position_embeddings": self.arch_u64(arch, "context_length")?,
            "vocab_size": vocab_size,
            "tie_word_embeddings": self.tensor("output.weight").is_none(),
            "attention_bias": self.tensor("blk.0.attn_q.bias").is_some(),
            "bos_token_id": token_id("tokenizer.ggml.bos_token_id"),
            "eos_token_id": token_id("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        });
        if let (Some(pad), Some(obj)) = (
            token_id("tokenizer.ggml.padding_token_id"),
            config.as_object_mut(),
        ) {
            obj.insert("pad_token_id".into(), json!(pad));
        }
        Ok(config)
    }

    /// Every tensor that has an HF name, by its HF name, in file order.
    pub fn hf_tensor_names(&self) -> Vec<String> {
        self.tensors()
            .iter()
            .filter_map(|t| gguf_to_hf_name(&t.name))
            .collect()
    }

    /// The HF shape of a tensor named in HF naming.
    pub fn hf_tensor_shape(&self, hf_name: &str) -> Result<Vec<usize>, Error> {
        let gguf = hf_to_gguf_name(hf_name).ok_or_else(|| Error::TensorNotFound {
            name: hf_name.into(),
        })?;
        let t = self.tensor(&gguf).ok_or_else(|| Error::TensorNotFound {
            name: hf_name.into(),
        })?;
        Ok(t.shape())
    }

    /// The llama.cpp tensor of an HF name, and its head count when its rows are in llama.cpp's
    /// permuted Q/K order.
    fn hf_source(&self, hf_name: &str) -> Result<(&TensorInfo, Option<usize>), Error> {
        let gguf = hf_to_gguf_name(hf_name).ok_or_else(|| Error::TensorNotFound {
            name: hf_name.into(),
        })?;
        let t = self.tensor(&gguf).ok_or_else(|| Error::TensorNotFound {
            name: hf_name.into(),
        })?;
        let is_q = gguf.contains(".attn_q.");
        let is_k = gguf.contains(".attn_k.");
        if !(is_q || is_k) {
            return Ok((t, None));
        }
        let arch = self.architecture()?;
        if !arch_info(arch)?.permuted_qk {
            return Ok((t, None));
        }
        let n_heads = self.arch_u64(arch, "attention.head_count")?;
        let n_heads = if is_k {
            self.arch_u64_opt(arch, "attention.head_count_kv")
                .unwrap_or(n_heads)
        } else {
            n_heads
        };
        Ok((t, Some(n_heads as usize)))
    }

    /// A tensor named in HF naming, dequantized to f32 in HF layout (Q/K rows un-permuted).
    pub fn load_hf_tensor(&self, hf_name: &str) -> Result<HfTensor, Error> {
        let (t, permuted) = self.hf_source(hf_name)?;
        let shape = t.shape();
        let mut data = self.dequantize(&t.name)?;
        if let Some(n_heads) = permuted {
            let row_len = if shape.len() >= 2 {
                shape[1..].iter().product()
            } else {
                1
            };
            unpermute_qk_rows(&mut data, n_heads, row_len)?;
        }
        Ok(HfTensor { shape, data })
    }

    /// A 2-D tensor named in HF naming as its stored blocks, rows in HF order (Q/K rows
    /// un-permuted: each row is whole blocks, so rows move as bytes). For a quantized weight
    /// kept quantized; [`GgufFile::load_hf_tensor`] is its f32 view.
    pub fn load_hf_raw(&self, hf_name: &str) -> Result<HfRawTensor, Error> {
        let (t, permuted) = self.hf_source(hf_name)?;
        let shape = t.shape();
        if shape.len() != 2 {
            return Err(Error::Malformed {
                reason: format!("{hf_name}: raw rows of a {}-D tensor", shape.len()),
            });
        }
        let mut data = self.tensor_bytes(&t.name)?.to_vec();
        if let Some(n_heads) = permuted {
            let row_bytes = data.len() / shape[0].max(1);
            unpermute_qk_rows(&mut data, n_heads, row_bytes)?;
        }
        Ok(HfRawTensor {
            shape,
            ggml_type: t.ggml_type,
            data,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::value::Value;
    use crate::writer::GgufWriter;

    /// llama.cpp's forward permutation written independently, as the converter describes it:
    /// view rows as `[n_heads, 2, head_dim/2]`, swap the last two axes.
    fn permute_like_llama_cpp(rows: &[Vec<f32>], n_heads: usize) -> Vec<Vec<f32>> {
        let head_dim = rows.len() / n_heads;
        let half = head_dim / 2;
        let mut out = Vec::new();
        for h in 0..n_heads {
            for i in 0..half {
                for j in 0..2 {
                    out.push(rows[h * head_dim + j * half + i].clone());
                }
            }
        }
        out
    }

    #[test]
    fn names_map_both_ways() {
        let pairs = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.0.attn_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "blk.12.ffn_norm.weight",
                "model.layers.12.post_attention_layernorm.weight",
            ),
            (
                "blk.3.attn_q.weight",
                "model.layers.3.self_attn.q_proj.weight",
            ),
            ("blk.3.attn_q.bias", "model.layers.3.self_attn.q_proj.bias"),
            (
                "blk.3.attn_k.weight",
                "model.layers.3.self_attn.k_proj.weight",
            ),
            (
                "blk.3.attn_v.weight",
                "model.layers.3.self_attn.v_proj.weight",
            ),
            (
                "blk.3.attn_output.weight",
                "model.layers.3.self_attn.o_proj.weight",
            ),
            (
                "blk.29.ffn_gate.weight",
                "model.layers.29.mlp.gate_proj.weight",
            ),
            ("blk.29.ffn_up.weight", "model.layers.29.mlp.up_proj.weight"),
            (
                "blk.29.ffn_down.weight",
                "model.layers.29.mlp.down_proj.weight",
            ),
        ];
        for (g, h) in pairs {
            assert_eq!(gguf_to_hf_name(g).as_deref(), Some(h));
            assert_eq!(hf_to_gguf_name(h).as_deref(), Some(g));
        }
        assert_eq!(gguf_to_hf_name("rope_freqs.weight"), None);
        assert_eq!(gguf_to_hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(
            hf_to_gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq"),
            None
        );
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        let (n_heads, head_dim, cols) = (3, 8, 2);
        let hf: Vec<Vec<f32>> = (0..n_heads * head_dim)
            .map(|r| vec![r as f32, -(r as f32)])
            .collect();
        let permuted = permute_like_llama_cpp(&hf, n_heads);
        assert_ne!(permuted, hf);
        let mut flat: Vec<f32> = permuted.concat();
        unpermute_qk_rows(&mut flat, n_heads, cols).unwrap();
        assert_eq!(flat, hf.concat());
        assert!(unpermute_qk_rows(&mut [0.0; 6], 2, 1).is_err());
    }

    /// A two-layer llama in llama.cpp layout: q rows permuted over 2 heads, k over 1 KV head.
    fn tiny_llama(with_output: bool) -> GgufFile {
        let (hidden, head_dim, n_heads, n_kv) = (8u64, 4usize, 2usize, 1usize);
        let rows = |n: usize, tag: f32| -> Vec<Vec<f32>> {
            (0..n)
                .map(|r| {
                    (0..hidden as usize)
                        .map(|c| tag + r as f32 * 10.0 + c as f32 * 0.1)
                        .collect()
                })
                .collect()
        };
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()));
        w.metadata("llama.embedding_length", Value::U32(hidden as u32));
        w.metadata("llama.feed_forward_length", Value::U32(16));
        w.metadata("llama.block_count", Value::U32(1));
        w.metadata("llama.attention.head_count", Value::U32(n_heads as u32));
        w.metadata("llama.attention.head_count_kv", Value::U32(n_kv as u32));
        w.metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
        w.metadata("llama.rope.freq_base", Value::F32(100000.0));
        w.metadata("llama.context_length", Value::U32(64));
        w.metadata("llama.vocab_size", Value::U32(5));
        w.metadata("tokenizer.ggml.bos_token_id", Value::U32(1));
        w.metadata("tokenizer.ggml.eos_token_id", Value::U32(2));
        let q = rows(n_heads * head_dim, 1000.0);
        let k = rows(n_kv * head_dim, 2000.0);
        w.tensor_f32(
            "blk.0.attn_q.weight",
            &[hidden, (n_heads * head_dim) as u64],
            &permute_like_llama_cpp(&q, n_heads).concat(),
        );
        w.tensor_f32(
            "blk.0.attn_k.weight",
            &[hidden, (n_kv * head_dim) as u64],
            &permute_like_llama_cpp(&k, n_kv).concat(),
        );
        w.tensor_f32(
            "blk.0.attn_v.weight",
            &[hidden, (n_kv * head_dim) as u64],
            &k.concat(),
        );
        w.tensor_f32("token_embd.weight", &[hidden, 5], &[0.5; 40]);
        w.tensor_f32("rope_freqs.weight", &[2], &[1.0, 1.0]);
        if with_output {
            w.tensor_f32("output.weight", &[hidden, 5], &[0.25; 40]);
        }
        GgufFile::from_bytes(w.to_bytes()).unwrap()
    }

    #[test]
    fn q_and_k_load_in_hf_layout_and_v_is_untouched() {
        let f = tiny_llama(false);
        let q = f
            .load_hf_tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        assert_eq!(q.shape, [8, 8]);
        for r in 0..8 {
            assert_eq!(q.data[r * 8], 1000.0 + r as f32 * 10.0, "q row {r}");
        }
        let k = f
            .load_hf_tensor("model.layers.0.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k.shape, [4, 8]);
        for r in 0..4 {
            assert_eq!(
                k.data[r * 8 + 3],
                2000.0 + r as f32 * 10.0 + 0.3,
                "k row {r}"
            );
        }
        let v = f
            .load_hf_tensor("model.layers.0.self_attn.v_proj.weight")
            .unwrap();
        assert_eq!(v.data, k.data);
        assert!(matches!(
            f.load_hf_tensor("lm_head.weight"),
            Err(Error::TensorNotFound { .. })
        ));
    }

    #[test]
    fn raw_q_rows_are_unpermuted_as_whole_blocks() {
        // Q8_0 q_proj of 2 heads x 4 rows, 32 columns: row r's block has scale 1 and values r.
        let (n_heads, rows, cols) = (2usize, 8usize, 32u64);
        let hf: Vec<Vec<u8>> = (0..rows)
            .map(|r| {
                let mut b = half::f16::from_f32(1.0).to_le_bytes().to_vec();
                b.extend([r as u8; 32]);
                b
            })
            .collect();
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()));
        w.metadata("llama.attention.head_count", Value::U32(n_heads as u32));
        let stored = permute_like_llama_cpp(
            &hf.iter()
                .map(|r| r.iter().map(|&b| f32::from(b)).collect())
                .collect::<Vec<_>>(),
            n_heads,
        );
        let bytes: Vec<u8> = stored
            .iter()
            .flat_map(|r| r.iter().map(|&v| v as u8))
            .collect();
        w.tensor_raw(
            "blk.0.attn_q.weight",
            &[cols, rows as u64],
            GgmlType::Q8_0,
            bytes,
        );
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        let name = "model.layers.0.self_attn.q_proj.weight";
        let raw = f.load_hf_raw(name).unwrap();
        assert_eq!(
            (raw.shape.clone(), raw.ggml_type),
            (vec![8, 32], GgmlType::Q8_0)
        );
        assert_eq!(raw.data, hf.concat());
        let deq = crate::dequantize(raw.ggml_type, &raw.data, 8 * 32).unwrap();
        assert_eq!(deq, f.load_hf_tensor(name).unwrap().data);
    }

    #[test]
    fn hf_names_skip_tensors_hf_does_not_have() {
        let f = tiny_llama(true);
        let names = f.hf_tensor_names();
        assert!(names.contains(&"lm_head.weight".to_string()));
        assert!(!names.iter().any(|n| n.contains("rope")));
        assert_eq!(
            f.hf_tensor_shape("model.embed_tokens.weight").unwrap(),
            [5, 8]
        );
    }

    #[test]
    fn config_is_synthesized_from_metadata() {
        let c = tiny_llama(false).hf_config().unwrap();
        assert_eq!(c["architectures"], json!(["LlamaForCausalLM"]));
        assert_eq!(c["hidden_size"], 8);
        assert_eq!(c["intermediate_size"], 16);
        assert_eq!(c["num_hidden_layers"], 1);
        assert_eq!(c["num_attention_heads"], 2);
        assert_eq!(c["num_key_value_heads"], 1);
        assert_eq!(c["head_dim"], 4);
        assert_eq!(c["rms_norm_eps"], 1e-5);
        assert_eq!(c["rope_theta"], 100000.0);
        assert_eq!(c["max_position_embeddings"], 64);
        assert_eq!(c["vocab_size"], 5);
        assert_eq!(c["tie_word_embeddings"], true);
        assert_eq!(c["bos_token_id"], 1);
        assert_eq!(c["eos_token_id"], 2);
        assert_eq!(
            tiny_llama(true).hf_config().unwrap()["tie_word_embeddings"],
            false
        );
    }
}
