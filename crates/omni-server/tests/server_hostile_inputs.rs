//! Malformed and hostile inputs: each gets the right 4xx/5xx in OpenAI's error shape, and the
//! server keeps answering afterwards.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::{FakeEngine, app, call, config, sse_data};
use serde_json::Value;

const CHAT: &str = "/v1/chat/completions";
const CMPL: &str = "/v1/completions";

fn assert_openai_error(v: &Value, ctx: &str) {
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{ctx}: {v}"
    );
    assert!(e["type"].is_string(), "{ctx}: {v}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{ctx}: {v}"
    );
}

#[tokio::test]
async fn malformed_and_out_of_range_requests_get_4xx_and_server_keeps_serving() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let msgs = r#""messages":[{"role":"user","content":"Hi"}]"#;
    let big = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(100 * 1024));
    let long_prompt = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(300));
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        (CHAT, "{".into(), 400, None),
        (CHAT, "not json".into(), 400, None),
        (CHAT, "".into(), 400, None),
        (CHAT, "[]".into(), 400, None),
        (CHAT, r#"{"model":"test-model"}"#.into(), 400, None),
        (CHAT, r#"{"messages":"hello"}"#.into(), 400, None),
        (CHAT, r#"{"messages":[]}"#.into(), 400, Some("messages")),
        (CHAT, r#"{"messages":[{"content":"x"}]}"#.into(), 400, None),
        (CHAT, format!(r#"{{"model":"nope",{msgs}}}"#), 404, Some("model")),
        (CHAT, format!(r#"{{"temperature":"hot",{msgs}}}"#), 400, None),
        (CHAT, format!(r#"{{"temperature":-1,{msgs}}}"#), 400, Some("temperature")),
        (CHAT, format!(r#"{{"temperature":1e300,{msgs}}}"#), 400, Some("temperature")),
        (CHAT, format!(r#"{{"top_p":0,{msgs}}}"#), 400, Some("top_p")),
        (CHAT, format!(r#"{{"top_p":1.5,{msgs}}}"#), 400, Some("top_p")),
        (CHAT, format!(r#"{{"top_k":-5,{msgs}}}"#), 400, Some("top_k")),
        (CHAT, format!(r#"{{"min_p":2,{msgs}}}"#), 400, Some("min_p")),
        (CHAT, format!(r#"{{"presence_penalty":3,{msgs}}}"#), 400, Some("presence_penalty")),
        (CHAT, format!(r#"{{"frequency_penalty":-3,{msgs}}}"#), 400, Some("frequency_penalty")),
        (CHAT, format!(r#"{{"repetition_penalty":0,{msgs}}}"#), 400, Some("repetition_penalty")),
        (CHAT, format!(r#"{{"max_tokens":0,{msgs}}}"#), 400, Some("max_tokens")),
        (CHAT, format!(r#"{{"max_tokens":-1,{msgs}}}"#), 400, None),
        (CHAT, format!(r#"{{"max_tokens":1.5,{msgs}}}"#), 400, None),
        (CHAT, format!(r#"{{"max_tokens":100000,{msgs}}}"#), 400, Some("messages")),
        (CHAT, format!(r#"{{"max_tokens":4294967295,{msgs}}}"#), 400, Some("messages")),
        (CHAT, format!(r#"{{"max_tokens":5,"min_tokens":6,{msgs}}}"#), 400, Some("min_tokens")),
        (CHAT, format!(r#"{{"n":0,{msgs}}}"#), 400, Some("n")),
        (CHAT, format!(r#"{{"n":100000,{msgs}}}"#), 400, Some("n")),
        (CHAT, format!(r#"{{"stop":5,{msgs}}}"#), 400, None),
        (CHAT, format!(r#"{{"stop_token_ids":[99999999],{msgs}}}"#), 400, Some("stop_token_ids")),
        (CHAT, format!(r#"{{"top_logprobs":5,{msgs}}}"#), 400, Some("top_logprobs")),
        (CHAT, format!(r#"{{"logprobs":true,"top_logprobs":50,{msgs}}}"#), 400, Some("top_logprobs")),
        (CHAT, format!(r#"{{"modalities":["audio"],{msgs}}}"#), 400, Some("modalities")),
        (CHAT, format!(r#"{{"modalities":["smell"],{msgs}}}"#), 400, Some("modalities")),
        (CHAT, format!(r#"{{"stream_options":{{"include_usage":true}},{msgs}}}"#), 400, Some("stream_options")),
        // A text-only model: media parts are refused by modality, before any fetch.
        (CHAT, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://127.0.0.1:9/x.png"}}]}]}"#.into(), 400, Some("messages[0].content[0]")),
        (CHAT, r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]}]}"#.into(), 400, Some("messages[0].content[1]")),
        (CHAT, r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"x"}]}]}"#.into(), 400, Some("messages[0].content[0].image_url")),
        (CHAT, r#"{"messages":[{"role":"user","content":[{"type":"smell"}]}]}"#.into(), 400, Some("messages[0].content")),
        (CHAT, r#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#.into(), 400, Some("messages[0].content")),
        (CMPL, r#"{"prompt":""}"#.into(), 400, Some("prompt")),
        (CMPL, r#"{"prompt":[]}"#.into(), 400, Some("prompt")),
        (CMPL, r#"{"prompt":[1,2,999999]}"#.into(), 400, Some("prompt")),
        (CMPL, r#"{"prompt":[-1]}"#.into(), 400, None),
        (CMPL, r#"{"prompt":{"a":1}}"#.into(), 400, None),
        (CMPL, r#"{"prompt":"x","logprobs":21}"#.into(), 400, Some("logprobs")),
        (CMPL, r#"{"prompt":"x","seed":"abc"}"#.into(), 400, None),
        (CMPL, long_prompt, 400, Some("prompt")),
        (CMPL, r#"{"prompt":["a","b","c","d","e","f","g","h","i"],"n":128}"#.into(), 400, Some("prompt")),
        (CMPL, big, 413, None),
    ];
    assert!(cases.len() >= 25);
    for (path, body, want, param) in &cases {
        let (status, v, text) = call(&app, "POST", path, Some(body), &[]).await;
        let ctx = format!("{path} {}", &body[..body.len().min(120)]);
        assert_eq!(status, *want, "{ctx}: {text}");
        assert_openai_error(&v, &ctx);
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], *p, "{ctx}: {v}");
        }
        // Still serving.
        let (ok, _, _) = call(&app, "GET", "/health", None, &[]).await;
        assert_eq!(ok, 200, "after {ctx}");
    }
    assert!(
        engine.requests.lock().unwrap().is_empty(),
        "no bad request reached the engine"
    );
    let body = format!(r#"{{{msgs},"max_tokens":2}}"#);
    let (status, v, _) = call(&app, "POST", CHAT, Some(&body), &[]).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test]
async fn stop_lists_beyond_32_strings_or_256_bytes_get_a_400_naming_stop() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let body = |path: &str, stop: Value| {
        let mut b = if path == CHAT {
            serde_json::json!({"messages": [{"role": "user", "content": "Hi"}]})
        } else {
            serde_json::json!({"prompt": "Hi"})
        };
        b["max_tokens"] = 2.into();
        b["stop"] = stop;
        b.to_string()
    };
    let many: Vec<String> = (0..33).map(|i| format!("stop-{i}")).collect();
    let long = "é".repeat(129); // 258 bytes, 129 characters
    for path in [CHAT, CMPL] {
        for (what, stop) in [
            ("33 strings", serde_json::json!(many)),
            ("a 258-byte string", serde_json::json!(long)),
            (
                "a 258-byte string in a list",
                serde_json::json!(["\n", long]),
            ),
        ] {
            let (status, v, text) = call(&app, "POST", path, Some(&body(path, stop)), &[]).await;
            assert_eq!(status, 400, "{path} {what}: {text}");
            assert_openai_error(&v, what);
            assert_eq!(v["error"]["param"], "stop", "{path} {what}: {v}");
        }
        // At the bounds: 32 strings of 256 bytes are accepted.
        let most: Vec<String> = (0..32).map(|i| format!("{i:0>256}")).collect();
        let (status, v, _) = call(
            &app,
            "POST",
            path,
            Some(&body(path, serde_json::json!(most))),
            &[],
        )
        .await;
        assert_eq!(status, 200, "{path} at the bounds: {v}");
    }
    assert_eq!(
        engine.requests.lock().unwrap().len(),
        2,
        "only the two at the bounds ran"
    );
}

#[tokio::test]
async fn a_prompt_past_the_context_is_named_the_prompt_and_messages_the_messages() {
    let app = app(Arc::new(FakeEngine::default()), config());
    // max_model_len is 256; one token per byte.
    let prompt = "a".repeat(300);
    for body in [
        serde_json::json!({"prompt": prompt}),
        serde_json::json!({"prompt": ["short", prompt]}),
        serde_json::json!({"prompt": "short", "max_tokens": 1000}),
    ] {
        let (status, v, text) = call(&app, "POST", CMPL, Some(&body.to_string()), &[]).await;
        assert_eq!(status, 400, "{text}");
        assert_eq!(v["error"]["param"], "prompt", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("in the prompt") && message.contains("length of the prompt"),
            "{message}"
        );
        assert!(!message.contains("messages"), "{message}");
    }
    let chat = serde_json::json!({"messages": [{"role": "user", "content": prompt}]});
    let (status, v, _) = call(&app, "POST", CHAT, Some(&chat.to_string()), &[]).await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["param"], "messages", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("in the messages"), "{message}");
}

#[tokio::test]
async fn wrong_routes_methods_and_content_types_get_openai_errors() {
    let app = app(Arc::new(FakeEngine::default()), config());
    for (method, path, want) in [
        ("GET", "/v1/nope", 404),
        ("GET", CHAT, 405),
        ("DELETE", "/v1/models", 405),
    ] {
        let (status, v, _) = call(&app, method, path, None, &[]).await;
        assert_eq!(status, want, "{method} {path}");
        assert_openai_error(&v, path);
    }
    let (status, v, _) = call(
        &app,
        "POST",
        CHAT,
        Some("{}"),
        &[("content-type", "text/plain")],
    )
    .await;
    assert!(status == 415 || status == 400, "{status}");
    assert_openai_error(&v, "content-type");
}

#[tokio::test]
async fn api_key_is_required_on_v1_routes_only() {
    let cfg = omni_server::ServerConfig {
        api_key: Some("sk-secret".into()),
        ..config()
    };
    let app = app(Arc::new(FakeEngine::default()), cfg);
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":1}"#;
    for headers in [
        vec![],
        vec![("authorization", "Bearer wrong")],
        vec![("authorization", "sk-secret")],
    ] {
        let (status, v, _) = call(&app, "POST", CHAT, Some(body), &headers).await;
        assert_eq!(status, 401, "{headers:?}");
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let (status, _, _) = call(&app, "GET", "/v1/models", None, &[]).await;
    assert_eq!(status, 401);
    let (status, _, _) = call(
        &app,
        "POST",
        CHAT,
        Some(body),
        &[("authorization", "Bearer sk-secret")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(call(&app, "GET", "/health", None, &[]).await.0, 200);
    assert_eq!(call(&app, "GET", "/metrics", None, &[]).await.0, 200);
}

#[tokio::test]
async fn dead_engine_is_503_and_overloaded_engine_is_429() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let body = r#"{"messages":[{"role":"user","content":"Hi"}]}"#;
    engine.overloaded.store(true, Ordering::SeqCst);
    let (status, v, _) = call(&app, "POST", CHAT, Some(body), &[]).await;
    assert_eq!(status, 429);
    assert_eq!(v["error"]["type"], "rate_limit_error");
    engine.overloaded.store(false, Ordering::SeqCst);
    engine.dead.store(true, Ordering::SeqCst);
    let (status, v, _) = call(&app, "POST", CMPL, Some(r#"{"prompt":"x"}"#), &[]).await;
    assert_eq!(status, 503);
    assert_openai_error(&v, "dead");
    engine.dead.store(false, Ordering::SeqCst);
    assert_eq!(call(&app, "POST", CHAT, Some(body), &[]).await.0, 200);
}

/// An engine whose request streams fail mid-way.
struct FailingEngine(FakeEngine);

impl omni_server::EngineClient for FailingEngine {
    fn add_request(
        &self,
        req: omni_protocol::EngineCoreRequest,
    ) -> Result<omni_server::OutputReceiver, omni_server::EngineError> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let _ = tx.send(Ok(omni_protocol::EngineCoreOutput {
            request_id: req.request_id,
            new_token_ids: vec![3 + u32::from(b'A')],
            new_logprobs: Vec::new(),
            finish_reason: None,
            stop_reason: None,
            num_cached_tokens: 0,
            queue_time: None,
            text_finish_reason: None,
            audio: None,
        }));
        let _ = tx.send(Err(omni_server::EngineError::Dead {
            cause: "worker 1 exited".into(),
        }));
        Ok(rx)
    }
    fn abort(&self, ids: &[String]) {
        self.0.abort(ids)
    }
    fn stats(&self) -> omni_protocol::SchedulerStats {
        self.0.stats()
    }
    fn is_healthy(&self) -> Result<(), String> {
        Ok(())
    }
    fn cache_info(&self) -> omni_server::CacheInfo {
        self.0.cache_info()
    }
}

#[tokio::test]
async fn engine_failure_mid_stream_is_one_error_event_then_done() {
    let app = omni_server::router(
        config(),
        Arc::new(FailingEngine(FakeEngine::default())),
        common::tokenizer(),
    );
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"stream":true}"#;
    let (status, _, text) = call(&app, "POST", CHAT, Some(body), &[]).await;
    assert_eq!(status, 200);
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(err["error"]["code"], 503);
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("worker 1")
    );
    let (status, v, _) = call(
        &app,
        "POST",
        CHAT,
        Some(r#"{"messages":[{"role":"user","content":"Hi"}]}"#),
        &[],
    )
    .await;
    assert_eq!(status, 503);
    assert_openai_error(&v, "non-streaming failure");
}
