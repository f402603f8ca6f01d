//! Shared by the omni-tts tests: where the voice and the reference outputs are, and loading them.
//!
//! The voice comes from `scripts/fetch-voice.sh` (`$OMNI_CACHE_DIR/voices/` or
//! `~/.cache/omni-engine/voices/`); without it the tests print a SKIP line and pass. The committed
//! references are `tests/fixtures/` (phoneme ids of 20 sentences, audio of 3); the larger ones
//! (every sentence's audio and model outputs) are made by `scripts/make-tts-golden.sh` into the
//! git-ignored `.cache/tts-golden/` and used when present.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use omni_tts::Voice;
use serde_json::Value;

pub fn voices_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("OMNI_CACHE_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/omni-engine"),
    };
    Some(base.join("voices"))
}

/// The fetched voice, loaded once per test binary; `None` (after a SKIP line naming `test`) when
/// it was not fetched.
pub fn voice(test: &str) -> Option<&'static Voice> {
    static VOICE: OnceLock<Option<Voice>> = OnceLock::new();
    let v = VOICE.get_or_init(|| {
        let dir = voices_dir()?.join("hibari-0.2.1");
        if !dir.join(omni_tts::MODEL_FILE).exists() {
            return None;
        }
        Some(Voice::load(&dir).expect("the fetched voice loads"))
    });
    if v.is_none() {
        println!("SKIP {test}: voice not fetched (run scripts/fetch-voice.sh)");
    }
    v.as_ref()
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// `.cache/tts-golden/` of the workspace, if `scripts/make-tts-golden.sh` has made it.
pub fn golden_cache() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/tts-golden");
    dir.join("index.json").exists().then_some(dir)
}

pub fn golden() -> Value {
    let text = std::fs::read_to_string(fixtures().join("tts_golden.json")).expect("golden json");
    serde_json::from_str(&text).expect("golden json parses")
}

pub fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Largest absolute difference; lengths must match.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
