//! The Gateway API Inference Extension's model-server protocol, end to end: `omni-engine serve`
//! on the tiny fixture answers requests while `/metrics` is scraped and parsed as a Prometheus
//! scraper parses it (tests/prometheus_text.rs). The endpoint picker reads the queue and running
//! gauges, the KV-cache usage as a 0..1 gauge and the block size and block count off
//! `vllm:cache_config_info` (docs/proposals/003-model-server-protocol of
//! kubernetes-sigs/gateway-api-inference-extension); llm-d-inference-sim, the simulator the
//! extension's examples run, also emits the latency histograms and prefix-cache counters checked
//! here, under these names and types. (The simulator's docs/metrics.md also lists
//! `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_params_max_tokens`,
//! `vllm:max_num_generation_tokens`, `vllm:request_inference_time_seconds`, the deprecated
//! `vllm:time_per_output_token_seconds` and `vllm:lora_requests_info`, which omni-engine does not
//! export; the endpoint picker reads none of them.) The Grafana dashboard in deploy/k8s/ must
//! query only names this scrape has.

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;
#[path = "prometheus_text.rs"]
mod prometheus_text;

use std::time::Duration;

use common::*;
use prometheus_text::{Exposition, MetricType, check_histogram, parse};
use serde_json::json;

const NUM_GPU_BLOCKS: u64 = 256;
const BLOCK_SIZE: u64 = 16;
/// Prompt tokens of the long request: 19 blocks of 16, so while it runs at least 19 of the 256
/// blocks are in use (0.074 of the cache; as a percentage it would read 7.4). With its 3700
/// output tokens it stays within the 256 blocks (4096 tokens, also the longest model length).
const LONG_PROMPT: usize = 300;

/// The gauges the endpoint picker reads.
const GAUGES: [&str; 4] = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
];
/// The simulator's latency histograms (TTFT, TPOT, ITL, e2e, queue, prefill, decode).
const HISTOGRAMS: [&str; 7] = [
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
];
/// The simulator's prefix-cache counters, as sample names.
const COUNTERS: [&str; 2] = [
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
];

async fn scrape(server: &Server) -> Exposition {
    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, 200);
    parse(&text).unwrap_or_else(|e| panic!("/metrics does not parse: {e}\n{text}"))
}

/// The one sample of gauge `name` (the unlabelled-by-stage series of model "tiny").
fn gauge(exp: &Exposition, name: &str) -> f64 {
    let family = exp
        .family(name)
        .unwrap_or_else(|| panic!("no {name} family"));
    assert_eq!(family.kind, MetricType::Gauge, "{name}");
    let samples = family.named(name);
    assert_eq!(samples.len(), 1, "{name}: {samples:?}");
    assert_eq!(samples[0].labels["model_name"], "tiny", "{name}");
    samples[0].value
}

/// The protocol's checks on one scrape: types, the KV usage range, the info labels.
fn check_protocol(exp: &Exposition) {
    for name in GAUGES {
        gauge(exp, name);
    }
    let usage = gauge(exp, "vllm:kv_cache_usage_perc");
    assert!((0.0..=1.0).contains(&usage), "kv_cache_usage_perc {usage}");
    let info = &exp.samples("vllm:cache_config_info")[0];
    assert_eq!(info.value, 1.0, "an info gauge is 1");
    let label = |k: &str| -> u64 {
        let v = info.labels.get(k).unwrap_or_else(|| panic!("no {k} label"));
        v.parse()
            .unwrap_or_else(|_| panic!("{k}={v:?} is not an integer"))
    };
    assert_eq!(label("block_size"), BLOCK_SIZE);
    assert_eq!(label("num_gpu_blocks"), NUM_GPU_BLOCKS);
    for name in HISTOGRAMS {
        let family = exp
            .family(name)
            .unwrap_or_else(|| panic!("no {name} family"));
        assert_eq!(family.kind, MetricType::Histogram, "{name}");
        check_histogram(family).unwrap();
    }
    for name in COUNTERS {
        let family = exp
            .family_of_sample(name)
            .unwrap_or_else(|| panic!("no family for {name}"));
        assert_eq!(family.kind, MetricType::Counter, "{name}");
        assert_eq!(exp.samples(name).len(), 1, "{name}");
    }
}

fn histogram_count(exp: &Exposition, name: &str) -> f64 {
    check_histogram(exp.family(name).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_the_inference_gateway_model_server_protocol() {
    let server = Server::tiny(&[
        "--max-model-len",
        "4096",
        "--num-gpu-blocks-override",
        &NUM_GPU_BLOCKS.to_string(),
        "--block-size",
        &BLOCK_SIZE.to_string(),
    ]);
    let idle = scrape(&server).await;
    check_protocol(&idle);
    assert_eq!(gauge(&idle, "vllm:num_requests_running"), 0.0);
    assert_eq!(gauge(&idle, "vllm:num_requests_waiting"), 0.0);
    assert_eq!(gauge(&idle, "vllm:kv_cache_usage_perc"), 0.0);

    // A long request holds its blocks while the gauges are read.
    let prompt: Vec<u32> = (0..LONG_PROMPT as u32).map(|i| 1 + i % 300).collect();
    let resp = server
        .http
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 3700, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let busy = loop {
        let exp = scrape(&server).await;
        if gauge(&exp, "vllm:num_requests_running") == 1.0 {
            break exp;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the long request never showed as running"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    check_protocol(&busy);
    let usage = gauge(&busy, "vllm:kv_cache_usage_perc");
    let held = usage * NUM_GPU_BLOCKS as f64;
    let prompt_blocks = LONG_PROMPT.div_ceil(BLOCK_SIZE as usize) as f64;
    assert!(
        held >= prompt_blocks && (held - held.round()).abs() < 1e-3,
        "kv usage {usage} = {held} of {NUM_GPU_BLOCKS} blocks while a {LONG_PROMPT}-token prompt runs"
    );
    drop(resp); // the server aborts the request
    assert_eq!(
        server
            .metric_settles("vllm:num_requests_running", 0.0)
            .await,
        0.0
    );

    // Two short requests finish; the second's prompt is the first's, a prefix-cache hit.
    for _ in 0..2 {
        let (status, body) = server
            .post(
                "/v1/completions",
                &json!({"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], "max_tokens": 6}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let done = scrape(&server).await;
    check_protocol(&done);
    assert_eq!(gauge(&done, "vllm:num_requests_waiting"), 0.0);
    for name in [
        "vllm:time_to_first_token_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
    ] {
        let n = histogram_count(&done, name);
        assert!(
            n >= 2.0,
            "{name} has {n} observations after 2 finished requests"
        );
    }
    // 6 tokens each: 5 gaps per short request, and the long one's.
    assert!(histogram_count(&done, "vllm:inter_token_latency_seconds") >= 10.0);
    let queries = exp_value(&done, "vllm:prefix_cache_queries_total");
    let hits = exp_value(&done, "vllm:prefix_cache_hits_total");
    assert!(
        queries >= (LONG_PROMPT + 2 * 17) as f64,
        "prefix cache queries {queries}"
    );
    assert!(
        hits > 0.0 && hits <= queries,
        "prefix cache hits {hits} of {queries}"
    );

    // The Grafana dashboard queries only what this scrape has.
    let names = dashboard_metric_names();
    assert!(names.len() >= 10, "{names:?}");
    for name in &names {
        assert!(
            done.family_of_sample(name).is_some(),
            "deploy/k8s/grafana-dashboard.json queries {name}, which /metrics does not export"
        );
    }
}

/// Every `vllm:...` name in the dashboard's queries.
fn dashboard_metric_names() -> std::collections::BTreeSet<String> {
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/k8s/grafana-dashboard.json");
    let path = if built.is_file() {
        built
    } else {
        "deploy/k8s/grafana-dashboard.json".into()
    };
    let text = std::fs::read_to_string(&path).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    let mut stack = vec![&dashboard];
    while let Some(v) = stack.pop() {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", serde_json::Value::String(e)) => exprs.push(e),
                        _ => stack.push(v),
                    }
                }
            }
            serde_json::Value::Array(a) => stack.extend(a),
            _ => {}
        }
    }
    let mut names = std::collections::BTreeSet::new();
    for e in exprs {
        for (i, _) in e.match_indices("vllm:") {
            let rest = &e[i..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            names.insert(rest[..end].to_string());
        }
    }
    names
}

fn exp_value(exp: &Exposition, sample: &str) -> f64 {
    exp.samples(sample)[0].value
}
