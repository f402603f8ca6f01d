//! `omni-engine serve --enable-multiprocessing`: the engine core in its own process
//! (`omni-engine-core`, which spawns the workers). Its greedy tokens are the in-process ones;
//! kill -9 of it ends every in-flight stream with an error event naming it within 2 s, `/health`
//! and new requests answer 503, its workers die with it and no shared memory is left; a dead
//! worker of it is named as a worker; SIGTERM stops it and leaves no shared memory.

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

/// The engine-core process's `comm` (`PR_SET_NAME` keeps 15 bytes).
fn core_comm() -> &'static str {
    &omni_core::ENGINE_CORE_PROCESS_NAME[..15]
}

/// The one engine-core process of `server`.
fn engine_core_of(server: &Server) -> u32 {
    let cores = children_named(server.pid, core_comm());
    assert_eq!(cores.len(), 1, "engine core of {}: {cores:?}", server.pid);
    cores[0]
}

/// Whether `pid` has exited (gone, or a zombie nobody reaped yet).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

/// The error event before `[DONE]` of a stream that ended abnormally.
fn error_event(text: &str) -> Value {
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    assert!(events.len() >= 2, "{text}");
    serde_json::from_str(events[events.len() - 2]).unwrap()
}

/// The greedy completion text of the fixture's first reference prompt.
async fn greedy_text(server: &Server) -> String {
    let text = std::fs::read_to_string(fixture("llama").join("reference.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": reference["input_ids"][0], "max_tokens": 32, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["text"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_core_process_serves_the_in_process_greedy_tokens_at_tp2() {
    let in_process = greedy_text(&Server::tiny(&["-tp", "2"])).await;
    let server = Server::tiny(&["-tp", "2", "--enable-multiprocessing"]);
    let core = engine_core_of(&server);
    assert_eq!(children_named(core, "omni-worker-1").len(), 1);
    assert!(children_named(server.pid, "omni-worker-0").is_empty());
    assert_eq!(greedy_text(&server).await, in_process);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_engine_core_fails_every_stream_within_2s_naming_it() {
    let server = Server::tiny(&[
        "--enable-multiprocessing",
        "-tp",
        "2",
        "--max-model-len",
        "8192",
    ]);
    let core = engine_core_of(&server);
    let workers: Vec<u32> = (0..2)
        .flat_map(|r| children_named(core, &format!("omni-worker-{r}")))
        .collect();
    assert_eq!(workers.len(), 2, "workers of the engine core {core}");
    let (a, b, c) = futures::join!(
        long_stream(&server),
        long_stream(&server),
        long_stream(&server)
    );
    assert!(!segments_of(server.pid).is_empty(), "the input queue");
    assert!(!segments_of(core).is_empty(), "the engine core's queues");

    let killed_at = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(core as i32), Signal::SIGKILL).unwrap();
    let ends = tokio::time::timeout(
        Duration::from_secs(10),
        futures::future::join_all([rest_of(a), rest_of(b), rest_of(c)]),
    )
    .await
    .expect("streams still open 10 s after the engine core died");
    let mut slowest = Duration::ZERO;
    for (text, ended_at) in &ends {
        let error = error_event(text);
        assert_eq!(error["error"]["code"], 503, "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("engine core") && message.contains("signal 9"),
            "{message}"
        );
        slowest = slowest.max(*ended_at - killed_at);
    }
    eprintln!("kill -9 of the engine core -> every stream's error event: {slowest:?}");
    assert!(slowest < Duration::from_secs(2), "errors after {slowest:?}");

    let (status, health) = server.get("/health").await;
    assert_eq!(status, 503, "{health}");
    assert!(health.contains("engine core"), "{health}");
    let (status, body) = server
        .post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}))
        .await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("engine core"),
        "{body}"
    );

    let cleaned = eventually(Duration::from_secs(5), || async {
        segments_of(server.pid).is_empty()
            && segments_of(core).is_empty()
            && workers.iter().all(|&w| exited(w))
    })
    .await;
    assert!(
        cleaned,
        "left behind: {:?} {:?}; workers exited: {:?}",
        segments_of(server.pid),
        segments_of(core),
        workers.iter().map(|&w| exited(w)).collect::<Vec<_>>()
    );
    // The API process lives on and keeps answering.
    assert_eq!(server.get("/health").await.0, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_of_the_engine_core_process_is_named_by_its_rank() {
    let mut server = Server::tiny(&[
        "--enable-multiprocessing",
        "-tp",
        "2",
        "--max-model-len",
        "8192",
    ]);
    let pid = server.pid;
    let core = engine_core_of(&server);
    let victim = children_named(core, "omni-worker-1");
    assert_eq!(victim.len(), 1);
    let stream = long_stream(&server).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim[0] as i32),
        Signal::SIGKILL,
    )
    .unwrap();
    let (text, _) = tokio::time::timeout(Duration::from_secs(5), rest_of(stream))
        .await
        .expect("stream still open 5 s after the worker died");
    let error = error_event(&text);
    assert_eq!(error["error"]["code"], 503, "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("worker 1") && message.contains("signal 9"),
        "{message}"
    );
    let (status, health) = server.get("/health").await;
    assert_eq!(status, 503);
    assert!(health.contains("worker 1"), "{health}");

    // The engine core lives on (dead engine, answering 503) until a clean SIGTERM.
    server.signal(Signal::SIGTERM);
    let status = tokio::task::block_in_place(|| server.wait_exit(Duration::from_secs(15)))
        .unwrap_or_else(|| panic!("still running 15 s after SIGTERM:\n{}", server.log()));
    assert!(status.success(), "{status}:\n{}", server.log());
    assert!(exited(core));
    assert_eq!(segments_of(pid), Vec::<String>::new());
    assert_eq!(segments_of(core), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_engine_core_process_and_leaves_no_shared_memory() {
    let mut server = Server::tiny(&["--enable-multiprocessing", "--max-model-len", "8192"]);
    let pid = server.pid;
    let core = engine_core_of(&server);
    let workers = children_named(core, "omni-worker-0");
    assert_eq!(workers.len(), 1);
    let stream = long_stream(&server).await;
    assert!(!segments_of(core).is_empty());

    server.signal(Signal::SIGTERM);
    let (text, _) = tokio::time::timeout(Duration::from_secs(10), rest_of(stream))
        .await
        .expect("stream still open 10 s after SIGTERM");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let status = tokio::task::block_in_place(|| server.wait_exit(Duration::from_secs(15)))
        .unwrap_or_else(|| panic!("still running 15 s after SIGTERM:\n{}", server.log()));
    assert!(status.success(), "{status}:\n{}", server.log());
    assert!(
        server.log().contains("shutdown complete"),
        "{}",
        server.log()
    );
    assert!(exited(core) && exited(workers[0]));
    assert_eq!(segments_of(pid), Vec::<String>::new());
    assert_eq!(segments_of(core), Vec::<String>::new());
}
