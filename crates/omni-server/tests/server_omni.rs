//! Omni chat requests (text + speech) against a fake engine that follows the omni output
//! contract: vLLM-Omni's request fields and their 400s, the text and audio choices, streamed
//! audio chunks with `modality` and one `finish_reason`, the audio metrics.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use common::{
    FakeEngine, REPLY, SAMPLE_RATE, app, assert_pcm_matches, base64_decode, call, config,
    decode_wav, fake_audio, omni_config, pcm_samples, sse_data,
};
use omni_protocol::{Modality, OmniParams};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn chat_body(extra: Value) -> String {
    let mut v = json!({"model": "test-model", "messages": [{"role": "user", "content": "Hi"}]});
    for (k, val) in extra.as_object().unwrap() {
        v[k] = val.clone();
    }
    v.to_string()
}

async fn omni_call(engine: Arc<FakeEngine>, extra: Value) -> (u16, Value, String) {
    let app = app(engine, omni_config());
    call(&app, "POST", CHAT, Some(&chat_body(extra)), &[]).await
}

fn sent_omni(engine: &FakeEngine) -> OmniParams {
    engine.requests.lock().unwrap()[0].omni.clone().unwrap()
}

/// The `data:` payloads of an SSE body as JSON, `[DONE]` checked and dropped.
fn sse_json(text: &str) -> Vec<Value> {
    let data = sse_data(text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn assert_openai_400(status: u16, v: &Value, param: &str, ctx: &str) {
    assert_eq!(status, 400, "{ctx}: {v}");
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{ctx}: {v}"
    );
    assert_eq!(e["type"], "invalid_request_error", "{ctx}: {v}");
    assert_eq!(e["param"], param, "{ctx}: {v}");
    assert!(e.get("code").is_some(), "{ctx}: {v}");
}

#[tokio::test]
async fn text_and_audio_answer_has_a_text_choice_and_an_audio_choice_with_the_engines_samples() {
    let engine = Arc::new(FakeEngine::default());
    let (status, v, _) = omni_call(engine.clone(), json!({})).await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{v}");
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[0]["message"]["content"], REPLY);
    assert_eq!(choices[0]["finish_reason"], "stop");
    let audio_choice = &choices[1];
    assert_eq!(audio_choice["index"], 0);
    assert_eq!(audio_choice["finish_reason"], "stop");
    assert_eq!(audio_choice["message"]["role"], "assistant");
    let audio = &audio_choice["message"]["audio"];
    let id = audio["id"].as_str().unwrap();
    let hex = id.strip_prefix("audio-").unwrap();
    assert!(
        hex.len() == 16 && hex.chars().all(|c| c.is_ascii_hexdigit()),
        "{id}"
    );
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let expires = audio["expires_at"].as_u64().unwrap();
    assert!(expires.abs_diff(now + 86_400) <= 5, "{expires} vs {now}");
    assert_eq!(audio["transcript"], REPLY);
    let (rate, samples) = decode_wav(&base64_decode(audio["data"].as_str().unwrap()));
    assert_eq!(rate, SAMPLE_RATE);
    assert_pcm_matches(&samples, &fake_audio());
    assert_eq!(v["usage"]["completion_tokens"], REPLY.len() as u64 + 1);
    // The engine got the omni part: the default modalities and speaker, the profile's later
    // stages; the Thinker's profile default (temperature 0) under the request's fields.
    let sent = sent_omni(&engine);
    assert_eq!(sent.modalities, [Modality::Text, Modality::Audio]);
    assert_eq!(sent.speaker, "ethan");
    assert_eq!(
        sent.stage_sampling,
        omni_config().omni.unwrap().stage_sampling
    );
    assert_eq!(
        engine.requests.lock().unwrap()[0]
            .sampling_params
            .temperature,
        0.0
    );
}

#[tokio::test]
async fn audio_only_answer_is_one_audio_choice_with_the_transcript() {
    let engine = Arc::new(FakeEngine::default());
    let (status, v, _) = omni_call(engine.clone(), json!({"modalities": ["audio"]})).await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1, "{v}");
    let msg = &choices[0]["message"];
    assert!(msg["content"].is_null(), "{v}");
    assert_eq!(msg["audio"]["transcript"], REPLY);
    let (_, samples) = decode_wav(&base64_decode(msg["audio"]["data"].as_str().unwrap()));
    assert_pcm_matches(&samples, &fake_audio());
    assert_eq!(sent_omni(&engine).modalities, [Modality::Audio]);
}

#[tokio::test]
async fn text_only_on_an_omni_server_is_a_text_answer_with_omni_params() {
    let engine = Arc::new(FakeEngine::default());
    let (status, v, _) = omni_call(
        engine.clone(),
        json!({"modalities": ["text"], "voice": "Chelsie", "language": "en"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    assert_eq!(v["choices"][0]["message"]["content"], REPLY);
    let sent = sent_omni(&engine);
    assert_eq!(sent.modalities, [Modality::Text]);
    assert_eq!(sent.speaker, "chelsie", "voice is case-insensitive");
}

#[tokio::test]
async fn pcm_flac_and_pcm16_formats_encode_the_whole_waveform() {
    for (format, raw) in [("pcm", true), ("PCM16", true), ("flac", false)] {
        let engine = Arc::new(FakeEngine::default());
        let (status, v, _) = omni_call(engine, json!({"audio": {"format": format}})).await;
        assert_eq!(status, 200, "{format}: {v}");
        let data = base64_decode(
            v["choices"][1]["message"]["audio"]["data"]
                .as_str()
                .unwrap(),
        );
        if raw {
            assert_pcm_matches(&pcm_samples(&data), &fake_audio());
        } else {
            assert_eq!(&data[..4], b"fLaC", "{format}");
        }
    }
}

#[tokio::test]
async fn no_audio_from_the_engine_is_vllm_omnis_500() {
    let engine = Arc::new(FakeEngine {
        no_audio: true,
        ..FakeEngine::default()
    });
    let (status, v, _) = omni_call(engine, json!({})).await;
    assert_eq!(status, 500, "{v}");
    assert_eq!(v["error"]["message"], omni_server::NO_AUDIO_PRODUCED);
    assert_eq!(v["error"]["type"], "server_error");
}

/// The audio of a stream: every audio chunk's content decoded on its own.
fn streamed_audio(chunks: &[Value], format: &str) -> Vec<i16> {
    let mut all = Vec::new();
    for c in chunks.iter().filter(|c| c["modality"] == "audio") {
        let Some(content) = c["choices"][0]["delta"]["content"].as_str() else {
            continue; // the closing chunk
        };
        let bytes = base64_decode(content);
        all.extend(match format {
            "wav" => {
                let (rate, s) = decode_wav(&bytes);
                assert_eq!(rate, SAMPLE_RATE);
                s
            }
            _ => pcm_samples(&bytes),
        });
    }
    all
}

fn finish_reasons(chunks: &[Value]) -> Vec<(usize, String)> {
    chunks
        .iter()
        .enumerate()
        .flat_map(|(k, c)| {
            c["choices"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(move |ch| ch["finish_reason"].as_str().map(|r| (k, r.to_string())))
        })
        .collect()
}

async fn stream_on_a_real_port(engine: Arc<FakeEngine>, extra: Value) -> Vec<Value> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = omni_config();
    let limits = config.connections.clone();
    let (_stop, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(omni_server::serve_on(
        listener,
        app(engine, config),
        limits,
        async move {
            let _ = rx.await;
        },
    ));
    let mut body: Value = serde_json::from_str(&chat_body(extra)).unwrap();
    body["stream"] = json!(true);
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}{CHAT}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    sse_json(&resp.text().await.unwrap())
}

#[tokio::test]
async fn streaming_tags_every_chunk_finishes_once_and_its_wav_chunks_equal_the_full_audio() {
    let engine = Arc::new(FakeEngine::default());
    let chunks = stream_on_a_real_port(
        engine.clone(),
        json!({"stream_options": {"include_usage": true}}),
    )
    .await;
    for c in &chunks {
        assert!(c["modality"] == "text" || c["modality"] == "audio", "{c}");
    }
    // Text: the role chunk, then the reply.
    assert_eq!(chunks[0]["modality"], "text");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter(|c| c["modality"] == "text")
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, REPLY);
    // The first audio chunk arrives while the text is still streaming.
    let first_audio = chunks
        .iter()
        .position(|c| c["modality"] == "audio")
        .unwrap();
    let last_text = chunks
        .iter()
        .rposition(|c| c["modality"] == "text" && !c["choices"].as_array().unwrap().is_empty())
        .unwrap();
    assert!(first_audio < last_text, "{first_audio} {last_text}");
    // Audio chunks: the role, base64 of a whole WAV each, usage with no completion tokens.
    let audio: Vec<&Value> = chunks.iter().filter(|c| c["modality"] == "audio").collect();
    assert_eq!(audio.len(), common::AUDIO_CHUNKS);
    for c in &audio {
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(c["usage"]["completion_tokens"], 0);
        assert!(c["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    }
    // One finish_reason, on the last audio chunk; then the usage chunk.
    let finishes = finish_reasons(&chunks);
    let last_audio = chunks
        .iter()
        .rposition(|c| c["modality"] == "audio")
        .unwrap();
    assert_eq!(finishes, [(last_audio, "stop".to_string())], "{chunks:?}");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], REPLY.len() as u64 + 1);
    // Each chunk decodes on its own; together they are the non-streaming audio.
    let streamed = streamed_audio(&chunks, "wav");
    assert_pcm_matches(&streamed, &fake_audio());
    let (_, v, _) = omni_call(Arc::new(FakeEngine::default()), json!({})).await;
    let (_, full) = decode_wav(&base64_decode(
        v["choices"][1]["message"]["audio"]["data"]
            .as_str()
            .unwrap(),
    ));
    assert_eq!(streamed, full);
}

#[tokio::test]
async fn streaming_pcm_audio_only_has_no_text_chunks() {
    let chunks = stream_on_a_real_port(
        Arc::new(FakeEngine::default()),
        json!({"modalities": ["audio"], "audio": {"format": "pcm"}}),
    )
    .await;
    assert!(
        chunks.iter().all(|c| c["modality"] == "audio"),
        "{chunks:?}"
    );
    assert_pcm_matches(&streamed_audio(&chunks, "pcm"), &fake_audio());
    assert_eq!(finish_reasons(&chunks), [(chunks.len() - 1, "stop".into())]);
}

#[tokio::test]
async fn streaming_closes_with_an_empty_delta_when_the_last_output_has_no_audio() {
    let engine = Arc::new(FakeEngine {
        empty_final_output: true,
        ..FakeEngine::default()
    });
    let chunks = stream_on_a_real_port(engine, json!({})).await;
    let last = chunks.last().unwrap();
    assert_eq!(last["modality"], "audio");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    assert_eq!(finish_reasons(&chunks), [(chunks.len() - 1, "stop".into())]);
    assert_pcm_matches(&streamed_audio(&chunks, "wav"), &fake_audio());
}

#[tokio::test]
async fn sampling_params_list_sets_each_stage_over_the_standard_fields() {
    let engine = Arc::new(FakeEngine::default());
    let list = json!([
        {"temperature": 0.0, "max_tokens": 5, "ignore_eos": true},
        {"temperature": 0.0, "top_k": 1, "detokenize": false}
    ]);
    let (status, v, _) = omni_call(
        engine.clone(),
        json!({"sampling_params_list": list, "temperature": 0.7, "seed": 7, "max_tokens": 9}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let req = engine.requests.lock().unwrap()[0].clone();
    let thinker = &req.sampling_params;
    assert_eq!(
        (
            thinker.temperature,
            thinker.max_tokens,
            thinker.ignore_eos,
            thinker.seed
        ),
        (0.0, Some(5), true, Some(7))
    );
    let stages = &req.omni.unwrap().stage_sampling;
    assert_eq!((stages[0].temperature, stages[0].top_k), (0.0, Some(1)));
    assert_eq!(
        stages[0].repetition_penalty, 1.0,
        "defaults, not the profile's"
    );
    // Code2Wav, beyond the list: the profile's default.
    assert_eq!(stages[1], omni_config().omni.unwrap().stage_sampling[1]);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn bad_omni_fields_are_openai_400s_naming_the_field() {
    let too_long = json!([{}, {}, {}, {}]);
    let cases = [
        (
            json!({"modalities": ["smell"]}),
            "modalities",
            "Unsupported output modalities smell",
        ),
        (
            json!({"modalities": "audio"}),
            "modalities",
            "'modalities' must be a list of strings.",
        ),
        (json!({"modalities": []}), "modalities", "must not be empty"),
        (
            json!({"audio": {"format": "ogg"}}),
            "audio.format",
            "Invalid audio format 'ogg'",
        ),
        (
            json!({"audio": {"format": "mp3"}}),
            "audio.format",
            "not supported by this server",
        ),
        (
            json!({"speaker": "Nobody"}),
            "speaker",
            "Invalid speaker 'Nobody'. Supported: chelsie, ethan",
        ),
        (json!({"voice": "x"}), "voice", "Supported: chelsie, ethan"),
        (
            json!({"sampling_params_list": [{"temprature": 0}]}),
            "sampling_params_list[0]",
            "temprature",
        ),
        (
            json!({"sampling_params_list": [{}, {"top_p": 2.0}]}),
            "sampling_params_list[1]",
            "top_p",
        ),
        (
            json!({"sampling_params_list": too_long}),
            "sampling_params_list",
            "3 stages",
        ),
        (json!({"n": 2}), "n", "audio"),
        (json!({"stop": ["x"]}), "stop", "stop_token_ids"),
    ];
    for (extra, param, message) in cases {
        let ctx = extra.to_string();
        let (status, v, _) = omni_call(Arc::new(FakeEngine::default()), extra).await;
        assert_openai_400(status, &v, param, &ctx);
        let got = v["error"]["message"].as_str().unwrap();
        assert!(got.contains(message), "{ctx}: {got}");
    }
}

#[tokio::test]
async fn audio_fields_on_a_server_without_omni_are_400s() {
    let app = app(Arc::new(FakeEngine::default()), config());
    for (extra, param) in [
        (json!({"modalities": ["text", "audio"]}), "modalities"),
        (json!({"audio": {"format": "wav"}}), "audio"),
        (json!({"speaker": "ethan"}), "speaker"),
        (json!({"voice": "ethan"}), "voice"),
        (
            json!({"sampling_params_list": [{}]}),
            "sampling_params_list",
        ),
    ] {
        let ctx = extra.to_string();
        let (status, v, _) = call(&app, "POST", CHAT, Some(&chat_body(extra)), &[]).await;
        assert_openai_400(status, &v, param, &ctx);
    }
    let (status, v, _) = call(
        &app,
        "POST",
        CHAT,
        Some(&chat_body(json!({"modalities": ["text"]}))),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test]
async fn completions_on_an_omni_server_point_at_chat() {
    let app = app(Arc::new(FakeEngine::default()), omni_config());
    let (status, v, _) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"Hi"}"#),
        &[],
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/chat/completions"),
        "{v}"
    );
}

/// The value of the sample `name{model_name="test-model"}` in an exposition.
fn sample(text: &str, name: &str) -> f64 {
    let prefix = format!("{name}{{model_name=\"test-model\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn audio_metrics_are_exposed_after_an_audio_request() {
    let app = app(Arc::new(FakeEngine::default()), omni_config());
    let (status, _, _) = call(&app, "POST", CHAT, Some(&chat_body(json!({}))), &[]).await;
    assert_eq!(status, 200);
    let (status, _, text) = call(&app, "GET", "/metrics", None, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(sample(&text, "vllm_omni:audio_ttfp_s_count"), 1.0);
    assert_eq!(sample(&text, "vllm_omni:audio_rtf_count"), 1.0);
    assert!(sample(&text, "vllm_omni:audio_rtf_sum") > 0.0);
    let samples = fake_audio().len() as f64;
    assert_eq!(sample(&text, "vllm_omni:audio_frames_total"), samples);
    let seconds = sample(&text, "vllm_omni:audio_duration_s_sum");
    assert!(
        (seconds - samples / f64::from(SAMPLE_RATE)).abs() < 1e-9,
        "{seconds}"
    );
    assert!(
        text.contains("# TYPE vllm_omni:audio_ttfp_s histogram"),
        "{text}"
    );
    // Help texts read as vLLM's: one period (the encoder adds it).
    for line in text.lines().filter(|l| l.starts_with("# HELP")) {
        assert!(!line.ends_with(".."), "{line}");
    }
}
