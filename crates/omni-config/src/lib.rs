//! Engine configuration and the one registry of environment variables.
//!
//! Layer L1. Precedence is defaults < YAML profile < environment < CLI flags; the binary
//! merges once, validates once, and hands the resolved parts to each process in its
//! handshake (children never re-read the environment).
//!
//! Every environment variable the engine reads is a field of [`EnvVars`], read once with
//! envy. `VLLM_MQ_MAX_CHUNK_BYTES_MB` keeps vLLM's name because users tune it by that name; our
//! own variables are `OMNI_<AREA>_<NAME>`.
//!
//! ```
//! let env = omni_config::EnvVars::from_iter([("VLLM_MQ_MAX_CHUNK_BYTES_MB".to_string(), "100".to_string())]).unwrap();
//! let ipc = env.ipc_config().unwrap();
//! assert_eq!(ipc.max_chunk_bytes, 100 << 20);
//! ```

use std::time::Duration;

use omni_ipc::MessageQueueConfig;
use serde::Deserialize;

/// Configuration errors; all problems are reported together.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An environment variable could not be parsed.
    #[error("bad environment variable: {0}")]
    Env(String),
    /// Values that parse but do not make sense.
    #[error("invalid configuration: {}", .0.join("; "))]
    Invalid(Vec<String>),
}

/// Every environment variable omni-engine reads (envy maps field `foo_bar` to `FOO_BAR`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct EnvVars {
    /// Ring slot size of the broadcast queue in MiB (vLLM's name; default 16). Payloads larger
    /// than one slot go over ZeroMQ.
    pub vllm_mq_max_chunk_bytes_mb: Option<u64>,
    /// Number of ring slots (default 10).
    pub omni_ipc_max_chunks: Option<usize>,
    /// How long a waiting reader spins before parking, in microseconds (default 200).
    pub omni_ipc_spin_us: Option<u64>,
    /// Interval of the "No available shared memory broadcast block" warning, seconds (60).
    pub omni_ipc_warn_interval_s: Option<u64>,
    /// Where downloaded models are cached (default `$HOME/.cache/omni-engine`).
    pub omni_cache_dir: Option<String>,
}

impl EnvVars {
    /// Reads the process environment (once, at start-up, in the binary).
    pub fn from_env() -> Result<Self, Error> {
        Self::from_iter(std::env::vars())
    }

    /// Reads from explicit pairs (tests, handshakes).
    #[allow(clippy::should_implement_trait)]
    pub fn from_iter(vars: impl IntoIterator<Item = (String, String)>) -> Result<Self, Error> {
        let known = [
            "VLLM_MQ_MAX_CHUNK_BYTES_MB",
            "OMNI_IPC_MAX_CHUNKS",
            "OMNI_IPC_SPIN_US",
            "OMNI_IPC_WARN_INTERVAL_S",
            "OMNI_CACHE_DIR",
        ];
        let vars: Vec<(String, String)> = vars
            .into_iter()
            .filter(|(k, _)| known.contains(&k.as_str()))
            .collect();
        envy::from_iter(vars).map_err(|e| Error::Env(e.to_string()))
    }

    /// The broadcast queue's configuration from these variables over the defaults.
    pub fn ipc_config(&self) -> Result<MessageQueueConfig, Error> {
        let mut c = MessageQueueConfig::default();
        let mut problems = Vec::new();
        if let Some(mb) = self.vllm_mq_max_chunk_bytes_mb {
            if mb == 0 || mb > 64 * 1024 {
                problems.push(format!(
                    "VLLM_MQ_MAX_CHUNK_BYTES_MB must be between 1 and 65536, got {mb}"
                ));
            } else {
                c.max_chunk_bytes = (mb as usize) << 20;
            }
        }
        if let Some(n) = self.omni_ipc_max_chunks {
            if n == 0 || n > 1024 {
                problems.push(format!(
                    "OMNI_IPC_MAX_CHUNKS must be between 1 and 1024, got {n}"
                ));
            } else {
                c.max_chunks = n;
            }
        }
        if let Some(us) = self.omni_ipc_spin_us {
            c.spin = Duration::from_micros(us);
        }
        if let Some(s) = self.omni_ipc_warn_interval_s {
            if s == 0 {
                problems.push("OMNI_IPC_WARN_INTERVAL_S must be at least 1".to_string());
            } else {
                c.warn_interval = Duration::from_secs(s);
            }
        }
        if c.max_message_bytes < c.max_chunk_bytes {
            c.max_message_bytes = c.max_chunk_bytes;
        }
        if problems.is_empty() {
            Ok(c)
        } else {
            Err(Error::Invalid(problems))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<EnvVars, Error> {
        EnvVars::from_iter(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn chunk_size_defaults_to_16_mib() {
        assert_eq!(
            env(&[]).unwrap().ipc_config().unwrap().max_chunk_bytes,
            16 << 20
        );
    }

    #[test]
    fn chunk_size_comes_from_vllm_variable() {
        let c = env(&[
            ("VLLM_MQ_MAX_CHUNK_BYTES_MB", "100"),
            ("OMNI_IPC_MAX_CHUNKS", "4"),
        ])
        .unwrap()
        .ipc_config()
        .unwrap();
        assert_eq!((c.max_chunk_bytes, c.max_chunks), (100 << 20, 4));
    }

    #[test]
    fn unparsable_value_is_a_clear_error() {
        let e = env(&[("VLLM_MQ_MAX_CHUNK_BYTES_MB", "sixteen")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("VLLM_MQ_MAX_CHUNK_BYTES_MB"), "{e}");
    }

    #[test]
    fn out_of_range_values_are_all_reported() {
        let e = env(&[
            ("VLLM_MQ_MAX_CHUNK_BYTES_MB", "0"),
            ("OMNI_IPC_MAX_CHUNKS", "0"),
        ])
        .unwrap()
        .ipc_config()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("VLLM_MQ_MAX_CHUNK_BYTES_MB") && e.contains("OMNI_IPC_MAX_CHUNKS"),
            "{e}"
        );
    }
}
