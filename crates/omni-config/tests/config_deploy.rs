//! Deploy profiles: the built-in Qwen3-Omni profile, vLLM-Omni-shaped files with keys we do not
//! use, overlays (`base_config`), platform deltas, `--stage-overrides`, `--no-async-chunk`, and
//! each stage's engine config through the precedence defaults < file < stage < env < CLI.
#![allow(clippy::unwrap_used)]

mod common;

use clap::FromArgMatches;
use omni_config::{
    DeployConfig, DeployOverrides, DeploySource, EngineConfig, Error, layered_argv_with,
};

fn builtin(ov: &DeployOverrides<'_>) -> Result<DeployConfig, Error> {
    DeployConfig::load(
        DeploySource::Builtin("qwen3_omni_moe"),
        ov,
        &common::command(),
    )
}

fn cuda() -> DeployOverrides<'static> {
    DeployOverrides {
        platform: "cuda",
        ..Default::default()
    }
}

/// Stage `id`'s engine config for `cli` and `env`.
fn stage_config(d: &DeployConfig, id: u32, cli: &[&str], env: &[(&str, &str)]) -> EngineConfig {
    let argv = std::iter::once("serve")
        .chain(cli.iter().copied())
        .map(String::from)
        .collect();
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    let stage = &d.stage(id).unwrap().engine_args;
    let argv = layered_argv_with(argv, &common::command(), env, stage).unwrap();
    let m = common::command().try_get_matches_from(argv).unwrap();
    EngineConfig::from_arg_matches(&m).unwrap()
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn the_builtin_profile_puts_three_stages_on_one_gpu_with_async_chunks() {
    let d = builtin(&cuda()).unwrap();
    assert!(d.async_chunk);
    assert_eq!(
        d.stages.iter().map(|s| s.stage_id).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    let c = d.connectors["connector_of_shared_memory"]
        .codec_chunking()
        .unwrap();
    assert_eq!(
        (
            c.initial_codec_chunk_frames,
            c.codec_chunk_frames,
            c.codec_left_context_frames
        ),
        (4, 25, 25)
    );
    let talker = d.stage(1).unwrap();
    assert_eq!(
        talker.input_connectors["from_stage_0"],
        "connector_of_shared_memory"
    );
    assert_eq!(talker.default_sampling_params["top_k"], 50);
    assert!(d.stages.iter().all(|s| s.replica_devices(0) == [0]));
    let total: f32 = (0..3)
        .map(|i| stage_config(&d, i, &[], &[]).cache.gpu_memory_utilization)
        .sum();
    assert!(total <= 0.9, "the stages share one GPU: {total}");
    let thinker = stage_config(&d, 0, &[], &[]);
    assert_eq!(thinker.scheduler.max_num_seqs, 64);
    assert!(!thinker.cache.prefix_caching());
    assert!(d.warnings.is_empty(), "{:?}", d.warnings);
}

#[test]
fn a_stage_key_beats_the_default_and_loses_to_env_and_cli() {
    let t = common::tempdir::Dir::new();
    let f = write(
        t.path(),
        "d.yaml",
        "stages:\n  - stage_id: 0\n    max_num_seqs: 8\n    max_model_len: 1024\n    mq_max_chunk_bytes_mb: 4\n",
    );
    let d = DeployConfig::load(DeploySource::File(&f), &cuda(), &common::command()).unwrap();
    let c = stage_config(&d, 0, &[], &[]);
    assert_eq!((c.scheduler.max_num_seqs, c.model.max_model_len), (8, 1024));
    let c = stage_config(
        &d,
        0,
        &["--max-num-seqs", "32"],
        &[("VLLM_MQ_MAX_CHUNK_BYTES_MB", "32")],
    );
    assert_eq!(c.scheduler.max_num_seqs, 32, "the command line wins");
    assert_eq!(c.ipc.mq_max_chunk_bytes_mb, 32, "the environment wins");
    assert_eq!(c.model.max_model_len, 1024);
}

#[test]
fn a_vllm_omni_shaped_profile_loads_and_names_the_keys_we_do_not_use() {
    let t = common::tempdir::Dir::new();
    let f = write(
        t.path(),
        "vo.yaml",
        r#"
async_chunk: true
connectors:
  shm:
    name: SharedMemoryConnector
    extra: {initial_codec_chunk_frames: 4, codec_chunk_frames: 25, codec_left_context_frames: 25}
stages:
  - stage_id: 0
    max_num_batched_tokens: 32768
    trust_remote_code: true
    devices: "0"
  - stage_id: 2
    enforce_eager: false
    async_scheduling: false
    enable_chunked_prefill: false
    devices: "1"
    input_connectors: {from_stage_1: shm}
platforms:
  rocm:
    stages:
      - {stage_id: 2, enforce_eager: true}
  npu:
    stages:
      - {stage_id: 0, compilation_config: {cudagraph_mode: PIECEWISE}, devices: "0,1"}
"#,
    );
    let d = DeployConfig::load(DeploySource::File(&f), &cuda(), &common::command()).unwrap();
    for key in [
        "trust_remote_code",
        "async_scheduling",
        "enable_chunked_prefill",
    ] {
        assert!(
            d.warnings.iter().any(|w| w.contains(key)),
            "{key}: {:?}",
            d.warnings
        );
    }
    assert!(!stage_config(&d, 2, &[], &[]).device.enforce_eager);
    // The ROCm delta merges into stage 2 by id.
    let rocm = DeployOverrides {
        platform: "rocm",
        ..Default::default()
    };
    let d = DeployConfig::load(DeploySource::File(&f), &rocm, &common::command()).unwrap();
    assert!(stage_config(&d, 2, &[], &[]).device.enforce_eager);
}

#[test]
fn overlays_merge_by_stage_id_and_overrides_apply_last() {
    let t = common::tempdir::Dir::new();
    write(
        t.path(),
        "base.yaml",
        "async_chunk: true\nstages:\n  - stage_id: 0\n    max_num_seqs: 16\n    default_sampling_params: {temperature: 0.0, max_tokens: 64}\n  - stage_id: 1\n    devices: \"0\"\n",
    );
    let f = write(
        t.path(),
        "over.yaml",
        "base_config: base.yaml\nstages:\n  - stage_id: 0\n    default_sampling_params: {max_tokens: 128}\n",
    );
    let ov = DeployOverrides {
        platform: "cuda",
        stage_overrides: Some(r#"{"1": {"num_replicas": 2, "devices": "1,2"}}"#),
        no_async_chunk: true,
    };
    let d = DeployConfig::load(DeploySource::File(&f), &ov, &common::command()).unwrap();
    assert!(!d.async_chunk);
    let s0 = d.stage(0).unwrap();
    assert_eq!(s0.default_sampling_params["max_tokens"], 128);
    assert_eq!(s0.default_sampling_params["temperature"], 0.0);
    assert_eq!(stage_config(&d, 0, &[], &[]).scheduler.max_num_seqs, 16);
    let s1 = d.stage(1).unwrap();
    assert_eq!(s1.num_replicas, 2);
    assert_eq!(
        (s1.replica_devices(0), s1.replica_devices(1)),
        (vec![1], vec![2])
    );
}

#[test]
fn every_problem_of_a_profile_is_reported_together() {
    let t = common::tempdir::Dir::new();
    let f = write(
        t.path(),
        "bad.yaml",
        "stages:\n  - stage_id: 0\n    devices: \"0,x\"\n    max_num_seqs: many\n    input_connectors: {from_stage_9: nowhere}\n  - stage_id: 0\n",
    );
    let ov = DeployOverrides {
        platform: "cuda",
        stage_overrides: Some(r#"{"5": {"num_replicas": 2}}"#),
        no_async_chunk: false,
    };
    let e = DeployConfig::load(DeploySource::File(&f), &ov, &common::command())
        .unwrap_err()
        .to_string();
    for part in [
        "bad.yaml",
        "`x`",
        "max-num-seqs",
        "nowhere",
        "listed twice",
        "stage 5",
    ] {
        assert!(e.contains(part), "{part}: {e}");
    }
    assert!(
        DeployConfig::load(DeploySource::Builtin("llama"), &cuda(), &common::command()).is_err()
    );
}

#[test]
fn the_text_speech_profile_names_its_stage_kinds_and_a_stage_may_name_its_model() {
    let d = DeployConfig::load(
        DeploySource::Builtin(omni_config::TEXT_SPEECH_PROFILE),
        &DeployOverrides {
            platform: "cpu",
            ..Default::default()
        },
        &common::command(),
    )
    .unwrap();
    let kinds: Vec<_> = d
        .stages
        .iter()
        .map(|s| (s.stage_id, s.model_stage.as_deref(), s.model.clone()))
        .collect();
    assert_eq!(kinds, [(0, Some("thinker"), None), (1, Some("tts"), None)]);
    assert_eq!(d.stage(1).unwrap().default_sampling_params["seed"], 0);
    assert!(d.warnings.is_empty(), "{:?}", d.warnings);

    // A file's `model` (with `~/` expanded) and a bad `model_stage` type.
    let t = common::tempdir::Dir::new();
    let f = write(
        t.path(),
        "voice.yaml",
        "stages:\n  - stage_id: 0\n  - stage_id: 1\n    model_stage: tts\n    model: ~/voices/mine\n",
    );
    let d = DeployConfig::load(DeploySource::File(&f), &cuda(), &common::command()).unwrap();
    let home = std::env::var("HOME").unwrap();
    assert_eq!(
        d.stage(1).unwrap().model.as_deref(),
        Some(std::path::Path::new(&format!("{home}/voices/mine")))
    );
    let f = write(
        t.path(),
        "bad.yaml",
        "stages:\n  - stage_id: 0\n    model_stage: [1]\n",
    );
    let e = DeployConfig::load(DeploySource::File(&f), &cuda(), &common::command())
        .unwrap_err()
        .to_string();
    assert!(e.contains("model_stage") && e.contains("string"), "{e}");
}
