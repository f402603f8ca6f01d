//! Every endpoint against a fake engine: response shapes, usage, stop strings, n > 1, logprobs,
//! streaming to `[DONE]` on a real port, client disconnects, metrics.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{FAKE_QUEUE_TIME, FakeEngine, REPLY, app, call, config, sse_data};
use serde_json::{Value, json};

fn chat_body(extra: Value) -> String {
    let mut v = json!({"model": "test-model", "messages": [{"role": "user", "content": "Hi"}]});
    for (k, val) in extra.as_object().unwrap() {
        v[k] = val.clone();
    }
    v.to_string()
}

#[tokio::test]
async fn chat_completion_returns_reply_usage_and_stop_reason() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let (status, v, _) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body(json!({}))),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "test-model");
    assert!(v["created"].as_u64().unwrap() > 0);
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], REPLY);
    assert_eq!(choice["finish_reason"], "stop");
    // "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n": 1 + 5 + 2 + 1 + 1 + 1 + 10
    let prompt_len = engine.requests.lock().unwrap()[0].prompt_token_ids.len() as u64;
    assert_eq!(prompt_len, 21);
    assert_eq!(v["usage"]["prompt_tokens"], prompt_len);
    assert_eq!(v["usage"]["completion_tokens"], REPLY.len() as u64 + 1);
    assert_eq!(
        v["usage"]["total_tokens"],
        prompt_len + REPLY.len() as u64 + 1
    );
}

#[tokio::test]
async fn max_tokens_ends_with_length_and_sampling_fields_reach_the_engine() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let body = chat_body(
        json!({"max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "top_k": 40, "min_p": 0.1, "seed": 7, "presence_penalty": 0.5, "frequency_penalty": 0.25,
        "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [9], "ignore_eos": true,
        "modalities": ["text"], "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
    );
    let (status, v, _) = call(&app, "POST", "/v1/chat/completions", Some(&body), &[]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let req = engine.requests.lock().unwrap()[0].clone();
    let p = req.sampling_params;
    assert_eq!(
        (p.temperature, p.top_p, p.top_k, p.min_p),
        (0.5, 0.9, Some(40), 0.1)
    );
    assert_eq!((p.seed, p.max_tokens, p.min_tokens), (Some(7), Some(5), 2));
    assert_eq!(
        (
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty
        ),
        (0.5, 0.25, 1.1)
    );
    assert!(p.ignore_eos);
    assert_eq!(p.stop_token_ids, vec![9]);
    assert_eq!(
        req.prompt_token_ids.len(),
        21,
        "content parts render like a string"
    );
}

#[tokio::test]
async fn stop_string_truncates_text_and_aborts_engine_request() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let (status, v, _) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body(json!({"stop": "STOP"}))),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world. ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"]["completion_tokens"],
        "Hello world. STOP".len() as u64
    );
    assert_eq!(engine.aborted().len(), 1);
    // A list, and include_stop_str_in_output.
    let body = chat_body(json!({"stop": ["zzz", "world"], "include_stop_str_in_output": true}));
    let (_, v, _) = call(&app, "POST", "/v1/chat/completions", Some(&body), &[]).await;
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world");
}

#[tokio::test]
async fn n_greater_than_one_fans_out_to_n_engine_requests() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let (status, v, _) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body(json!({"n": 3, "seed": 1}))),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i as u64);
        assert_eq!(c["message"]["content"], REPLY);
    }
    assert_eq!(
        v["usage"]["completion_tokens"],
        3 * (REPLY.len() as u64 + 1)
    );
    let reqs = engine.requests.lock().unwrap();
    assert_eq!(reqs.len(), 3);
    let seeds: Vec<_> = reqs.iter().map(|r| r.sampling_params.seed).collect();
    assert_eq!(seeds, [Some(1), Some(2), Some(3)]);
}

#[tokio::test]
async fn chat_logprobs_have_openai_shape() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine, config());
    let body = chat_body(json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 3}));
    let (status, v, _) = call(&app, "POST", "/v1/chat/completions", Some(&body), &[]).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    assert_eq!(content[0]["token"], "H");
    assert_eq!(content[0]["logprob"], -0.5);
    assert_eq!(content[0]["bytes"], json!([72]));
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(content[0]["top_logprobs"][1]["token"], "b");
}

#[tokio::test]
async fn completions_accept_strings_lists_and_token_ids() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let body =
        json!({"model": "alias", "prompt": "Say", "max_tokens": 5, "logprobs": 1, "echo": true})
            .to_string();
    let (status, v, _) = call(&app, "POST", "/v1/completions", Some(&body), &[]).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "test-model");
    assert_eq!(v["choices"][0]["text"], "SayHello");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(lp["token_logprobs"][0], -0.5);
    assert_eq!(lp["text_offset"][0], 3);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
    );

    let body = json!({"prompt": ["a", "bb"], "max_tokens": 2, "n": 2}).to_string();
    let (status, v, _) = call(&app, "POST", "/v1/completions", Some(&body), &[]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 4);
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 8);

    let body = json!({"prompt": [10, 11, 12], "max_tokens": 1}).to_string();
    let (status, v, _) = call(&app, "POST", "/v1/completions", Some(&body), &[]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], "H");
    let body = json!({"prompt": [[10, 11], [12]], "max_tokens": 1}).to_string();
    let (status, v, _) = call(&app, "POST", "/v1/completions", Some(&body), &[]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn models_health_version_and_metrics_answer() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let (status, v, _) = call(&app, "GET", "/v1/models", None, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "test-model");
    assert_eq!(v["data"][1]["id"], "alias");
    assert_eq!(v["data"][0]["max_model_len"], 256);
    assert_eq!(call(&app, "GET", "/health", None, &[]).await.0, 200);
    let (status, v, _) = call(&app, "GET", "/version", None, &[]).await;
    assert_eq!(status, 200);
    assert!(v["version"].is_string());

    let queue_count = "vllm:request_queue_time_seconds_count{model_name=\"test-model\"}";
    let (_, _, text) = call(&app, "GET", "/metrics", None, &[]).await;
    assert!(text.contains(&format!("{queue_count} 0")), "{text}");
    call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&chat_body(json!({}))),
        &[],
    )
    .await;
    let (status, _, text) = call(&app, "GET", "/metrics", None, &[]).await;
    assert_eq!(status, 200);
    for want in [
        "vllm:num_requests_running{model_name=\"test-model\"} 3",
        "vllm:num_requests_waiting{model_name=\"test-model\"} 1",
        "vllm:kv_cache_usage_perc{model_name=\"test-model\"} 0.25",
        "vllm:cache_config_info{model_name=\"test-model\",block_size=\"16\",num_gpu_blocks=\"1024\"} 1",
        "vllm:prompt_tokens_total{model_name=\"test-model\"} 21",
        "vllm:generation_tokens_total{model_name=\"test-model\"} 23",
        "vllm:request_success_total{model_name=\"test-model\",finished_reason=\"stop\"} 1",
        "vllm:num_preemptions_total{model_name=\"test-model\"} 7",
        "vllm:prefix_cache_queries_total{model_name=\"test-model\"} 100",
        "vllm:prefix_cache_hits_total{model_name=\"test-model\"} 40",
        "vllm:time_to_first_token_seconds_bucket{le=\"0.001\",model_name=\"test-model\"}",
        "vllm:inter_token_latency_seconds_count{model_name=\"test-model\"} 22",
        "vllm:e2e_request_latency_seconds_count{model_name=\"test-model\"} 1",
        &format!("{queue_count} 1"),
        &format!(
            "vllm:request_queue_time_seconds_sum{{model_name=\"test-model\"}} {FAKE_QUEUE_TIME}"
        ),
        // FAKE_QUEUE_TIME (0.4 s) lands in the 0.5 bucket, not the 0.3 one.
        "vllm:request_queue_time_seconds_bucket{le=\"0.3\",model_name=\"test-model\"} 0",
        "vllm:request_queue_time_seconds_bucket{le=\"0.5\",model_name=\"test-model\"} 1",
        "vllm:request_prefill_time_seconds_count{model_name=\"test-model\"} 1",
        "vllm:request_decode_time_seconds_count{model_name=\"test-model\"} 1",
        "vllm:request_time_per_output_token_seconds_count{model_name=\"test-model\"} 1",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    // Time per output token: the decode time over the output tokens after the first (23
    // tokens: the reply and EOS).
    let sum = |name: &str| -> f64 {
        let key = format!("{name}_sum{{model_name=\"test-model\"}} ");
        let line = text.lines().find(|l| l.starts_with(&key)).unwrap();
        line[key.len()..].parse().unwrap()
    };
    let decode = sum("vllm:request_decode_time_seconds");
    let tpot = sum("vllm:request_time_per_output_token_seconds");
    assert!(
        (tpot * (REPLY.len() as f64) - decode).abs() <= 1e-9 * decode.max(1.0),
        "tpot {tpot} vs decode {decode} over {} tokens",
        REPLY.len()
    );
    // Cumulative engine counters are not double counted on the next scrape.
    let (_, _, text) = call(&app, "GET", "/metrics", None, &[]).await;
    assert!(text.contains("vllm:num_preemptions_total{model_name=\"test-model\"} 7"));

    engine.dead.store(true, std::sync::atomic::Ordering::SeqCst);
    let (status, v, _) = call(&app, "GET", "/health", None, &[]).await;
    assert_eq!(status, 503);
    assert_eq!(v["error"]["type"], "server_error");
}

async fn spawn_server(engine: Arc<FakeEngine>) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let config = config();
    let limits = config.connections.clone();
    let app = app(engine, config);
    tokio::spawn(omni_server::serve_on(listener, app, limits, async move {
        let _ = rx.await;
    }));
    (format!("http://{addr}"), tx)
}

#[tokio::test]
async fn streaming_chat_on_a_real_port_ends_with_usage_and_done() {
    let engine = Arc::new(FakeEngine::default());
    let (base, _stop) = spawn_server(engine).await;
    let client = reqwest::Client::new();
    let body = chat_body(
        json!({"stream": true, "stream_options": {"include_usage": true}, "stop": "STOP"}),
    );
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = resp.text().await.unwrap();
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"].get(0)?["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(content, "Hello world. ", "stop string never streamed");
    let finish: Vec<_> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["finish_reason"].as_str())
        .collect();
    assert_eq!(finish, ["stop"]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    assert_eq!(usage["completion_tokens"], "Hello world. STOP".len() as u64);
    assert!(chunks[1]["usage"].is_null());
}

#[tokio::test]
async fn streaming_completion_with_n_streams_every_choice() {
    let engine = Arc::new(FakeEngine::default());
    let (base, _stop) = spawn_server(engine).await;
    let body = json!({"prompt": "x", "stream": true, "n": 2, "max_tokens": 4}).to_string();
    let text = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let mut texts = [String::new(), String::new()];
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert!(v.get("usage").is_none());
        let c = &v["choices"][0];
        texts[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
    }
    assert_eq!(texts, ["Hell", "Hell"]);
}

#[tokio::test]
async fn dropped_stream_aborts_engine_request() {
    let engine = Arc::new(FakeEngine::slow(20));
    let (base, _stop) = spawn_server(engine.clone()).await;
    let body = chat_body(json!({"stream": true}));
    let mut resp = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("assistant"));
    drop(resp);
    let mut aborted = false;
    for _ in 0..100 {
        if !engine.aborted().is_empty() {
            aborted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(aborted, "the engine request was not aborted");
}

#[tokio::test]
async fn dropped_non_streaming_request_aborts_engine_request() {
    let engine = Arc::new(FakeEngine::slow(50));
    let app = app(engine.clone(), config());
    let body = chat_body(json!({}));
    let fut = call(&app, "POST", "/v1/chat/completions", Some(&body), &[]);
    assert!(
        tokio::time::timeout(Duration::from_millis(150), fut)
            .await
            .is_err()
    );
    assert_eq!(engine.aborted().len(), 1);
}
