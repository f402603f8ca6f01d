//! OpenAI-compatible HTTP API server (layer L4, the `omni-api` process).
//!
//! Owns the HTTP surface: `POST /v1/chat/completions`, `POST /v1/completions` (plain JSON and
//! SSE streaming), `GET /v1/models`, vLLM's `POST /tokenize` and `POST /detokenize`, `/health`,
//! `/version` and `/metrics` (vLLM's metric names).
//! Tokenization, chat templating, incremental detokenization and stop strings happen here; the
//! engine receives token ids through the [`EngineClient`] trait and never sees text. Every error
//! is one [`ApiError`] rendered as OpenAI's error JSON. The listener ([`serve_on`]) closes idle
//! and half-sent connections and bounds how many are open ([`ConnectionLimits`]).
//!
//! Chat content parts may carry images and audio on a model with the encoders for them
//! ([`media`]: base64 data URLs, allowed http(s) hosts under an egress guard, `file://` under
//! an allowed directory; limits checked before fetching; omni-mm decodes and preprocesses).
//!
//! An omni model (text + speech; [`ServerConfig::omni`] set, see [`OmniServerInfo`]) takes
//! vLLM-Omni's chat fields (`modalities`, `audio.format`, `speaker` / `voice`,
//! `sampling_params_list`), sends them to the engine as `EngineCoreRequest::omni`, and answers
//! with a text choice and an audio choice, or a stream whose chunks carry `modality` and whose
//! audio chunks are each a complete file in base64.
//!
//! ```no_run
//! # async fn run(engine: std::sync::Arc<dyn omni_server::EngineClient>) -> Result<(), omni_server::ServeError> {
//! use std::sync::Arc;
//! use omni_server::ServerConfig;
//!
//! let tokenizer = Arc::new(omni_tokenizer::Tokenizer::from_gguf_path("model.gguf").unwrap());
//! let config = ServerConfig { port: 8000, ..ServerConfig::default() };
//! omni_server::serve(config, engine, tokenizer).await
//! # }
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod audio;
mod config;
mod connection;
mod engine;
mod error;
mod generate;
mod logprobs;
pub mod media;
mod metrics;
mod omni;
mod omni_stream;
pub mod openai;
mod prepare;
mod tokenize;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;
use serde_json::json;

pub use config::{ConnectionLimits, ServerConfig};
pub use engine::{CacheInfo, EngineClient, EngineError, OutputReceiver};
pub use error::ApiError;
pub use metrics::{
    AUDIO_RTF_BUCKETS, AUDIO_SECONDS_BUCKETS, ITL_BUCKETS, Metrics, REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
};
pub use omni::{OmniServerInfo, SamplingParamsParseError, sampling_params_from_json};
pub use omni_stream::NO_AUDIO_PRODUCED;
pub use omni_tokenizer::Tokenizer;

use generate::Generation;
use prepare::Prepared;

/// Failure to run the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Binding the listening socket failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Shared state of every handler.
#[derive(Debug)]
pub(crate) struct AppState {
    config: ServerConfig,
    engine: Arc<dyn EngineClient>,
    tokenizer: Arc<Tokenizer>,
    metrics: Metrics,
    /// Preprocessed media by source (`--mm-processor-cache-gb`; `None`: off).
    mm_cache: Option<media::ProcessorCache>,
}

impl std::fmt::Debug for dyn EngineClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineClient")
    }
}

/// The application: every route, the body limit and API-key check, OpenAI-shaped 404/405s.
pub fn router(
    config: ServerConfig,
    engine: Arc<dyn EngineClient>,
    tokenizer: Arc<Tokenizer>,
) -> Router {
    let body_limit = config.max_body_bytes;
    let metrics = Metrics::new(config.model_name());
    let mm_cache = config
        .multimodal
        .as_ref()
        .and_then(|_| media::ProcessorCache::new(config.media.mm_processor_cache_gb));
    let state = Arc::new(AppState {
        config,
        engine,
        tokenizer,
        metrics,
        mm_cache,
    });
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), check_api_key));
    // As in vLLM, the API key guards `/v1/*` only; the tokenizer endpoints never reach the
    // engine.
    Router::new()
        .merge(v1)
        .route("/tokenize", post(tokenize_handler))
        .route("/detokenize", post(detokenize_handler))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics_handler))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Binds `config.host:config.port` and serves until the process ends, under
/// `config.connections`.
pub async fn serve(
    config: ServerConfig,
    engine: Arc<dyn EngineClient>,
    tokenizer: Arc<Tokenizer>,
) -> Result<(), ServeError> {
    let addr = format!("{}:{}", config.host, config.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: addr.clone(),
            source,
        })?;
    tracing::info!(%addr, model = config.model_name(), "omni-api listening");
    let limits = config.connections.clone();
    serve_on(
        listener,
        router(config, engine, tokenizer),
        limits,
        std::future::pending(),
    )
    .await;
    Ok(())
}

/// Serves `app` on an already bound listener until `shutdown` resolves, then closes idle
/// connections and waits for the busy ones to finish their response. Connections are HTTP/1.1
/// under `limits`: idle ones close after `timeout_keep_alive`, a request header must arrive
/// whole within `header_read_timeout` of its first byte, and beyond `limit_concurrency` open
/// connections a new one gets a `503` and is closed. Tests bind port 0 and pass the listener
/// here.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    connection::serve(listener, app, limits, shutdown).await;
}

async fn check_api_key(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if given != Some(key.as_str()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Parses a JSON body into `T`, turning every failure into an OpenAI-shaped 4xx.
fn parse_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body?;
    if let Some(ct) = headers.get(header::CONTENT_TYPE)
        && !ct
            .to_str()
            .is_ok_and(|s| s.trim_start().starts_with("application/json"))
    {
        return Err(ApiError::with_status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Content-Type must be application/json",
        ));
    }
    serde_json::from_slice(&body).map_err(|e| {
        let what = if e.is_data() {
            "invalid request"
        } else {
            "malformed JSON"
        };
        ApiError::bad_request(format!("{what}: {e}"))
    })
}

/// Runs tokenization (CPU work) on a blocking thread.
async fn blocking<T: Send + 'static>(
    state: &Arc<AppState>,
    f: impl FnOnce(&ServerConfig, &Tokenizer) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let st = state.clone();
    tokio::task::spawn_blocking(move || f(&st.config, &st.tokenizer))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

async fn run(state: Arc<AppState>, prep: Prepared) -> Response {
    if let Err(cause) = state.engine.is_healthy() {
        return ApiError::from(EngineError::Dead { cause }).into_response();
    }
    let stream = prep.stream;
    let generation = match Generation::start(state, prep) {
        Ok(g) => g,
        Err(e) => return e.into_response(),
    };
    if stream {
        Sse::new(generation.into_sse())
            .keep_alive(KeepAlive::default())
            .into_response()
    } else {
        match generation.collect().await {
            Ok(v) => axum::Json(v).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut req = match parse_body::<openai::ChatCompletionRequest>(&headers, body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    // The cheap checks before any media is fetched.
    if let Err(e) = prepare::check_chat(&state.config, &req.common, req.messages.len()) {
        return e.into_response();
    }
    let media = match media::load(&state, std::mem::take(&mut req.messages)).await {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    match blocking(&state, move |c, t| prepare::prepare_chat(c, t, req, media)).await {
        Ok(prep) => run(state, prep).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let req = match parse_body::<openai::CompletionRequest>(&headers, body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match blocking(&state, move |c, t| prepare::prepare_completion(c, t, req)).await {
        Ok(prep) => run(state, prep).await,
        Err(e) => e.into_response(),
    }
}

async fn tokenize_handler(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut req = match parse_body::<openai::TokenizeRequest>(&headers, body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let media = match &mut req {
        openai::TokenizeRequest::Chat(r) => {
            if let Err(e) = prepare::check_model(&state.config, &r.model) {
                return e.into_response();
            }
            match media::load(&state, std::mem::take(&mut r.messages)).await {
                Ok(m) => m,
                Err(e) => return e.into_response(),
            }
        }
        openai::TokenizeRequest::Completion(_) => media::ChatMedia::default(),
    };
    match blocking(&state, move |c, t| tokenize::tokenize(c, t, req, media)).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize_handler(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let req = match parse_body::<openai::DetokenizeRequest>(&headers, body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match blocking(&state, move |c, t| tokenize::detokenize(c, t, req)).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let data: Vec<_> = state
        .config
        .served_model_names
        .iter()
        .map(|name| {
            json!({
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "omni-engine",
                "root": state.config.model_name(),
                "parent": null,
                "max_model_len": state.config.max_model_len,
            })
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.is_healthy() {
        Ok(()) => StatusCode::OK.into_response(),
        Err(cause) => ApiError::from(EngineError::Dead { cause }).into_response(),
    }
}

async fn version() -> Response {
    axum::Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

async fn metrics_handler(State(state): State<Arc<AppState>>) -> Response {
    let text = state.metrics.render(state.engine.as_ref());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn not_found() -> Response {
    ApiError::with_status(StatusCode::NOT_FOUND, "Not found.").into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::with_status(StatusCode::METHOD_NOT_ALLOWED, "Method not allowed.").into_response()
}
