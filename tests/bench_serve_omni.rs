//! `omni-engine bench serve --omni` against `omni-engine serve MODEL --omni` on the tiny
//! Qwen3-Omni fixture (issue 13): generated Seed-TTS requests with fixed lengths (Thinker 8
//! tokens, Talker 11 frames, `ignore_eos` on both) at concurrency 2, and vLLM-Omni's result
//! block with every request successful, the audio of 11 frames each (the Code2Wav windows'
//! samples less the streaming trim), and a time to first packet and real-time factor above
//! zero.

// server_common.rs and omni_common.rs each load engine_common.rs as a module.
#![allow(clippy::unwrap_used)]

#[path = "server_common.rs"]
mod common;
#[path = "omni_common.rs"]
mod omni_common;

use std::process::Command;

use common::Server;
use omni_common::{FRAMES, THINKER_TOKENS, engine_bin, fixture_with_tokenizer};

/// Samples of `frames` Talker frames: 1920 per frame, less the 555 the streaming decode trims.
fn samples_of(frames: u32) -> u64 {
    1920 * u64::from(frames) - 555
}

/// The value of the block's row `name` (`{name:<40} {value}`).
fn value<'a>(block: &'a str, name: &str) -> &'a str {
    block
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .unwrap_or_else(|| panic!("no row {name:?} in\n{block}"))
        .trim()
}

#[test]
fn bench_serve_omni_reports_audio_of_every_request() {
    let (dir, _guard) = fixture_with_tokenizer();
    let server = Server::start(&[
        dir.to_str().unwrap(),
        "--omni",
        "--served-model-name",
        "omni",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "8",
    ]);
    let fixed = format!("{THINKER_TOKENS},{FRAMES}");
    let out = Command::new(engine_bin())
        .args(["bench", "serve", "--omni", "--backend", "openai-chat-omni"])
        .args(["--base-url", &server.base, "--model", "omni"])
        .args(["--dataset-name", "seed-tts", "--seed-tts-prompt-len", "10"])
        .args(["--omni-fixed-lengths", &fixed, "--num-warmups", "1"])
        .args(["--num-prompts", "4", "--max-concurrency", "2"])
        .args([
            "--percentile-metrics",
            "ttft,tpot,itl,e2el,audio_ttfp,audio_rtf",
        ])
        .args([
            "--extra-body",
            r#"{"speaker": "chelsie"}"#,
            "--disable-tqdm",
        ])
        .output()
        .unwrap();
    let block = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{block}\n{stderr}\nserver:\n{}",
        server.log()
    );
    println!("{block}");
    assert_eq!(value(&block, "Successful requests:"), "4", "{stderr}");
    assert_eq!(value(&block, "Failed requests:"), "0");
    assert_eq!(value(&block, "Maximum request concurrency:"), "2");
    assert_eq!(
        value(&block, "Total generated tokens:"),
        (4 * THINKER_TOKENS).to_string()
    );
    let frames = 4 * samples_of(FRAMES);
    assert_eq!(
        value(&block, "Total audio frames generated:"),
        frames.to_string()
    );
    assert_eq!(
        value(&block, "Total audio duration generated(s):"),
        format!("{:.2}", frames as f64 / 24_000.0)
    );
    for row in [
        "Mean AUDIO_TTFP (ms):",
        "P99 AUDIO_TTFP (ms):",
        "Mean AUDIO_RTF:",
        "Median AUDIO_RTF:",
        "Mean TTFT (ms):",
        "Mean E2EL (ms):",
    ] {
        let v: f64 = value(&block, row).parse().unwrap();
        assert!(v > 0.0, "{row} {v}\n{block}");
    }
    let order = [
        " Serving Benchmark Result ",
        "End-to-end Latency",
        " Text Result ",
        " Audio Result ",
        "Time to First Packet",
        "Real Time Factor",
    ];
    let at: Vec<usize> = order.iter().map(|s| block.find(s).unwrap()).collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{block}");
}
