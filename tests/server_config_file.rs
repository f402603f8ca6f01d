//! `serve --config FILE`: defaults < file < environment < command line, end to end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod server_common;

use server_common::*;

/// A YAML config in a fresh directory (removed by the caller's `remove_dir_all`).
fn config_file(name: &str, text: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("omni-cfg-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cfg.yaml");
    std::fs::write(&path, text).unwrap();
    let p = path.display().to_string();
    (dir, p)
}

async fn max_model_len(s: &Server) -> u64 {
    let (status, body) = s.get("/v1/models").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["data"][0]["max_model_len"].as_u64().unwrap()
}

#[tokio::test]
async fn the_file_sets_max_model_len_and_the_command_line_wins_over_it() {
    let (dir, f) = config_file("mml", "max-model-len: 512\nmax_num_seqs: 8\n");
    let s = Server::tiny(&["--config", &f]);
    assert_eq!(max_model_len(&s).await, 512);
    drop(s);
    let s = Server::tiny(&["--config", &f, "--max-model-len", "300"]);
    assert_eq!(max_model_len(&s).await, 300);
    drop(s);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn the_environment_wins_over_the_file() {
    let (dir, f) = config_file("env", "mq-max-chunk-bytes-mb: 32\nipc-max-chunks: 2\n");
    let s = Server::start_with_env(
        &[
            fixture("llama").to_str().unwrap(),
            "--chat-template",
            CHAT_TEMPLATE,
            "--config",
            &f,
        ],
        &[("VLLM_MQ_MAX_CHUNK_BYTES_MB", "3")],
    );
    let log = s.log();
    assert!(
        log.contains(&format!("max_chunk_bytes={}", 3 << 20)),
        "{log}"
    );
    assert!(log.contains("max_chunks=2"), "{log}");
    drop(s);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_unknown_key_fails_start_up_naming_the_key_and_the_file() {
    let (dir, f) = config_file("bad", "max-model-len: 512\nmax-modle-len: 7\n");
    let out = std::process::Command::new(engine_bin())
        .args([
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--config",
            &f,
        ])
        .arg(fixture("llama"))
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max-modle-len") && err.contains(&f), "{err}");
}
