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
    /// ITL and end-to-end latency over streamed requests; prints the result block last.
    Serve(omni_bench::serve::ServeBenchArgs),
    /// This machine's memory bandwidth (read with all cores; single-threaded copy): the
    /// ceiling of CPU decode, which streams every weight once per step.
    Mem(MemArgs),
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
        BenchCommand::Serve(a) => {
            // Prints the result block last and writes `--save-result` JSON.
            let result = omni_bench::serve::run(a)?;
            if result.completed == 0 {
                anyhow::bail!("no request completed");
            }
            Ok(())
        }
        BenchCommand::Mem(a) => {
            let m = omni_bench::mem::measure(a.mib << 20, a.reps.max(1));
            println!("{}", serde_json::to_string(&m)?);
            Ok(())
        }
        BenchCommand::IpcReader(a) => Ok(ipc::reader_main(
            a.reader,
            a.latency_iters,
            a.throughput_iters,
        )?),
    }
}
