//! [`ServerConfig`]: what the HTTP layer needs to know (the binary fills it from omni-config's
//! `FrontendConfig` and `EngineConfig`),
//! and [`ConnectionLimits`]: how long and how many connections the listener keeps.

use std::sync::Arc;
use std::time::Duration;

use crate::media::MultimodalModel;
use crate::omni::OmniServerInfo;

/// HTTP server settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// Address to bind, e.g. `0.0.0.0`.
    pub host: String,
    /// Port to bind.
    pub port: u16,
    /// Names the model answers to; the first is reported in responses and metric labels.
    pub served_model_names: Vec<String>,
    /// When set, `/v1/*` requires `Authorization: Bearer <api_key>`.
    pub api_key: Option<String>,
    /// Longest prompt + completion, in tokens.
    pub max_model_len: u32,
    /// Largest accepted request body, in bytes (larger ones get 413).
    pub max_body_bytes: usize,
    /// The omni model's speakers, default modalities, sample rate and stage sampling defaults;
    /// `None` for a text-only model (then `modalities: ["audio"]`, `audio`, `speaker` are a 400).
    /// On an omni server `/v1/completions` is a 400 that points at chat.
    pub omni: Option<OmniServerInfo>,
    /// Largest accepted `n`.
    pub max_n: u32,
    /// Timeouts and the connection bound of the listener ([`crate::serve_on`]).
    pub connections: ConnectionLimits,
    /// Where media of chat content parts may come from, and how much of it (see
    /// [`crate::media`]).
    pub media: omni_config::MediaConfig,
    /// The model's vision and audio encoders; `None` for a text-only model (then every image
    /// or audio part is a 400 naming the modality).
    pub multimodal: Option<Arc<MultimodalModel>>,
}

impl Default for ServerConfig {
    /// omni-config's defaults for what it configures (host, port, connection limits, the
    /// engine's `--max-model-len`); the rest are the HTTP layer's own.
    fn default() -> Self {
        Self::new(
            &omni_config::FrontendConfig::default(),
            vec!["default".into()],
            omni_config::EngineConfig::default().model.max_model_len,
        )
    }
}

impl ServerConfig {
    /// The settings `serve` resolved: `frontend` (host, port, API key, connection limits), the
    /// names to answer to, and the engine's longest sequence.
    pub fn new(
        frontend: &omni_config::FrontendConfig,
        served_model_names: Vec<String>,
        max_model_len: u32,
    ) -> Self {
        Self {
            host: frontend.host.clone(),
            port: frontend.port,
            served_model_names,
            api_key: frontend.api_key.clone(),
            max_model_len,
            max_body_bytes: 32 * 1024 * 1024,
            omni: None,
            max_n: 128,
            connections: ConnectionLimits::from(frontend),
            media: omni_config::MediaConfig::default(),
            multimodal: None,
        }
    }
}

impl ServerConfig {
    /// The name reported in responses and metrics.
    pub fn model_name(&self) -> &str {
        self.served_model_names
            .first()
            .map(String::as_str)
            .unwrap_or("default")
    }

    /// Whether `name` is one of the served names.
    pub fn serves(&self, name: &str) -> bool {
        self.served_model_names.iter().any(|n| n == name)
    }
}

/// How long an HTTP connection may sit without a request, and how many may be open at once.
///
/// A connection is *idle* when no request is in flight on it and the last response has been
/// handed to the kernel whole. An idle connection is closed after [`timeout_keep_alive`] without
/// a byte from the client, or [`header_read_timeout`] after the first byte of a request header
/// that has not arrived whole by then, whichever comes first. A request in flight (a long
/// generation, an SSE stream) is never cut by either.
///
/// [`timeout_keep_alive`]: ConnectionLimits::timeout_keep_alive
/// [`header_read_timeout`]: ConnectionLimits::header_read_timeout
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Close an idle connection after this long without a byte from the client (also counted
    /// from the moment it was accepted). vLLM: `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, passed to
    /// uvicorn's `timeout_keep_alive`.
    pub timeout_keep_alive: Duration,
    /// Close a connection whose request header has not arrived whole this long after its first
    /// byte (a client trickling a header byte by byte).
    pub header_read_timeout: Duration,
    /// Most connections open at once (uvicorn's `limit_concurrency`). A connection beyond it gets
    /// one `503` in OpenAI's error shape and is closed.
    pub limit_concurrency: usize,
}

impl From<&omni_config::FrontendConfig> for ConnectionLimits {
    fn from(c: &omni_config::FrontendConfig) -> Self {
        Self {
            timeout_keep_alive: c.keep_alive(),
            header_read_timeout: c.header_read(),
            limit_concurrency: c.limit_concurrency,
        }
    }
}

impl Default for ConnectionLimits {
    /// omni-config's defaults (`--timeout-keep-alive 5`, `--header-read-timeout 10`,
    /// `--limit-concurrency 1024`), written there once.
    fn default() -> Self {
        Self::from(&omni_config::FrontendConfig::default())
    }
}
