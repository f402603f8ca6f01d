//! The listener on a real port (127.0.0.1): a request in flight (a slow answer, an SSE stream
//! its client stops reading for a while) is never cut by the keep-alive or header timeouts, and
//! shutdown closes idle connections at once while a busy one finishes its response.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{FakeEngine, app, config, sse_data};
use futures::StreamExt;
use omni_server::ConnectionLimits;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CHAT: &str = "/v1/chat/completions";

async fn spawn(
    engine: Arc<FakeEngine>,
    limits: ConnectionLimits,
) -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(omni_server::serve_on(
        listener,
        app(engine, config()),
        limits,
        async move {
            let _ = rx.await;
        },
    ));
    (addr, tx, served)
}

fn chat(stream: bool) -> String {
    json!({"messages": [{"role": "user", "content": "Hi"}], "stream": stream}).to_string()
}

/// Waits up to `limit` for the peer to close `s` (EOF or reset); whether it did.
async fn closes_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_outlive_the_keep_alive_and_header_timeouts() {
    let limits = ConnectionLimits {
        timeout_keep_alive: Duration::from_millis(200),
        header_read_timeout: Duration::from_millis(200),
        limit_concurrency: 8,
    };
    // 23 outputs 40 ms apart: each answer takes about 0.9 s, over 4 timeouts.
    let (addr, _stop, _served) = spawn(Arc::new(FakeEngine::slow(40)), limits).await;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}{CHAT}");

    let t0 = Instant::now();
    let resp = client
        .post(&url)
        .header("content-type", "application/json")
        .body(chat(false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], common::REPLY);
    assert!(
        t0.elapsed() > Duration::from_millis(800),
        "{:?}",
        t0.elapsed()
    );

    // A stream whose client reads nothing for 3 timeouts after the first chunk.
    let resp = client
        .post(&url)
        .header("content-type", "application/json")
        .body(chat(true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = Box::pin(resp.bytes_stream());
    let mut text = body.next().await.unwrap().unwrap().to_vec();
    tokio::time::sleep(Duration::from_millis(600)).await;
    while let Some(chunk) = body.next().await {
        text.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(text).unwrap();
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let content: String = data[..data.len() - 1]
        .iter()
        .filter_map(|d| {
            let v: Value = serde_json::from_str(d).unwrap();
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(content, common::REPLY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_idle_connections_at_once_and_lets_a_busy_one_finish() {
    // Timeouts far away: whatever closes below is the shutdown.
    let limits = ConnectionLimits {
        timeout_keep_alive: Duration::from_secs(60),
        header_read_timeout: Duration::from_secs(60),
        limit_concurrency: 16,
    };
    let (addr, stop, served) = spawn(Arc::new(FakeEngine::slow(40)), limits).await;
    let mut idle = Vec::new();
    for i in 0..6 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        if i % 2 == 1 {
            s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                .await
                .unwrap();
        }
        idle.push(s);
    }
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}{CHAT}"))
        .header("content-type", "application/json")
        .body(chat(true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = Box::pin(resp.bytes_stream());
    let mut text = body.next().await.unwrap().unwrap().to_vec();

    stop.send(()).unwrap();
    for (i, s) in idle.iter_mut().enumerate() {
        assert!(
            closes_within(s, Duration::from_secs(2)).await,
            "idle connection {i} still open 2 s after shutdown"
        );
    }
    while let Some(chunk) = body.next().await {
        text.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(text).unwrap();
    assert_eq!(
        sse_data(&text).last().map(String::as_str),
        Some("[DONE]"),
        "{text}"
    );
    tokio::time::timeout(Duration::from_secs(2), served)
        .await
        .expect("serve_on still running 2 s after its last connection ended")
        .unwrap();
    assert!(TcpStream::connect(addr).await.is_err(), "still accepting");
}
