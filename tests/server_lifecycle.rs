//! `omni-engine serve` when things end: kill -9 of a worker turns `/health` and new requests
//! into 503s naming the rank within 5 s (and the in-flight stream into an error event), with no
//! shared memory left; SIGTERM aborts in-flight requests, stops the workers and exits 0 with no
//! shared memory left, and does not wait for connections that are idle or half sent.

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_makes_requests_fail_with_503_naming_the_rank() {
    let server = Server::tiny(&["-tp", "2", "--max-model-len", "8192"]);
    let stream = long_stream(&server).await;
    let victims = children_named(server.pid, "omni-worker-1");
    assert_eq!(victims.len(), 1, "worker 1 of {} not found", server.pid);
    assert!(
        !segments_of(server.pid).is_empty(),
        "engine uses shared memory"
    );

    let killed_at = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victims[0] as i32),
        Signal::SIGKILL,
    )
    .unwrap();
    // The in-flight stream ends with one error event (503, rank named), then [DONE].
    let (text, _) = tokio::time::timeout(Duration::from_secs(5), rest_of(stream))
        .await
        .expect("stream still open 5 s after the worker died");
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let error: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], 503, "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("worker 1"),
        "{error}"
    );

    let (status, body) = server
        .post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}))
        .await;
    let latency = killed_at.elapsed();
    assert_eq!(status, 503, "{body}");
    assert!(latency < Duration::from_secs(5), "503 after {latency:?}");
    assert_eq!(body["error"]["type"], "server_error");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("worker 1") && message.contains("signal 9"),
        "{message}"
    );
    let (status, health) = server.get("/health").await;
    assert_eq!(status, 503);
    assert!(health.contains("worker 1"), "{health}");

    let cleaned = eventually(Duration::from_secs(5), || async {
        segments_of(server.pid).is_empty() && children_named(server.pid, "omni-worker-0").is_empty()
    })
    .await;
    assert!(
        cleaned,
        "left behind: {:?}, worker 0 alive: {:?}",
        segments_of(server.pid),
        children_named(server.pid, "omni-worker-0")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_aborts_in_flight_requests_and_leaves_no_shared_memory() {
    let mut server = Server::tiny(&["--max-model-len", "8192"]);
    let pid = server.pid;
    let stream = long_stream(&server).await;
    assert_eq!(children_named(pid, "omni-worker-0").len(), 1);
    assert!(!segments_of(pid).is_empty());

    server.signal(Signal::SIGTERM);
    let (text, _) = tokio::time::timeout(Duration::from_secs(10), rest_of(stream))
        .await
        .expect("stream still open 10 s after SIGTERM");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let status = tokio::task::block_in_place(|| server.wait_exit(Duration::from_secs(10)))
        .unwrap_or_else(|| panic!("still running 10 s after SIGTERM:\n{}", server.log()));
    assert!(status.success(), "{status}:\n{}", server.log());
    assert!(
        server.log().contains("shutdown complete"),
        "{}",
        server.log()
    );
    assert_eq!(segments_of(pid), Vec::<String>::new());
    assert!(children_named(pid, "omni-worker-0").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_idle_and_half_sent_connections_and_exits_at_once() {
    use tokio::io::AsyncWriteExt;
    let mut server = Server::tiny(&[]);
    let mut conns = Vec::new();
    for i in 0..20 {
        let mut s = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
        if i % 2 == 1 {
            s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                .await
                .unwrap();
        }
        conns.push(s);
    }
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
    let t0 = Instant::now();
    server.signal(Signal::SIGTERM);
    // Well inside the 5 s keep-alive: the shutdown closed them, not the timeout.
    for (i, s) in conns.iter_mut().enumerate() {
        assert!(
            closed_within(s, Duration::from_secs(3)).await.is_some(),
            "connection {i} still open 3 s after SIGTERM"
        );
    }
    let status = server
        .wait_exit(Duration::from_secs(3))
        .unwrap_or_else(|| panic!("still running 3 s after SIGTERM\n{}", server.log()));
    assert!(status.success(), "{status:?}\n{}", server.log());
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
}
