//! Multi-node serving without Ray (issue 15), across two network namespaces the test creates
//! (`netns_common.rs`): the leader runs the engine core and node 0's ranks, the follower
//! (`serve --headless`) node 1's, in its own mount and PID namespaces with a private
//! `/dev/shm`. The broadcast reaches the follower over TCP, pipeline activations and
//! tensor-parallel partial sums cross the veth pair, the responses come back over TCP.
//!
//! Skipped (with a line on stderr) where namespaces cannot be made (not root).

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;
#[path = "netns_common.rs"]
mod netns;

use std::io::Read;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use netns::{LEADER_IP, LEADER_NAME, NodePair};

const PORT: &str = "29501";

fn parallel(tp: u32, pp: u32) -> Vec<String> {
    let mut a = s(&["--device", "cpu", "-tp"]);
    a.push(tp.to_string());
    a.push("-pp".into());
    a.push(pp.to_string());
    a.extend(s(&["--nnodes", "2", "--master-port", PORT]));
    a
}

fn follower_args(tp: u32, pp: u32) -> Vec<String> {
    let mut a = s(&[
        "serve",
        "--headless",
        "--node-rank",
        "1",
        "--master-addr",
        LEADER_NAME,
    ]);
    a.extend(parallel(tp, pp));
    a.extend(s(&["--distributed-timeout-seconds", "60"]));
    a
}

/// The leader's and the follower's segments are gone: the leader's in the root `/dev/shm`
/// (by its pid), the follower's private one as listed after it exited.
fn assert_no_segments(pair: &NodePair, leader_pid: u32) {
    assert!(
        segments_of(leader_pid).is_empty(),
        "{:?}",
        segments_of(leader_pid)
    );
    let listing = pair.follower_shm();
    assert!(
        !listing.contains("omni."),
        "the follower left segments: {listing}"
    );
}

/// `generate` on the leader with `tp x pp` ranks over both nodes gives the transformers
/// greedy tokens; the follower is started `head_start` before the leader.
fn check_across_nodes(name: &str, tp: u32, pp: u32, head_start: Duration) {
    let Some(pair) = NodePair::new() else { return };
    let r = reference(name);
    let mut follower = pair.spawn_follower(&engine_bin(), &follower_args(tp, pp));
    std::thread::sleep(head_start);
    assert!(
        follower.try_wait().unwrap().is_none(),
        "the follower gave up before the leader came: {}",
        pair.log("follower")
    );
    let mut args = s(&[
        "generate",
        "--json",
        "--temperature",
        "0",
        "--max-tokens",
        "32",
    ]);
    args.extend(s(&["--model"]));
    args.push(fixture(name).display().to_string());
    args.extend(parallel(tp, pp));
    args.extend(s(&["--node-rank", "0", "--master-addr", LEADER_IP]));
    args.extend(prompt_args(&r.input_ids));
    let mut leader = pair.spawn_leader(&engine_bin(), &args);
    let leader_pid = leader.id();
    let status = wait_exit(&mut leader, Duration::from_secs(120), "the leader");
    assert!(
        status.success(),
        "leader failed: {}\n--- follower:\n{}",
        pair.log("leader"),
        pair.log("follower")
    );
    let out = pair.leader_stdout();
    let gens: Vec<Generation> = serde_json::from_str(out.lines().last().unwrap_or("")).unwrap();
    assert_eq!(gens.len(), r.greedy.len());
    for (i, g) in gens.iter().enumerate() {
        assert_eq!(
            g.token_ids, r.greedy[i],
            "{name} tp={tp} pp={pp} over 2 nodes, prompt {i}"
        );
    }
    let status = wait_exit(&mut follower, Duration::from_secs(30), "the follower");
    assert!(status.success(), "follower: {}", pair.log("follower"));
    assert!(
        pair.log("follower")
            .contains("the leader shut the group down"),
        "{}",
        pair.log("follower")
    );
    assert_no_segments(&pair, leader_pid);
}

#[test]
fn tp2_pp2_over_two_nodes_gives_the_transformers_greedy_tokens() {
    // Node 0 holds stage 0 (ranks 0, 1), node 1 stage 1 (ranks 2, 3): the activations cross.
    check_across_nodes("qwen3", 2, 2, Duration::ZERO);
}

#[test]
fn tp2_across_two_nodes_gives_the_transformers_greedy_tokens() {
    // One tensor-parallel group split over the nodes: its partial sums cross every layer.
    check_across_nodes("qwen3-moe", 2, 1, Duration::ZERO);
}

#[test]
fn a_follower_started_10_s_before_the_leader_joins_it_and_pp2_serves() {
    check_across_nodes("llama", 1, 2, Duration::from_secs(10));
}

/// Streams one completion from the leader's HTTP port (from a thread in its namespace):
/// says on `first` when the first event came, returns the whole response and when it ended.
fn stream_completion(
    pair: &NodePair,
    addr: String,
    first: mpsc::Sender<()>,
) -> std::thread::JoinHandle<(String, Instant)> {
    pair.in_leader_ns(move || {
        use std::io::Write;
        let body = r#"{"model":"m","prompt":"the quick brown fox","max_tokens":220,"stream":true,"ignore_eos":true,"temperature":0}"#;
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut text = String::new();
        let mut buf = [0u8; 4096];
        let mut told = false;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => text.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
            if !told && text.matches("data: {").count() >= 2 {
                told = true;
                let _ = first.send(());
            }
        }
        (text, Instant::now())
    })
}

/// A follower and a leader `serve` (llama fixture, tp 2 x pp 2 over the two nodes) up and
/// healthy: `(follower, leader, leader pid, leader's address)`.
fn serve_pair(pair: &NodePair) -> (std::process::Child, std::process::Child, u32, String) {
    let follower = pair.spawn_follower(&engine_bin(), &follower_args(2, 2));
    let mut args = s(&["serve"]);
    args.push(fixture("llama").display().to_string());
    args.extend(parallel(2, 2));
    args.extend(s(&[
        "--node-rank",
        "0",
        "--master-addr",
        LEADER_IP,
        "--host",
        LEADER_IP,
    ]));
    args.extend(s(&[
        "--port",
        "8000",
        "--served-model-name",
        "m",
        "--max-model-len",
        "256",
    ]));
    let leader = pair.spawn_leader(&engine_bin(), &args);
    let leader_pid = leader.id();
    let addr = format!("{LEADER_IP}:8000");
    let healthy = {
        let addr = addr.clone();
        pair.in_leader_ns(move || {
            let until = Instant::now() + Duration::from_secs(90);
            while Instant::now() < until {
                if let Ok(mut st) = std::net::TcpStream::connect(&addr) {
                    use std::io::Write;
                    let _ = write!(
                        st,
                        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                    );
                    let mut t = String::new();
                    let _ = st.read_to_string(&mut t);
                    if t.starts_with("HTTP/1.1 200") {
                        return true;
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            false
        })
        .join()
        .unwrap()
    };
    assert!(
        healthy,
        "leader: {}\nfollower: {}",
        pair.log("leader"),
        pair.log("follower")
    );
    (follower, leader, leader_pid, addr)
}

#[test]
fn sigterm_to_a_follower_stops_it_cleanly_and_breaks_the_group_loudly() {
    let Some(pair) = NodePair::new() else { return };
    let (mut follower, mut leader, leader_pid, _addr) = serve_pair(&pair);
    let nodes = pair.follower_pids("omni-engine");
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(nodes[0]),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = wait_exit(&mut follower, Duration::from_secs(30), "the follower");
    let log = pair.log("follower");
    assert!(
        status.success(),
        "a requested stop exits 0: {status}\n{log}"
    );
    assert!(log.contains("stopped by a signal"), "{log}");
    // The group is broken: the leader fails and exits non-zero (LeaderWorkerSet recreates it).
    let status = wait_exit(&mut leader, Duration::from_secs(30), "the leader");
    assert!(!status.success(), "the leader must exit non-zero: {status}");
    assert!(
        pair.log("leader").contains("node 1"),
        "the leader does not name node 1: {}",
        pair.log("leader")
    );
    assert_no_segments(&pair, leader_pid);
}

#[test]
fn killing_a_follower_worker_fails_every_stream_fast_naming_node_and_rank() {
    let Some(pair) = NodePair::new() else { return };
    let (mut follower, mut leader, leader_pid, addr) = serve_pair(&pair);
    let (tx, rx) = mpsc::channel();
    let streams: Vec<_> = (0..3)
        .map(|_| stream_completion(&pair, addr.clone(), tx.clone()))
        .collect();
    for _ in 0..3 {
        rx.recv_timeout(Duration::from_secs(60))
            .expect("every stream sends tokens before the kill");
    }
    let victims = pair.follower_pids("omni-worker-3");
    assert_eq!(victims.len(), 1, "{victims:?}");
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victims[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    for st in streams {
        let (text, ended) = st.join().unwrap();
        let took = ended.duration_since(killed);
        assert!(
            took < Duration::from_secs(5),
            "a stream ended {took:?} after the kill"
        );
        assert!(
            text.contains("\"error\"") && text.contains("node 1") && text.contains("rank 3"),
            "the stream's end does not name node 1 and rank 3: {}",
            &text[text.len().saturating_sub(600)..]
        );
        assert!(text.contains("data: [DONE]"), "{text}");
    }
    let status = wait_exit(&mut leader, Duration::from_secs(30), "the leader");
    assert!(!status.success(), "the leader must exit non-zero: {status}");
    let status = wait_exit(&mut follower, Duration::from_secs(30), "the follower");
    assert!(
        !status.success(),
        "the follower must exit non-zero: {status}"
    );
    assert_no_segments(&pair, leader_pid);
}
