//! `omni-engine bench ...`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use omni_bench::ipc::{self, IpcBenchOptions};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Latency and throughput of the shared-memory broadcast queue across processes, against
    /// a plain memcpy of the same bytes.
    Ipc(IpcArgs),
    /// Serving benchmark of an OpenAI-compatible server (vLLM's `bench serve`): TTFT, TPOT,
    /// ITL and end-to-end latency over streamed requests; with --omni (vLLM-Omni's) also audio
    /// TTFP and RTF; prints the result block last.
    Serve(Box<omni_bench::serve::ServeBenchArgs>),
    /// This machine's memory bandwidth (read with all cores; single-threaded copy): the
    /// ceiling of CPU decode, which streams every weight once per step.
    Mem(MemArgs),
    /// NCCL all-reduce over this machine's GPUs (one thread per GPU, bf16, in place): time,
    /// algorithm and bus bandwidth per size, as nccl-tests prints them.
    Nccl(NcclArgs),
    /// Offline latency of the engine (vLLM's `bench latency`): decode tok/s and ms per step
    /// for each batch size, prefill tok/s, each against its roofline bound on this device.
    Latency(Box<crate::bench_latency::LatencyArgs>),
    /// Qwen3-Omni's Talker on one GPU: frames/s (one Talker step + 15 code-predictor steps per
    /// frame) per batch size, with CUDA graphs and eagerly, and where the GPU time goes.
    Talker(Box<crate::bench_talker::TalkerArgs>),
    /// Qwen3-Omni's Thinker on one GPU: decode tok/s with and without its hidden-state export
    /// (layer 0 and `accept_hidden_layer`), CUDA graphs.
    Thinker(Box<crate::bench_thinker::ThinkerArgs>),
    /// Qwen3-Omni's Code2Wav on one GPU: ms per batch of streaming windows (graphs, end to end
    /// and replay alone; eager), TFLOP/s against the GEMM rate, per-op GPU time.
    Code2wav(Box<crate::bench_code2wav::Code2WavArgs>),
    /// Internal: a reader process of `bench ipc`.
    #[command(hide = true)]
    IpcReader(IpcReaderArgs),
}

#[derive(Debug, Args)]
pub struct IpcArgs {
    /// A subset that runs in under 30 s: 64 B .. 32 MiB payloads, 16 MiB chunks, 1 reader.
    #[arg(long)]
    quick: bool,
    /// Write the rows as JSON to this path.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Payload sizes in bytes (comma separated); overrides the default matrix.
    #[arg(long, value_delimiter = ',')]
    payloads: Option<Vec<usize>>,
    /// Reader process counts (comma separated).
    #[arg(long, value_delimiter = ',')]
    readers: Option<Vec<usize>>,
    /// Chunk sizes in MiB (comma separated); the default matrix is 10,16,100. The engine's
    /// own chunk size comes from VLLM_MQ_MAX_CHUNK_BYTES_MB.
    #[arg(long, value_delimiter = ',')]
    chunk_mb: Option<Vec<usize>>,
    /// How long a waiting reader spins before parking, microseconds.
    #[arg(long, default_value_t = 2000)]
    spin_us: u64,
}

#[derive(Debug, Args)]
pub struct NcclArgs {
    /// GPUs (ranks); default: every GPU the driver sees.
    #[arg(long)]
    gpus: Option<usize>,
    /// Sizes in bytes per rank (comma separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16384,262144,1048576,16777216,268435456,1073741824"
    )]
    sizes: Vec<usize>,
    /// Timed calls per size.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Write the rows as JSON to this path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct MemArgs {
    /// Buffer size in MiB (well above the last-level cache).
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// Repetitions (the best is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

#[derive(Debug, Args)]
pub struct IpcReaderArgs {
    #[arg(long)]
    reader: usize,
    #[arg(long)]
    latency_iters: usize,
    #[arg(long)]
    throughput_iters: usize,
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Ipc(a) => {
            let exe = crate::current_exe()?;
            let mut opts = if a.quick {
                IpcBenchOptions::quick(exe)
            } else {
                IpcBenchOptions::full(exe)
            };
            if let Some(p) = a.payloads {
                opts.payloads = p;
            }
            if let Some(r) = a.readers {
                opts.readers = r;
            }
            if let Some(c) = a.chunk_mb {
                opts.chunk_mib = c;
            }
            opts.spin = Duration::from_micros(a.spin_us);
            eprintln!(
                "bench ipc: {} payloads x readers {:?} x chunks {:?} MiB ({} slots)",
                opts.payloads.len(),
                opts.readers,
                opts.chunk_mib,
                opts.max_chunks
            );
            let rows = ipc::run(&opts)?;
            if let Some(path) = &a.json {
                ipc::write_json(path, &rows)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            println!("{}", ipc::recommend(&rows, opts.max_chunks));
            print!("{}", ipc::format_table(&rows));
            Ok(())
        }
        BenchCommand::Talker(a) => crate::bench_talker::run(*a),
        BenchCommand::Thinker(a) => crate::bench_thinker::run(*a),
        BenchCommand::Code2wav(a) => crate::bench_code2wav::run(*a),
        BenchCommand::Serve(a) => {
            // Prints the result block last and writes `--save-result` JSON.
            let result = omni_bench::serve::run(*a)?;
            if result.completed == 0 {
                anyhow::bail!("no request completed");
            }
            Ok(())
        }
        BenchCommand::Nccl(a) => run_nccl(a),
        BenchCommand::Mem(a) => {
            let m = omni_bench::mem::measure(a.mib << 20, a.reps.max(1));
            println!("{}", serde_json::to_string(&m)?);
            Ok(())
        }
        BenchCommand::Latency(a) => crate::bench_latency::run(*a),
        BenchCommand::IpcReader(a) => Ok(ipc::reader_main(
            a.reader,
            a.latency_iters,
            a.throughput_iters,
        )?),
    }
}

#[cfg(feature = "cuda")]
fn run_nccl(a: NcclArgs) -> anyhow::Result<()> {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        eprintln!(
            "bench nccl: NCCL_NVLS_ENABLE is unset (set it to 0 where NVLink multicast is unsupported)"
        );
    }
    let info = omni_backend::cuda::driver_status()?;
    let gpus = a.gpus.unwrap_or(info.device_count);
    if gpus > info.device_count {
        anyhow::bail!("--gpus {gpus}: the driver sees {} GPUs", info.device_count);
    }
    let rows = omni_backend::cuda::measure_all_reduce(gpus, &a.sizes, a.iters)?;
    println!(
        "NCCL all-reduce, bf16 sum in place, {gpus} x {} ({} timed calls)",
        info.name, a.iters
    );
    println!(
        "{:>14} {:>12} {:>14} {:>14}",
        "bytes", "time us", "algbw GB/s", "busbw GB/s"
    );
    let mut json = Vec::new();
    for r in &rows {
        println!(
            "{:>14} {:>12.1} {:>14.1} {:>14.1}",
            r.bytes,
            r.seconds * 1e6,
            r.algbw / 1e9,
            r.busbw / 1e9
        );
        json.push(serde_json::json!({
            "bytes": r.bytes, "seconds": r.seconds, "algbw_gbs": r.algbw / 1e9, "busbw_gbs": r.busbw / 1e9,
        }));
    }
    if let Some(path) = a.json {
        let doc =
            serde_json::json!({"gpus": gpus, "device": info.name, "iters": a.iters, "rows": json});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_nccl(_a: NcclArgs) -> anyhow::Result<()> {
    anyhow::bail!("this omni-engine was built without the CUDA backend (feature `cuda`)")
}
