//! `omni-engine serve --omni` with no model (issue 18): the built-in SmolLM2 as the text stage
//! and the built-in voice as a TTS stage, over HTTP. The audio must be speech: 24 kHz, longer
//! for a longer answer, neither silence nor clipping, with a speech-like zero-crossing rate and
//! pauses; streamed per sentence as WAV chunks that concatenate to the non-streamed samples;
//! an unknown voice is a 400 naming the voice there is; a killed TTS stage fails requests with
//! a 503 naming it.
//!
//! Skips (passes, saying so) when the built-in model or voice is not cached: `scripts/test.sh`
//! fetches both.

#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;
#[path = "omni_common.rs"]
mod omni_common;

use std::time::Duration;

use common::{Server, children_named, eventually};
use omni_common::{base64_decode, wav_samples};
use serde_json::{Value, json};

fn start() -> Option<Server> {
    let (Some(_), Some(_)) = (
        omni_gguf::default_model::locate(),
        omni_tts::builtin::locate_in(
            std::env::var_os("OMNI_CACHE_DIR")
                .map(std::path::PathBuf::from)
                .as_deref(),
        ),
    ) else {
        eprintln!(
            "skipped: the built-in model or voice is not cached (scripts/test.sh fetches them)"
        );
        return None;
    };
    Some(Server::start(&["--omni", "--max-num-seqs", "4"]))
}

fn body(prompt: &str, tokens: u32, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "temperature": 0.0,
        "max_tokens": tokens,
        "ignore_eos": true,
        "stream": stream,
    })
}

/// (text, samples) of a non-streamed answer.
async fn speak(s: &Server, prompt: &str, tokens: u32) -> (String, Vec<f32>) {
    let (status, v) = s
        .post("/v1/chat/completions", &body(prompt, tokens, false))
        .await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "a text choice and an audio choice: {v}");
    let text = choices[0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let data = choices[1]["message"]["audio"]["data"].as_str().unwrap();
    let (samples, rate) = wav_samples(&base64_decode(data));
    assert_eq!(rate, 24_000);
    (text, samples)
}

/// What makes a waveform speech rather than silence, noise or a clipped tone.
fn assert_speech(samples: &[f32], what: &str) {
    let n = samples.len().max(1) as f32;
    let rms = (samples.iter().map(|x| x * x).sum::<f32>() / n).sqrt();
    let clipped = samples.iter().filter(|x| x.abs() >= 0.999).count() as f32 / n;
    // 20 ms frames: speech has loud frames and pauses between words.
    let frames: Vec<f32> = samples
        .chunks(480)
        .map(|f| (f.iter().map(|x| x * x).sum::<f32>() / f.len() as f32).sqrt())
        .collect();
    let loud = frames.iter().filter(|&&r| r > 0.02).count() as f32 / frames.len() as f32;
    let quiet = frames.iter().filter(|&&r| r < 0.01).count() as f32 / frames.len() as f32;
    let crossings = samples
        .windows(2)
        .filter(|w| (w[0] >= 0.0) != (w[1] >= 0.0))
        .count() as f32
        / n;
    let report = format!(
        "{what}: rms {rms:.4}, clipped {clipped:.5}, loud frames {loud:.2}, quiet frames \
         {quiet:.2}, zero crossings per sample {crossings:.3}"
    );
    eprintln!("{report}");
    assert!((0.01..0.5).contains(&rms), "{report}");
    assert!(clipped < 0.001, "{report}");
    assert!(loud > 0.3, "mostly silence: {report}");
    assert!(quiet > 0.02, "no pauses at all: {report}");
    // Voiced speech at 24 kHz crosses zero a few hundred to a few thousand times a second;
    // white noise crosses every other sample, a DC offset or hum almost never.
    assert!((0.005..0.25).contains(&crossings), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_omni_with_no_model_speaks_its_answers() {
    let Some(s) = start() else { return };
    assert!(s.log().contains("deploy/text_speech.yaml"), "{}", s.log());
    let prompt = "Tell me about the city of Paris.";
    let (short_text, short) = speak(&s, prompt, 8).await;
    let (long_text, long) = speak(&s, prompt, 64).await;
    assert!(
        long_text.starts_with(&short_text),
        "greedy: {short_text:?} / {long_text:?}"
    );
    let secs = |a: &[f32]| a.len() as f32 / 24_000.0;
    eprintln!(
        "{:.2} s for {short_text:?}, {:.2} s for {long_text:?}",
        secs(&short),
        secs(&long)
    );
    // About 14 characters a second, as people speak.
    for (text, audio) in [(&short_text, &short), (&long_text, &long)] {
        let per_char = secs(audio) / text.chars().count().max(1) as f32;
        assert!(
            (0.03..0.15).contains(&per_char),
            "{per_char} s a character: {text:?}"
        );
    }
    assert!(
        secs(&long) > 3.0 * secs(&short),
        "the audio grows with the text"
    );
    assert_speech(&short, "short answer");
    assert_speech(&long, "long answer");

    // Streamed: the same text, the audio in several chunks (a sentence or clause each), each a
    // WAV of its own, whose samples concatenate to the non-streamed answer's.
    let chunks = s.sse("/v1/chat/completions", &body(prompt, 64, true)).await;
    let mut text = String::new();
    let mut streamed = Vec::new();
    let mut audio_chunks = 0;
    for c in &chunks {
        let Some(choice) = c["choices"].as_array().and_then(|a| a.first()) else {
            continue;
        };
        let content = choice["delta"]["content"].as_str().unwrap_or_default();
        match c["modality"].as_str() {
            Some("text") => text.push_str(content),
            Some("audio") if !content.is_empty() => {
                let (samples, rate) = wav_samples(&base64_decode(content));
                assert_eq!(rate, 24_000);
                streamed.extend(samples);
                audio_chunks += 1;
            }
            _ => {}
        }
    }
    assert_eq!(text, long_text);
    assert!(audio_chunks >= 2, "{audio_chunks} audio chunks");
    assert_eq!(streamed.len(), long.len(), "samples");
    assert!(
        streamed == long,
        "streamed audio differs from the whole answer's"
    );

    // Text only: no audio choice.
    let mut b = body(prompt, 8, false);
    b["modalities"] = json!(["text"]);
    let (status, v) = s.post("/v1/chat/completions", &b).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], short_text.as_str());

    // The voice there is, by name; another is refused.
    let mut b = body(prompt, 8, false);
    b["voice"] = json!("Heart");
    assert_eq!(s.post("/v1/chat/completions", &b).await.0, 200);
    b["voice"] = json!("alloy");
    let (status, v) = s.post("/v1/chat/completions", &b).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("heart"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_tts_stage_fails_requests_naming_it() {
    let Some(s) = start() else { return };
    let tts = children_named(s.pid, "omni-stage-1");
    assert_eq!(tts.len(), 1, "one TTS stage process");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(tts[0] as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            s.get("/health").await.0 == 503
        })
        .await,
        "health after the TTS stage died"
    );
    let (status, v) = s
        .post("/v1/chat/completions", &body("Hello there.", 8, false))
        .await;
    assert_eq!(status, 503, "{v}");
    let msg = v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(msg.contains("stage 1") && msg.contains("tts"), "{msg}");
}
