//! vLLM's `/tokenize` and `/detokenize`: the text and chat forms, `add_special_tokens`,
//! `return_token_strs`, the chat prompt equal to a chat completion's, and every error in OpenAI's
//! shape.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{FakeEngine, app, call, config, text_ids, tokenizer_with_bos};
use serde_json::{Value, json};

async fn post(app: &axum::Router, path: &str, body: Value) -> (u16, Value) {
    let (status, v, _) = call(app, "POST", path, Some(&body.to_string()), &[]).await;
    (status, v)
}

fn assert_error(status: u16, v: &Value, want: u16, param: Option<&str>, ctx: &str) {
    assert_eq!(status, want, "{ctx}: {v}");
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{ctx}: {v}"
    );
    assert!(
        e["type"].is_string() && e.get("code").is_some(),
        "{ctx}: {v}"
    );
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{ctx}: {v}");
    }
}

#[tokio::test]
async fn tokenize_prompt_returns_vllms_fields() {
    let app = app(Arc::new(FakeEngine::default()), config());
    let (status, v) = post(
        &app,
        "/tokenize",
        json!({"model": "test-model", "prompt": "Hi there"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let ids = text_ids("Hi there");
    assert_eq!(
        v,
        json!({"count": ids.len(), "max_model_len": 256, "tokens": ids, "token_strs": null})
    );
    // The model is optional, and an alias is as good as the first name.
    let (status, v) = post(&app, "/tokenize", json!({"prompt": "Hi"})).await;
    assert_eq!((status, v["count"].as_u64()), (200, Some(2)), "{v}");
    let (status, _) = post(&app, "/tokenize", json!({"model": "alias", "prompt": "Hi"})).await;
    assert_eq!(status, 200);
    // An empty prompt is zero tokens, not an error.
    let (status, v) = post(&app, "/tokenize", json!({"prompt": ""})).await;
    assert_eq!((status, v["count"].as_u64()), (200, Some(0)), "{v}");
}

#[tokio::test]
async fn return_token_strs_gives_the_vocabulary_strings() {
    let app = app(Arc::new(FakeEngine::default()), config());
    let (status, v) = post(
        &app,
        "/tokenize",
        json!({"prompt": "a b", "return_token_strs": true}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    // Byte-level: the space is the vocabulary's `Ġ`.
    assert_eq!(v["token_strs"], json!(["a", "Ġ", "b"]));
    let (_, v) = post(
        &app,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "a"}], "return_token_strs": true}),
    )
    .await;
    let strs = v["token_strs"].as_array().unwrap();
    assert_eq!(strs.len() as u64, v["count"].as_u64().unwrap());
    assert_eq!(strs[0], "<|im_start|>");
}

#[tokio::test]
async fn add_special_tokens_defaults_to_true_for_prompts_and_false_for_messages() {
    let app = omni_server::router(
        config(),
        Arc::new(FakeEngine::default()),
        tokenizer_with_bos(),
    );
    let ids = text_ids("Hi");
    let (_, v) = post(&app, "/tokenize", json!({"prompt": "Hi"})).await;
    assert_eq!(v["tokens"], json!([0, ids[0], ids[1]]), "{v}");
    let (_, v) = post(
        &app,
        "/tokenize",
        json!({"prompt": "Hi", "add_special_tokens": false}),
    )
    .await;
    assert_eq!(v["tokens"], json!(ids), "{v}");

    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let (_, plain) = post(&app, "/tokenize", json!({"messages": msgs})).await;
    assert_eq!(
        plain["tokens"][0], 1,
        "the template's <|im_start|> comes first: {plain}"
    );
    let (_, with) = post(
        &app,
        "/tokenize",
        json!({"messages": msgs, "add_special_tokens": true}),
    )
    .await;
    assert_eq!(with["tokens"][0], 0, "{with}");
    assert_eq!(
        with["count"].as_u64().unwrap(),
        plain["count"].as_u64().unwrap() + 1
    );
}

#[tokio::test]
async fn chat_form_is_the_prompt_a_chat_completion_gets() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), config());
    let msgs = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
    ]);
    let (status, v, _) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&json!({"messages": msgs, "max_tokens": 1}).to_string()),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let served = engine.requests.lock().unwrap()[0].prompt_token_ids.clone();
    let (status, v) = post(&app, "/tokenize", json!({"messages": msgs})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["tokens"], json!(served));
    assert_eq!(v["count"], served.len());

    // Without the generation prompt the assistant header is missing.
    let (_, bare) = post(
        &app,
        "/tokenize",
        json!({"messages": msgs, "add_generation_prompt": false}),
    )
    .await;
    let header = text_ids("assistant\n").len() + 1;
    assert_eq!(
        bare["count"].as_u64().unwrap() as usize,
        served.len() - header
    );
}

#[tokio::test]
async fn continue_final_message_leaves_the_last_message_open() {
    let app = app(Arc::new(FakeEngine::default()), config());
    let msgs = json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Sure,"}
    ]);
    for body in [
        json!({"messages": msgs, "continue_final_message": true, "add_generation_prompt": false}),
        json!({"messages": msgs, "continue_final_message": true}),
    ] {
        let (status, v) = post(&app, "/tokenize", body).await;
        assert_eq!(status, 200, "{v}");
        let tokens: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
        assert!(tokens.ends_with(&text_ids("assistant\nSure,")), "{v}");
    }
    let (status, v) = post(
        &app,
        "/tokenize",
        json!({"messages": msgs, "continue_final_message": true, "add_generation_prompt": true}),
    )
    .await;
    assert_error(status, &v, 400, Some("continue_final_message"), "both set");
}

#[tokio::test]
async fn detokenize_returns_the_text_with_special_tokens() {
    let app = app(Arc::new(FakeEngine::default()), config());
    let (status, v) = post(
        &app,
        "/detokenize",
        json!({"model": "test-model", "tokens": text_ids("Hello world")}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v, json!({"prompt": "Hello world"}));
    let mut ids = vec![1];
    ids.extend(text_ids("user"));
    let (_, v) = post(&app, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(v["prompt"], "<|im_start|>user");
    let (status, v) = post(&app, "/detokenize", json!({"tokens": []})).await;
    assert_eq!((status, v), (200, json!({"prompt": ""})));
}

#[tokio::test]
async fn vllm_bench_alignment_round_trips_a_cut_prompt() {
    // `vllm bench serve`: tokenize without special tokens, cut to the wanted length, detokenize,
    // and the text is that many tokens.
    let app = omni_server::router(
        config(),
        Arc::new(FakeEngine::default()),
        tokenizer_with_bos(),
    );
    let (_, v) = post(
        &app,
        "/tokenize",
        json!({"model": "test-model", "prompt": "one two three four", "add_special_tokens": false}),
    )
    .await;
    let cut = &v["tokens"].as_array().unwrap()[..7];
    let (_, text) = post(
        &app,
        "/detokenize",
        json!({"model": "test-model", "tokens": cut}),
    )
    .await;
    assert_eq!(text["prompt"], "one two");
    let (_, again) = post(
        &app,
        "/tokenize",
        json!({"prompt": text["prompt"], "add_special_tokens": false}),
    )
    .await;
    assert_eq!(again["tokens"].as_array().unwrap(), cut);
}

#[tokio::test]
async fn bad_tokenize_and_detokenize_requests_get_openai_errors() {
    let app = app(Arc::new(FakeEngine::default()), config());
    let at_limit = "a".repeat(256);
    let past_limit = "a".repeat(257);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/tokenize", "{".into(), 400, None),
        ("/tokenize", "{}".into(), 400, None),
        ("/tokenize", r#"{"prompt": 5}"#.into(), 400, None),
        (
            "/tokenize",
            r#"{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}"#.into(),
            400,
            None,
        ),
        (
            "/tokenize",
            r#"{"messages": []}"#.into(),
            400,
            Some("messages"),
        ),
        ("/tokenize", r#"{"messages": "hi"}"#.into(), 400, None),
        (
            "/tokenize",
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#.into(),
            400,
            Some("messages[0].content[0].image_url"),
        ),
        (
            "/tokenize",
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}"#.into(),
            400,
            Some("messages[0].content[0]"),
        ),
        (
            "/tokenize",
            json!({"model": "nope", "prompt": "a"}).to_string(),
            404,
            Some("model"),
        ),
        (
            "/tokenize",
            json!({"model": "nope", "messages": [{"role": "user", "content": "a"}]}).to_string(),
            404,
            Some("model"),
        ),
        (
            "/tokenize",
            json!({"prompt": past_limit}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": past_limit}]}).to_string(),
            400,
            Some("messages"),
        ),
        ("/detokenize", "{}".into(), 400, None),
        ("/detokenize", r#"{"tokens": [-1]}"#.into(), 400, None),
        ("/detokenize", r#"{"tokens": "abc"}"#.into(), 400, None),
        (
            "/detokenize",
            r#"{"tokens": [4, 300]}"#.into(),
            400,
            Some("tokens"),
        ),
        (
            "/detokenize",
            json!({"tokens": vec![4; 257]}).to_string(),
            400,
            Some("tokens"),
        ),
        (
            "/detokenize",
            json!({"model": "nope", "tokens": [4]}).to_string(),
            404,
            Some("model"),
        ),
    ];
    for (path, body, want, param) in cases {
        let (status, v, _) = call(&app, "POST", path, Some(&body), &[]).await;
        assert_error(status, &v, want, param, &format!("{path} {body:.80}"));
    }
    let (status, v) = post(&app, "/tokenize", json!({"prompt": past_limit})).await;
    assert_eq!(status, 400);
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("You passed 257 input tokens") && message.contains("256 tokens"),
        "{message}"
    );
    // The whole context is allowed.
    let (status, v) = post(&app, "/tokenize", json!({"prompt": at_limit})).await;
    assert_eq!((status, v["count"].as_u64()), (200, Some(256)), "{v}");
    // A body that is not JSON, and a GET.
    let (status, v, _) = call(
        &app,
        "POST",
        "/tokenize",
        Some("{}"),
        &[("content-type", "text/plain")],
    )
    .await;
    assert!(status == 415 || status == 400, "{status}");
    assert_error(status, &v, status, None, "text/plain");
    let (status, v, _) = call(&app, "GET", "/detokenize", None, &[]).await;
    assert_error(status, &v, 405, None, "GET");
}

#[tokio::test]
async fn tokenizer_endpoints_are_outside_the_api_key_as_in_vllm() {
    let mut cfg = config();
    cfg.api_key = Some("secret".into());
    let app = app(Arc::new(FakeEngine::default()), cfg);
    let (status, _) = post(&app, "/tokenize", json!({"prompt": "Hi"})).await;
    assert_eq!(status, 200);
    let (status, _) = post(&app, "/detokenize", json!({"tokens": [4]})).await;
    assert_eq!(status, 200);
    let (status, v, _) = call(&app, "GET", "/v1/models", None, &[]).await;
    assert_eq!(status, 401, "{v}");
}
