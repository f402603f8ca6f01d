//! The engine core in its own process (`--enable-multiprocessing`, an `omni-engine-core` child
//! that spawns the workers) gives the greedy tokens of the in-process engine core, which are
//! the transformers reference, at tensor-parallel size 1 and 2; kill -9 of it fails offline
//! inference within 2 s naming it, and leaves no shared memory.

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

/// Greedy continuations of the fixture's prompts; `mp`: the engine core in its own process.
fn run(name: &str, tp: u32, mp: bool) -> Vec<Vec<u32>> {
    let r = reference(name);
    let mut args = s(&["--model"]);
    args.push(fixture(name).display().to_string());
    args.extend(s(&["--max-tokens", "32", "-tp"]));
    args.push(tp.to_string());
    if mp {
        args.push("--enable-multiprocessing".into());
    }
    args.extend(prompt_args(&r.input_ids));
    let (gens, stderr) = generate(&args);
    // The log line of the client that started the engine-core process, and only then.
    assert_eq!(
        stderr.contains("engine core ready in its own process"),
        mp,
        "{name} tp={tp} mp={mp}: {stderr}"
    );
    assert_eq!(gens.len(), r.greedy.len(), "{stderr}");
    gens.into_iter()
        .enumerate()
        .map(|(i, g)| {
            assert_eq!(g.prompt_token_ids, r.input_ids[i]);
            g.token_ids
        })
        .collect()
}

fn check(name: &str, tp: u32) {
    let in_process = run(name, tp, false);
    let own_process = run(name, tp, true);
    assert_eq!(own_process, in_process, "{name} tp={tp}");
    assert_eq!(own_process, reference(name).greedy, "{name} tp={tp}");
}

#[test]
fn tp1_engine_core_process_greedy_tokens_equal_in_process_ones() {
    check("llama", 1);
    check("qwen3-moe", 1);
}

#[test]
fn tp2_engine_core_process_greedy_tokens_equal_in_process_ones() {
    check("llama", 2);
    check("qwen3", 2);
    check("qwen3-moe", 2);
}

#[test]
fn killing_the_engine_core_fails_generate_within_2s_naming_it() {
    let mut child = Command::new(engine_bin())
        .args(["generate", "--temperature", "0", "--ignore-eos", "-tp", "2"])
        .arg("--enable-multiprocessing")
        .arg("--model")
        .arg(fixture("llama"))
        .args(["--max-tokens", "6000", "--max-model-len", "8192"])
        .args(["--repeat", "4", "--prompt-token-ids", "1,2,3,4,5"])
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send((Instant::now(), line));
        }
    });
    loop {
        let (_, line) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        if line.contains("engine ready") {
            break;
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let comm = &omni_core::ENGINE_CORE_PROCESS_NAME[..15];
    let cores = children_named(pid, comm);
    assert_eq!(cores.len(), 1, "engine core of {pid}");
    let core = cores[0];
    assert_eq!(children_named(core, "omni-worker-1").len(), 1);
    assert!(!segments_of(core).is_empty());

    let killed_at = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(core as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let (failed_at, line) = loop {
        let (at, line) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        if line.contains("request") && line.contains("failed") {
            break (at, line);
        }
    };
    let latency = failed_at - killed_at;
    eprintln!("kill -9 of the engine core -> generate's error: {latency:?}");
    assert!(
        latency < Duration::from_secs(2),
        "failed after {latency:?}: {line}"
    );
    assert!(line.contains("engine core"), "{line}");
    assert!(line.contains("signal 9"), "{line}");

    let status = child.wait().unwrap();
    assert!(!status.success());
    assert_eq!(segments_of(pid), Vec::<String>::new());
    assert_eq!(segments_of(core), Vec::<String>::new());
}
