//! Deploy profiles: how an omni model's stages are laid out (vLLM-Omni's deploy YAML, same keys,
//! so a vLLM-Omni user's file loads unchanged).
//!
//! A profile has `async_chunk`, `connectors` (name -> `{name, extra}`; `extra` holds the codec
//! chunking of the Talker -> Code2Wav edge), `stages[]` and `platforms` (per-platform deltas of
//! stages, merged by `stage_id`). A stage entry mixes wrapper keys (`stage_id`, `devices`,
//! `num_replicas`, `env`, `input_connectors`, `output_connectors`, `default_sampling_params`)
//! with engine keys: the engine keys are long flag names of [`crate::EngineConfig`]
//! (`gpu_memory_utilization`, `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`,
//! `enforce_eager`, `enable_prefix_caching`, `tensor_parallel_size`, ...) and become that stage's
//! layer of the precedence: defaults < `--config FILE` < the stage's keys < environment <
//! command line ([`crate::layered_argv_with`]). Keys we do not use (vLLM-only settings such as
//! `trust_remote_code`, `async_scheduling`, `compilation_config`) are kept out and named in
//! [`DeployConfig::warnings`].
//!
//! Resolution order, as vLLM-Omni's: a `base_config` the file overlays (top-level keys
//! replaced, `stages` and `platforms` merged by `stage_id`), then the delta of the platform in
//! use, then `--stage-overrides` (JSON, `{"1": {...}}`), then `--no-async-chunk`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Command;
use serde_norway::{Mapping, Value};

use crate::Error;
use crate::layers::{find_long, mapping_to_args};

/// The default profiles shipped in the binary, by `config.json`'s `model_type`: (model type,
/// file name, text).
pub const DEFAULT_PROFILES: &[(&str, &str, &str)] = &[
    (
        "qwen3_omni_moe",
        "deploy/qwen3_omni_moe.yaml",
        include_str!("../../../deploy/qwen3_omni_moe.yaml"),
    ),
    (
        TEXT_SPEECH_PROFILE,
        "deploy/text_speech.yaml",
        include_str!("../../../deploy/text_speech.yaml"),
    ),
];

/// The key in [`DEFAULT_PROFILES`] of the profile for a text LLM without a speech network of
/// its own (the built-in SmolLM2, any GGUF or text decoder): the model as stage 0, the
/// built-in voice as a TTS stage 1.
pub const TEXT_SPEECH_PROFILE: &str = "text_speech";

/// Stage keys the deploy layer reads itself.
const WRAPPER_KEYS: &[&str] = &[
    "stage_id",
    "model_stage",
    "model",
    "devices",
    "num_replicas",
    "env",
    "input_connectors",
    "output_connectors",
    "default_sampling_params",
];

/// Engine flags a stage does not take: a stage hands its outputs on every step, so it
/// schedules synchronously whatever its profile says.
const STAGE_UNUSED_ENGINE_KEYS: &[&str] = &["async_scheduling"];

/// Whether a stage's engine takes profile key `key` (an engine flag, spelt with `_`).
fn stage_takes(engine: &clap::Command, key: &str) -> bool {
    !STAGE_UNUSED_ENGINE_KEYS.contains(&key) && find_long(engine, &key.replace('_', "-")).is_some()
}

/// Top-level keys of the profile format.
const TOP_KEYS: &[&str] = &[
    "async_chunk",
    "connectors",
    "stages",
    "platforms",
    "base_config",
];

/// Codec chunking of the Talker -> Code2Wav edge (a connector's `extra`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodecChunking {
    /// Frames in the first window (the first audio packet).
    pub initial_codec_chunk_frames: usize,
    /// New frames per later window.
    pub codec_chunk_frames: usize,
    /// Frames of left context each later window is decoded with.
    pub codec_left_context_frames: usize,
}

/// One connector: its class name and its settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectorConfig {
    /// vLLM-Omni's class name (`SharedMemoryConnector`); every connector here runs over
    /// omni-ipc shared memory on one host.
    pub name: String,
    /// `extra`, as given.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ConnectorConfig {
    /// The codec chunking in `extra` (vLLM-Omni's defaults where absent: 25, 25, no context).
    pub fn codec_chunking(&self) -> Result<CodecChunking, Error> {
        let get = |k: &str, d: usize| -> Result<usize, Error> {
            match self.extra.get(k) {
                None => Ok(d),
                Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                    Error::Invalid(vec![format!(
                        "connector {}: `{k}` must be a non-negative integer, got {v}",
                        self.name
                    )])
                }),
            }
        };
        Ok(CodecChunking {
            initial_codec_chunk_frames: get("initial_codec_chunk_frames", 25)?,
            codec_chunk_frames: get("codec_chunk_frames", 25)?,
            codec_left_context_frames: get("codec_left_context_frames", 0)?,
        })
    }
}

/// One stage of the pipeline, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct StageDeployConfig {
    /// Position in the pipeline (0 = Thinker, 1 = Talker, 2 = Code2Wav for Qwen3-Omni).
    pub stage_id: u32,
    /// What it runs (`thinker`, `talker`, `code2wav`, `tts`; vLLM-Omni's `model_stage`);
    /// `None`: Qwen3-Omni's stage of this `stage_id`.
    pub model_stage: Option<String>,
    /// Its own model (a TTS stage's voice folder; `~/` is the home directory); `None`: the
    /// served model (a TTS stage: the built-in voice).
    pub model: Option<PathBuf>,
    /// Device ordinals the stage's replicas share out (`"0,1"`); empty: device 0.
    pub devices: Vec<u32>,
    /// Replicas (each a process with its own engine core and workers).
    pub num_replicas: u32,
    /// Environment for the stage's processes.
    pub env: BTreeMap<String, String>,
    /// `from_stage_<n>` -> connector name.
    pub input_connectors: BTreeMap<String, String>,
    /// `to_stage_<n>` -> connector name.
    pub output_connectors: BTreeMap<String, String>,
    /// Sampling defaults of requests in this stage (OpenAI field names).
    pub default_sampling_params: serde_json::Map<String, serde_json::Value>,
    /// The stage's engine keys as flags, for [`crate::layered_argv_with`].
    pub engine_args: Vec<String>,
}

impl StageDeployConfig {
    /// The devices of replica `r`: the list split evenly over the replicas.
    pub fn replica_devices(&self, r: u32) -> Vec<u32> {
        let devices = if self.devices.is_empty() {
            vec![0]
        } else {
            self.devices.clone()
        };
        let per = (devices.len() / self.num_replicas.max(1) as usize).max(1);
        let start = (r as usize * per) % devices.len();
        devices[start..(start + per).min(devices.len())].to_vec()
    }
}

/// A resolved deploy profile.
#[derive(Debug, Clone, PartialEq)]
pub struct DeployConfig {
    /// Where it came from (a path, or the built-in profile's name).
    pub source: String,
    /// Stream between stages while upstream still runs (vLLM-Omni's default), or hand over
    /// whole payloads.
    pub async_chunk: bool,
    /// Connectors by name.
    pub connectors: BTreeMap<String, ConnectorConfig>,
    /// Stages in `stage_id` order.
    pub stages: Vec<StageDeployConfig>,
    /// Keys that were read but are not used here, one line each (start-up logs them).
    pub warnings: Vec<String>,
}

/// `serve`'s omni flags (vLLM-Omni's).
#[derive(
    Debug, Clone, Default, PartialEq, Eq, clap::Args, serde::Serialize, serde::Deserialize,
)]
pub struct OmniArgs {
    /// Serve an omni model as its pipeline of stages (Qwen3-Omni: Thinker -> Talker ->
    /// Code2Wav), each stage replica a process of its own, set by a deploy profile.
    #[arg(long)]
    pub omni: bool,
    /// The deploy profile (vLLM-Omni's YAML); default: the built-in one of the model's
    /// `model_type` (`deploy/`).
    #[arg(long, value_name = "FILE")]
    pub deploy_config: Option<PathBuf>,
    /// Per-stage edits of the profile, JSON `{"<stage_id>": {key: value}}`.
    #[arg(long, value_name = "JSON")]
    pub stage_overrides: Option<String>,
    /// Hand whole payloads between stages instead of streaming chunks (`async_chunk: false`).
    #[arg(long)]
    pub no_async_chunk: bool,
}

/// Where a profile comes from.
#[derive(Debug, Clone, Copy)]
pub enum DeploySource<'a> {
    /// `--deploy-config FILE`.
    File(&'a Path),
    /// The built-in profile of a model type ([`DEFAULT_PROFILES`]).
    Builtin(&'a str),
}

/// What modifies the profile on the command line.
#[derive(Debug, Clone, Default)]
pub struct DeployOverrides<'a> {
    /// The platform whose `platforms` delta applies (`cuda`, `cpu`).
    pub platform: &'a str,
    /// `--stage-overrides`: JSON `{"<stage_id>": {key: value}}`.
    pub stage_overrides: Option<&'a str>,
    /// `--no-async-chunk`.
    pub no_async_chunk: bool,
}

impl DeployConfig {
    /// Reads, merges and checks a profile. `engine` is the clap command whose flags the stage
    /// engine keys name (`serve`'s). Every problem is reported together.
    pub fn load(
        source: DeploySource<'_>,
        overrides: &DeployOverrides<'_>,
        engine: &Command,
    ) -> Result<Self, Error> {
        let (name, doc) = match source {
            DeploySource::File(p) => (p.display().to_string(), read_with_base(p, 0)?),
            DeploySource::Builtin(model_type) => {
                let (_, file, text) = DEFAULT_PROFILES
                    .iter()
                    .find(|(t, _, _)| *t == model_type)
                    .ok_or_else(|| {
                        Error::Invalid(vec![format!(
                            "no default deploy profile for model_type `{model_type}` (pass --deploy-config)"
                        )])
                    })?;
                let doc = parse(text).map_err(|m| file_error(Path::new(file), m))?;
                (format!("built-in {file}"), doc)
            }
        };
        resolve(name, doc, overrides, engine)
    }

    /// The stage with this id.
    pub fn stage(&self, id: u32) -> Option<&StageDeployConfig> {
        self.stages.iter().find(|s| s.stage_id == id)
    }
}

fn file_error(path: &Path, message: String) -> Error {
    Error::ConfigFile {
        path: path.to_path_buf(),
        message,
    }
}

fn parse(text: &str) -> Result<Mapping, String> {
    match serde_norway::from_str::<Value>(text).map_err(|e| e.to_string())? {
        Value::Mapping(m) => Ok(m),
        Value::Null => Ok(Mapping::new()),
        _ => Err("expected a mapping at the top level".into()),
    }
}

/// The file, over its `base_config` chain (relative to the file; at most 8 deep).
fn read_with_base(path: &Path, depth: usize) -> Result<Mapping, Error> {
    if depth > 8 {
        return Err(file_error(path, "base_config chain deeper than 8".into()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e.to_string()))?;
    let mut doc = parse(&text).map_err(|m| file_error(path, m))?;
    let Some(base) = doc.remove("base_config") else {
        return Ok(doc);
    };
    let base = base
        .as_str()
        .ok_or_else(|| file_error(path, "base_config must be a path".into()))?;
    let base_path: PathBuf = path.parent().unwrap_or_else(|| Path::new(".")).join(base);
    let mut merged = read_with_base(&base_path, depth + 1)?;
    overlay(&mut merged, doc);
    Ok(merged)
}

/// `over` onto `base`: top-level keys replaced, `stages` and `platforms.*.stages` merged by
/// `stage_id`.
fn overlay(base: &mut Mapping, over: Mapping) {
    for (k, v) in over {
        match (k.as_str(), base.get_mut(&k)) {
            (Some("stages"), Some(Value::Sequence(b))) => {
                if let Value::Sequence(o) = v {
                    merge_stages(b, o);
                }
            }
            (Some("platforms"), Some(Value::Mapping(b))) => {
                if let Value::Mapping(o) = v {
                    for (pk, pv) in o {
                        match b.get_mut(&pk) {
                            Some(Value::Mapping(bp)) => overlay(bp, mapping(pv)),
                            _ => {
                                b.insert(pk, pv);
                            }
                        }
                    }
                }
            }
            _ => {
                base.insert(k, v);
            }
        }
    }
}

fn mapping(v: Value) -> Mapping {
    match v {
        Value::Mapping(m) => m,
        _ => Mapping::new(),
    }
}

fn stage_id_of(v: &Value) -> Option<u64> {
    v.get("stage_id").and_then(Value::as_u64)
}

/// Each entry of `over` deep-merged into the entry of `base` with its `stage_id` (appended
/// when there is none).
fn merge_stages(base: &mut Vec<Value>, over: Vec<Value>) {
    for o in over {
        match base
            .iter_mut()
            .find(|b| stage_id_of(b).is_some() && stage_id_of(b) == stage_id_of(&o))
        {
            Some(b) => deep_merge(b, o),
            None => base.push(o),
        }
    }
}

fn deep_merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(bv) if bv.is_mapping() && v.is_mapping() => deep_merge(bv, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

fn resolve(
    source: String,
    mut doc: Mapping,
    ov: &DeployOverrides<'_>,
    engine: &Command,
) -> Result<DeployConfig, Error> {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    // The platform's delta.
    let platforms = doc.remove("platforms");
    if let Some(Value::Mapping(p)) = platforms
        && let Some(Value::Mapping(delta)) = p.get(ov.platform)
        && let Some(Value::Sequence(d)) = delta.get("stages")
        && let Some(Value::Sequence(stages)) = doc.get_mut("stages")
    {
        merge_stages(stages, d.clone());
    }
    // --stage-overrides.
    if let Some(json) = ov.stage_overrides {
        match serde_json::from_str::<BTreeMap<String, serde_json::Value>>(json) {
            Err(e) => problems.push(format!("--stage-overrides is not a JSON object: {e}")),
            Ok(map) => {
                // No `stages` list is reported below; the overrides then name no stage.
                let mut none = Vec::new();
                let stages = match doc.get_mut("stages") {
                    Some(Value::Sequence(s)) => s,
                    _ => &mut none,
                };
                for (id, delta) in map {
                    let Ok(id) = id.parse::<u64>() else {
                        problems.push(format!("--stage-overrides key `{id}` is not a stage id"));
                        continue;
                    };
                    let Some(stage) = stages.iter_mut().find(|s| stage_id_of(s) == Some(id)) else {
                        problems.push(format!(
                            "--stage-overrides names stage {id}, which the profile does not have"
                        ));
                        continue;
                    };
                    match serde_norway::to_value(&delta) {
                        Ok(v) => deep_merge(stage, v),
                        Err(e) => problems.push(format!("--stage-overrides stage {id}: {e}")),
                    }
                }
            }
        }
    }
    // Pipeline-wide engine keys at the top level apply to every stage, before its own keys.
    let mut pipeline_wide = Mapping::new();
    for (k, v) in doc.iter() {
        let Some(key) = k.as_str() else { continue };
        if TOP_KEYS.contains(&key) {
            continue;
        }
        if stage_takes(engine, key) {
            pipeline_wide.insert(k.clone(), v.clone());
        } else {
            warnings.push(format!("top-level key `{key}` is not used"));
        }
    }
    let async_chunk = match doc.get("async_chunk") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            problems.push(format!("async_chunk must be true or false, got {v:?}"));
            true
        }
    } && !ov.no_async_chunk;
    let mut connectors = BTreeMap::new();
    if let Some(c) = doc.get("connectors") {
        match serde_json::to_value(c)
            .and_then(serde_json::from_value::<BTreeMap<String, RawConnector>>)
        {
            Ok(map) => {
                for (name, raw) in map {
                    connectors.insert(
                        name,
                        ConnectorConfig {
                            name: raw.name,
                            extra: raw.extra,
                        },
                    );
                }
            }
            Err(e) => problems.push(format!("connectors: {e}")),
        }
    }
    let mut stages = Vec::new();
    match doc.get("stages") {
        Some(Value::Sequence(list)) => {
            let mut ids: Vec<u64> = list.iter().filter_map(stage_id_of).collect();
            ids.sort_unstable();
            for w in ids.windows(2).filter(|w| w[0] == w[1]) {
                problems.push(format!("stage {} is listed twice", w[0]));
            }
            for v in list {
                match stage(v, &pipeline_wide, engine, &connectors, &mut warnings) {
                    Ok(s) => stages.push(s),
                    Err(mut p) => problems.append(&mut p),
                }
            }
        }
        _ => problems.push("no `stages` list".into()),
    }
    stages.sort_by_key(|s| s.stage_id);
    for c in connectors.values() {
        if let Err(Error::Invalid(mut p)) = c.codec_chunking() {
            problems.append(&mut p);
        }
    }
    if !problems.is_empty() {
        return Err(Error::ConfigFile {
            path: PathBuf::from(&source),
            message: problems.join("; "),
        });
    }
    Ok(DeployConfig {
        source,
        async_chunk,
        connectors,
        stages,
        warnings,
    })
}

#[derive(serde::Deserialize)]
struct RawConnector {
    name: String,
    #[serde(default)]
    extra: serde_json::Map<String, serde_json::Value>,
}

fn string_map(
    v: Option<&Value>,
    what: &str,
    id: u64,
    p: &mut Vec<String>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(v) = v {
        match v {
            Value::Mapping(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        (Some(k), Value::String(s)) => {
                            out.insert(k.to_string(), s.clone());
                        }
                        (Some(k), Value::Number(n)) => {
                            out.insert(k.to_string(), n.to_string());
                        }
                        (Some(k), Value::Bool(b)) => {
                            out.insert(k.to_string(), b.to_string());
                        }
                        _ => p.push(format!("stage {id}: `{what}` values must be scalars")),
                    }
                }
            }
            _ => p.push(format!("stage {id}: `{what}` must be a mapping")),
        }
    }
    out
}

fn stage(
    v: &Value,
    pipeline_wide: &Mapping,
    engine: &Command,
    connectors: &BTreeMap<String, ConnectorConfig>,
    warnings: &mut Vec<String>,
) -> Result<StageDeployConfig, Vec<String>> {
    let mut p = Vec::new();
    let Value::Mapping(m) = v else {
        return Err(vec!["a stage entry is not a mapping".into()]);
    };
    let Some(id) = v.get("stage_id").and_then(Value::as_u64) else {
        return Err(vec!["a stage has no integer `stage_id`".into()]);
    };
    let devices = match m.get("devices") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Number(n)) => n.as_u64().map(|d| vec![d as u32]).unwrap_or_default(),
        Some(Value::String(s)) => s
            .split(',')
            .filter(|d| !d.trim().is_empty())
            .filter_map(|d| match d.trim().parse::<u32>() {
                Ok(d) => Some(d),
                Err(_) => {
                    p.push(format!("stage {id}: device `{d}` is not an ordinal"));
                    None
                }
            })
            .collect(),
        Some(other) => {
            p.push(format!(
                "stage {id}: devices must be a string like \"0,1\", got {other:?}"
            ));
            Vec::new()
        }
    };
    let num_replicas = match m.get("num_replicas") {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n as u32,
            _ => {
                p.push(format!("stage {id}: num_replicas must be at least 1"));
                1
            }
        },
    };
    if !devices.is_empty() && !devices.len().is_multiple_of(num_replicas as usize) {
        p.push(format!(
            "stage {id}: {} devices do not split over {num_replicas} replicas",
            devices.len()
        ));
    }
    let mut text = |key: &str| match m.get(key) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Some(other) => {
            p.push(format!(
                "stage {id}: `{key}` must be a string, got {other:?}"
            ));
            None
        }
    };
    let model_stage = text("model_stage");
    let model = text("model").map(|m| expand_home(&m));
    let env = string_map(m.get("env"), "env", id, &mut p);
    let input_connectors = string_map(m.get("input_connectors"), "input_connectors", id, &mut p);
    let output_connectors = string_map(m.get("output_connectors"), "output_connectors", id, &mut p);
    for c in input_connectors.values().chain(output_connectors.values()) {
        if !connectors.contains_key(c) {
            p.push(format!(
                "stage {id}: connector `{c}` is not in `connectors`"
            ));
        }
    }
    let default_sampling_params = match m.get("default_sampling_params") {
        None => serde_json::Map::new(),
        Some(v) => match serde_json::to_value(v) {
            Ok(serde_json::Value::Object(o)) => o,
            _ => {
                p.push(format!(
                    "stage {id}: default_sampling_params must be a mapping"
                ));
                serde_json::Map::new()
            }
        },
    };
    let mut keys = pipeline_wide.clone();
    for (k, v) in m {
        let Some(key) = k.as_str() else {
            p.push(format!("stage {id}: key {k:?} is not a string"));
            continue;
        };
        if WRAPPER_KEYS.contains(&key) {
            continue;
        }
        if stage_takes(engine, key) {
            keys.insert(k.clone(), v.clone());
        } else {
            warnings.push(format!("stage {id}: key `{key}` is not used"));
        }
    }
    let (engine_args, mut bad) = mapping_to_args(keys, engine, &|_| false);
    p.extend(bad.drain(..).map(|b| format!("stage {id}: {b}")));
    // The values through the real parser now, so a bad one names its stage.
    let mut probe = engine.clone().no_binary_name(true);
    if let Err(e) = probe.try_get_matches_from_mut(engine_args.iter()) {
        let msg = e.to_string();
        let line = msg
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default()
            .trim_start_matches("error: ");
        p.push(format!("stage {id}: {line}"));
    }
    if p.is_empty() {
        Ok(StageDeployConfig {
            stage_id: id as u32,
            model_stage,
            model,
            devices,
            num_replicas,
            env,
            input_connectors,
            output_connectors,
            default_sampling_params,
            engine_args,
        })
    } else {
        Err(p)
    }
}

/// `path` with a leading `~/` replaced by `$HOME/`.
fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    }
}
