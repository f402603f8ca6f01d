//! Where synthesis time goes, on the 20 golden sentences: G2P, the acoustic model (ONNX Runtime,
//! one thread), the DSP; one warm-up pass, then `ROUNDS` timed passes; prints a table.
//!
//! ```text
//! cargo run --release -p omni-tts --example voice_bench [VOICE_DIR]
//! ```

use std::time::Instant;

use omni_tts::{NumpyRng, Voice};

const ROUNDS: usize = 3;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = match std::env::args().nth(1) {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(std::env::var("HOME")?)
            .join(".cache/omni-engine/voices/hibari-0.2.1"),
    };
    let t0 = Instant::now();
    let voice = Voice::load(&dir)?;
    let load_s = t0.elapsed().as_secs_f64();
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tts_golden.json"
    ))?)?;
    let texts: Vec<String> = golden["sentences"]
        .as_array()
        .ok_or("no sentences")?
        .iter()
        .filter_map(|s| s["text"].as_str().map(str::to_string))
        .collect();
    let (mut g2p, mut model, mut dsp, mut samples) = (0.0, 0.0, 0.0, 0usize);
    for round in 0..=ROUNDS {
        for text in &texts {
            let mut rng = NumpyRng::from_seed(0);
            let t = Instant::now();
            let ids = voice.phonemize(text)?;
            let t_g2p = t.elapsed().as_secs_f64();
            for ids in ids {
                let t = Instant::now();
                let s = voice.spectra(&ids, 1.0)?;
                let t_model = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let audio = voice.render(&s, &mut rng);
                let t_dsp = t.elapsed().as_secs_f64();
                if round > 0 {
                    model += t_model;
                    dsp += t_dsp;
                    samples += audio.len();
                }
            }
            if round > 0 {
                g2p += t_g2p;
            }
        }
    }
    let audio_s = samples as f64 / f64::from(omni_tts::SAMPLE_RATE);
    let total = g2p + model + dsp;
    println!(
        "voice load: {load_s:.2} s; {ROUNDS} rounds of {} sentences",
        texts.len()
    );
    println!("| part  | seconds | share | x real time |");
    println!("|-------|---------|-------|-------------|");
    for (name, t) in [
        ("g2p", g2p),
        ("model", model),
        ("dsp", dsp),
        ("total", total),
    ] {
        println!(
            "| {name:5} | {t:7.3} | {:4.0}% | {:11.0} |",
            100.0 * t / total,
            audio_s / t
        );
    }
    Ok(())
}
