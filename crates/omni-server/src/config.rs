//! [`ServerConfig`]: what the HTTP layer needs to know (the binary fills it from `EngineConfig`).

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
