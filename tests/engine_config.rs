//! Start-up configuration errors of the real binary.
#![allow(clippy::unwrap_used)]

mod engine_common;

#[test]
fn bad_chunk_size_variable_is_a_clear_startup_error() {
    let out = std::process::Command::new(engine_common::engine_bin())
        .args(["generate", "--model"])
        .arg(engine_common::fixture("llama"))
        .args(["--prompt-token-ids", "1,2,3", "--max-tokens", "2"])
        .env("VLLM_MQ_MAX_CHUNK_BYTES_MB", "sixteen")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("VLLM_MQ_MAX_CHUNK_BYTES_MB") && err.contains("sixteen"),
        "{err}"
    );
}

#[test]
fn chunk_size_variable_reaches_the_broadcast_queue() {
    let out = std::process::Command::new(engine_common::engine_bin())
        .args(["generate", "--model"])
        .arg(engine_common::fixture("llama"))
        .args(["--prompt-token-ids", "1,2,3", "--max-tokens", "2"])
        .env("VLLM_MQ_MAX_CHUNK_BYTES_MB", "3")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("max_chunk_bytes={}", 3 << 20)),
        "{err}"
    );
}
