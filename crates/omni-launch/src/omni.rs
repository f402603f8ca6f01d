//! Starting an omni model's pipeline ([`omni_core::OmniPipeline`]) from its deploy profile:
//! one [`StageSpec`] per stage replica, each stage's engine keys resolved through the
//! `EngineConfig` precedence by the caller (`serve --omni`).

use std::path::Path;

use omni_config::{DeployConfig, EngineConfig, LoadFormat as LoadFormatCfg};
use omni_core::{MpClientConfig, OmniPipeline, OmniPipelineConfig};
use omni_protocol::{CodecWindowing, LoadFormat, SamplingParams, StageKind, StageSpec};

use crate::LaunchError;

/// One stage of the profile, resolved.
#[derive(Debug, Clone)]
pub struct ResolvedStage {
    /// Its `stage_id`.
    pub stage_id: u32,
    /// Its replicas.
    pub num_replicas: u32,
    /// Its engine config (defaults < `--config` < the profile's keys < env < CLI).
    pub engine: EngineConfig,
    /// Its `default_sampling_params`.
    pub default_sampling: SamplingParams,
}

/// What stage `stage_id` of `deploy` runs: its `model_stage`, else Qwen3-Omni's stage of that
/// id.
pub fn deployed_kind(deploy: &DeployConfig, stage_id: u32) -> Result<StageKind, LaunchError> {
    match deploy
        .stage(stage_id)
        .and_then(|s| s.model_stage.as_deref())
    {
        None => stage_kind(stage_id),
        Some(name) => StageKind::from_name(name).ok_or_else(|| {
            LaunchError::Omni(format!(
                "{}: stage {stage_id}: model_stage `{name}` is not one of {:?}",
                deploy.source,
                StageKind::ALL.map(StageKind::as_str)
            ))
        }),
    }
}

/// Qwen3-Omni's stage order.
pub fn stage_kind(stage_id: u32) -> Result<StageKind, LaunchError> {
    match stage_id {
        0 => Ok(StageKind::Thinker),
        1 => Ok(StageKind::Talker),
        2 => Ok(StageKind::Code2Wav),
        n => Err(LaunchError::Omni(format!(
            "stage {n}: Qwen3-Omni has stages 0 (Thinker), 1 (Talker), 2 (Code2Wav)"
        ))),
    }
}

/// The Talker -> Code2Wav windows: the codec settings of the connector feeding stage 2 (or of
/// any connector that has them), vLLM-Omni's defaults otherwise.
pub fn windowing(deploy: &DeployConfig) -> Result<CodecWindowing, LaunchError> {
    let named = deploy
        .stage(2)
        .and_then(|s| s.input_connectors.values().next())
        .and_then(|n| deploy.connectors.get(n));
    let connector = named.or_else(|| deploy.connectors.values().next());
    let c = match connector {
        Some(c) => c.codec_chunking()?,
        None => omni_config::CodecChunking {
            initial_codec_chunk_frames: 25,
            codec_chunk_frames: 25,
            codec_left_context_frames: 0,
        },
    };
    let n = |v: usize, what: &str| {
        u32::try_from(v)
            .ok()
            .filter(|&v| v > 0 || what == "codec_left_context_frames")
            .ok_or_else(|| LaunchError::Omni(format!("connector `{what}` {v} is out of range")))
    };
    Ok(CodecWindowing {
        initial: n(c.initial_codec_chunk_frames, "initial_codec_chunk_frames")?,
        chunk: n(c.codec_chunk_frames, "codec_chunk_frames")?,
        left_context: n(c.codec_left_context_frames, "codec_left_context_frames")?,
    })
}

/// Every replica's spec, per stage in `stage_id` order (Thinker, Talker, Code2Wav; or
/// Thinker, TTS). A TTS stage's model is its profile `model` or the built-in voice (fetched on
/// first use into the cache of `--cache-dir`); it detokenizes with `model`'s tokenizer.
pub fn stage_specs(
    deploy: &DeployConfig,
    stages: &[ResolvedStage],
    model: &Path,
) -> Result<Vec<Vec<StageSpec>>, LaunchError> {
    let ids: Vec<u32> = stages.iter().map(|s| s.stage_id).collect();
    let kinds = ids
        .iter()
        .map(|&id| deployed_kind(deploy, id))
        .collect::<Result<Vec<_>, _>>()?;
    let qwen3_omni = [StageKind::Thinker, StageKind::Talker, StageKind::Code2Wav];
    let text_speech = [StageKind::Thinker, StageKind::Tts];
    let numbered = ids.iter().enumerate().all(|(i, &id)| id == i as u32);
    if !numbered || (kinds != qwen3_omni && kinds != text_speech) {
        return Err(LaunchError::Omni(format!(
            "{}: a pipeline is stages 0, 1, 2 = thinker, talker, code2wav (Qwen3-Omni) or \
             0, 1 = thinker, tts (a text model and a voice); the profile has {:?}",
            deploy.source,
            ids.iter()
                .zip(&kinds)
                .map(|(id, k)| format!("{id} = {}", k.as_str()))
                .collect::<Vec<_>>()
        )));
    }
    let windowing = windowing(deploy)?;
    let mut out = Vec::new();
    for (s, &kind) in stages.iter().zip(&kinds) {
        let e = &s.engine;
        let profile = deploy.stage(s.stage_id);
        let (stage_model, tokenizer) = match kind {
            StageKind::Tts => {
                let voice = match profile.and_then(|p| p.model.clone()) {
                    Some(dir) => dir,
                    None => omni_tts::builtin::locate_or_fetch_in(e.model.cache_dir.as_deref())
                        .map_err(|err| LaunchError::Omni(format!("stage {}: {err}", s.stage_id)))?,
                };
                (voice, model.display().to_string())
            }
            _ => (
                profile
                    .and_then(|p| p.model.clone())
                    .unwrap_or_else(|| model.to_path_buf()),
                String::new(),
            ),
        };
        let block_size = e.cache.block_size.max(1);
        let per_seq = e.model.max_model_len.div_ceil(block_size);
        let num_blocks = e.cache.num_gpu_blocks_override.unwrap_or_else(|| {
            per_seq.saturating_mul(u32::try_from(e.scheduler.max_num_seqs).unwrap_or(u32::MAX))
        });
        let load_format = match e.model.load_format {
            LoadFormatCfg::Dummy => LoadFormat::Dummy,
            LoadFormatCfg::Gguf => LoadFormat::Gguf,
            LoadFormatCfg::Auto | LoadFormatCfg::Safetensors => LoadFormat::Safetensors,
        };
        // The voice runs on the host whatever the device of the rest.
        let device = match kind {
            StageKind::Tts => omni_protocol::Device::Cpu,
            _ => crate::resolve_device(e)?,
        };
        let replicas = (0..s.num_replicas.max(1))
            .map(|replica| StageSpec {
                stage_id: s.stage_id,
                replica,
                kind,
                model: stage_model.display().to_string(),
                tokenizer: tokenizer.clone(),
                device,
                device_ordinal: profile
                    .and_then(|p| p.replica_devices(replica).first().copied())
                    .unwrap_or(0),
                gpu_memory_utilization: e.cache.gpu_memory_utilization,
                enforce_eager: e.device.enforce_eager,
                load_format,
                seed: e.model.engine_seed,
                max_num_seqs: u32::try_from(e.scheduler.max_num_seqs).unwrap_or(u32::MAX),
                max_num_batched_tokens: u32::try_from(e.scheduler.max_num_batched_tokens)
                    .unwrap_or(u32::MAX),
                max_model_len: e.model.max_model_len,
                block_size,
                num_blocks,
                enable_prefix_caching: e.cache.prefix_caching(),
                async_chunk: deploy.async_chunk,
                windowing,
                default_sampling: s.default_sampling.clone(),
                cuda_profile_steps: e.device.cuda_profile_steps,
                profile_interval_s: e.device.stage_profile_interval_s,
            })
            .collect();
        out.push(replicas);
    }
    Ok(out)
}

/// The Talker's voices (`talker_config.speaker_id`), lower-case, in the config's order.
pub fn speakers(model: &Path) -> Result<Vec<String>, LaunchError> {
    let config = omni_models::registry::read_config(model)
        .map_err(|e| LaunchError::Omni(format!("{}: {e}", model.display())))?;
    let omni = omni_models::qwen3_omni::config::OmniConfig::from_json(&config)
        .map_err(|e| LaunchError::Omni(format!("{}: {e}", model.display())))?;
    Ok(omni
        .talker_config
        .speaker_id
        .keys()
        .map(|k| k.to_lowercase())
        .collect())
}

/// Starts every stage replica as `exe stage`, then the pipeline's dispatcher.
pub fn start_pipeline(
    exe: &Path,
    stages: Vec<Vec<StageSpec>>,
) -> Result<OmniPipeline, LaunchError> {
    let mut client = MpClientConfig::new(exe.to_path_buf());
    client.args = vec!["stage".into()];
    Ok(OmniPipeline::start(&OmniPipelineConfig { client, stages })?)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Args as _;
    use omni_config::DeploySource;

    fn profile(text: &str) -> DeployConfig {
        // One file per call: the tests run in parallel threads of one process.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("omni-launch-omni-{}-{n}.yaml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let cmd = EngineConfig::augment_args(clap::Command::new("serve"));
        let d = DeployConfig::load(
            DeploySource::File(&path),
            &omni_config::DeployOverrides {
                platform: "cpu",
                ..Default::default()
            },
            &cmd,
        );
        let _ = std::fs::remove_file(&path);
        d.unwrap()
    }

    fn resolved(d: &DeployConfig) -> Vec<ResolvedStage> {
        d.stages
            .iter()
            .map(|s| ResolvedStage {
                stage_id: s.stage_id,
                num_replicas: s.num_replicas,
                engine: EngineConfig::default(),
                default_sampling: SamplingParams::default(),
            })
            .collect()
    }

    #[test]
    fn a_tts_stage_takes_its_voice_and_the_text_models_tokenizer() {
        let d = profile(
            "stages:\n  - stage_id: 0\n    model_stage: thinker\n  - stage_id: 1\n    \
             model_stage: tts\n    model: /voices/v\n",
        );
        let specs = stage_specs(&d, &resolved(&d), Path::new("/models/m.gguf")).unwrap();
        let kinds: Vec<_> = specs.iter().map(|s| s[0].kind).collect();
        assert_eq!(kinds, [StageKind::Thinker, StageKind::Tts]);
        assert_eq!(specs[0][0].model, "/models/m.gguf");
        assert_eq!(specs[1][0].model, "/voices/v");
        assert_eq!(specs[1][0].tokenizer, "/models/m.gguf");
        assert_eq!(specs[1][0].device, omni_protocol::Device::Cpu);
    }

    #[test]
    fn a_pipeline_of_other_stage_kinds_is_refused_naming_them() {
        for (text, names) in [
            (
                "stages:\n  - stage_id: 0\n  - stage_id: 1\n    model_stage: code2wav\n",
                "1 = code2wav",
            ),
            (
                "stages:\n  - stage_id: 0\n    model_stage: speech\n",
                "speech",
            ),
            (
                "stages:\n  - stage_id: 0\n  - stage_id: 2\n",
                "2 = code2wav",
            ),
        ] {
            let d = profile(text);
            let e = stage_specs(&d, &resolved(&d), Path::new("/m"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(names), "{names}: {e}");
        }
    }
}
