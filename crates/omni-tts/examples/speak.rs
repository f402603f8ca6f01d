//! Text to a 16-bit mono WAV file, sentence by sentence, for listening checks.
//!
//! ```text
//! cargo run --release -p omni-tts --example speak -- "Hello there." hello.wav [VOICE_DIR]
//! ```

use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let text = args.next().ok_or("usage: speak TEXT OUT.wav [VOICE_DIR]")?;
    let out = args.next().ok_or("usage: speak TEXT OUT.wav [VOICE_DIR]")?;
    let dir = match args.next() {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(std::env::var("HOME")?)
            .join(".cache/omni-engine/voices/hibari-0.2.1"),
    };
    let voice = omni_tts::Voice::load(&dir)?;
    for ps in voice.phoneme_strings(&text)? {
        eprintln!("{ps}");
    }
    let audio = voice.synthesize(&text, 1.0)?;
    let pcm: Vec<u8> = audio
        .iter()
        .flat_map(|v| ((v.clamp(-1.0, 1.0) * 32767.0) as i16).to_le_bytes())
        .collect();
    let rate = omni_tts::SAMPLE_RATE;
    let mut f = std::io::BufWriter::new(std::fs::File::create(&out)?);
    f.write_all(b"RIFF")?;
    f.write_all(&(36 + pcm.len() as u32).to_le_bytes())?;
    f.write_all(b"WAVEfmt ")?;
    f.write_all(&16u32.to_le_bytes())?;
    f.write_all(&1u16.to_le_bytes())?; // PCM
    f.write_all(&1u16.to_le_bytes())?; // mono
    f.write_all(&rate.to_le_bytes())?;
    f.write_all(&(rate * 2).to_le_bytes())?;
    f.write_all(&2u16.to_le_bytes())?;
    f.write_all(&16u16.to_le_bytes())?;
    f.write_all(b"data")?;
    f.write_all(&(pcm.len() as u32).to_le_bytes())?;
    f.write_all(&pcm)?;
    eprintln!(
        "{out}: {:.2} s at {rate} Hz",
        audio.len() as f64 / f64::from(rate)
    );
    Ok(())
}
