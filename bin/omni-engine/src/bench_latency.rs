//! `omni-engine bench latency`: offline latency of the engine (vLLM's `bench latency`):
//! decode tok/s and ms per step per batch size, prefill tok/s, each against its roofline bound
//! on this device (probed, or given with `--copy-bw-gbs` / `--gemm-tflops`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

/// Timed prefill tries (`bench latency` reports the best).
const PREFILL_TRIES: usize = 3;

/// Bytes of each buffer of the GPU copy probe (1 GiB: far above any L2).
#[cfg(feature = "cuda")]
const CUDA_PROBE_COPY_BYTES: usize = 1 << 30;

/// Edge of the GPU GEMM probe (8192³: ~1.5 ms per call on an H200).
const CUDA_PROBE_GEMM_N: usize = 8192;

/// Timed repetitions of each GPU probe (the best counts).
#[cfg(feature = "cuda")]
const CUDA_PROBE_REPS: usize = 20;

/// Buffer of the CPU bandwidth probe: 1 GiB (as `bench mem`), well above the last-level cache;
/// 64 MiB in unoptimized builds, whose probe is too slow to be a ceiling anyway.
const CPU_PROBE_BYTES: usize = if cfg!(debug_assertions) {
    64 << 20
} else {
    1 << 30
};

/// `omni-engine bench latency` flags.
#[derive(Debug, Args)]
pub struct LatencyArgs {
    /// Batch sizes to measure (comma separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8, 32, 64])]
    batch_sizes: Vec<usize>,
    /// Prompt tokens of each decode request.
    #[arg(long, default_value_t = 1024)]
    input_len: usize,
    /// Output tokens of each decode request (at least 2: one from prefill, the rest decoded).
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    /// Prompt tokens of the prefill measurement (one request, one output token; 0 skips it).
    #[arg(long, default_value_t = 2048)]
    prefill_len: usize,
    /// Unmeasured iterations before each measured one.
    #[arg(long, default_value_t = 1)]
    warmup_iters: usize,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Bandwidth ceiling in GB/s (1e9 B/s) per device instead of measuring it (on a GPU the
    /// probe counts a copy's reads and writes).
    #[arg(long)]
    copy_bw_gbs: Option<f64>,
    /// Dense GEMM ceiling in TFLOP/s per device instead of measuring it (the CPU has none
    /// unless given).
    #[arg(long)]
    gemm_tflops: Option<f64>,
    /// Write every number as JSON to this path.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Engine: model loading, parallelism, KV cache, scheduler.
    #[command(flatten)]
    engine: omni_config::EngineConfig,
}

/// The GPU probe's findings (`None` where a ceiling was given or the probe failed).
#[derive(Debug, Default)]
struct CudaProbe {
    name: String,
    copy_bytes_per_s: Option<f64>,
    gemm_flops_per_s: Option<f64>,
}

/// Measures GPU 0's copy bandwidth and GEMM rate (those not given), then releases the device
/// before the engine starts. A failed measurement is a warning; the bound is then `n/a`.
#[cfg(feature = "cuda")]
fn probe_cuda(need_bw: bool, need_gemm: bool) -> anyhow::Result<CudaProbe> {
    use omni_backend::cuda::{CudaContext, measure_copy_bandwidth, measure_gemm_tflops};
    let cx = CudaContext::new(0).context("opening GPU 0 for the ceiling probes")?;
    let mut probe = CudaProbe {
        name: cx.info().name.clone(),
        ..CudaProbe::default()
    };
    if need_bw {
        match measure_copy_bandwidth(&cx, CUDA_PROBE_COPY_BYTES, CUDA_PROBE_REPS) {
            Ok(b) => probe.copy_bytes_per_s = Some(b),
            Err(e) => tracing::warn!("copy bandwidth probe failed: {e}"),
        }
    }
    if need_gemm {
        match measure_gemm_tflops(&cx, CUDA_PROBE_GEMM_N, CUDA_PROBE_REPS) {
            Ok(t) => probe.gemm_flops_per_s = Some(t * 1e12),
            Err(e) => tracing::warn!("GEMM probe failed: {e}"),
        }
    }
    drop(cx);
    Ok(probe)
}

#[cfg(not(feature = "cuda"))]
fn probe_cuda(_need_bw: bool, _need_gemm: bool) -> anyhow::Result<CudaProbe> {
    anyhow::bail!("this omni-engine was built without the CUDA backend (feature `cuda`)")
}

/// This CPU's model name and thread count.
fn cpu_name() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{model}, {threads} threads")
}

/// The device summary, the ceilings and the bytes per weight/KV element on `device`.
fn ceilings_for(
    device: omni_protocol::Device,
    a: &LatencyArgs,
) -> anyhow::Result<(
    omni_bench::latency::DeviceSummary,
    omni_bench::latency::Ceilings,
    usize,
)> {
    use omni_bench::latency::{Ceilings, DeviceSummary};
    use omni_bench::roofline::RankCeilings;
    let tp = a.engine.parallel.tensor_parallel_size.max(1) as f64;
    let given_bw = a.copy_bw_gbs.map(|g| g * 1e9);
    let given_gemm = a.gemm_tflops.map(|t| t * 1e12);
    match device {
        omni_protocol::Device::Cuda => {
            let probe = probe_cuda(given_bw.is_none(), given_gemm.is_none())?;
            let (bw, bw_src) = match given_bw {
                Some(b) => (Some(b), "--copy-bw-gbs".to_string()),
                None => (
                    probe.copy_bytes_per_s,
                    "GPU 0 memcpy_dtod of 1 GiB, read+write counted".to_string(),
                ),
            };
            let (gemm, gemm_src) = match given_gemm {
                Some(f) => (Some(f), "--gemm-tflops".to_string()),
                None => (
                    probe.gemm_flops_per_s,
                    format!("GPU 0 bf16 cuBLAS GEMM {CUDA_PROBE_GEMM_N}³"),
                ),
            };
            let ceilings = Ceilings {
                bandwidth_bytes_per_s: bw,
                bandwidth_source: bw_src,
                gemm_flops_per_s: gemm,
                gemm_source: gemm_src,
                // One GPU per rank: each has its own HBM and tensor cores.
                per_rank: RankCeilings {
                    bandwidth_bytes_per_s: bw,
                    gemm_flops_per_s: gemm,
                },
            };
            let device = DeviceSummary {
                kind: "cuda".into(),
                name: probe.name,
            };
            Ok((device, ceilings, 2))
        }
        omni_protocol::Device::Cpu => {
            let (bw, bw_src) = match given_bw {
                Some(b) => (Some(b), "--copy-bw-gbs".to_string()),
                None => {
                    if cfg!(debug_assertions) {
                        tracing::warn!(
                            "unoptimized build: the CPU bandwidth probe under-reads, so the \
                             fractions come out too high; use --release or --copy-bw-gbs"
                        );
                    }
                    let m = omni_bench::mem::measure(CPU_PROBE_BYTES, 3);
                    (
                        Some(m.read_gbps * 1e9),
                        format!("all-core read of {} MiB", CPU_PROBE_BYTES >> 20),
                    )
                }
            };
            let gemm_src = if given_gemm.is_some() {
                "--gemm-tflops"
            } else {
                "not measured on the CPU"
            };
            let ceilings = Ceilings {
                bandwidth_bytes_per_s: bw,
                bandwidth_source: bw_src,
                gemm_flops_per_s: given_gemm,
                gemm_source: gemm_src.to_string(),
                // Ranks on one CPU share its memory bandwidth and cores.
                per_rank: RankCeilings {
                    bandwidth_bytes_per_s: bw.map(|b| b / tp),
                    gemm_flops_per_s: given_gemm.map(|f| f / tp),
                },
            };
            let device = DeviceSummary {
                kind: "cpu".into(),
                name: cpu_name(),
            };
            // The CPU backend keeps KV in f32, and weights in f32 or (GGUF Q4_1 / Q8_0) in
            // their blocks; the roofline counts every element as 4 bytes either way.
            Ok((device, ceilings, 4))
        }
    }
}

/// Greedy sampling of exactly `max_tokens` tokens, EOS ignored.
fn bench_params(max_tokens: usize) -> anyhow::Result<omni_protocol::SamplingParams> {
    Ok(omni_protocol::SamplingParams {
        temperature: 0.0,
        max_tokens: Some(u32::try_from(max_tokens).context("token count too large")?),
        ignore_eos: true,
        ..omni_protocol::SamplingParams::default()
    })
}

/// What one decode iteration measured.
#[derive(Debug)]
struct DecodeIteration {
    timing: omni_bench::latency::DecodeTiming,
    cached_tokens: u64,
    preemptions: u64,
}

/// Submits `prompts` together, each for `output_len` tokens, and times the first tokens and
/// the end. The streams are polled round-robin; the decode window's token count is taken at
/// the end of the sweep that saw the last first token.
fn decode_iteration(
    client: &dyn omni_core::EngineCoreClient,
    tag: &str,
    prompts: Vec<Vec<u32>>,
    output_len: usize,
) -> anyhow::Result<DecodeIteration> {
    use std::time::Instant;

    let params = bench_params(output_len)?;
    let n = prompts.len();
    let preempt0 = client.stats().num_preemptions;
    let t0 = Instant::now();
    let mut streams = Vec::with_capacity(n);
    for (i, p) in prompts.into_iter().enumerate() {
        let req =
            omni_protocol::EngineCoreRequest::new(format!("{tag}-{i}"), p, params.clone(), None);
        streams.push(client.add_request(req).context("submitting a request")?);
    }
    let mut got = vec![0usize; n];
    let mut first: Vec<Option<Instant>> = vec![None; n];
    let mut cached = 0u64;
    let mut last_token = t0;
    let mut all_first: Option<(Instant, usize)> = None;
    let mut first_done: Option<(Instant, usize)> = None;
    crate::generate_cmd::drain_streams(&mut streams, |i, out, now| {
        if !out.new_token_ids.is_empty() {
            first[i].get_or_insert(now);
            got[i] += out.new_token_ids.len();
            last_token = now;
            // The moment the last request gets its first token: decode timing starts here.
            if all_first.is_none() && first.iter().all(Option::is_some) {
                all_first = Some((now, got.iter().sum()));
            }
            // The moment the first request is done: the batch is whole up to here.
            if first_done.is_none() && got[i] >= output_len {
                first_done = Some((now, got.iter().sum()));
            }
        }
        cached += u64::from(out.num_cached_tokens);
    })
    .with_context(|| format!("bench requests {tag}-*"))?;
    if let Some(i) = got.iter().position(|&g| g != output_len) {
        anyhow::bail!(
            "request {tag}-{i} produced {} of {output_len} tokens (is --max-model-len large enough?)",
            got[i]
        );
    }
    let (all_first_at, before) = all_first.unwrap_or((last_token, got.iter().sum()));
    // A request done before the last one started leaves no full-batch window.
    let (first_done_at, at_first_done) = first_done
        .filter(|(t, _)| *t >= all_first_at)
        .unwrap_or((all_first_at, before));
    let secs = |t: Instant| (t - t0).as_secs_f64();
    let first_first = first.iter().flatten().min().copied().unwrap_or(t0);
    Ok(DecodeIteration {
        timing: omni_bench::latency::DecodeTiming {
            first_first_s: secs(first_first),
            all_first_s: secs(all_first_at),
            end_s: secs(last_token),
            decode_tokens: got.iter().sum::<usize>() - before,
            first_done_s: secs(first_done_at),
            full_batch_tokens: at_first_done - before,
        },
        cached_tokens: cached,
        preemptions: client.stats().num_preemptions.saturating_sub(preempt0),
    })
}

/// Time to first token of one `prompt` with one output token; also the prompt tokens the
/// prefix cache served.
fn prefill_once(
    client: &dyn omni_core::EngineCoreClient,
    id: String,
    prompt: Vec<u32>,
) -> anyhow::Result<(f64, u64)> {
    let req = omni_protocol::EngineCoreRequest::new(id.clone(), prompt, bench_params(1)?, None);
    let t0 = std::time::Instant::now();
    let mut stream = client.add_request(req).context("submitting a request")?;
    let mut ttft = None;
    let mut cached = 0u64;
    while let Some(item) = stream.blocking_next() {
        let out = item.map_err(|e| anyhow::anyhow!("request {id}: {e}"))?;
        if ttft.is_none() && !out.new_token_ids.is_empty() {
            ttft = Some(t0.elapsed().as_secs_f64());
        }
        cached += u64::from(out.num_cached_tokens);
        if out.finished() {
            break;
        }
    }
    let ttft = ttft.ok_or_else(|| anyhow::anyhow!("request {id} ended without a token"))?;
    Ok((ttft, cached))
}

/// `omni-engine bench latency`.
pub fn run(a: LatencyArgs) -> anyhow::Result<()> {
    use omni_bench::latency::{
        DecodeRow, DistinctPrompts, EngineSummary, LatencyParams, LatencyReport, PrefillRow,
        context_len,
    };
    use omni_bench::roofline::{ModelShape, decode_roofline, prefill_roofline};

    let mut batch_sizes = a.batch_sizes.clone();
    batch_sizes.retain(|&b| b > 0);
    if batch_sizes.is_empty() {
        anyhow::bail!("--batch-sizes: give at least one batch size above 0");
    }
    if a.output_len < 2 {
        anyhow::bail!("--output-len must be at least 2 (one token from prefill, then decode)");
    }
    if a.input_len == 0 {
        anyhow::bail!("--input-len must be at least 1");
    }
    // As `serve`: a HF directory, a `.gguf` file, or (none given) the built-in default model.
    let model = omni_launch::resolve_model(&a.engine)?;
    let max_model_len = a.engine.model.max_model_len as usize;
    if a.input_len + a.output_len > max_model_len {
        anyhow::bail!(
            "--input-len {} + --output-len {} exceeds --max-model-len {max_model_len}",
            a.input_len,
            a.output_len
        );
    }
    if a.prefill_len > max_model_len {
        anyhow::bail!(
            "--prefill-len {} exceeds --max-model-len {max_model_len}",
            a.prefill_len
        );
    }
    let config = omni_models::registry::read_model_config(&model).with_context(|| {
        format!(
            "bench latency needs a HF model directory or a .gguf file: {}",
            model.display()
        )
    })?;
    let spec = omni_models::registry::decoder_spec(&config)?;
    let tp = a.engine.parallel.tensor_parallel_size as usize;
    spec.head_layout(0, tp)
        .with_context(|| format!("-tp {tp} does not fit the model's heads"))?;
    let shape = ModelShape::from_spec(&spec);

    let device = omni_launch::resolve_device(&a.engine)?;
    let (device, ceilings, elem_bytes) = ceilings_for(device, &a)?;
    eprintln!(
        "bench latency: {} on {} ({}); bandwidth {}, GEMM {}",
        model.display(),
        device.kind,
        device.name,
        ceilings
            .bandwidth_bytes_per_s
            .map_or("n/a".into(), |b| format!("{:.1} GB/s", b / 1e9)),
        ceilings
            .gemm_flops_per_s
            .map_or("n/a".into(), |f| format!("{:.1} TFLOP/s", f / 1e12)),
    );

    let t_load = std::time::Instant::now();
    // On this (the main) thread: workers die with the thread that spawned them.
    let mut engine_config = a.engine.clone();
    engine_config.model.model = Some(model.clone());
    let omni_launch::StartedEngine {
        engine, scheduler, ..
    } = crate::generate_cmd::start_engine(&engine_config)?;
    eprintln!(
        "engine ready in {:.2?}: {} rank(s), {} KV blocks of {}, max_num_batched_tokens {}",
        t_load.elapsed(),
        tp,
        scheduler.num_blocks,
        scheduler.block_size,
        scheduler.max_num_batched_tokens
    );
    let client = engine.clone();
    let mut prompts = DistinctPrompts::new(a.seed, shape.vocab_size, scheduler.block_size);
    let per_seq_blocks = (a.input_len + a.output_len).div_ceil(scheduler.block_size.max(1));

    let mut decode_rows = Vec::with_capacity(batch_sizes.len());
    for &b in &batch_sizes {
        if b > scheduler.max_num_seqs {
            tracing::warn!(
                "batch {b} > --max-num-seqs {}: it runs in waves; the roofline assumes one",
                scheduler.max_num_seqs
            );
        }
        if b * per_seq_blocks > scheduler.num_blocks {
            tracing::warn!(
                "batch {b} needs {} KV blocks, the cache has {}: expect preemptions",
                b * per_seq_blocks,
                scheduler.num_blocks
            );
        }
        for w in 0..a.warmup_iters {
            let p = (0..b).map(|_| prompts.next_prompt(a.input_len)).collect();
            decode_iteration(&client, &format!("warmup{w}-b{b}"), p, a.output_len)?;
        }
        let p = (0..b).map(|_| prompts.next_prompt(a.input_len)).collect();
        let it = decode_iteration(&client, &format!("decode-b{b}"), p, a.output_len)?;
        let bound = decode_roofline(
            &shape,
            b,
            context_len(a.input_len, a.output_len),
            tp,
            elem_bytes,
            ceilings.per_rank,
        );
        let mut row = DecodeRow::new(b, a.input_len, a.output_len, it.timing, bound);
        row.prefix_cache_hit_tokens = it.cached_tokens;
        row.preemptions = it.preemptions;
        if it.cached_tokens > 0 {
            tracing::warn!(
                "batch {b}: the prefix cache served {} prompt tokens",
                it.cached_tokens
            );
        }
        let (window, window_tokens) = match row.window {
            omni_bench::latency::DecodeWindow::FullBatch => ("full-batch", row.full_batch_tokens),
            omni_bench::latency::DecodeWindow::Tail => ("tail", row.decode_tokens),
        };
        eprintln!(
            "  B={b}: {:.1} decode tok/s, {:.3} ms/step over the {window} window \
             ({window_tokens} tokens); {:.1} tok/s from the last first token to the end (first \
             tokens spread over {:.3} s)",
            row.decode_tok_per_s,
            row.ms_per_step,
            row.tail_decode_tok_per_s,
            row.first_token_spread_s
        );
        decode_rows.push(row);
    }

    let prefill = if a.prefill_len > 0 {
        let chunked = a.prefill_len > scheduler.max_num_batched_tokens;
        if chunked {
            eprintln!(
                "prefill of {} tokens > max_num_batched_tokens {}: it is chunked over {} steps",
                a.prefill_len,
                scheduler.max_num_batched_tokens,
                a.prefill_len
                    .div_ceil(scheduler.max_num_batched_tokens.max(1))
            );
        }
        for w in 0..a.warmup_iters {
            prefill_once(
                &client,
                format!("warmup{w}-prefill"),
                prompts.next_prompt(a.prefill_len),
            )?;
        }
        let mut ttfts = Vec::with_capacity(PREFILL_TRIES);
        let mut cached = 0;
        for i in 0..PREFILL_TRIES {
            let (t, c) = prefill_once(
                &client,
                format!("prefill-{i}"),
                prompts.next_prompt(a.prefill_len),
            )?;
            ttfts.push(t);
            cached += c;
        }
        let bound = prefill_roofline(&shape, a.prefill_len, tp, ceilings.per_rank);
        let mut row = PrefillRow::new(a.prefill_len, chunked, ttfts, bound);
        row.prefix_cache_hit_tokens = cached;
        Some(row)
    } else {
        None
    };
    engine.shutdown();

    let report = LatencyReport {
        date: omni_bench::latency::utc_now(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        model: model.display().to_string(),
        config: shape,
        device,
        engine: EngineSummary {
            tensor_parallel_size: tp,
            elem_bytes,
            load_format: format!("{:?}", a.engine.model.load_format).to_lowercase(),
            max_num_batched_tokens: scheduler.max_num_batched_tokens,
            max_num_seqs: scheduler.max_num_seqs,
            max_model_len: scheduler.max_model_len,
            block_size: scheduler.block_size,
            num_kv_blocks: scheduler.num_blocks,
            enforce_eager: a.engine.device.enforce_eager,
        },
        params: LatencyParams {
            batch_sizes,
            input_len: a.input_len,
            output_len: a.output_len,
            prefill_len: a.prefill_len,
            warmup_iters: a.warmup_iters,
            seed: a.seed,
        },
        ceilings,
        decode: decode_rows,
        prefill,
    };
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    print!("{}", report.format_table());
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::bench_cmd::BenchCommand;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: BenchCommand,
    }

    /// `bench latency` takes a `.gguf` file as `serve` does: a tiny llama GGUF (metadata only,
    /// dummy weights of its shapes), one decode batch and a prefill.
    #[test]
    fn latency_takes_a_gguf_file() {
        use omni_gguf::{GgufWriter, Value};
        let dir = std::env::temp_dir().join(format!("omni-bench-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (gguf, json) = (dir.join("tiny.gguf"), dir.join("latency.json"));
        let mut w = GgufWriter::new();
        for (k, v) in [
            ("general.architecture", Value::String("llama".into())),
            ("llama.embedding_length", Value::U32(64)),
            ("llama.feed_forward_length", Value::U32(128)),
            ("llama.block_count", Value::U32(2)),
            ("llama.attention.head_count", Value::U32(4)),
            ("llama.attention.head_count_kv", Value::U32(2)),
            ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
            ("llama.context_length", Value::U32(256)),
            ("llama.vocab_size", Value::U32(320)),
        ] {
            w.metadata(k, v);
        }
        std::fs::write(&gguf, w.to_bytes()).unwrap();
        let args = [
            "bench",
            "latency",
            "--model",
            &gguf.display().to_string(),
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--executor",
            "uni",
            "--batch-sizes",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--prefill-len",
            "16",
            "--copy-bw-gbs",
            "10",
            "--json",
            &json.display().to_string(),
        ]
        .map(String::from);
        let cli = Cli::try_parse_from(args).unwrap();
        crate::bench_cmd::run(cli.cmd).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(v["config"]["num_layers"], 2);
        assert!(v["model"].as_str().unwrap().ends_with("tiny.gguf"));
        assert!(v["decode"][0]["decode_tok_per_s"].as_f64().unwrap() > 0.0);
        assert_eq!(v["prefill"]["tokens"], 16);
    }

    /// `bench latency` on the tiny Qwen3 fixture, in-process (`--executor uni`), with given
    /// ceilings so that no probe runs: every row and the JSON come out.
    #[test]
    fn latency_runs_end_to_end_on_the_cpu() {
        let json =
            std::env::temp_dir().join(format!("omni-bench-latency-{}.json", std::process::id()));
        let model = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../crates/omni-models/tests/fixtures/qwen3"
        );
        let args = [
            "bench",
            "latency",
            "--model",
            model,
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--executor",
            "uni",
            "--batch-sizes",
            "1,4",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--prefill-len",
            "64",
            "--copy-bw-gbs",
            "10",
            "--gemm-tflops",
            "0.1",
        ];
        let cli = Cli::try_parse_from(
            args.iter()
                .map(|s| s.to_string())
                .chain(["--json".to_string(), json.display().to_string()]),
        )
        .unwrap();
        crate::bench_cmd::run(cli.cmd).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let _ = std::fs::remove_file(&json);
        assert_eq!(v["config"]["num_layers"], 2);
        assert_eq!(v["device"]["kind"], "cpu");
        assert_eq!(v["ceilings"]["bandwidth_bytes_per_s"], 1e10);
        let rows = v["decode"].as_array().unwrap();
        assert_eq!(rows.len(), 2);
        for (row, b) in rows.iter().zip([1u64, 4]) {
            assert_eq!(row["batch"], b);
            let tokens = row["decode_tokens"].as_u64().unwrap();
            assert!(tokens > 0 && tokens <= b * 7, "{row}");
            assert!(row["decode_tok_per_s"].as_f64().unwrap() > 0.0, "{row}");
            assert!(row["ms_per_step"].as_f64().unwrap() > 0.0, "{row}");
            assert!(row["fraction"].as_f64().unwrap() > 0.0, "{row}");
            assert_eq!(row["prefix_cache_hit_tokens"], 0, "{row}");
            assert_eq!(row["preemptions"], 0, "{row}");
        }
        let p = &v["prefill"];
        assert_eq!(p["tokens"], 64);
        assert_eq!(p["chunked"], false);
        assert_eq!(p["ttft_s"].as_array().unwrap().len(), PREFILL_TRIES);
        assert!(p["fraction"].as_f64().unwrap() > 0.0, "{p}");
        assert_eq!(p["prefix_cache_hit_tokens"], 0);
    }
}
