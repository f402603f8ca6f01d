//! `omni-engine bench ipc`: one-way latency and per-reader throughput of the broadcast queue
//! across real processes, against a plain memcpy of the same bytes measured in the same run.
//!
//! For each (chunk size, readers, payload) the writer spawns `readers` processes
//! (`omni-engine bench ipc-reader`), then
//! * **latency**: sends `latency_iters` messages one at a time (each after every reader has
//!   released the previous one), stamped with `CLOCK_MONOTONIC` (system-wide, so comparable
//!   across processes); a reader records `now - stamp` when `dequeue_borrowed` returns, i.e.
//!   when the payload is readable in its address space (zero-copy on the ring path; fully
//!   received on the ZeroMQ path). Each reader's first message is reported on its own
//!   (`first_us`): on the ZeroMQ path it pays for the fresh process's receive buffer (a 32 MiB
//!   buffer is 8,192 page faults and a kernel zero-fill, 3-5x the steady state; later messages
//!   reuse it), and with 100 samples of large payloads it alone would be the p99. The
//!   percentiles are over the rest;
//! * **throughput**: sends `throughput_iters` messages back to back; each reader copies every
//!   payload into its own buffer (the bytes end up owned by the reader, as a worker needs them)
//!   and reports payload bytes / time from the first stamp to its last copy;
//! * **memcpy**: the writer times `copy_from_slice` of the same payloads from the same
//!   rotating source buffers into rotating destinations that span the ring's size, so neither
//!   the queue nor the baseline is flattered by a cache-hot source.
//!
//! Readers report through stdout as one JSON line. The table is printed last.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use omni_ipc::{Handle, MessageQueue, MessageQueueConfig, MessageQueueReader, QueueSpec, ReaderId};
use serde::{Deserialize, Serialize};

/// Errors of the IPC benchmark.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The queue failed.
    #[error(transparent)]
    Ipc(#[from] omni_ipc::IpcError),
    /// Spawning or talking to a reader process failed.
    #[error("reader process: {0}")]
    Reader(String),
    /// Writing results failed.
    #[error("writing {path}: {source}")]
    Io {
        /// Output path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
}

/// What to run.
#[derive(Debug, Clone)]
pub struct IpcBenchOptions {
    /// Payload sizes in bytes.
    pub payloads: Vec<usize>,
    /// Reader process counts.
    pub readers: Vec<usize>,
    /// Chunk sizes in MiB.
    pub chunk_mib: Vec<usize>,
    /// Ring slots.
    pub max_chunks: usize,
    /// Messages timed for latency.
    pub latency_iters: usize,
    /// Bytes streamed per throughput measurement (message count derives from it).
    pub throughput_bytes: usize,
    /// Reader spin before parking.
    pub spin: Duration,
    /// The binary to spawn readers with (`<exe> bench ipc-reader`).
    pub exe: std::path::PathBuf,
}

impl IpcBenchOptions {
    /// The full matrix of the issue: 7 payloads x 1, 2, 4 readers x 10, 16, 100 MiB chunks.
    pub fn full(exe: std::path::PathBuf) -> Self {
        Self {
            payloads: vec![64, 4 << 10, 256 << 10, 1 << 20, 8 << 20, 11 << 20, 32 << 20],
            readers: vec![1, 2, 4],
            chunk_mib: vec![10, 16, 100],
            max_chunks: 10,
            latency_iters: 1000,
            throughput_bytes: 384 << 20,
            spin: Duration::from_millis(2),
            exe,
        }
    }

    /// The `--quick` subset (< 30 s): 64 B, 1 MiB, 11 MiB, 32 MiB at 16 MiB chunks, 1 reader.
    pub fn quick(exe: std::path::PathBuf) -> Self {
        Self {
            payloads: vec![64, 4 << 10, 1 << 20, 11 << 20, 32 << 20],
            readers: vec![1],
            chunk_mib: vec![16],
            latency_iters: 2000,
            throughput_bytes: 512 << 20,
            ..Self::full(exe)
        }
    }
}

/// One result row (the `--json` schema).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IpcBenchRow {
    /// Payload bytes per message.
    pub payload_bytes: usize,
    /// Reader processes.
    pub readers: usize,
    /// Ring slot size.
    pub max_chunk_bytes: usize,
    /// "shm" (in the ring) or "zmq" (overflow over ZeroMQ).
    pub path: String,
    /// One-way latency of each reader's first message (the slowest reader's), microseconds: it
    /// pays for a fresh reader's receive buffer (page faults) on the ZeroMQ path and is left out
    /// of the percentiles, which describe the steady state.
    #[serde(default)]
    pub first_us: f64,
    /// One-way latency, median, microseconds.
    pub p50_us: f64,
    /// One-way latency, 99th percentile, microseconds.
    pub p99_us: f64,
    /// Throughput of the slowest reader, GB/s (1e9 B/s), reading every payload byte where it
    /// was delivered (zero-copy from the ring slot; the received buffer on the ZeroMQ path).
    pub gbps_per_reader: f64,
    /// The same when the reader also copies every payload into a buffer of its own.
    pub owned_copy_gbps_per_reader: f64,
    /// Single-threaded memcpy of the same bytes in the same run, GB/s.
    pub memcpy_gbps: f64,
}

#[derive(Debug, Serialize, Deserialize)]
struct ReaderReport {
    latencies_ns: Vec<u64>,
    gbps: f64,
    owned_gbps: f64,
}

/// Reads every byte (a wrapping sum of 64-bit words), so a zero-copy reader really touches
/// the payload.
pub fn checksum(b: &[u8]) -> u64 {
    let mut acc = [0u64; 4];
    let mut chunks = b.chunks_exact(32);
    for c in &mut chunks {
        for (k, w) in c.chunks_exact(8).enumerate() {
            acc[k] = acc[k].wrapping_add(u64::from_ne_bytes([
                w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
            ]));
        }
    }
    let tail: u64 = chunks.remainder().iter().map(|&x| u64::from(x)).sum();
    acc.iter().fold(tail, |a, &x| a.wrapping_add(x))
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    stamp_ns: u64,
    phase: u8,
}

/// `CLOCK_MONOTONIC` in nanoseconds (shared by all processes of the host).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_MONOTONIC is always available on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64
}

/// Source buffers the writer rotates through: a scheduler builds a fresh batch every step,
/// so neither the queue nor the memcpy baseline gets a cache-hot source.
fn sources(bytes: usize) -> Vec<Vec<u8>> {
    let n = ((256usize << 20) / bytes.max(1)).clamp(1, 16);
    (0..n)
        .map(|i| vec![0x11u8.wrapping_mul(i as u8 + 1); bytes])
        .collect()
}

/// memcpy of `bytes` from the rotating `srcs` into rotating destinations spanning `span`
/// bytes (as the writer fills ring slots), GB/s.
pub fn memcpy_gbps(srcs: &[Vec<u8>], span: usize) -> f64 {
    let bytes = srcs.first().map_or(0, Vec::len);
    let n_dst = (span / bytes.max(1)).clamp(1, 64);
    let mut dsts: Vec<Vec<u8>> = (0..n_dst).map(|_| vec![0u8; bytes]).collect();
    let iters = ((512usize << 20) / bytes.max(1)).clamp(16, 200_000);
    for (i, d) in dsts.iter_mut().enumerate() {
        d.copy_from_slice(&srcs[i % srcs.len()]);
    }
    let t0 = Instant::now();
    for i in 0..iters {
        dsts[i % n_dst].copy_from_slice(&srcs[i % srcs.len()]);
        std::hint::black_box(&dsts[i % n_dst]);
    }
    (iters * bytes) as f64 / t0.elapsed().as_secs_f64() / 1e9
}

fn run_one(
    opts: &IpcBenchOptions,
    chunk_mib: usize,
    readers: usize,
    payload: usize,
) -> Result<IpcBenchRow, BenchError> {
    let config = MessageQueueConfig {
        max_chunk_bytes: chunk_mib << 20,
        max_chunks: opts.max_chunks,
        spin: opts.spin,
        enqueue_timeout: Some(Duration::from_secs(120)),
        max_message_bytes: (payload + (1 << 20)).max(chunk_mib << 20),
        ..MessageQueueConfig::default()
    };
    let mut q = MessageQueue::create(QueueSpec::local(
        &omni_ipc::shm::new_instance_id(),
        "bench",
        readers,
        config,
    ))?;
    let lat_iters = if payload >= 8 << 20 {
        opts.latency_iters.min(100)
    } else {
        opts.latency_iters
    };
    let tput_iters = (opts.throughput_bytes / payload).clamp(40, 40_000);
    let handle =
        serde_json::to_string(&q.handle()).map_err(|e| BenchError::Reader(e.to_string()))?;
    let mut kids = Vec::new();
    for r in 0..readers {
        let child = Command::new(&opts.exe)
            .args(["bench", "ipc-reader", "--reader", &r.to_string()])
            .args([
                "--latency-iters",
                &lat_iters.to_string(),
                "--throughput-iters",
                &tput_iters.to_string(),
            ])
            .env("OMNI_BENCH_HANDLE", &handle)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| BenchError::Reader(format!("spawn {}: {e}", opts.exe.display())))?;
        kids.push(child);
    }
    q.wait_until_ready(Duration::from_secs(60))?;
    let srcs = sources(payload);
    let span = opts.max_chunks * payload.min(chunk_mib << 20);
    // The machine is shared and noisy: time memcpy right before and right after the queue and
    // use the mean, so the ratio compares like with like.
    let memcpy_before = memcpy_gbps(&srcs, span);
    // Latency: one message in flight at a time.
    for i in 0..lat_iters {
        q.wait_drained(Duration::from_secs(60))?;
        q.enqueue(
            &Header {
                stamp_ns: monotonic_ns(),
                phase: 0,
            },
            &[&srcs[i % srcs.len()]],
        )?;
    }
    q.wait_drained(Duration::from_secs(60))?;
    // Throughput: back to back.
    for i in 0..tput_iters {
        q.enqueue(
            &Header {
                stamp_ns: monotonic_ns(),
                phase: 1,
            },
            &[&srcs[i % srcs.len()]],
        )?;
    }
    q.wait_drained(Duration::from_secs(120))?;
    let mut lat = Vec::new();
    let mut first = 0u64;
    let mut gbps = f64::INFINITY;
    let mut owned = f64::INFINITY;
    for mut k in kids {
        let out = k
            .stdout
            .take()
            .ok_or_else(|| BenchError::Reader("no stdout".into()))?;
        let mut report = None;
        for line in BufReader::new(out).lines() {
            let line = line.map_err(|e| BenchError::Reader(e.to_string()))?;
            if let Some(j) = line.strip_prefix("@@ ") {
                report = Some(
                    serde_json::from_str::<ReaderReport>(j)
                        .map_err(|e| BenchError::Reader(e.to_string()))?,
                );
            }
        }
        let status = k.wait().map_err(|e| BenchError::Reader(e.to_string()))?;
        let report = report.ok_or_else(|| {
            BenchError::Reader(format!("reader exited ({status}) without a report"))
        })?;
        if let Some((f, rest)) = report.latencies_ns.split_first() {
            first = first.max(*f);
            lat.extend_from_slice(rest);
        }
        gbps = gbps.min(report.gbps);
        owned = owned.min(report.owned_gbps);
    }
    drop(q);
    lat.sort_unstable();
    let inline = omni_ipc::codec::inline_len(16, &[&srcs[0]]) <= chunk_mib << 20;
    Ok(IpcBenchRow {
        payload_bytes: payload,
        readers,
        max_chunk_bytes: chunk_mib << 20,
        path: if inline { "shm" } else { "zmq" }.into(),
        first_us: first as f64 / 1e3,
        p50_us: percentile(&lat, 0.5) / 1e3,
        p99_us: percentile(&lat, 0.99) / 1e3,
        gbps_per_reader: gbps,
        owned_copy_gbps_per_reader: owned,
        memcpy_gbps: (memcpy_before + memcpy_gbps(&srcs, span)) / 2.0,
    })
}

/// Runs the matrix; prints a progress line per row to stderr.
pub fn run(opts: &IpcBenchOptions) -> Result<Vec<IpcBenchRow>, BenchError> {
    omni_ipc::shm::sweep_stale();
    let mut rows = Vec::new();
    for &c in &opts.chunk_mib {
        for &r in &opts.readers {
            for &p in &opts.payloads {
                let row = run_one(opts, c, r, p)?;
                eprintln!(
                    "  chunk {c:>3} MiB  readers {r}  payload {:>9}  {}  p50 {:>9.2} us  {:>6.2} GB/s ({:.2} of memcpy)",
                    human(p),
                    row.path,
                    row.p50_us,
                    row.gbps_per_reader,
                    row.gbps_per_reader / row.memcpy_gbps
                );
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

/// The reader process: attaches, measures, prints one `@@ {json}` line.
pub fn reader_main(
    reader: usize,
    latency_iters: usize,
    throughput_iters: usize,
) -> Result<(), BenchError> {
    let handle: Handle = serde_json::from_str(
        &std::env::var("OMNI_BENCH_HANDLE").map_err(|e| BenchError::Reader(e.to_string()))?,
    )
    .map_err(|e| BenchError::Reader(e.to_string()))?;
    let mut q = MessageQueueReader::attach(&handle, ReaderId::Local(reader))?;
    q.wait_until_ready(Duration::from_secs(60))?;
    let timeout = Some(Duration::from_secs(120));
    let mut latencies_ns = Vec::with_capacity(latency_iters);
    for _ in 0..latency_iters {
        let g = q.dequeue_borrowed(timeout)?;
        let now = monotonic_ns();
        let h: Header = g.header()?;
        latencies_ns.push(now.saturating_sub(h.stamp_ns));
        std::hint::black_box(g.buffer(0).first());
    }
    // Throughput 1: read every byte where it lies (zero-copy on the ring path).
    let half = throughput_iters / 2;
    let (mut start, mut bytes, mut sum) = (0u64, 0usize, 0u64);
    for i in 0..half {
        let g = q.dequeue_borrowed(timeout)?;
        if i == 0 {
            start = g.header::<Header>()?.stamp_ns;
        }
        sum = sum.wrapping_add(checksum(g.buffer(0)));
        bytes += g.buffer(0).len();
    }
    std::hint::black_box(sum);
    let gbps = bytes as f64 / ((monotonic_ns() - start) as f64 / 1e9) / 1e9;
    // Throughput 2: take an owned copy of every payload.
    let mut own: Vec<u8> = Vec::new();
    let (mut start, mut bytes) = (0u64, 0usize);
    for i in half..throughput_iters {
        let g = q.dequeue_borrowed(timeout)?;
        if i == half {
            start = g.header::<Header>()?.stamp_ns;
        }
        let b = g.buffer(0);
        if own.len() != b.len() {
            own = vec![0u8; b.len()];
        }
        own.copy_from_slice(b);
        std::hint::black_box(&own);
        bytes += b.len();
    }
    let owned_gbps = bytes as f64 / ((monotonic_ns() - start) as f64 / 1e9) / 1e9;
    let report = ReaderReport {
        latencies_ns,
        gbps,
        owned_gbps,
    };
    println!(
        "@@ {}",
        serde_json::to_string(&report).map_err(|e| BenchError::Reader(e.to_string()))?
    );
    Ok(())
}

fn human(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// The table, printed last.
pub fn format_table(rows: &[IpcBenchRow]) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:>9} {:>7} {:>9} {:>4} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>10}\n",
        "payload",
        "readers",
        "chunk",
        "path",
        "first us",
        "p50 us",
        "p99 us",
        "GB/s/rdr",
        "memcpy",
        "ratio",
        "copy ratio"
    ));
    for r in rows {
        s.push_str(&format!(
            "{:>9} {:>7} {:>9} {:>4} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>8.2} {:>10.2}\n",
            human(r.payload_bytes),
            r.readers,
            human(r.max_chunk_bytes),
            r.path,
            r.first_us,
            r.p50_us,
            r.p99_us,
            r.gbps_per_reader,
            r.memcpy_gbps,
            r.gbps_per_reader / r.memcpy_gbps,
            r.owned_copy_gbps_per_reader / r.memcpy_gbps
        ));
    }
    s
}

/// A chunk size that keeps every payload seen on the ring path, and its memory cost.
pub fn recommend(rows: &[IpcBenchRow], max_chunks: usize) -> String {
    let Some(largest) = rows.iter().map(|r| r.payload_bytes).max() else {
        return String::new();
    };
    let need_mib =
        (omni_ipc::codec::inline_len(4096, &[&vec![0u8; 0][..]]) + largest).div_ceil(1 << 20);
    let zmq_rows: Vec<&IpcBenchRow> = rows.iter().filter(|r| r.path == "zmq").collect();
    let mut s = format!(
        "Recommendation: VLLM_MQ_MAX_CHUNK_BYTES_MB={need_mib} keeps every payload seen here (largest {}) in shared memory; \
         it costs {max_chunks} x {need_mib} MiB = {} MiB of /dev/shm per queue.",
        human(largest),
        max_chunks * need_mib
    );
    if let Some(z) = zmq_rows.first() {
        let shm = rows
            .iter()
            .filter(|r| r.path == "shm" && r.readers == z.readers)
            .map(|r| r.gbps_per_reader / r.memcpy_gbps)
            .fold(0.0, f64::max);
        s.push_str(&format!(
            " Payloads above the chunk took the ZeroMQ path at {:.2} of memcpy vs up to {:.2} in the ring.",
            z.gbps_per_reader / z.memcpy_gbps,
            shm
        ));
    }
    s
}

/// Writes rows as JSON.
pub fn write_json(path: &std::path::Path, rows: &[IpcBenchRow]) -> Result<(), BenchError> {
    let text = serde_json::to_string_pretty(rows).map_err(|e| BenchError::Reader(e.to_string()))?;
    std::fs::write(path, text).map_err(|source| BenchError::Io {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_from_sorted_samples() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), 51.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn recommendation_covers_the_largest_payload() {
        let row = |p: usize, path: &str| IpcBenchRow {
            payload_bytes: p,
            readers: 1,
            max_chunk_bytes: 16 << 20,
            path: path.into(),
            first_us: 3.0,
            p50_us: 1.0,
            p99_us: 2.0,
            gbps_per_reader: 1.0,
            owned_copy_gbps_per_reader: 0.5,
            memcpy_gbps: 2.0,
        };
        let s = recommend(&[row(64, "shm"), row(32 << 20, "zmq")], 10);
        assert!(s.contains("VLLM_MQ_MAX_CHUNK_BYTES_MB=33"), "{s}");
    }
}
