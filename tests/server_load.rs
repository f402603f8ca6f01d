//! `omni-engine serve` under load and under client misbehaviour: 200 concurrent streams all
//! finish with exact token counts; a client that hangs up mid-stream gets its request aborted
//! and its KV blocks freed (visible in `/metrics`); connections that send nothing, half a
//! header, or a header trickled byte by byte are closed on time while requests are served; and
//! connections beyond `--limit-concurrency` get a 503 and are closed.

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_all_finish_with_exact_token_counts() {
    let server = Server::tiny(&[]);
    let t0 = Instant::now();
    let requests = (0..200).map(|i| {
        let server = &server;
        async move {
            let body = json!({
                "prompt": format!("request number {i} says"),
                "max_tokens": 4,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
            let chunks = server.sse("/v1/completions", &body).await;
            let usage = chunks.last().unwrap()["usage"].clone();
            let finishes = chunks
                .iter()
                .filter(|c| c["choices"][0]["finish_reason"] == "length")
                .count();
            (usage, finishes)
        }
    });
    let results = futures::future::join_all(requests).await;
    let elapsed = t0.elapsed();
    assert_eq!(results.len(), 200);
    for (usage, finishes) in &results {
        assert_eq!(usage["completion_tokens"], 4, "{usage}");
        assert_eq!(finishes, &1);
    }
    println!("200 concurrent streams in {elapsed:.2?}");
    assert_eq!(
        server.metric("vllm:generation_tokens_total").await,
        800.0,
        "{}",
        server.log()
    );
    assert_eq!(
        server
            .metric_settles("vllm:num_requests_running", 0.0)
            .await,
        0.0
    );
    assert_eq!(
        server.metric_settles("vllm:kv_cache_usage_perc", 0.0).await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_aborts_the_request_and_frees_its_kv_blocks() {
    let server = Server::tiny(&["--max-model-len", "8192"]);
    let resp = server
        .http
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 8000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = Box::pin(resp.bytes_stream());
    let mut seen = 0;
    while seen < 2048 {
        seen += body.next().await.unwrap().unwrap().len();
    }
    assert_eq!(server.metric("vllm:num_requests_running").await, 1.0);
    assert!(server.metric("vllm:kv_cache_usage_perc").await > 0.0);
    drop(body); // hang up mid-stream

    let freed = eventually(Duration::from_secs(5), || async {
        server.metric("vllm:num_requests_running").await == 0.0
            && server.metric("vllm:kv_cache_usage_perc").await == 0.0
    })
    .await;
    assert!(
        freed,
        "blocks still held after the disconnect:\n{}",
        server.log()
    );
    let generated = server.metric("vllm:generation_tokens_total").await;
    assert!(
        generated < 8000.0,
        "the request ran to completion ({generated} tokens)"
    );
    let (_, metrics) = server.get("/metrics").await;
    assert!(
        !metrics.contains("finished_reason=\"length\""),
        "the request was not aborted:\n{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_half_sent_and_kept_alive_connections_close_after_the_keep_alive_timeout() {
    // Defaults: vLLM's 5 s keep-alive.
    const N: usize = 40;
    let server = Server::tiny(&[]);
    let addr = server.addr();
    // (kind, connection, when its last byte went out)
    let mut conns = Vec::new();
    for i in 0..3 * N {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let kind = match i % 3 {
            0 => "idle",
            1 => {
                s.write_all(
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: applic",
                )
                .await
                .unwrap();
                "half a header"
            }
            _ => {
                let (status, _, _) = raw_get(&mut s, "/health").await;
                assert_eq!(status, 200);
                "kept alive after a request"
            }
        };
        conns.push((kind, s, Instant::now()));
    }
    let closes = futures::future::join_all(
        conns
            .iter_mut()
            .map(|(_, s, _)| closed_within(s, Duration::from_secs(10))),
    );
    // Meanwhile the server answers as usual.
    let served = async {
        for _ in 0..3 {
            let (status, body) = server
                .post(
                    "/v1/completions",
                    &json!({"prompt": "hello", "max_tokens": 2}),
                )
                .await;
            assert_eq!(status, 200, "{body}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let (closed, ()) = tokio::join!(closes, served);
    for ((kind, _, last_byte), closed) in conns.iter().zip(closed) {
        let closed = closed.unwrap_or_else(|| {
            panic!(
                "a connection ({kind}) is still open 10 s later\n{}",
                server.log()
            )
        });
        let after = closed - *last_byte;
        assert!(
            after >= Duration::from_millis(4900),
            "a connection ({kind}) closed {after:?} after its last byte, before the keep-alive timeout"
        );
    }
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_trickled_byte_by_byte_is_cut_off_at_the_header_read_timeout() {
    let server = Server::tiny(&["--header-read-timeout", "2"]);
    let mut s = TcpStream::connect(server.addr()).await.unwrap();
    let header = format!(
        "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: {}\r\n\r\n",
        "a".repeat(200)
    );
    let t0 = Instant::now();
    let mut buf = [0u8; 1024];
    let mut closed_after = None;
    // One byte every 100 ms, well inside the 5 s keep-alive; at most 6 s.
    for b in header.bytes() {
        if s.write_all(&[b]).await.is_err() {
            closed_after = Some(t0.elapsed());
            break;
        }
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => {
                closed_after = Some(t0.elapsed());
                break;
            }
            Ok(Ok(n)) => panic!("answered a header that never ended: {:?}", &buf[..n]),
            Err(_) => {}
        }
        if t0.elapsed() > Duration::from_secs(6) {
            break;
        }
    }
    let after = closed_after.expect("a trickled header is still being read after 6 s");
    assert!(
        after >= Duration::from_millis(1900) && after < Duration::from_millis(4500),
        "closed {after:?} after the first byte"
    );
    // A header sent whole is answered.
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_limit_concurrency_get_a_503_and_are_closed() {
    let server = Server::tiny(&["--limit-concurrency", "3", "--timeout-keep-alive", "60"]);
    let addr = server.addr();
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let (status, _, _) = raw_get(&mut s, "/health").await;
        assert_eq!(status, 200);
        held.push(s);
    }
    // A fourth connection: one 503 in OpenAI's shape, then closed.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let (status, head, body) = raw_get(&mut s, "/v1/models").await;
    assert_eq!(status, 503, "{head}\n{body}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "too_many_connections", "{v}");
    assert_eq!(v["error"]["type"], "server_error", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains('3'), "{v}");
    assert!(
        closed_within(&mut s, Duration::from_secs(2))
            .await
            .is_some(),
        "the refused connection stays open"
    );
    // An HTTP client sees the same.
    let (status, v) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "hello", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 503, "{v}");
    assert!(
        server.log().contains("connection limit reached"),
        "{}",
        server.log()
    );
    // The held connections still work, and closing one makes room.
    let (status, _, _) = raw_get(&mut held[0], "/health").await;
    assert_eq!(status, 200);
    drop(held.pop());
    assert!(
        eventually(Duration::from_secs(3), || async {
            server.get("/health").await.0 == 200
        })
        .await,
        "no room after a connection closed"
    );
}
