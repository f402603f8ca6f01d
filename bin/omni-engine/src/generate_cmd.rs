//! `omni-engine generate`: offline batch inference (vLLM's `LLM.generate`). Starts the engine
//! (one worker process per tensor-parallel rank, or the model in-process with
//! `--executor uni`), submits every prompt at once through the engine loop, and prints the
//! continuations (`--json`: `[{"prompt_token_ids":[..],"token_ids":[..],"text":".."}]`).
//! Throughput (prefill and decode tok/s) goes to stderr.
//!
//! ```text
//! omni-engine generate --prompt "What is the capital of France?" --chat --temperature 0
//! omni-engine generate --model path/to/hf-dir -tp 2 --prompt-token-ids 1,2,3 --json
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use anyhow::{Context, bail};
use omni_core::{
    DEFAULT_KV_CACHE_MEMORY_BYTES, EngineCore, EngineLoop, Executor, MultiprocConfig,
    MultiprocExecutor, SchedulerConfig, StartupSpec, UniprocExecutor,
};
use omni_protocol::{DType, Device, EngineCoreRequest, LoadFormat, LoadModelSpec, SamplingParams};
use omni_tokenizer::Tokenizer;

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// CUDA when an NVIDIA driver is present, else CPU.
    Auto,
    /// One NVIDIA GPU per tensor-parallel rank (bf16).
    Cuda,
    /// The CPU backend (f32).
    Cpu,
}

/// Where the weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadFormatArg {
    /// From the files found at `--model`.
    Auto,
    /// HF safetensors files.
    Safetensors,
    /// A GGUF file.
    Gguf,
    /// Random weights of the model's shapes.
    Dummy,
}

/// Which executor runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExecutorArg {
    /// One worker process per rank (`MultiprocExecutor`).
    Mp,
    /// The model in this process (`UniprocExecutor`, tensor-parallel size 1).
    Uni,
}

/// `omni-engine generate` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Model: a HF checkpoint directory or a `.gguf` file. Default: the built-in
    /// SmolLM2-135M-Instruct GGUF (fetched into ~/.cache/omni-engine/models on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A text prompt (repeatable).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// Render each text prompt as one user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A prompt as comma-separated token ids (repeatable), e.g. `1,2,3`.
    #[arg(long)]
    pub prompt_token_ids: Vec<String>,
    /// Repeat every prompt this many times (benchmarking batches).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Most tokens to generate per prompt.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Fewest tokens to generate before EOS may stop.
    #[arg(long, default_value_t = 0)]
    pub min_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k sampling (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Min-p sampling.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Per-request sampling seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating after EOS.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Engine: model loading, parallelism, KV cache, scheduler.
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Compute dtype of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeArg {
    /// The checkpoint's own dtype.
    Auto,
    /// 32-bit float.
    #[value(alias = "float")]
    Float32,
    /// 16-bit float.
    #[value(alias = "half")]
    Float16,
    /// bfloat16.
    Bfloat16,
}

/// Engine flags shared by `generate` and `serve` (vLLM's names): how the model is loaded, how
/// many ranks run it, how big the KV cache is, and the scheduler's budgets. [`start_engine`]
/// turns them into a running engine.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Engine")]
pub struct EngineArgs {
    /// Weight format: `auto` reads what the model path holds; `dummy` uses random weights of the
    /// model's shapes (config.json still required).
    #[arg(long, value_enum, default_value_t = LoadFormatArg::Auto)]
    pub load_format: LoadFormatArg,
    /// Compute dtype (`auto`: the checkpoint's). It travels to the workers in the load spec;
    /// the CPU backend computes in float32 whatever is asked (a warning says so).
    #[arg(long, value_enum, default_value_t = DtypeArg::Auto)]
    pub dtype: DtypeArg,
    /// Tensor-parallel size: worker processes (also `-tp`).
    #[arg(
        long = "tensor-parallel-size",
        visible_alias = "tp",
        default_value_t = 1
    )]
    pub tensor_parallel_size: u32,
    /// Executor.
    #[arg(long, value_enum, default_value_t = ExecutorArg::Mp)]
    pub executor: ExecutorArg,
    /// Longest sequence (prompt + output), in tokens.
    #[arg(long, default_value_t = 2048)]
    pub max_model_len: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Device: `auto` takes CUDA when an NVIDIA driver is present, else the CPU.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
    /// Fraction of each GPU's memory the engine may use (weights, activations, KV cache); the
    /// KV cache gets what is left after loading.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// KV cache bytes per rank, e.g. `256MiB`, `1GiB`, `1000000` (CPU default 256MiB; on a GPU
    /// the default is what `--gpu-memory-utilization` leaves).
    #[arg(long, value_parser = parse_bytes)]
    pub kv_cache_memory: Option<u64>,
    /// Run every step eagerly (no CUDA graphs for decode).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Use exactly this many KV blocks instead of the byte budget.
    #[arg(long)]
    pub num_gpu_blocks_override: Option<u32>,
    /// Most requests in a batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Reuse the KV blocks of shared prompt prefixes (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turn prefix caching off.
    #[arg(long, alias = "no-prefix-caching")]
    pub no_enable_prefix_caching: bool,
    /// Seed of the workers' global sampling stream and of dummy weights.
    #[arg(long, default_value_t = 0)]
    pub engine_seed: u64,
}

impl EngineArgs {
    /// Whether prefix caching is on (the last of the two flags wins; default on).
    pub fn prefix_caching(&self) -> bool {
        !self.no_enable_prefix_caching
    }
}

/// A started engine: the loop that owns the engine core, and what start-up decided.
#[derive(Debug)]
pub struct StartedEngine {
    /// The engine-core loop (drop or [`EngineLoop::shutdown`] stops it and the workers).
    pub engine: EngineLoop,
    /// The scheduler's configuration, KV blocks included.
    pub scheduler: SchedulerConfig,
}

/// The model path: `model` when given, else the built-in default model (fetched into the cache
/// on first use; its path is logged).
pub fn resolve_model(model: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(m) = model {
        return Ok(m.to_path_buf());
    }
    let path = omni_gguf::default_model::locate_or_fetch()
        .context("locating the default model (run scripts/fetch-default-model.sh)")?;
    tracing::info!(
        path = %path.display(),
        "no model given: using the built-in default model {}",
        omni_gguf::default_model::MODEL_NAME
    );
    Ok(path)
}

/// Starts the workers (one process per rank, or the model in-process with `--executor uni`),
/// loads `model`, sizes the KV cache and spawns the engine loop.
///
/// Call it on a thread that lives as long as the engine (the main thread): worker processes
/// get `PR_SET_PDEATHSIG` and die with the thread that spawned them.
pub fn start_engine(model: &Path, args: &EngineArgs) -> anyhow::Result<StartedEngine> {
    let device = resolve_device(args)?;
    if args.dtype != DtypeArg::Auto {
        tracing::warn!(
            "--dtype {:?}: the {device:?} backend computes in {} regardless",
            args.dtype,
            if device == Device::Cpu {
                "float32"
            } else {
                "bfloat16"
            }
        );
    }
    if !(args.gpu_memory_utilization > 0.0 && args.gpu_memory_utilization <= 1.0) {
        bail!(
            "--gpu-memory-utilization must be in (0, 1], got {}",
            args.gpu_memory_utilization
        );
    }
    let load = LoadModelSpec {
        model: model.display().to_string(),
        load_format: match args.load_format {
            LoadFormatArg::Auto => LoadFormat::Auto,
            LoadFormatArg::Safetensors => LoadFormat::Safetensors,
            LoadFormatArg::Gguf => LoadFormat::Gguf,
            LoadFormatArg::Dummy => LoadFormat::Dummy,
        },
        dtype: match args.dtype {
            DtypeArg::Auto => None,
            DtypeArg::Float32 => Some(DType::F32),
            DtypeArg::Float16 => Some(DType::F16),
            DtypeArg::Bfloat16 => Some(DType::Bf16),
        },
        max_model_len: args.max_model_len,
        block_size: args.block_size,
        gpu_memory_utilization: args.gpu_memory_utilization,
        tensor_parallel_size: args.tensor_parallel_size,
        seed: args.engine_seed,
        device,
        max_num_batched_tokens: args.max_num_batched_tokens as u32,
        max_num_seqs: args.max_num_seqs as u32,
        enforce_eager: args.enforce_eager,
    };
    let startup = StartupSpec {
        load,
        kv_cache_memory_bytes: match (args.kv_cache_memory, device) {
            (Some(b), _) if b > 0 => Some(b),
            (_, Device::Cpu) => Some(DEFAULT_KV_CACHE_MEMORY_BYTES),
            (_, Device::Cuda) => None,
        },
        num_blocks_override: args.num_gpu_blocks_override,
    };
    let (executor, num_blocks): (Box<dyn Executor + Send>, u32) = match args.executor {
        ExecutorArg::Mp => {
            let exe = std::env::current_exe().context("locating this binary")?;
            let mut config = MultiprocConfig::new(exe, args.tensor_parallel_size, startup);
            // The environment is read once, here; workers get the result in their handshake.
            config.ipc = omni_config::EnvVars::from_env()
                .and_then(|env| env.ipc_config())
                .context("reading the IPC settings from the environment")?;
            tracing::info!(
                max_chunk_bytes = config.ipc.max_chunk_bytes,
                max_chunks = config.ipc.max_chunks,
                "broadcast queue"
            );
            let ex = MultiprocExecutor::start(config)?;
            let n = ex.num_blocks();
            (Box::new(ex), n)
        }
        ExecutorArg::Uni => {
            if args.tensor_parallel_size != 1 {
                bail!("--executor uni runs one rank; use --executor mp for tensor parallelism");
            }
            let worker = omni_worker::Worker::new(0, Arc::new(omni_models::IdentityAllReduce));
            let ex = UniprocExecutor::start(worker, &startup)?;
            let n = ex.num_blocks();
            (Box::new(ex), n)
        }
    };
    let scheduler = SchedulerConfig {
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        max_model_len: args.max_model_len as usize,
        block_size: args.block_size as usize,
        num_blocks: num_blocks as usize,
        enable_prefix_caching: args.prefix_caching(),
        enable_chunked_prefill: true,
    };
    let engine = EngineLoop::spawn(EngineCore::new(scheduler.clone(), executor)?);
    Ok(StartedEngine { engine, scheduler })
}

/// The GPU this binary can use: its name and how many devices the driver sees.
#[derive(Debug)]
struct CudaStatus {
    name: String,
    device_count: usize,
}

#[cfg(feature = "cuda")]
fn cuda_status() -> Result<CudaStatus, String> {
    omni_backend::cuda::driver_status()
        .map(|i| CudaStatus {
            name: i.name,
            device_count: i.device_count,
        })
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda_status() -> Result<CudaStatus, String> {
    Err("this omni-engine was built without the CUDA backend (feature `cuda`)".into())
}

/// `--device`: `auto` is CUDA when a driver and a device are usable, else the CPU (logged);
/// `cuda` without a usable driver is a start-up error that says why.
pub fn resolve_device(args: &EngineArgs) -> anyhow::Result<Device> {
    match args.device {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Cuda => match cuda_status() {
            Ok(info) => {
                let need = args.tensor_parallel_size as usize;
                if info.device_count < need {
                    bail!(
                        "--device cuda with -tp {need} needs {need} GPUs; this machine has {}",
                        info.device_count
                    );
                }
                Ok(Device::Cuda)
            }
            Err(e) => bail!("--device cuda: {e}"),
        },
        DeviceArg::Auto => match cuda_status() {
            Ok(info) if info.device_count >= args.tensor_parallel_size as usize => {
                tracing::info!(
                    gpu = %info.name,
                    count = info.device_count,
                    "CUDA device found: running on the GPU"
                );
                Ok(Device::Cuda)
            }
            Ok(info) => {
                tracing::warn!(
                    "{} GPUs for -tp {}: running on the CPU",
                    info.device_count,
                    args.tensor_parallel_size
                );
                Ok(Device::Cpu)
            }
            Err(e) => {
                tracing::info!("running on the CPU ({e})");
                Ok(Device::Cpu)
            }
        },
    }
}

/// Reads every stream to its end, round-robin so the arrival time of each output is seen when
/// it arrives: `on_output(request index, output, arrival time)` for each output. The first
/// failed request is the error.
pub fn drain_streams(
    streams: &mut [omni_core::RequestStream],
    mut on_output: impl FnMut(usize, &omni_protocol::EngineCoreOutput, Instant),
) -> anyhow::Result<()> {
    let mut done = vec![false; streams.len()];
    while done.iter().any(|d| !d) {
        let mut progressed = false;
        for (i, stream) in streams.iter_mut().enumerate() {
            while !done[i] {
                match stream.try_next() {
                    Poll::Pending => break,
                    Poll::Ready(None) => done[i] = true,
                    Poll::Ready(Some(item)) => {
                        progressed = true;
                        let out = item.map_err(|e| anyhow::anyhow!("request {i} failed: {e}"))?;
                        on_output(i, &out, Instant::now());
                        if out.finished() {
                            done[i] = true;
                        }
                    }
                }
            }
        }
        if !progressed {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
    Ok(())
}

/// The tokenizer of a HF directory or a GGUF file.
pub fn load_tokenizer(model: &Path) -> anyhow::Result<Tokenizer> {
    Ok(if model.is_dir() {
        Tokenizer::from_hf_dir(model)?
    } else {
        Tokenizer::from_gguf_path(model)?
    })
}

/// Rewrites vLLM's `-tp N` (a multi-letter short flag clap cannot express) into
/// `--tensor-parallel-size N`. Call on argv before parsing.
pub fn normalize_args(args: impl IntoIterator<Item = String>) -> Vec<String> {
    args.into_iter()
        .map(|a| match a.as_str() {
            "-tp" => "--tensor-parallel-size".to_string(),
            _ => match a.strip_prefix("-tp=") {
                Some(v) => format!("--tensor-parallel-size={v}"),
                None => a,
            },
        })
        .collect()
}

/// `256MiB`, `1GiB`, `64KiB`, `100MB`, or a plain byte count.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("not a size: {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => return Err(format!("unknown size unit {other:?}")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size too large: {s:?}"))
}

/// One finished prompt.
#[derive(Debug, serde::Serialize)]
struct Generation {
    prompt_token_ids: Vec<u32>,
    token_ids: Vec<u32>,
    text: String,
}

/// Runs offline inference and prints the results.
pub fn run(args: Args) -> anyhow::Result<()> {
    let model = resolve_model(args.model.as_deref())?;
    let tokenizer = load_tokenizer(&model);
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    if !args.prompt.is_empty() {
        let tok = tokenizer
            .as_ref()
            .map_err(|e| anyhow::anyhow!("text prompts need the tokenizer: {e}"))?;
        for p in &args.prompt {
            prompts.push(if args.chat {
                tok.encode_chat(&serde_json::json!([{"role": "user", "content": p}]), true)?
            } else {
                tok.encode(p, true)?
            });
        }
    }
    for ids in &args.prompt_token_ids {
        let parsed: Result<Vec<u32>, _> = ids
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().parse::<u32>())
            .collect();
        prompts.push(parsed.with_context(|| format!("--prompt-token-ids {ids:?}"))?);
    }
    if prompts.is_empty() {
        bail!("give at least one --prompt or --prompt-token-ids");
    }
    let prompts: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), args.repeat.max(1)))
        .collect();
    let eos = tokenizer
        .as_ref()
        .ok()
        .and_then(|t| t.eos_token_ids().first().copied());

    let t_load = Instant::now();
    // On this (the main) thread: workers die with the thread that spawned them.
    let StartedEngine { engine, scheduler } = start_engine(&model, &args.engine)?;
    eprintln!(
        "engine ready in {:.2?}: {} ({} rank(s), {} KV blocks of {})",
        t_load.elapsed(),
        model.display(),
        args.engine.tensor_parallel_size,
        scheduler.num_blocks,
        args.engine.block_size
    );
    let client = engine.client();
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: (args.top_k > 0).then_some(args.top_k),
        min_p: args.min_p,
        seed: args.seed,
        max_tokens: Some(args.max_tokens),
        min_tokens: args.min_tokens,
        ignore_eos: args.ignore_eos,
        ..SamplingParams::default()
    };
    let t0 = Instant::now();
    let mut streams = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let req = EngineCoreRequest::new(format!("gen-{i}"), p.clone(), params.clone(), eos);
        streams.push(client.add_request(req)?);
    }
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut first_token_at = t0;
    drain_streams(&mut streams, |i, out, now| {
        if outputs[i].is_empty() && !out.new_token_ids.is_empty() {
            first_token_at = first_token_at.max(now);
        }
        outputs[i].extend_from_slice(&out.new_token_ids);
    })?;
    let total = t0.elapsed();
    let stats = client.stats();
    engine.shutdown();

    let prefill_tokens: usize = prompts.iter().map(Vec::len).sum();
    let gen_tokens: usize = outputs.iter().map(Vec::len).sum();
    let prefill_s = (first_token_at - t0).as_secs_f64();
    let decode_s = (total.as_secs_f64() - prefill_s).max(1e-9);
    eprintln!(
        "{} requests: prefill {prefill_tokens} tokens in {prefill_s:.3}s ({:.1} tok/s); \
         decode {} tokens in {decode_s:.3}s ({:.1} tok/s); total {:.3}s; \
         prefix cache hits {}/{}; preemptions {}",
        prompts.len(),
        prefill_tokens as f64 / prefill_s.max(1e-9),
        gen_tokens.saturating_sub(prompts.len()),
        gen_tokens.saturating_sub(prompts.len()) as f64 / decode_s,
        total.as_secs_f64(),
        stats.prefix_cache_hits,
        stats.prefix_cache_queries,
        stats.num_preemptions,
    );

    let gens: Vec<Generation> = prompts
        .into_iter()
        .zip(outputs)
        .map(|(prompt_token_ids, token_ids)| {
            let text = tokenizer
                .as_ref()
                .ok()
                .and_then(|t| t.decode(&token_ids, true).ok())
                .unwrap_or_default();
            Generation {
                prompt_token_ids,
                token_ids,
                text,
            }
        })
        .collect();
    if args.json {
        println!("{}", serde_json::to_string(&gens)?);
    } else {
        for (i, g) in gens.iter().enumerate() {
            println!("[{i}] prompt: {:?}", g.prompt_token_ids);
            println!("[{i}] output: {:?}", g.text);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("256MiB"), Ok(256 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("2MB"), Ok(2_000_000));
        assert!(parse_bytes("12XB").is_err());
    }

    #[test]
    fn dash_tp_becomes_the_long_flag() {
        let a = normalize_args(["x", "-tp", "2", "-tp=3"].map(String::from));
        assert_eq!(
            a,
            [
                "x",
                "--tensor-parallel-size",
                "2",
                "--tensor-parallel-size=3"
            ]
        );
    }
}
