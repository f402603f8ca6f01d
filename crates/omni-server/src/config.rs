//! [`ServerConfig`]: what the HTTP layer needs to know (the binary fills it from `EngineConfig`),
//! and [`ConnectionLimits`]: how long and how many connections the listener keeps.

use std::time::Duration;

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
    /// Whether the model has an audio output stage (`modalities: ["audio"]` is refused if not).
    pub audio_output: bool,
    /// Largest accepted `n`.
    pub max_n: u32,
    /// Timeouts and the connection bound of the listener ([`crate::serve_on`]).
    pub connections: ConnectionLimits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 8000,
            served_model_names: vec!["default".into()],
            api_key: None,
            max_model_len: 4096,
            max_body_bytes: 32 * 1024 * 1024,
            audio_output: false,
            max_n: 128,
            connections: ConnectionLimits::default(),
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
    /// uvicorn's `timeout_keep_alive`; default 5 s.
    pub timeout_keep_alive: Duration,
    /// Close a connection whose request header has not arrived whole this long after its first
    /// byte (a client trickling a header byte by byte). Default 10 s.
    pub header_read_timeout: Duration,
    /// Most connections open at once (uvicorn's `limit_concurrency`). A connection beyond it gets
    /// one `503` in OpenAI's error shape and is closed. Default 1024.
    pub limit_concurrency: usize,
}

impl ConnectionLimits {
    /// [`ConnectionLimits::timeout_keep_alive`]'s default (vLLM's).
    pub const DEFAULT_TIMEOUT_KEEP_ALIVE: Duration = Duration::from_secs(5);
    /// [`ConnectionLimits::header_read_timeout`]'s default.
    pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
    /// [`ConnectionLimits::limit_concurrency`]'s default.
    pub const DEFAULT_LIMIT_CONCURRENCY: usize = 1024;
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            timeout_keep_alive: Self::DEFAULT_TIMEOUT_KEEP_ALIVE,
            header_read_timeout: Self::DEFAULT_HEADER_READ_TIMEOUT,
            limit_concurrency: Self::DEFAULT_LIMIT_CONCURRENCY,
        }
    }
}
