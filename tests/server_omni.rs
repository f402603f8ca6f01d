//! `omni-engine serve MODEL --omni` over HTTP on the tiny Qwen3-Omni fixture (issue 13): the
//! built-in deploy profile's three stages as processes, chat completions with text and audio,
//! streamed and not. Every stage greedy with fixed lengths: the text is transformers' greedy
//! text, the WAV is Code2Wav of transformers' greedy frames in the profile's windows (4, then
//! 25 + 25 context) within int16 rounding, and the streamed chunks (each a WAV of its own)
//! concatenate to the same samples.

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;
#[path = "omni_common.rs"]
mod omni_common;

use common::Server;
use omni_common::*;
use serde_json::{Value, json};

fn start(extra: &[&str]) -> (Server, TempDir) {
    let (dir, guard) = fixture_with_tokenizer();
    let mut args = vec![
        dir.to_str().unwrap().to_string(),
        "--omni".into(),
        "--served-model-name".into(),
        "omni".into(),
        "--max-model-len".into(),
        "256".into(),
        "--max-num-seqs".into(),
        "8".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    (Server::start(&args), guard)
}

fn body(prompt: usize, speaker: &str, stream: bool) -> Value {
    let r = reference();
    let prompt = ids(&r["thinker.prompts"][prompt]);
    json!({
        "model": "omni",
        "messages": messages_of(&prompt),
        "modalities": ["text", "audio"],
        "audio": {"format": "wav"},
        "speaker": speaker,
        "temperature": 0.0,
        "max_tokens": THINKER_TOKENS,
        "ignore_eos": true,
        "stream": stream,
        "sampling_params_list": [
            {"temperature": 0.0, "max_tokens": THINKER_TOKENS, "ignore_eos": true},
            {"temperature": 0.0, "max_tokens": FRAMES, "ignore_eos": true,
             "repetition_penalty": 1.05},
            {}
        ]
    })
}

fn greedy_text(i: usize) -> String {
    let r = reference();
    ids(&r[format!("thinker.greedy.{i}").as_str()])
        .iter()
        .map(|t| format!("w{t}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn expected(i: usize, speaker: &str) -> Vec<f32> {
    let frames = reference_frames(&format!("talker.frames.{i}.{speaker}"));
    expected_audio(&load_code2wav(), &frames, true)
}

/// Max difference after int16 rounding of the expected floats.
fn pcm_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "samples");
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - (w.clamp(-1.0, 1.0) * 32767.0).round() / 32768.0).abs())
        .fold(0.0, f32::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_with_audio_gives_transformers_text_and_the_waveform_of_its_frames() {
    let (server, _dir) = start(&[]);
    for (i, speaker) in [(0, "ethan"), (1, "chelsie")] {
        let (status, v) = server
            .post("/v1/chat/completions", &body(i, speaker, false))
            .await;
        assert_eq!(status, 200, "{v}\n{}", server.log());
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2, "{v}");
        let text = choices[0]["message"]["content"].as_str().unwrap();
        assert_eq!(text.trim(), greedy_text(i));
        let audio = &choices[1]["message"]["audio"];
        assert_eq!(audio["transcript"].as_str().unwrap().trim(), greedy_text(i));
        let (samples, rate) = wav_samples(&base64_decode(audio["data"].as_str().unwrap()));
        assert_eq!(rate, 24_000);
        let e = pcm_err(&samples, &expected(i, speaker));
        assert!(e <= 1.5 / 32768.0, "prompt {i} {speaker}: {e}");
    }
    // vLLM-Omni's audio metrics, per-stage gauges and the connectors' bytes.
    let (_, text) = server.get("/metrics").await;
    let value = |prefix: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    };
    assert_eq!(value("vllm_omni:audio_ttfp_s_count"), 2.0);
    let audio_s = 2.0 * f64::from(1920 * FRAMES - 555) / 24_000.0;
    assert!((value("vllm_omni:audio_duration_s_sum") - audio_s).abs() < 1e-6);
    for stage in 0..3 {
        let running = format!(
            "vllm:num_requests_running{{model_name=\"omni\",stage=\"{stage}\",replica=\"0\"}}"
        );
        assert_eq!(value(&running), 0.0);
    }
    assert!(
        value(
            "vllm_omni:connector_bytes_total{model_name=\"omni\",from_stage=\"0\",to_stage=\"1\"}"
        ) > 0.0
    );
    let codes = value(
        "vllm_omni:connector_bytes_total{model_name=\"omni\",from_stage=\"1\",to_stage=\"2\"}",
    );
    assert_eq!(
        codes,
        2.0 * f64::from(16 * FRAMES * 4 + 16 * 4 * 4),
        "11 frames + 4 of context"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_audio_chunks_are_wav_files_that_join_to_the_same_audio() {
    let (server, _dir) = start(&[]);
    let chunks = server
        .sse("/v1/chat/completions", &body(0, "ethan", true))
        .await;
    let mut text = String::new();
    let mut audio = Vec::new();
    let mut finishes = 0;
    for c in &chunks {
        let Some(choice) = c["choices"].as_array().and_then(|a| a.first()) else {
            continue; // the usage chunk
        };
        let modality = c["modality"].as_str().unwrap_or_else(|| panic!("{c}"));
        if !choice["finish_reason"].is_null() {
            finishes += 1;
        }
        let content = choice["delta"]["content"].as_str().unwrap_or("");
        match modality {
            "text" => text.push_str(content),
            "audio" if !content.is_empty() => {
                let (s, rate) = wav_samples(&base64_decode(content));
                assert_eq!(rate, 24_000);
                audio.extend(s);
            }
            "audio" => {}
            m => panic!("modality {m}"),
        }
    }
    assert_eq!(finishes, 1, "exactly one chunk carries finish_reason");
    assert_eq!(text.trim(), greedy_text(0));
    let e = pcm_err(&audio, &expected(0, "ethan"));
    assert!(e <= 1.5 / 32768.0, "{e}");
    // Each window's WAV: the first after 4 frames, the rest at the end.
    let packets = chunks
        .iter()
        .filter(|c| c["modality"] == "audio")
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .count();
    assert_eq!(packets, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn omni_requests_refuse_bad_voices_and_completions_without_losing_the_server() {
    let (server, _dir) = start(&["--no-async-chunk"]);
    let mut b = body(0, "nobody", false);
    let (status, v) = server.post("/v1/chat/completions", &b).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("chelsie"),
        "{v}"
    );
    let (status, v) = server
        .post(
            "/v1/completions",
            &json!({"model": "omni", "prompt": "w1 w2"}),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    // Text only, full payloads: the Talker and Code2Wav take no part; then a full-payload
    // audio request still works.
    b["modalities"] = json!(["text"]);
    b["speaker"] = json!("ethan");
    let (status, v) = server.post("/v1/chat/completions", &b).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 1);
    assert_eq!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .trim(),
        greedy_text(0)
    );
    let (status, v) = server
        .post("/v1/chat/completions", &body(0, "ethan", false))
        .await;
    assert_eq!(status, 200, "{v}");
    let data = v["choices"][1]["message"]["audio"]["data"]
        .as_str()
        .unwrap();
    let (samples, _) = wav_samples(&base64_decode(data));
    let frames = reference_frames("talker.frames.0.ethan");
    let want = expected_audio(&load_code2wav(), &frames, false);
    assert!(pcm_err(&samples, &want) <= 1.5 / 32768.0);
}
