//! Synthesized audio sounds like speech by simple measures: it lasts longer for longer text, is
//! not silence, does not clip, and streaming gives the same audio as whole text.

mod common;

fn rms(x: &[f32]) -> f32 {
    (x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32).sqrt()
}

#[test]
fn audio_is_speech_like() {
    let Some(voice) = common::voice("audio_is_speech_like") else {
        return;
    };
    let texts = [
        "Hi.",
        "The weather is nice today.",
        "The weather is nice today, so we are going for a long walk along the river after lunch.",
    ];
    let mut last_len = 0;
    for text in texts {
        let audio = voice.synthesize(text, 1.0).expect("synthesize");
        let secs = audio.len() as f32 / omni_tts::SAMPLE_RATE as f32;
        let clipped = audio.iter().filter(|v| v.abs() >= 1.0).count();
        let r = rms(&audio);
        println!("{text:?}: {secs:.2} s, rms {r:.4}, {clipped} samples at |x| >= 1");
        assert!(audio.len() > last_len, "duration grows with text length");
        assert!(r > 0.01, "not silence: rms {r}");
        assert!(
            clipped * 1000 < audio.len(),
            "clipping: {clipped} of {}",
            audio.len()
        );
        assert!(audio.iter().all(|v| v.is_finite()));
        last_len = audio.len();
    }
    // Slower speech lasts longer.
    let slow = voice.synthesize(texts[1], 0.8).expect("synthesize");
    let normal = voice.synthesize(texts[1], 1.0).expect("synthesize");
    assert!(slow.len() > normal.len());
}

#[test]
fn streamed_text_gives_the_same_audio_as_whole_text() {
    let Some(voice) = common::voice("streamed_text_gives_the_same_audio_as_whole_text") else {
        return;
    };
    let text = "Hello there. Is it ready yet? Thanks!";
    let whole = voice.synthesize_seeded(text, 1.0, 7).expect("synthesize");
    let mut stream = voice.stream(1.0, Some(7));
    let mut chunks = Vec::new();
    for piece in text.as_bytes().chunks(5) {
        let piece = std::str::from_utf8(piece).expect("ascii");
        chunks.extend(stream.push(piece).expect("push"));
    }
    chunks.extend(stream.finish().expect("finish"));
    assert_eq!(chunks.len(), 3, "one chunk per sentence");
    assert_eq!(chunks.concat(), whole);
}

#[test]
fn odd_text_gives_audio_or_nothing_without_failing() {
    let Some(voice) = common::voice("odd_text_gives_audio_or_nothing_without_failing") else {
        return;
    };
    let long = "This sentence, which goes on and on, has many clauses, and commas, ".repeat(12);
    let odd = [
        "",
        "   \n\n\t ",
        "...",
        "🙂🙂",
        "$",
        "—",
        "123456789012345678901234567890123456789012345678901234567890",
        "Ünïcödé façade naïve",
        "(((hello)))",
        "#@%&*",
        "a",
        "I",
        "1.2.3.4.5",
        "9:99pm 99/99/9999",
        long.as_str(),
    ];
    for text in odd {
        let ids = voice.phonemize(text).expect("phonemize");
        assert!(ids.iter().all(|c| c.len() <= crate_max_ids()), "{text:?}");
        let audio = voice.synthesize(text, 1.0).expect("synthesize");
        assert!(audio.iter().all(|v| v.is_finite()), "{text:?}");
    }
    assert!(voice.synthesize("", 1.0).expect("empty").is_empty());
    assert!(
        voice.phonemize(&long).expect("long").len() > 1,
        "long text is cut at clauses"
    );
}

/// A chunk's ids: at most the phoneme limit, plus the two pads (a clause longer than the limit
/// stays whole, which none of these texts has).
fn crate_max_ids() -> usize {
    omni_tts::split::MAX_PHONEMES + 2
}

#[test]
fn voice_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<omni_tts::Voice>();
}
