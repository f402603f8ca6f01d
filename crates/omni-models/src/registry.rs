//! Architectures keyed by the HF `architectures` string, and the entry points that build a model
//! from a checkpoint directory or from a config alone (dummy weights).

use std::path::Path;

use serde_json::Value;

use crate::decoder::{DecoderModel, DecoderSpec, TpContext};
use crate::dummy::DummyWeights;
use crate::error::ModelError;
use crate::hf_dir::SafetensorsDir;
use crate::interface::{ModelStage, StageModel};
use crate::qwen3_omni::code2wav::Code2Wav;
use crate::qwen3_omni::talker::Talker;
use crate::qwen3_omni::thinker::Thinker;
use crate::weights::{LoadProgressFn, ProgressWeights, SubmodelWeights, WeightSource};
use crate::{CausalLm, KvCacheSpec, llama, qwen3, qwen3_moe, qwen3_omni};

/// One registered architecture.
#[derive(Debug, Clone, Copy)]
pub struct Architecture {
    /// The HF `architectures[0]` string.
    pub name: &'static str,
    /// The stage networks this architecture string stands for (one, for a text LLM).
    pub stages: &'static [ModelStage],
    /// Parses `config.json` into the spec of the decoder that runs as a text LLM
    /// ([`ModelStage::CausalLm`]; an omni model's Thinker).
    pub spec: fn(&Value) -> Result<DecoderSpec, ModelError>,
    /// Where that decoder's tensors live in the checkpoint (`thinker.` for Qwen3-Omni).
    pub weights_prefix: &'static str,
    /// Every tensor a checkpoint of this config holds (each stage's, for a multi-stage model),
    /// with its full shape: what `--load-format dummy` generates.
    pub checkpoint_shapes: fn(&Value) -> Result<TensorShapes, ModelError>,
}

/// Tensor names with their full shapes.
pub type TensorShapes = Vec<(String, Vec<usize>)>;

/// A text LLM's checkpoint: its decoder's tensors.
fn decoder_shapes(config: &Value) -> Result<TensorShapes, ModelError> {
    Ok(decoder_spec(config)?.weight_shapes())
}

/// Every supported architecture.
pub const ARCHITECTURES: &[Architecture] = &[
    Architecture {
        name: llama::ARCHITECTURE,
        stages: &[ModelStage::CausalLm],
        spec: llama::spec_from_json,
        weights_prefix: "",
        checkpoint_shapes: decoder_shapes,
    },
    Architecture {
        name: qwen3::ARCHITECTURE,
        stages: &[ModelStage::CausalLm],
        spec: qwen3::spec_from_json,
        weights_prefix: "",
        checkpoint_shapes: decoder_shapes,
    },
    Architecture {
        name: qwen3_moe::ARCHITECTURE,
        stages: &[ModelStage::CausalLm],
        spec: qwen3_moe::spec_from_json,
        weights_prefix: "",
        checkpoint_shapes: decoder_shapes,
    },
    Architecture {
        name: qwen3_omni::config::ARCHITECTURE,
        // As a text LLM (no `--omni`) the checkpoint serves its Thinker, text out.
        stages: &[
            ModelStage::CausalLm,
            ModelStage::Thinker,
            ModelStage::Talker,
            ModelStage::Code2Wav,
        ],
        spec: qwen3_omni::thinker_spec_from_json,
        weights_prefix: "thinker.",
        checkpoint_shapes: qwen3_omni::weight_shapes,
    },
];

/// Where weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadFormat {
    /// The directory's safetensors files.
    Safetensors,
    /// Deterministic random weights from `config.json` alone (`--load-format dummy`).
    Dummy {
        /// Seed; every rank must use the same one.
        seed: u64,
    },
}

/// The registered architecture named by `config.json`'s `architectures[0]`.
pub fn architecture(config: &Value) -> Result<&'static Architecture, ModelError> {
    let name = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .ok_or_else(|| ModelError::Config("no `architectures` list".into()))?;
    ARCHITECTURES
        .iter()
        .find(|a| a.name == name)
        .ok_or_else(|| ModelError::UnknownArchitecture {
            name: name.into(),
            supported: ARCHITECTURES
                .iter()
                .map(|a| a.name)
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The decoder spec of a `config.json` value.
pub fn decoder_spec(config: &Value) -> Result<DecoderSpec, ModelError> {
    (architecture(config)?.spec)(config)
}

/// Reads and parses `<dir>/config.json`.
pub fn read_config(dir: &Path) -> Result<Value, ModelError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(serde_json::from_str(&text)?)
}

/// The `config.json` of a model path: `<dir>/config.json` for a HF directory, the config
/// synthesized from the metadata for a `.gguf` file.
pub fn read_model_config(path: &Path) -> Result<Value, ModelError> {
    if path.is_file() {
        Ok(crate::gguf::GgufWeights::open(path)?.hf_config()?)
    } else {
        read_config(path)
    }
}

/// Builds rank `tp.rank`'s model from a config and a weight source.
pub fn build_model(
    config: &Value,
    weights: &dyn WeightSource,
    tp: TpContext,
) -> Result<Box<dyn CausalLm>, ModelError> {
    build_model_with_progress(config, weights, tp, &|_, _| {})
}

/// [`build_model`], calling `on_load(tensors read, tensors in all)` after each tensor read.
pub fn build_model_with_progress(
    config: &Value,
    weights: &dyn WeightSource,
    tp: TpContext,
    on_load: LoadProgressFn<'_>,
) -> Result<Box<dyn CausalLm>, ModelError> {
    let spec = decoder_spec(config)?;
    let total = spec.weight_shapes().len();
    let view = causal_lm_weights(config, weights)?;
    let weights = ProgressWeights::new(&view, total, on_load);
    Ok(Box::new(DecoderModel::load(spec, &weights, tp)?))
}

/// The tensors of the decoder that runs as a text LLM, under the names its loader asks for
/// (`model.layers.0...`): the checkpoint itself, or its `thinker.` part for Qwen3-Omni.
pub fn causal_lm_weights<'a>(
    config: &Value,
    weights: &'a dyn WeightSource,
) -> Result<SubmodelWeights<'a>, ModelError> {
    Ok(SubmodelWeights::new(
        weights,
        architecture(config)?.weights_prefix,
        &[],
    ))
}

/// Builds rank `tp.rank`'s network of `stage` (keyed by (architecture, stage): one HF
/// architecture string can stand for several stage networks).
pub fn build_stage_model(
    config: &Value,
    stage: ModelStage,
    weights: &dyn WeightSource,
    tp: TpContext,
) -> Result<Box<dyn StageModel>, ModelError> {
    let arch = architecture(config)?;
    if !arch.stages.contains(&stage) {
        return Err(ModelError::Config(format!(
            "{} has no {stage:?} stage (it has {:?})",
            arch.name, arch.stages
        )));
    }
    match stage {
        ModelStage::CausalLm => Ok(Box::new(DecoderModel::load(
            (arch.spec)(config)?,
            &causal_lm_weights(config, weights)?,
            tp,
        )?)),
        ModelStage::Thinker => Ok(Box::new(Thinker::load(config, weights, tp)?)),
        ModelStage::Talker => Ok(Box::new(Talker::load(config, weights, tp)?)),
        // No tensor parallelism: vLLM-Omni runs Code2Wav on one device per replica too.
        ModelStage::Code2Wav => Ok(Box::new(Code2Wav::load(config, weights)?)),
    }
}

/// Random weights with every tensor the config's checkpoint would hold (each stage's, for a
/// multi-stage model).
pub fn dummy_weights(config: &Value, seed: u64) -> Result<DummyWeights, ModelError> {
    Ok(DummyWeights::new(
        (architecture(config)?.checkpoint_shapes)(config)?,
        seed,
    ))
}

/// Builds rank `tp.rank`'s model from a HF directory (`config.json` plus safetensors, or only
/// `config.json` with [`LoadFormat::Dummy`]).
pub fn load_model_dir(
    dir: &Path,
    format: LoadFormat,
    tp: TpContext,
) -> Result<Box<dyn CausalLm>, ModelError> {
    load_model_dir_with_progress(dir, format, tp, &|_, _| {})
}

/// [`load_model_dir`], calling `on_load(tensors read, tensors in all)` after each tensor read.
pub fn load_model_dir_with_progress(
    dir: &Path,
    format: LoadFormat,
    tp: TpContext,
    on_load: LoadProgressFn<'_>,
) -> Result<Box<dyn CausalLm>, ModelError> {
    let config = read_config(dir)?;
    match format {
        LoadFormat::Safetensors => {
            build_model_with_progress(&config, &SafetensorsDir::open(dir)?, tp, on_load)
        }
        LoadFormat::Dummy { seed } => {
            build_model_with_progress(&config, &dummy_weights(&config, seed)?, tp, on_load)
        }
    }
}

/// Builds rank `tp.rank`'s network of `stage` from a HF directory (safetensors, or dummy
/// weights of the config), calling `on_load(tensors read, tensors in all)` after each tensor
/// read. What an engine worker runs when the model takes more than token ids: Qwen3-Omni's
/// [`ModelStage::Thinker`] with the encoder towers its checkpoint has, served text out (vLLM's
/// thinker-only Qwen3-Omni).
pub fn load_stage_model_dir_with_progress(
    dir: &Path,
    stage: ModelStage,
    format: LoadFormat,
    tp: TpContext,
    on_load: LoadProgressFn<'_>,
) -> Result<Box<dyn StageModel>, ModelError> {
    let config = read_config(dir)?;
    if tp.pp.size > 1 {
        return Err(ModelError::TensorParallel(format!(
            "pipeline parallelism serves text decoders only, not the {stage:?} stage"
        )));
    }
    let load = |ws: &dyn WeightSource| {
        // Only the stage's own tensors count (a whole omni checkpoint holds all three).
        let prefix = match stage {
            ModelStage::Thinker => "thinker.",
            ModelStage::Talker => "talker.",
            ModelStage::Code2Wav => "code2wav.",
            ModelStage::CausalLm => "",
        };
        let total = ws
            .tensor_names()
            .iter()
            .filter(|n| n.starts_with(prefix))
            .count();
        let ws = ProgressWeights::new(ws, total, on_load);
        build_stage_model(&config, stage, &ws, tp)
    };
    match format {
        LoadFormat::Safetensors => load(&SafetensorsDir::open(dir)?),
        LoadFormat::Dummy { seed } => load(&dummy_weights(&config, seed)?),
    }
}

/// Whether a worker serving `config` as a text-output engine runs it as a [`StageModel`] of
/// this stage rather than as a [`CausalLm`]: Qwen3-Omni's Thinker (M-RoPE positions and the
/// encoder towers); `None` for a text LLM.
pub fn engine_stage(config: &Value) -> Option<ModelStage> {
    let arch = architecture(config).ok()?;
    (arch.name == qwen3_omni::config::ARCHITECTURE).then_some(ModelStage::Thinker)
}

/// The KV cache rank `tp_rank` of `tp_size` needs for this config (no weights read).
pub fn kv_cache_spec(
    config: &Value,
    tp_rank: usize,
    tp_size: usize,
) -> Result<KvCacheSpec, ModelError> {
    decoder_spec(config)?.kv_cache_spec(tp_rank, tp_size)
}

/// Bytes of K and V (f32) that one block of `block_size` tokens takes in one layer on one rank.
pub fn kv_cache_bytes_per_block_per_layer(
    config: &Value,
    block_size: usize,
    tp_rank: usize,
    tp_size: usize,
) -> Result<usize, ModelError> {
    Ok(kv_cache_spec(config, tp_rank, tp_size)?.bytes_per_block_per_layer(block_size))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn smollm2() -> Value {
        serde_json::json!({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
            "rope_theta": 100000, "tie_word_embeddings": true})
    }

    #[test]
    fn unknown_architecture_lists_supported_ones() {
        let c = serde_json::json!({"architectures": ["GPT2LMHeadModel"]});
        let e = decoder_spec(&c).unwrap_err().to_string();
        assert!(
            e.contains("GPT2LMHeadModel") && e.contains("Qwen3MoeForCausalLM"),
            "{e}"
        );
    }

    #[test]
    fn kv_bytes_per_block_follow_local_kv_heads() {
        let c = smollm2();
        // 3 KV heads x 64 dims x 16 tokens x (K + V) x 4 bytes.
        assert_eq!(
            kv_cache_bytes_per_block_per_layer(&c, 16, 0, 1).unwrap(),
            3 * 64 * 16 * 2 * 4
        );
        // 9 heads do not split over 2 ranks.
        assert!(kv_cache_bytes_per_block_per_layer(&c, 16, 0, 2).is_err());
        assert_eq!(
            kv_cache_bytes_per_block_per_layer(&c, 16, 2, 3).unwrap(),
            64 * 16 * 2 * 4
        );
    }

    #[test]
    fn dummy_weights_cover_every_tensor_the_model_loads() {
        let mut c = smollm2();
        c["num_hidden_layers"] = 1.into();
        c["vocab_size"] = 64.into();
        let w = dummy_weights(&c, 0).unwrap();
        let m = build_model(&c, &w, TpContext::single()).unwrap();
        assert_eq!(m.kv_cache_spec().num_kv_heads, 3);
    }

    #[test]
    fn progress_counts_every_tensor_up_to_the_total() {
        let mut c = smollm2();
        c["num_hidden_layers"] = 2.into();
        c["vocab_size"] = 64.into();
        let w = dummy_weights(&c, 0).unwrap();
        let seen = std::sync::Mutex::new(Vec::new());
        let on_load = |done: usize, total: usize| seen.lock().unwrap().push((done, total));
        build_model_with_progress(&c, &w, TpContext::single(), &on_load).unwrap();
        let seen = seen.into_inner().unwrap();
        let total = decoder_spec(&c).unwrap().weight_shapes().len();
        assert_eq!(seen.len(), total, "one call per tensor");
        assert_eq!(seen.last(), Some(&(total, total)));
        assert!(
            seen.iter()
                .enumerate()
                .all(|(i, &(d, t))| d == i + 1 && t == total)
        );
    }
}
