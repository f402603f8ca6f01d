//! The engine's cache directory and the fetch scripts that fill it.
//!
//! Built-in assets (the default model, the built-in voice) live under one base directory: the
//! engine's `--cache-dir` (env `OMNI_CACHE_DIR`, resolved by omni-config) or, when none is given,
//! `$HOME/.cache/omni-engine`. Each asset's crate embeds its `scripts/fetch-*.sh` so the binary
//! works outside the source tree, and runs it through [`run_fetch_script`] on first use; the
//! script reads the base from `OMNI_CACHE_DIR` and prints the fetched paths on stdout.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `base`, or `$HOME/.cache/omni-engine` when it is absent or empty.
pub fn base_dir(base: Option<&Path>) -> PathBuf {
    match base {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => {
            let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
            home.join(".cache").join("omni-engine")
        }
    }
}

/// The base directory from `OMNI_CACHE_DIR`, as the fetch scripts read it: for tests and tools
/// outside the engine, which have no resolved config.
pub fn env_base() -> Option<PathBuf> {
    std::env::var_os("OMNI_CACHE_DIR").map(PathBuf::from)
}

/// Runs an embedded fetch script with bash (`$0` = `name`) against the cache under `base`
/// (see [`base_dir`]) and returns what it printed on stdout; on failure, why, with the
/// script's stderr.
pub fn run_fetch_script(script: &str, name: &str, base: Option<&Path>) -> Result<String, String> {
    let output = Command::new("bash")
        .arg("-c")
        .arg(script)
        .arg(name)
        .env("OMNI_CACHE_DIR", base_dir(base))
        .output()
        .map_err(|e| format!("running {name} with bash: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{name} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_base_means_the_home_cache() {
        let home = base_dir(None);
        assert!(home.ends_with(".cache/omni-engine"), "{}", home.display());
        assert_eq!(base_dir(Some(Path::new(""))), home);
        assert_eq!(base_dir(Some(Path::new("/c"))), PathBuf::from("/c"));
    }

    #[test]
    fn a_script_sees_the_base_and_its_failure_is_reported_with_its_stderr() {
        let out = run_fetch_script(
            "echo \"$0 $OMNI_CACHE_DIR\"",
            "fetch-x",
            Some(Path::new("/c")),
        );
        assert_eq!(out.unwrap().trim(), "fetch-x /c");
        let err = run_fetch_script("echo no wheel >&2; exit 3", "fetch-y", None).unwrap_err();
        assert!(
            err.contains("fetch-y failed") && err.contains("no wheel"),
            "{err}"
        );
    }
}
