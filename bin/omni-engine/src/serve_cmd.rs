//! `omni-engine serve`: the OpenAI-compatible API server (vLLM's `vllm serve`).
//!
//! This process (`omni-api`) loads the tokenizer and chat template, runs omni-server's axum
//! router, and drives the engine core: on a thread of its own, or, with
//! `--enable-multiprocessing` (env `VLLM_ENABLE_V1_MULTIPROCESSING=1`), in an `omni-engine-core`
//! process that spawns the workers (one process per tensor-parallel rank, token ids only).
//! Start-up sweeps stale `/dev/shm/omni.*` segments, logs the resolved config and the KV cache
//! size, then `listening on http://host:port`. SIGINT or SIGTERM: stop accepting, abort
//! in-flight requests (their streams end with a 503 error event), shut the engine core and the
//! workers down (which removes their shared memory), exit 0. A dead worker or engine core turns
//! `/health` and every request into a 503 naming it.
//!
//! ```text
//! omni-engine serve                                   # the built-in default model on :8000
//! omni-engine serve path/to/hf-dir -tp 2 --port 8001 --served-model-name tiny
//! omni-engine serve model.gguf --api-key secret --max-model-len 4096
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use omni_core::EngineCoreClient;
use omni_server::{CacheInfo, EngineClient as _, ServerConfig, Tokenizer};
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::engine_adapter::CoreEngineClient;
use crate::generate_cmd::{load_tokenizer, start_engine};
use omni_config::{EngineConfig, FrontendConfig};
use omni_launch::StartedEngine;

/// How long in-flight connections may take to close after a shutdown signal.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// `omni-engine serve` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Model: a HF checkpoint directory or a `.gguf` file. Absent: the built-in
    /// SmolLM2-135M-Instruct GGUF (fetched into ~/.cache/omni-engine/models on first use).
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    pub model_tag: Option<PathBuf>,
    /// A YAML file of flags (keys are the long flag names, as in vLLM's `--config`); the
    /// environment and the command line override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// HTTP server.
    #[command(flatten)]
    pub server: FrontendConfig,
    /// Engine: model loading, parallelism, KV cache, scheduler.
    #[command(flatten)]
    pub engine: EngineConfig,
    /// Omni models: the stage pipeline and its deploy profile.
    #[command(flatten)]
    pub omni: omni_config::OmniArgs,
    /// Multimodal inputs: media fetching and limits (boxed: it is large, and `serve` is one
    /// variant of the command enum).
    #[command(flatten)]
    pub media: Box<omni_config::MediaConfig>,
}

/// Runs the server until SIGINT or SIGTERM.
pub fn run(args: Args) -> anyhow::Result<()> {
    let swept = omni_ipc::shm::sweep_stale();
    if !swept.is_empty() {
        tracing::info!(?swept, "removed shared memory segments of dead instances");
    }
    let mut engine_config = args.engine.clone();
    if let Some(m) = &args.model_tag {
        engine_config.model.model = Some(m.clone());
    }
    let given = engine_config.model.model.clone();
    engine_config.validate()?;
    if engine_config.parallel.headless {
        return crate::headless::run(&engine_config);
    }
    let model = omni_launch::resolve_model(&engine_config)?;
    engine_config.model.model = Some(model.clone());
    let mut tokenizer = load_tokenizer(&model)
        .with_context(|| format!("loading the tokenizer of {}", model.display()))?;
    if let Some(t) = &args.server.chat_template {
        tokenizer
            .set_chat_template(chat_template_source(t)?)
            .context("--chat-template")?;
    }
    if tokenizer.chat_template().is_none() {
        tracing::warn!(
            "{} has no chat template: /v1/chat/completions will answer 400 (pass --chat-template)",
            model.display()
        );
    }
    let mut config = server_config(&args, given.as_deref());
    config.media = (*args.media).clone();
    if let Some(dir) = &config.media.allowed_local_media_path {
        anyhow::ensure!(
            dir.is_dir(),
            "--allowed-local-media-path {} is not a directory",
            dir.display()
        );
    }
    config.multimodal = multimodal_model(&model)?.map(Arc::new);
    if let Some(mm) = &config.multimodal {
        tracing::info!(
            image = mm.image.is_some(),
            audio = mm.audio.is_some(),
            "the model takes media in chat content parts"
        );
    }
    tracing::info!(
        config_file = ?args.config,
        served_model_name = ?config.served_model_names,
        config = %serde_json::to_string(&args.server).unwrap_or_default(),
        "resolved server config"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("omni-api")
        .build()
        .context("starting the tokio runtime")?;
    let t_load = Instant::now();
    // On the main thread, which lives as long as the engine: workers and stages die with the
    // thread that spawned them (PR_SET_PDEATHSIG).
    let (core, cache): (Arc<dyn EngineCoreClient>, CacheInfo) = if args.omni.omni {
        let started = crate::serve_omni::start(&args, &engine_config, &model)?;
        tracing::info!("omni pipeline ready in {:.2?}", t_load.elapsed());
        config.omni = Some(started.info);
        (started.engine, started.cache)
    } else {
        let StartedEngine {
            engine, scheduler, ..
        } = start_engine(&engine_config)?;
        tracing::info!(
            num_gpu_blocks = scheduler.num_blocks,
            block_size = scheduler.block_size,
            "engine ready in {:.2?}: {} KV blocks ({} tokens of KV cache)",
            t_load.elapsed(),
            scheduler.num_blocks,
            scheduler.num_blocks * scheduler.block_size
        );
        let cache = CacheInfo {
            block_size: engine_config.cache.block_size,
            num_gpu_blocks: u32::try_from(scheduler.num_blocks).unwrap_or(u32::MAX),
        };
        (engine, cache)
    };
    let engine = core.clone();
    let adapter = Arc::new(CoreEngineClient::new(core.clone(), cache));
    // A multi-node group lives and dies as a whole (LeaderWorkerSet recreates it): a dead
    // engine there ends the leader with an error instead of serving 503s.
    let fatal_on_death = engine_config.parallel.nnodes > 1;
    let result = runtime.block_on(serve_until_signal(
        config,
        adapter,
        tokenizer,
        core,
        fatal_on_death,
    ));
    engine.shutdown();
    runtime.shutdown_timeout(Duration::from_secs(1));
    match &result {
        Ok(()) => tracing::info!("shutdown complete"),
        Err(e) => tracing::error!("server failed: {e:#}"),
    }
    result
}

fn server_config(args: &Args, given: Option<&Path>) -> ServerConfig {
    let names = if args.server.served_model_name.is_empty() {
        vec![match given {
            Some(m) => m.display().to_string(),
            None => omni_gguf::default_model::MODEL_NAME.to_string(),
        }]
    } else {
        args.server.served_model_name.clone()
    };
    ServerConfig::new(&args.server, names, args.engine.model.max_model_len)
}

/// The vision and audio towers of a Hugging Face model directory (from its `config.json` and
/// `preprocessor_config.json`); `None` for a GGUF file or a text-only model.
fn multimodal_model(model: &Path) -> anyhow::Result<Option<omni_server::media::MultimodalModel>> {
    let read = |name: &str| -> anyhow::Result<Option<serde_json::Value>> {
        let path = model.join(name);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        Ok(Some(value))
    };
    let Some(config) = read("config.json")? else {
        return Ok(None);
    };
    let preprocessor = read("preprocessor_config.json")?;
    omni_server::media::MultimodalModel::from_hf_config(&config, preprocessor.as_ref())
        .map_err(|e| anyhow::anyhow!("{}: {e}", model.display()))
}

/// `--chat-template`: a file's contents, or the argument itself when it is a template.
fn chat_template_source(arg: &str) -> anyhow::Result<String> {
    let path = Path::new(arg);
    if path.is_file() {
        return std::fs::read_to_string(path)
            .with_context(|| format!("reading --chat-template {}", path.display()));
    }
    if arg.contains("{{") || arg.contains("{%") {
        return Ok(arg.to_string());
    }
    bail!("--chat-template {arg:?} is neither a file nor a Jinja template")
}

/// Binds, logs `listening on http://...`, serves until SIGINT/SIGTERM, then stops the engine
/// (in-flight requests end with an error event) and waits up to [`DRAIN_TIMEOUT`] for open
/// connections.
async fn serve_until_signal(
    config: ServerConfig,
    engine: Arc<CoreEngineClient>,
    tokenizer: Tokenizer,
    core: Arc<dyn EngineCoreClient>,
    fatal_on_death: bool,
) -> anyhow::Result<()> {
    // Handlers first: a signal right after the listening line must not kill the process.
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let addr = format!("{}:{}", config.host, config.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr().context("reading the bound address")?;
    if let Err(cause) = engine.is_healthy() {
        bail!("the engine died during start-up: {cause}");
    }
    let limits = config.connections.clone();
    let app = omni_server::router(config, engine, Arc::new(tokenizer));
    tracing::info!("listening on http://{local} (press CTRL+C to quit)");
    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    let died = Arc::new(std::sync::Mutex::new(None::<String>));
    let died_in = died.clone();
    let watched = core.clone();
    let death = async move {
        if !fatal_on_death {
            return std::future::pending::<String>().await;
        }
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Err(e) = watched.health() {
                return e.to_string();
            }
        }
    };
    let shutdown = async move {
        tokio::select! {
            which = wait_for(&mut sigterm, &mut sigint) => tracing::info!(
                "{which}: shutting down (no new connections, aborting in-flight requests, \
                 stopping workers)"
            ),
            cause = death => {
                tracing::error!("{cause}: the multi-node group is broken; exiting with an error");
                if let Ok(mut d) = died_in.lock() {
                    *d = Some(cause);
                }
                // The streams already ended with the error; let their last bytes go out.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        // In-flight streams end at once; the wait for the engine core and its workers runs
        // off the runtime's threads (`run` waits for it again before exiting).
        tokio::task::spawn_blocking(move || core.shutdown());
        let _ = drain_tx.send(());
    };
    let server = omni_server::serve_on(listener, app, limits, shutdown);
    let drain_deadline = async move {
        match drain_rx.await {
            Ok(()) => tokio::time::sleep(DRAIN_TIMEOUT).await,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        () = server => {}
        () = drain_deadline => {
            tracing::warn!("connections still open {DRAIN_TIMEOUT:?} after the signal: closing them");
        }
    }
    match died.lock().ok().and_then(|mut d| d.take()) {
        Some(cause) => bail!("{cause}"),
        None => Ok(()),
    }
}

async fn wait_for(sigterm: &mut Signal, sigint: &mut Signal) -> &'static str {
    tokio::select! {
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn chat_template_is_a_file_or_an_inline_template() {
        assert_eq!(
            chat_template_source("{{ messages[0].content }}").unwrap(),
            "{{ messages[0].content }}"
        );
        assert!(chat_template_source("/no/such/template.jinja").is_err());
    }
}
