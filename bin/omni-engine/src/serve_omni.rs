//! `serve --omni`: an omni model (Qwen3-Omni) served as its pipeline of stage processes, set by
//! a deploy profile (`--deploy-config FILE`, else the built-in one of the model's
//! `model_type`), edited by `--stage-overrides` and `--no-async-chunk`. A text LLM (the
//! built-in model when none is given, a GGUF file, a text decoder directory) gets the
//! `text_speech` profile: the model, then the built-in voice as a TTS stage.
//!
//! Each stage's engine config is this command line's with the profile's keys for that stage as
//! a layer under the environment and the CLI; the profile's `platforms` delta is the one of
//! the device `--device` resolves to (`cuda` or `cpu`).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use omni_config::{DeployConfig, DeployOverrides, DeploySource, EngineConfig};
use omni_core::EngineCoreClient;
use omni_launch::omni::ResolvedStage;
use omni_server::{CacheInfo, OmniServerInfo, sampling_params_from_json};

use crate::serve_cmd::Args;

/// What `serve` needs of a started pipeline.
pub struct StartedOmni {
    /// The pipeline behind omni-core's client trait.
    pub engine: Arc<dyn EngineCoreClient>,
    /// The Thinker's KV geometry.
    pub cache: CacheInfo,
    /// The server's omni settings (voices, stage sampling defaults).
    pub info: OmniServerInfo,
}

/// Reads the profile, starts every stage replica and returns the pipeline.
pub fn start(args: &Args, engine: &EngineConfig, model: &Path) -> anyhow::Result<StartedOmni> {
    let model_type = if model.is_dir() {
        let config = omni_models::registry::read_config(model)?;
        config
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    } else {
        String::new()
    };
    // A model type without a profile of its own is a text LLM: it speaks through the voice.
    let profile = if omni_config::DEFAULT_PROFILES
        .iter()
        .any(|(t, _, _)| *t == model_type)
    {
        model_type.as_str()
    } else {
        omni_config::TEXT_SPEECH_PROFILE
    };
    let platform = match omni_launch::resolve_device(engine)? {
        omni_protocol::Device::Cuda => "cuda",
        omni_protocol::Device::Cpu => "cpu",
    };
    let source = match &args.omni.deploy_config {
        Some(p) => DeploySource::File(p),
        None => DeploySource::Builtin(profile),
    };
    let overrides = DeployOverrides {
        platform,
        stage_overrides: args.omni.stage_overrides.as_deref(),
        no_async_chunk: args.omni.no_async_chunk,
    };
    let deploy = DeployConfig::load(source, &overrides, &crate::serve_command())?;
    for w in &deploy.warnings {
        tracing::warn!("{}: {w}", deploy.source);
    }
    let mut stages = Vec::new();
    for st in &deploy.stages {
        let mut e = crate::stage_engine_config(&st.engine_args)
            .with_context(|| format!("stage {} of {}", st.stage_id, deploy.source))?;
        e.model.model = Some(model.to_path_buf());
        e.validate()?;
        let params = serde_json::Value::Object(st.default_sampling_params.clone());
        let default_sampling = sampling_params_from_json(&params)
            .with_context(|| format!("stage {}'s default_sampling_params", st.stage_id))?;
        stages.push(ResolvedStage {
            stage_id: st.stage_id,
            num_replicas: st.num_replicas,
            engine: e,
            default_sampling,
        });
    }
    let specs = omni_launch::omni::stage_specs(&deploy, &stages, model)?;
    tracing::info!(
        profile = %deploy.source,
        async_chunk = deploy.async_chunk,
        replicas = ?specs.iter().map(Vec::len).collect::<Vec<_>>(),
        "starting the omni pipeline"
    );
    let cache = CacheInfo {
        block_size: specs[0][0].block_size,
        num_gpu_blocks: specs[0][0].num_blocks,
    };
    let speaks = specs.iter().any(|s| {
        s.first()
            .is_some_and(|r| r.kind == omni_protocol::StageKind::Tts)
    });
    let pipeline = omni_launch::omni::start_pipeline(&crate::current_exe()?, specs)?;
    let speakers = if speaks {
        vec![omni_tts::builtin::VOICE.to_string()]
    } else {
        omni_launch::omni::speakers(model)?
    };
    let default_speaker = if speakers.iter().any(|s| s == "ethan") {
        "ethan".to_string()
    } else {
        speakers.first().cloned().unwrap_or_default()
    };
    let info = OmniServerInfo {
        speakers,
        default_speaker,
        thinker_sampling: stages[0].default_sampling.clone(),
        stage_sampling: stages[1..]
            .iter()
            .map(|s| s.default_sampling.clone())
            .collect(),
        ..OmniServerInfo::default()
    };
    Ok(StartedOmni {
        engine: Arc::new(pipeline),
        cache,
        info,
    })
}
