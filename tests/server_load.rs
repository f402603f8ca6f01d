//! `omni-engine serve` under load and under client misbehaviour: 200 concurrent streams all
//! finish with exact token counts, and a client that hangs up mid-stream gets its request
//! aborted and its KV blocks freed (visible in `/metrics`).

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use serde_json::json;

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
