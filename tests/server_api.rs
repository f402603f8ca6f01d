//! `omni-engine serve` end to end over HTTP, on the tiny Llama fixture (which has no EOS, so
//! every request generates exactly `max_tokens`): chat and completions, plain and streamed to
//! `data: [DONE]`, usage equal to the token counts, stop strings, n > 1, logprobs, hostile
//! inputs answered with OpenAI error JSON, `/metrics` with vLLM's names, and the built-in
//! default model answering a factual question.

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;

use common::*;
use serde_json::{Value, json};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_usage_counts_prompt_and_generated_tokens_with_logprobs() {
    let server = Server::tiny(&[]);
    let prompt_tokens = fixture_tokenizer().encode(PROMPT, true).unwrap().len();
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 7, "temperature": 0, "logprobs": 2}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], "tiny");
    assert_eq!(body["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(body["usage"]["completion_tokens"], 7);
    assert_eq!(body["usage"]["total_tokens"], prompt_tokens + 7);
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 7);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 7);
    for (top, sampled) in lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(lp["token_logprobs"].as_array().unwrap())
    {
        let top = top.as_object().unwrap();
        assert!((2..=3).contains(&top.len()), "{top:?}");
        assert!(sampled.as_f64().unwrap() <= 0.0);
    }
    // The same request with token ids as the prompt counts exactly those ids.
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 5);
    assert_eq!(body["usage"]["completion_tokens"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_chat_and_completions_match_the_plain_answers_and_end_with_done() {
    let server = Server::tiny(&[]);
    let messages = json!([{"role": "user", "content": "Hello there"}]);
    let prompt_tokens = fixture_tokenizer()
        .encode_chat(&messages, true)
        .unwrap()
        .len();
    let chat = json!({"messages": messages, "max_tokens": 9, "temperature": 0});
    let (status, plain) = server.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{plain}");
    assert_eq!(plain["object"], "chat.completion");
    assert_eq!(plain["choices"][0]["message"]["role"], "assistant");
    assert_eq!(plain["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(plain["usage"]["completion_tokens"], 9);

    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = server.sse("/v1/chat/completions", &streamed).await;
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(
        streamed_text(&chunks),
        plain["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("length")]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    assert_eq!(usage["completion_tokens"], 9);

    let cmpl = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0});
    let (_, plain) = server.post("/v1/completions", &cmpl).await;
    let mut streamed = cmpl.clone();
    streamed["stream"] = json!(true);
    let chunks = server.sse("/v1/completions", &streamed).await;
    assert_eq!(
        streamed_text(&chunks),
        plain["choices"][0]["text"].as_str().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_string_cuts_the_text_and_finishes_with_stop() {
    let server = Server::tiny(&[]);
    let req = json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0});
    let (_, body) = server.post("/v1/completions", &req).await;
    let full = body["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    assert!(chars.len() >= 8, "{full:?}");
    // A 2-character stop string from the middle; the answer ends before its first occurrence.
    let (start, _) = chars[chars.len() / 2];
    let end = chars
        .get(chars.len() / 2 + 2)
        .map_or(full.len(), |(i, _)| *i);
    let stop = &full[start..end];
    let expected = &full[..full.find(stop).unwrap()];

    let mut with_stop = req.clone();
    with_stop["stop"] = json!([stop]);
    let (status, body) = server.post("/v1/completions", &with_stop).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["text"], expected,
        "stop {stop:?} in {full:?}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() < 24);

    with_stop["stream"] = json!(true);
    let chunks = server.sse("/v1/completions", &with_stop).await;
    assert_eq!(streamed_text(&chunks), expected);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    // The stopped request freed its slot.
    assert!(
        eventually(std::time::Duration::from_secs(5), || async {
            server.metric("vllm:num_requests_running").await == 0.0
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_and_chat_logprobs_cover_every_generated_token() {
    let server = Server::tiny(&[]);
    let (status, body) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 5, "n": 3, "seed": 7}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
    }
    assert_eq!(body["usage"]["completion_tokens"], 15);

    let (status, body) = server
        .post(
            "/v1/chat/completions",
            &json!({
                "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 4, "n": 2, "logprobs": true, "top_logprobs": 3,
            }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8);
    for c in body["choices"].as_array().unwrap() {
        let content = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 4);
        for entry in content {
            assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
            assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 3);
        }
    }
}

/// One hostile request and the status it must get.
struct Case {
    what: &'static str,
    method: &'static str,
    path: &'static str,
    body: Vec<u8>,
    content_type: Option<&'static str>,
    key: Option<&'static str>,
    status: u16,
}

fn case(what: &'static str, path: &'static str, body: Value, status: u16) -> Case {
    Case {
        what,
        method: "POST",
        path,
        body: body.to_string().into_bytes(),
        content_type: Some("application/json"),
        key: Some("sekrit"),
        status,
    }
}

fn raw(what: &'static str, body: &[u8], content_type: Option<&'static str>, status: u16) -> Case {
    Case {
        what,
        method: "POST",
        path: "/v1/chat/completions",
        body: body.to_vec(),
        content_type,
        key: Some("sekrit"),
        status,
    }
}

fn hostile_cases() -> Vec<Case> {
    const CHAT: &str = "/v1/chat/completions";
    const CMPL: &str = "/v1/completions";
    let hi = json!([{"role": "user", "content": "hi"}]);
    let chat = |extra: Value| {
        let mut b = json!({"messages": hi, "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cmpl = |extra: Value| {
        let mut b = json!({"prompt": "hi", "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let mut nested = String::new();
    for _ in 0..10_000 {
        nested.push('[');
    }
    let nested: &'static str = Box::leak(nested.into_boxed_str());
    let long_prompt = "hello ".repeat(3000);
    vec![
        raw(
            "truncated JSON",
            b"{\"messages\": [",
            Some("application/json"),
            400,
        ),
        raw("empty body", b"", Some("application/json"), 400),
        raw(
            "not JSON at all",
            b"hello world",
            Some("application/json"),
            400,
        ),
        raw(
            "invalid UTF-8",
            b"{\"messages\": \"\xff\xfe\"}",
            Some("application/json"),
            400,
        ),
        raw(
            "JSON nested 10000 deep",
            nested.as_bytes(),
            Some("application/json"),
            400,
        ),
        raw("text/plain body", b"{}", Some("text/plain"), 415),
        case("array instead of object", CHAT, json!([1, 2, 3]), 400),
        case("messages missing", CHAT, json!({"max_tokens": 2}), 400),
        case("messages empty", CHAT, json!({"messages": []}), 400),
        case("messages is a string", CHAT, json!({"messages": "hi"}), 400),
        case(
            "message without role",
            CHAT,
            json!({"messages": [{"content": "hi"}]}),
            400,
        ),
        case(
            "temperature negative",
            CHAT,
            chat(json!({"temperature": -0.5})),
            400,
        ),
        case(
            "temperature a string",
            CHAT,
            chat(json!({"temperature": "hot"})),
            400,
        ),
        case("top_p above 1", CHAT, chat(json!({"top_p": 1.5})), 400),
        case("top_k -5", CHAT, chat(json!({"top_k": -5})), 400),
        case(
            "max_tokens negative",
            CHAT,
            chat(json!({"max_tokens": -1})),
            400,
        ),
        case("max_tokens zero", CHAT, chat(json!({"max_tokens": 0})), 400),
        case(
            "max_tokens past the context",
            CHAT,
            chat(json!({"max_tokens": 100_000})),
            400,
        ),
        case(
            "min_tokens above max_tokens",
            CHAT,
            chat(json!({"min_tokens": 5})),
            400,
        ),
        case("n zero", CHAT, chat(json!({"n": 0})), 400),
        case("n huge", CHAT, chat(json!({"n": 100_000})), 400),
        case(
            "frequency_penalty 5",
            CHAT,
            chat(json!({"frequency_penalty": 5.0})),
            400,
        ),
        case(
            "top_logprobs 21",
            CHAT,
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            400,
        ),
        case(
            "top_logprobs without logprobs",
            CHAT,
            chat(json!({"top_logprobs": 2})),
            400,
        ),
        case(
            "stream_options without stream",
            CHAT,
            chat(json!({"stream_options": {"include_usage": true}})),
            400,
        ),
        case("unknown model", CHAT, chat(json!({"model": "gpt-17"})), 404),
        case(
            "audio modality",
            CHAT,
            chat(json!({"modalities": ["audio"]})),
            400,
        ),
        case(
            "image content part",
            CHAT,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            400,
        ),
        case(
            "stop_token_ids outside the vocabulary",
            CHAT,
            chat(json!({"stop_token_ids": [4_000_000]})),
            400,
        ),
        case(
            "33 stop strings",
            CHAT,
            chat(json!({"stop": (0..33).map(|i| format!("s{i}")).collect::<Vec<_>>()})),
            400,
        ),
        case(
            "a 300-byte stop string",
            CMPL,
            cmpl(json!({"stop": "x".repeat(300)})),
            400,
        ),
        case(
            "prompt longer than the context",
            CMPL,
            cmpl(json!({"prompt": long_prompt})),
            400,
        ),
        case(
            "token id outside the vocabulary",
            CMPL,
            cmpl(json!({"prompt": [1, 2, 99_999]})),
            400,
        ),
        case("empty prompt list", CMPL, cmpl(json!({"prompt": []})), 400),
        case("empty prompt", CMPL, cmpl(json!({"prompt": ""})), 400),
        case(
            "prompt is an object",
            CMPL,
            cmpl(json!({"prompt": {"a": 1}})),
            400,
        ),
        case(
            "completions logprobs 50",
            CMPL,
            cmpl(json!({"logprobs": 50})),
            400,
        ),
        Case {
            key: None,
            ..case("no API key", CHAT, chat(json!({})), 401)
        },
        Case {
            key: Some("wrong"),
            ..case("wrong API key", CMPL, cmpl(json!({})), 401)
        },
        Case {
            method: "GET",
            ..case("GET on a POST route", CHAT, json!({}), 405)
        },
        case("unknown route", "/v1/embeddingz", json!({}), 404),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_openai_errors_and_the_server_keeps_answering() {
    let server = Server::tiny(&["--api-key", "sekrit"]);
    let cases = hostile_cases();
    assert!(cases.len() >= 25);
    for c in &cases {
        let mut req = match c.method {
            "GET" => server.http.get(server.url(c.path)),
            _ => server.http.post(server.url(c.path)).body(c.body.clone()),
        };
        if let Some(ct) = c.content_type {
            req = req.header("content-type", ct);
        }
        if let Some(key) = c.key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        assert_eq!(status, c.status, "{}: {text}", c.what);
        let body: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {text}", c.what));
        let err = &body["error"];
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}: {text}",
            c.what
        );
        assert!(err["type"].is_string(), "{}: {text}", c.what);
        assert!(
            err.get("param").is_some() && err.get("code").is_some(),
            "{}: {text}",
            c.what
        );
    }
    // Still serving, and the refused requests left nothing behind in the engine.
    let (status, body) = server
        .http
        .post(server.url("/v1/chat/completions"))
        .bearer_auth("sekrit")
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
        .send()
        .await
        .map(|r| (r.status().as_u16(), r))
        .unwrap();
    assert_eq!(status, 200);
    let body: Value = body.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 3);
    assert_eq!(
        server
            .metric_settles("vllm:num_requests_running", 0.0)
            .await,
        0.0
    );
    assert_eq!(
        server
            .metric_settles("vllm:num_requests_waiting", 0.0)
            .await,
        0.0
    );
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_models_use_vllm_names() {
    let server = Server::tiny(&["--num-gpu-blocks-override", "128", "--block-size", "16"]);
    let (status, _) = server
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 4}),
        )
        .await;
    assert_eq!(status, 200);
    let (status, models) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} missing from\n{text}"
        );
    }
    assert!(text.contains("model_name=\"tiny\""));
    assert!(text.contains("num_gpu_blocks=\"128\""), "{text}");
    assert_eq!(
        metric_value(&text, "vllm:generation_tokens_total"),
        Some(4.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_model_says_paris_is_the_capital_of_france() {
    if omni_gguf::default_model::locate().is_none() {
        println!(
            "SKIPPED: default model not cached at {} (run scripts/fetch-default-model.sh)",
            omni_gguf::default_model::cached_path().display()
        );
        return;
    }
    let server = Server::start(&[]);
    assert!(
        server.log().contains("built-in default model"),
        "{}",
        server.log()
    );
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            &json!({
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 24,
            }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let answer = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "{answer:?}");
}
