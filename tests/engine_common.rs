//! Helpers shared by the `engine_*` end-to-end tests: run `omni-engine generate`, parse its
//! JSON, read the fixture references.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// The binary under test (`OMNI_ENGINE_BIN` overrides it).
pub fn engine_bin() -> PathBuf {
    std::env::var_os("OMNI_ENGINE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_omni-engine")))
}

/// A fixture directory. Test binaries built here and run elsewhere (the GPU machine runs them
/// from a copy of the repository) fall back to the path relative to the working directory.
pub fn fixture(name: &str) -> PathBuf {
    let built =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../crates/omni-models/tests/fixtures");
    let base = if built.is_dir() {
        built
    } else {
        PathBuf::from("crates/omni-models/tests/fixtures")
    };
    base.join(name)
}

/// `/dev/shm/omni.<pid>x*`: the segments of the engine instances of process `pid`.
pub fn segments_of(pid: u32) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("omni.{pid}x")))
        .collect()
}

#[derive(Debug, serde::Deserialize)]
pub struct Reference {
    pub input_ids: Vec<Vec<u32>>,
    pub greedy: Vec<Vec<u32>>,
}

pub fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[derive(Debug, serde::Deserialize)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
}

pub fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// `omni-engine generate --json <args>` with greedy sampling; panics with stderr on failure.
pub fn generate(args: &[String]) -> (Vec<Generation>, String) {
    let out: Output = Command::new(engine_bin())
        .arg("generate")
        .args(["--json", "--temperature", "0"])
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "generate failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = stdout.lines().last().unwrap_or("");
    (serde_json::from_str(json).unwrap(), stderr)
}

/// `--prompt-token-ids` for each prompt.
pub fn prompt_args(prompts: &[Vec<u32>]) -> Vec<String> {
    prompts
        .iter()
        .flat_map(|p| ["--prompt-token-ids".to_string(), ids_arg(p)])
        .collect()
}

pub fn s(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// The number after `label` in the generate summary line on stderr (e.g. "preemptions ").
pub fn stat(stderr: &str, label: &str) -> u64 {
    let i = stderr
        .rfind(label)
        .unwrap_or_else(|| panic!("no {label:?} in {stderr}"));
    stderr[i + label.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}

/// Pids of the processes whose parent is `ppid` and whose name is `comm`.
pub fn children_named(ppid: u32, comm: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let parent: Option<u32> = stat[close + 1..]
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok());
        if &stat[open + 1..close] == comm && parent == Some(ppid) {
            found.push(pid);
        }
    }
    found
}

/// Waits up to `limit` for `child` to exit; kills it (and fails) past that.
pub fn wait_exit(child: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let until = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
