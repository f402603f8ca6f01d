//! defaults < `--config FILE` < environment < command line, through the real clap parser.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{resolve, tempdir};
use omni_config::EngineConfig;

fn yaml(text: &str) -> (tempdir::Dir, String) {
    let d = tempdir::Dir::new();
    let p = d.path().join("cfg.yaml");
    std::fs::write(&p, text).unwrap();
    let s = p.display().to_string();
    (d, s)
}

#[test]
fn defaults_are_the_clap_defaults() {
    let c = EngineConfig::default();
    assert_eq!(c.model.max_model_len, 2048);
    assert_eq!(c.cache.block_size, 16);
    assert_eq!(c.scheduler.max_num_seqs, 256);
    assert_eq!(c.ipc.broadcast().max_chunk_bytes, 16 << 20);
    assert!(c.cache.prefix_caching());
    assert_eq!(resolve(&[], &[]).unwrap(), c);
    c.validate().unwrap();
}

#[test]
fn the_file_sets_what_the_command_line_does_not() {
    let (_d, f) = yaml(
        "max-model-len: 512\nmax_num_seqs: 8\nenforce-eager: true\nenable-prefix-caching: false\n",
    );
    let c = resolve(&["--config", &f], &[]).unwrap();
    assert_eq!(c.model.max_model_len, 512);
    assert_eq!(c.scheduler.max_num_seqs, 8);
    assert!(c.device.enforce_eager);
    assert!(!c.cache.prefix_caching());
}

#[test]
fn the_command_line_wins_over_the_file() {
    let (_d, f) = yaml("max-model-len: 512\n");
    let c = resolve(&["--max-model-len", "1024", "--config", &f], &[]).unwrap();
    assert_eq!(c.model.max_model_len, 1024);
    let c = resolve(&["--config", &f, "--max-model-len=300"], &[]).unwrap();
    assert_eq!(c.model.max_model_len, 300);
}

#[test]
fn the_environment_wins_over_the_file_and_loses_to_the_command_line() {
    let (_d, f) = yaml("mq-max-chunk-bytes-mb: 32\n");
    let env = [("VLLM_MQ_MAX_CHUNK_BYTES_MB", "100")];
    let c = resolve(&["--config", &f], &env).unwrap();
    assert_eq!(c.ipc.broadcast().max_chunk_bytes, 100 << 20);
    let c = resolve(&["--config", &f], &[]).unwrap();
    assert_eq!(c.ipc.broadcast().max_chunk_bytes, 32 << 20);
    let c = resolve(&["--config", &f, "--mq-max-chunk-bytes-mb", "8"], &env).unwrap();
    assert_eq!(c.ipc.broadcast().max_chunk_bytes, 8 << 20);
}

#[test]
fn an_unknown_key_names_the_key_and_the_file() {
    let (_d, f) = yaml("max-model-len: 512\nmax-modle-len: 7\n");
    let e = resolve(&["--config", &f], &[]).unwrap_err().to_string();
    assert!(e.contains("max-modle-len") && e.contains(&f), "{e}");
}

#[test]
fn a_bad_environment_value_names_the_variable() {
    let e = resolve(&[], &[("VLLM_MQ_MAX_CHUNK_BYTES_MB", "sixteen")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("VLLM_MQ_MAX_CHUNK_BYTES_MB"), "{e}");
}

#[test]
fn validation_reports_every_problem_together() {
    let c = resolve(
        &[
            "--gpu-memory-utilization",
            "1.5",
            "--block-size",
            "12",
            "--pipeline-parallel-size",
            "0",
        ],
        &[],
    )
    .unwrap();
    let e = c.validate().unwrap_err().to_string();
    for part in ["gpu-memory-utilization", "block-size", "pipeline"] {
        assert!(e.contains(part), "{e}");
    }
}

#[test]
fn the_response_queue_does_not_inherit_the_broadcast_chunk_size() {
    let c = resolve(&[], &[("VLLM_MQ_MAX_CHUNK_BYTES_MB", "100")]).unwrap();
    assert_eq!(c.ipc.broadcast().max_chunk_bytes, 100 << 20);
    assert!(c.ipc.response().max_chunk_bytes <= 4 << 20);
}
