//! kill -9 of a worker: in-flight requests fail within a second with an error naming the rank,
//! and no shared-memory segment of the engine is left in /dev/shm; SIGTERM or SIGINT to
//! `generate` leaves none either, and its workers go with it.

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

/// A long greedy generation at -tp 2 of the llama fixture, once its engine is generating: the
/// child, its pid and its stderr lines with their arrival times.
fn long_generation() -> (std::process::Child, u32, mpsc::Receiver<(Instant, String)>) {
    let mut child = Command::new(engine_bin())
        .args(["generate", "--temperature", "0", "--ignore-eos", "-tp", "2"])
        .arg("--model")
        .arg(fixture("llama"))
        .args([
            "--max-tokens",
            "6000",
            "--max-model-len",
            "8192",
            "--repeat",
            "8",
        ])
        .args(["--prompt-token-ids", "1,2,3,4,5"])
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
    // Wait until the engine is generating.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, line) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        if line.contains("engine ready") {
            break;
        }
        assert!(Instant::now() < deadline, "engine did not start");
    }
    std::thread::sleep(Duration::from_millis(300));
    (child, pid, rx)
}

#[test]
fn killing_a_worker_fails_requests_within_a_second_naming_the_rank() {
    let (mut child, pid, rx) = long_generation();
    let victims = children_named(pid, "omni-worker-1");
    assert_eq!(victims.len(), 1, "worker 1 of {pid} not found");
    assert_eq!(children_named(pid, "omni-worker-0").len(), 1);
    assert!(!segments_of(pid).is_empty(), "engine uses shared memory");

    let killed_at = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victims[0] as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let (failed_at, line) = loop {
        let (at, line) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        if line.contains("failed") && line.contains("request") {
            break (at, line);
        }
    };
    let latency = failed_at - killed_at;
    assert!(
        latency < Duration::from_secs(1),
        "failed after {latency:?}: {line}"
    );
    assert!(line.contains("worker 1"), "{line}");
    assert!(line.contains("signal 9"), "{line}");

    let status = child.wait().unwrap();
    assert!(!status.success());
    assert!(children_named(pid, "omni-worker-0").is_empty());
    assert_eq!(segments_of(pid), Vec::<String>::new());
}

#[test]
fn sigterm_or_sigint_to_generate_removes_its_shared_memory() {
    use nix::sys::signal::Signal;
    for (sig, code) in [(Signal::SIGTERM, 143), (Signal::SIGINT, 130)] {
        let (mut child, pid, _rx) = long_generation();
        assert!(!segments_of(pid).is_empty(), "engine uses shared memory");
        let workers = children_named(pid, "omni-worker-0");
        assert_eq!(workers.len(), 1);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).unwrap();
        let status = wait_exit(
            &mut child,
            Duration::from_secs(10),
            &format!("{sig}: generate"),
        );
        assert_eq!(status.code(), Some(code), "{sig}: {status}");
        assert_eq!(segments_of(pid), Vec::<String>::new(), "{sig}");
        // The workers die with it (PR_SET_PDEATHSIG): gone, or a zombie of their new parent.
        let alive = |w: u32| {
            std::fs::read_to_string(format!("/proc/{w}/stat")).is_ok_and(|st| {
                st.rsplit(')')
                    .next()
                    .is_some_and(|r| !r.trim_start().starts_with('Z'))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while workers.iter().any(|&w| alive(w)) {
            assert!(
                Instant::now() < deadline,
                "{sig}: worker 0 outlived the engine"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
