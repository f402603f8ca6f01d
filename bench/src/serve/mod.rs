//! `omni-engine bench serve`: an OpenAI-API load generator that measures TTFT, TPOT, ITL and
//! end-to-end latency over streamed requests and prints vLLM's `Serving Benchmark Result` block.
//! It speaks only the public OpenAI API, so the same command benchmarks omni-engine and vLLM.
//!
//! With `--omni` (vLLM-Omni's `vllm bench serve --omni --backend openai-chat-omni`) it sends
//! chat requests with `modalities` (default text and audio) and
//! `stream_options.continuous_usage_stats`, times text chunks for TTFT / ITL / TPOT and audio
//! chunks (`modality: "audio"`, each a base64 WAV file of its own) for the time to first packet
//! (TTFP: the first non-empty audio chunk) and the real-time factor (RTF: the last audio chunk's
//! arrival over the audio's duration, PCM sample frames of every decoded chunk over its sample
//! rate), and prints vLLM-Omni's block with its Text Result and Audio Result.
//! Datasets beside random and ShareGPT: a Seed-TTS-like one ([`seed_tts`]). For dummy weights,
//! `--omni-fixed-lengths 64,144` fixes the Thinker tokens and Talker frames of every request.
//!
//! Requests go out as `vllm bench serve` sends them (its `benchmark` and `get_request`): one
//! test request first (retried until the server answers, `--ready-check-timeout-sec`); then
//! every request gets an arrival time (all at once at `--request-rate inf`, else exponential
//! gaps rescaled so the last arrives at `num_prompts / rate`), becomes a task at that time, and
//! waits there on a FIFO semaphore of `--max-concurrency` permits: a request starts the moment
//! any earlier one finishes. Each response is read to its end so that its keep-alive connection
//! carries the next request, as aiohttp's pool does (a body dropped at `[DONE]` can close its
//! connection, and a request that has to open a new one reaches the server later than one that
//! reuses one).
//!
//! ```no_run
//! use clap::Parser;
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     serve: omni_bench::serve::ServeBenchArgs,
//! }
//! let args = Cli::parse_from(["bench", "--base-url", "http://127.0.0.1:8000", "--num-prompts", "8"]);
//! let result = omni_bench::serve::run(args.serve).unwrap();
//! println!("{} ok", result.completed);
//! ```

mod client;
pub mod dataset;
mod engine_counters;
mod omni_stats;
mod plan;
pub mod random_mm;
pub mod seed_tts;
pub mod stats;
pub mod wav;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use omni_tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Semaphore;

use plan::{Plan, plan, samples};

pub use client::{DEFAULT_OMNI_MODALITIES, RequestSpec};
pub use dataset::SampleRequest;
pub use stats::{AudioMetrics, AudioOutcome, RequestOutcome, ServeBenchResult, Summary};

/// Which prompts to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatasetName {
    /// Random prompts of `--random-input-len` tokens.
    Random,
    /// vLLM's `random-mm`: random prompts, each with `--random-mm-base-items-per-request`
    /// synthetic PNG images of sizes from `--random-mm-bucket-config` (chat backend only).
    RandomMm,
    /// ShareGPT conversations from `--dataset-path`.
    Sharegpt,
    /// Text to speak under a text-to-speech system prompt: `meta.lst` of `--dataset-path`
    /// (`utt_id|prompt_transcript|prompt_wav|text`), else generated texts of
    /// `--seed-tts-prompt-len` tokens.
    SeedTts,
}

/// The request protocol (vLLM's `--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// `/v1/completions` with `prompt`.
    Openai,
    /// vLLM's name for the completions protocol.
    Vllm,
    /// `/v1/chat/completions` with `messages`.
    OpenaiChat,
    /// vLLM-Omni's: chat with content parts and `modalities`, text and audio chunks timed
    /// apart (the same as `--omni`).
    OpenaiChatOmni,
}

/// The metrics `--percentile-metrics` may name.
pub const PERCENTILE_METRICS: [&str; 7] = [
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "audio_ttfp",
    "audio_rtf",
    "audio_duration",
];

/// Options of `bench serve` (names as in `vllm bench serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeBenchArgs {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// API path: /v1/completions or /v1/chat/completions (default: the backend's).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Request protocol (default: chat when the endpoint is a chat one, else completions).
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// vLLM-Omni's omni mode (the `openai-chat-omni` backend): chat completions with
    /// `modalities` (default text and audio), audio chunks measured for time to first packet
    /// (TTFP) and real-time factor (RTF), and the Audio Result in the block. A request that
    /// asks for audio and gets none fails.
    #[arg(long)]
    pub omni: bool,
    /// JSON object merged into every request body, replacing the client's keys (e.g.
    /// '{"speaker":"chelsie","sampling_params_list":[...]}').
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Omni fixed-length profile for dummy weights, THINKER_TOKENS,TALKER_FRAMES (e.g.
    /// 64,144): `sampling_params_list` with those `max_tokens` and `ignore_eos` on both (the
    /// Talker keeps the built-in profile's sampling, Code2Wav its defaults).
    #[arg(long, value_delimiter = ',')]
    pub omni_fixed_lengths: Option<Vec<usize>>,
    /// Requests sent (and discarded) before the timed run, --max-concurrency at a time.
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    /// Model name to request (default: the first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Dataset.
    #[arg(long, alias = "dataset-name", value_enum, default_value = "random")]
    pub dataset: DatasetName,
    /// ShareGPT JSON file.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Number of requests.
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Most requests in flight at once.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Requests per second (Poisson arrivals); `inf` sends all at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    /// Random dataset: prompt tokens, exactly as the server counts a completion prompt (the BOS
    /// it adds included) when `--tokenizer` is given; else a word count.
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Random dataset: output tokens.
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Seed-TTS generated set: tokens of text to speak (vLLM-Omni's blog: 10, 160, 320, 640);
    /// `w<id>` words unless --tokenizer fits them.
    #[arg(long, default_value_t = seed_tts::SEED_TTS_PROMPT_LENS[0])]
    pub seed_tts_prompt_len: usize,
    /// Seed-TTS: the Thinker's `max_tokens` (vLLM-Omni's default).
    #[arg(long, default_value_t = seed_tts::SEED_TTS_OUTPUT_LEN)]
    pub seed_tts_output_len: usize,
    /// Random dataset: lengths vary in [len*(1-r), len*(1+r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Random dataset: tokens of a prefix shared by every prompt.
    #[arg(long, default_value_t = 0)]
    pub random_prefix_len: usize,
    /// random-mm: images per request.
    #[arg(long, default_value_t = 1)]
    pub random_mm_base_items_per_request: usize,
    /// random-mm: image sizes and their probabilities, vLLM's syntax
    /// `{(height, width, frames): probability, ...}` (frames 1: images only).
    #[arg(long, default_value = random_mm::DEFAULT_BUCKET_CONFIG)]
    pub random_mm_bucket_config: String,
    /// Send `ignore_eos: true` so every request generates its full output length.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Seed of the dataset and the arrival process.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the figures as JSON to this file.
    #[arg(long)]
    pub save_result: Option<PathBuf>,
    /// Tokenizer (HF directory or GGUF file, the server's) to build prompts of exact token
    /// lengths.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Wait up to this many seconds for the first test request to succeed before the run,
    /// retrying every 5 s (vLLM's ready check); 0 skips the test request.
    #[arg(long, default_value_t = 600)]
    pub ready_check_timeout_sec: u64,
    /// Sections to print: any of ttft,tpot,itl,e2el,audio_ttfp,audio_rtf,audio_duration
    /// (default ttft,tpot,itl; with --omni also e2el,audio_ttfp,audio_rtf).
    #[arg(long, value_delimiter = ',')]
    pub percentile_metrics: Option<Vec<String>>,
    /// Hide the progress bar.
    #[arg(long)]
    pub disable_tqdm: bool,
}

/// Why the benchmark could not run (failed requests are counted, not errors).
#[derive(Debug, thiserror::Error)]
pub enum ServeBenchError {
    /// Bad option values.
    #[error("invalid arguments: {0}")]
    Args(String),
    /// The dataset could not be read.
    #[error("dataset {path}: {reason}")]
    Dataset {
        /// File.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The tokenizer failed.
    #[error(transparent)]
    Tokenizer(#[from] omni_tokenizer::Error),
    /// The server could not be asked for its model.
    #[error("querying {url}: {reason}")]
    Server {
        /// URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// Local I/O (runtime, result file).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Runs the benchmark, prints the result block, and returns the figures.
pub fn run(args: ServeBenchArgs) -> Result<ServeBenchResult, ServeBenchError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run_async(args))
}

fn load_tokenizer(path: &std::path::Path) -> Result<Tokenizer, ServeBenchError> {
    if path.is_dir() {
        Ok(Tokenizer::from_hf_dir(path)?)
    } else {
        Ok(Tokenizer::from_gguf_path(path)?)
    }
}

/// When each request arrives, from the start of the run (vLLM's `get_request` at burstiness 1):
/// all at once for an infinite rate; else exponential gaps of mean `1 / rate`, summed and
/// rescaled so the last request arrives at exactly `n / rate` (vLLM does so that runs of
/// different seeds send at the same average rate).
pub fn arrival_times(n: usize, rate: f64, rng: &mut StdRng) -> Vec<Duration> {
    if !rate.is_finite() || n == 0 {
        return vec![Duration::ZERO; n];
    }
    let mut at = 0.0;
    let cumulative: Vec<f64> = (0..n)
        .map(|_| {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            at += -u.ln() / rate;
            at
        })
        .collect();
    let scale = n as f64 / rate / at;
    cumulative
        .into_iter()
        .map(|t| Duration::from_secs_f64(t * scale))
        .collect()
}

/// Sends `n` requests (the samples' bodies in turn), `limit` at a time, and waits for them
/// all; their figures are dropped.
async fn warm_up(
    http: &reqwest::Client,
    url: &str,
    bodies: &[(serde_json::Value, usize)],
    n: usize,
    limit: &Arc<Semaphore>,
) {
    let tasks: Vec<_> = bodies
        .iter()
        .cycle()
        .take(n)
        .map(|(body, prompt_len)| {
            let (http, url, body, limit) =
                (http.clone(), url.to_string(), body.clone(), limit.clone());
            let prompt_len = *prompt_len;
            tokio::spawn(async move {
                let _permit = limit.acquire_owned().await;
                client::send(&http, &url, &body, prompt_len, Instant::now()).await
            })
        })
        .collect();
    let mut failed = 0;
    for t in tasks {
        if !t.await.is_ok_and(|o| o.success) {
            failed += 1;
        }
    }
    eprintln!("warm-up: {n} request(s), {failed} failed");
}

async fn run_async(args: ServeBenchArgs) -> Result<ServeBenchResult, ServeBenchError> {
    let Plan {
        endpoint,
        mut spec,
        metrics,
    } = plan(&args)?;
    let tokenizer = args.tokenizer.as_deref().map(load_tokenizer).transpose()?;
    let samples = samples(&args, tokenizer.as_ref())?;
    let base = args.base_url.trim_end_matches('/').to_string();
    // Keep-alive connections, no Nagle: what aiohttp's connector does for vLLM's client.
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .map_err(|e| ServeBenchError::Server {
            url: base.clone(),
            reason: format!("building the HTTP client: {e}"),
        })?;
    spec.model = match &args.model {
        Some(m) => m.clone(),
        None => client::first_model(&http, &base).await?,
    };
    let url = format!("{base}{endpoint}");
    if args.ready_check_timeout_sec > 0
        && let Some(first) = samples.first()
    {
        let body = spec.body(first);
        let timeout = Duration::from_secs(args.ready_check_timeout_sec);
        let test = client::wait_for_endpoint(&http, &url, &body, first.prompt_len, timeout).await;
        if let Some(e) = test.error {
            return Err(ServeBenchError::Server {
                url,
                reason: format!("the initial test request failed: {e}"),
            });
        }
    }
    let limit = Arc::new(Semaphore::new(
        args.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    if args.num_warmups > 0 {
        let bodies: Vec<_> = samples
            .iter()
            .map(|s| (spec.body(s), s.prompt_len))
            .collect();
        warm_up(&http, &url, &bodies, args.num_warmups, &limit).await;
    }

    let progress = if args.disable_tqdm {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(samples.len() as u64)
    };
    progress.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let counters_before = engine_counters::scrape(&http, &base).await;
    let mut rng = StdRng::seed_from_u64(args.seed);
    let arrivals = arrival_times(samples.len(), args.request_rate, &mut rng);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(samples.len());
    for (sample, at) in samples.into_iter().zip(arrivals) {
        if let Some(wait) = (start + at).checked_duration_since(Instant::now())
            && !wait.is_zero()
        {
            tokio::time::sleep(wait).await;
        }
        let body = spec.body(&sample);
        let (http, url, limit, progress) =
            (http.clone(), url.clone(), limit.clone(), progress.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = limit.acquire_owned().await;
            let outcome = client::send(&http, &url, &body, sample.prompt_len, start).await;
            progress.inc(1);
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await.unwrap_or_else(|e| RequestOutcome {
            error: Some(format!("request task failed: {e}")),
            ..RequestOutcome::default()
        }));
    }
    let duration = start.elapsed().as_secs_f64();
    progress.finish_and_clear();
    // Nothing to report where no engine core stepped (`serve --omni`: the stages have their own
    // loops and the `omni:` engine counters stay at zero).
    let counters = match (counters_before, engine_counters::scrape(&http, &base).await) {
        (Some(before), Some(after)) => Some(after.since(&before)).filter(|c| c.steps > 0.0),
        _ => None,
    };

    let result =
        ServeBenchResult::compute(&outcomes, duration, args.max_concurrency, args.request_rate);
    for e in &result.errors {
        eprintln!("request failed: {e}");
    }
    if spec.omni {
        print!("{}", result.format_omni_block(&metrics));
    } else {
        print!("{}", result.format_block(&metrics));
    }
    if let Some(c) = &counters {
        print!("{}", c.format_block());
    }
    if let Some(path) = &args.save_result {
        let mut json = serde_json::to_value(&result).unwrap_or_default();
        json["model"] = serde_json::json!(spec.model);
        json["endpoint"] = serde_json::json!(endpoint);
        json["base_url"] = serde_json::json!(args.base_url);
        json["num_prompts"] = serde_json::json!(args.num_prompts);
        json["omni"] = serde_json::json!(spec.omni);
        json["num_warmups"] = serde_json::json!(args.num_warmups);
        if let Some(extra) = &args.extra_body {
            json["extra_body"] = serde_json::json!(extra);
        }
        if let Some(c) = &counters {
            c.add_to_json(&mut json);
        }
        let text = serde_json::to_string_pretty(&json).unwrap_or_default();
        std::fs::write(path, text)?;
    }
    Ok(result)
}
