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

/// A llama config of the fixture's shape with 6 query and 3 KV heads (both divide by 3), in a
/// fresh directory with the fixture tokenizer; weights come from `--load-format dummy`.
fn tp3_model_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("omni-tp3-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = engine_common::fixture("llama");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["num_attention_heads"] = 6.into();
    config["num_key_value_heads"] = 3.into();
    config["hidden_size"] = 96.into();
    config["intermediate_size"] = 192.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    dir
}

/// Bytes reserved in /dev/shm by the segments of the engine started by process `pid`
/// (`omni.<pid>x<n>.*`): the larger of each file's length and its allocated blocks.
fn shm_bytes_of(pid: u32) -> (u64, Vec<(String, u64)>) {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut files = Vec::new();
    for entry in std::fs::read_dir("/dev/shm").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(&format!("omni.{pid}x")) {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        let bytes = meta.len().max(meta.blocks() * 512);
        total += bytes;
        files.push((name, bytes));
    }
    files.sort();
    (total, files)
}

#[test]
fn response_queues_stay_small_when_the_broadcast_chunk_is_100_mib() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    use std::time::Duration;

    let model = tp3_model_dir();
    let mut child = std::process::Command::new(engine_common::engine_bin())
        .args(["serve", "--host", "127.0.0.1", "--port", "0", "-tp", "3"])
        .args(["--device", "cpu", "--load-format", "dummy", "--model"])
        .arg(&model)
        .env("VLLM_MQ_MAX_CHUNK_BYTES_MB", "100")
        .env("RUST_BACKTRACE", "0")
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut log = Vec::new();
    let listening = loop {
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(line) => {
                let done = line.contains("listening on http://");
                log.push(line);
                if done {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let (total, files) = shm_bytes_of(pid);
    // SIGTERM: the server shuts the workers down and their segments go with them.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&model);
    assert!(listening, "server did not start:\n{}", log.join("\n"));
    println!(
        "/dev/shm used by the -tp 3 engine at VLLM_MQ_MAX_CHUNK_BYTES_MB=100: {total} bytes \
         ({:.3} GiB) in {files:?}",
        total as f64 / (1u64 << 30) as f64
    );
    assert!(
        files.iter().any(|(n, _)| n.ends_with(".bcast")),
        "no broadcast segment among {files:?}"
    );
    assert!(
        total as f64 <= 1.1 * (1u64 << 30) as f64,
        "{total} bytes of /dev/shm: {files:?}"
    );
    assert!(status.success(), "serve exited with {status}");
    assert_eq!(shm_bytes_of(pid).1, Vec::<(String, u64)>::new());
}
