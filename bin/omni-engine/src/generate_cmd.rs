//! `omni-engine generate`: offline batch inference (vLLM's `LLM.generate`). Starts the engine
//! (one worker process per tensor-parallel rank, or the model in-process with
//! `--executor uni`; the engine core on a thread, or in its own process with
//! `--enable-multiprocessing`), submits every prompt at once to the engine core, and prints the
//! continuations (`--json`: `[{"prompt_token_ids":[..],"token_ids":[..],"text":".."}]`).
//! Throughput (prefill and decode tok/s) goes to stderr.
//!
//! ```text
//! omni-engine generate --prompt "What is the capital of France?" --chat --temperature 0
//! omni-engine generate --model path/to/hf-dir -tp 2 --prompt-token-ids 1,2,3 --json
//! ```

use std::path::{Path, PathBuf};
use std::task::Poll;
use std::time::Instant;

use anyhow::{Context, bail};
use omni_config::EngineConfig;
use omni_launch::StartedEngine;
use omni_protocol::{EngineCoreRequest, SamplingParams};
use omni_tokenizer::Tokenizer;

/// `omni-engine generate` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// A YAML file of flags (keys are the long flag names, as in vLLM's `--config`); the
    /// environment and the command line override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
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
    pub engine: EngineConfig,
}

/// Starts the engine of `config` from this binary (which runs as each rank's worker, and as the
/// engine-core process with `--enable-multiprocessing`).
///
/// Call it on a thread that lives as long as the engine (the main thread): worker processes
/// get `PR_SET_PDEATHSIG` and die with the thread that spawned them.
pub fn start_engine(config: &EngineConfig) -> anyhow::Result<StartedEngine> {
    Ok(omni_launch::launch(config, &crate::current_exe()?)?)
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

/// Rewrites vLLM's `-tp N` / `-pp N` (multi-letter short flags clap cannot express) into
/// `--tensor-parallel-size N` / `--pipeline-parallel-size N`. Call on argv before parsing.
pub fn normalize_args(args: impl IntoIterator<Item = String>) -> Vec<String> {
    const SHORT: [(&str, &str); 2] = [
        ("-tp", "--tensor-parallel-size"),
        ("-pp", "--pipeline-parallel-size"),
    ];
    args.into_iter()
        .map(|a| {
            for (short, long) in SHORT {
                if a == short {
                    return long.to_string();
                }
                if let Some(v) = a.strip_prefix(short).and_then(|r| r.strip_prefix('=')) {
                    return format!("{long}={v}");
                }
            }
            a
        })
        .collect()
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
    let mut engine_config = args.engine.clone();
    let model = omni_launch::resolve_model(&engine_config)?;
    engine_config.model.model = Some(model.clone());
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
    let StartedEngine {
        engine, scheduler, ..
    } = start_engine(&engine_config)?;
    eprintln!(
        "engine ready in {:.2?}: {} ({} rank(s), {} KV blocks of {})",
        t_load.elapsed(),
        model.display(),
        engine_config.parallel.tensor_parallel_size * engine_config.parallel.pipeline_parallel_size,
        scheduler.num_blocks,
        engine_config.cache.block_size
    );
    let client = engine.clone();
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
        assert_eq!(omni_config::parse_bytes("256MiB"), Ok(256 << 20));
        assert_eq!(omni_config::parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(omni_config::parse_bytes("1000"), Ok(1000));
        assert_eq!(omni_config::parse_bytes("2MB"), Ok(2_000_000));
        assert!(omni_config::parse_bytes("12XB").is_err());
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
