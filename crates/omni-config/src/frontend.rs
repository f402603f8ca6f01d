//! [`FrontendConfig`]: the API server's part of the configuration (vLLM's `FrontendArgs`).
//!
//! It goes through the same layering as [`crate::EngineConfig`] (defaults < `--config FILE` <
//! environment < command line; its defaults are written once, in the clap attributes below),
//! but it is not a field of the engine config: an engine (one stage of a pipeline, an
//! engine-core process, a worker) never needs the HTTP settings, and only the API process reads
//! them.

use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize, Serializer};

/// Settings of the HTTP layer (`serve` only).
#[derive(Debug, Clone, PartialEq, Eq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Server")]
#[serde(deny_unknown_fields)]
pub struct FrontendConfig {
    /// Address to bind.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    /// Port to bind (0: any free port; the log line `listening on ...` says which).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Names the model answers to in `model` (the first is reported). Default: MODEL as given,
    /// or the default model's name.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Require `Authorization: Bearer <KEY>` on /v1/*.
    #[arg(long, value_name = "KEY")]
    #[serde(serialize_with = "redacted")]
    pub api_key: Option<String>,
    /// Chat template: a Jinja file, or the template itself. Default: the model's own.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Close a connection that has no request in flight after this many seconds without a byte
    /// from the client (uvicorn's `--timeout-keep-alive`; env VLLM_HTTP_TIMEOUT_KEEP_ALIVE, as
    /// vLLM reads it).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 5,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub timeout_keep_alive: u64,
    /// Close a connection whose request header is still incomplete this many seconds after its
    /// first byte (a client trickling its header).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub header_read_timeout: u64,
    /// Most connections open at once (uvicorn's `--limit-concurrency`): a connection beyond it
    /// gets a 503 error and is closed. Keep it below the open-file limit (`ulimit -n`).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1024,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    pub limit_concurrency: usize,
}

impl Default for FrontendConfig {
    /// The defaults, as clap's attributes write them (the one place they are written).
    fn default() -> Self {
        crate::engine::clap_defaults()
    }
}

impl FrontendConfig {
    /// `--timeout-keep-alive` as a duration.
    pub fn keep_alive(&self) -> Duration {
        Duration::from_secs(self.timeout_keep_alive)
    }

    /// `--header-read-timeout` as a duration.
    pub fn header_read(&self) -> Duration {
        Duration::from_secs(self.header_read_timeout)
    }
}

/// Start-up logs the resolved config; the key itself never reaches a log.
fn redacted<S: Serializer>(key: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match key {
        Some(_) => s.serialize_str("<set>"),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_clap_attributes_and_the_api_key_is_not_logged() {
        let d = FrontendConfig::default();
        assert_eq!((d.host.as_str(), d.port), ("0.0.0.0", 8000));
        assert_eq!(d.keep_alive(), Duration::from_secs(5));
        assert_eq!(d.header_read(), Duration::from_secs(10));
        assert_eq!(d.limit_concurrency, 1024);
        let c = FrontendConfig {
            api_key: Some("secret".into()),
            ..d
        };
        let logged = serde_json::to_string(&c).unwrap();
        assert!(!logged.contains("secret"), "{logged}");
        assert!(logged.contains("<set>"), "{logged}");
    }
}
