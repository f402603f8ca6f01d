//! How `bench serve` sends requests, against a minimal HTTP/1.1 streaming server that logs when
//! each request starts and ends and counts its connections: a test request first; with
//! `--max-concurrency` a new request starts as soon as any running one ends (not when a whole
//! wave has ended); keep-alive connections carry the requests one after another; a finite
//! `--request-rate` spreads the arrivals over `num_prompts / rate` seconds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: omni_bench::serve::ServeBenchArgs,
}

/// One request as the server saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    start: Instant,
    end: Instant,
    connection: usize,
}

#[derive(Default)]
struct Log {
    requests: Mutex<Vec<Seen>>,
    connections: AtomicUsize,
}

/// Streams `max_tokens` completion chunks, `token_ms` apart, then usage and `[DONE]`, in
/// chunked transfer encoding; serves any number of requests per connection.
async fn serve_connection(tcp: TcpStream, log: Arc<Log>, token_ms: u64) {
    let connection = log.connections.fetch_add(1, Ordering::SeqCst);
    let (read, mut write) = tcp.into_split();
    let mut read = BufReader::new(read);
    loop {
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                return; // the client closed the connection
            }
            if line == "\r\n" {
                break;
            }
            if let Some((k, v)) = line.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        read.read_exact(&mut body).await.unwrap();
        if length == 0 {
            // A GET (`bench serve` scrapes /metrics around the run): this server has none.
            write
                .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
            continue;
        }
        let start = Instant::now();
        let req: Value = serde_json::from_slice(&body).unwrap();
        let tokens = req["max_tokens"].as_u64().unwrap();
        write
            .write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                  transfer-encoding: chunked\r\n\r\n",
            )
            .await
            .unwrap();
        let chunk = |data: String| {
            let event = format!("data: {data}\n\n");
            format!("{:x}\r\n{event}\r\n", event.len())
        };
        for _ in 0..tokens {
            tokio::time::sleep(Duration::from_millis(token_ms)).await;
            let c = chunk(r#"{"choices":[{"index":0,"text":"x"}]}"#.into());
            write.write_all(c.as_bytes()).await.unwrap();
        }
        let usage = format!(
            r#"{{"choices":[],"usage":{{"prompt_tokens":4,"completion_tokens":{tokens}}}}}"#
        );
        write.write_all(chunk(usage).as_bytes()).await.unwrap();
        write
            .write_all(chunk("[DONE]".into()).as_bytes())
            .await
            .unwrap();
        let end = Instant::now();
        log.requests.lock().unwrap().push(Seen {
            start,
            end,
            connection,
        });
        write.write_all(b"0\r\n\r\n").await.unwrap();
    }
}

/// Runs `bench serve` with `flags` against a fresh server; returns what the server saw.
fn bench(flags: &[&str], token_ms: u64) -> (Vec<Seen>, usize, omni_bench::serve::ServeBenchResult) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let log = Arc::new(Log::default());
    let listener = runtime.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server_log = log.clone();
    runtime.spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            tokio::spawn(serve_connection(tcp, server_log.clone(), token_ms));
        }
    });
    let mut argv = vec![
        "bench",
        "--base-url",
        &url,
        "--model",
        "m",
        "--disable-tqdm",
        "--seed",
        "1",
    ];
    argv.extend_from_slice(flags);
    let result = omni_bench::serve::run(Cli::parse_from(argv).serve).unwrap();
    let mut seen = log.requests.lock().unwrap().clone();
    seen.sort_by_key(|s| s.start);
    let connections = log.connections.load(Ordering::SeqCst);
    (seen, connections, result)
}

/// Requests in flight at the server at `t` (started at or before, not yet ended).
fn in_flight(seen: &[Seen], t: Instant) -> usize {
    seen.iter().filter(|s| s.start <= t && t < s.end).count()
}

#[test]
fn a_request_starts_when_any_slot_frees_not_when_the_wave_ends() {
    // 24 requests of 5..=15 tokens at 10 ms, 4 at a time: lengths differ, so slots free one by
    // one and each new request starts while the others of its "wave" still run.
    let flags = [
        "--num-prompts",
        "24",
        "--max-concurrency",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "10",
        "--random-range-ratio",
        "0.5",
    ];
    let (seen, connections, result) = bench(&flags, 10);
    assert_eq!((result.completed, result.failed), (24, 0));
    assert_eq!(seen.len(), 25, "the test request and the 24 of the run");
    let (test, run) = (seen[0], &seen[1..]);
    assert!(
        run.iter().all(|s| s.start >= test.end),
        "the test request runs alone, before the run"
    );
    for s in run {
        assert!(in_flight(run, s.start) <= 4, "more than 4 in flight");
    }
    // After the first four, every request begins within 50 ms of an earlier one's end, and
    // while at least two others are still running (waves would start them with none running).
    let mut overlapping = 0;
    for s in &run[4..] {
        let freed = run
            .iter()
            .filter(|o| o.end <= s.start)
            .map(|o| s.start - o.end)
            .min()
            .unwrap();
        assert!(
            freed < Duration::from_millis(50),
            "started {freed:?} after a slot freed"
        );
        if in_flight(run, s.start) >= 3 {
            overlapping += 1;
        }
    }
    assert!(
        overlapping >= 15,
        "only {overlapping} of 20 started beside 2 running ones"
    );
    // Keep-alive: at most one connection per slot, and the test request's, carry all 25
    // requests, one after another on each.
    assert!(connections <= 5, "{connections} connections for 4 slots");
    for a in &seen {
        for b in &seen {
            if a.connection == b.connection && a.start < b.start {
                assert!(a.end <= b.start, "two requests at once on one connection");
            }
        }
    }
}

#[test]
fn a_finite_rate_spreads_arrivals_over_num_prompts_over_rate() {
    let flags = [
        "--num-prompts",
        "20",
        "--request-rate",
        "40",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
    ];
    let (seen, _, result) = bench(&flags, 1);
    assert_eq!(result.completed, 20);
    let run = &seen[1..];
    // The last arrival is at 20 / 40 = 0.5 s after the run starts; the first at a gap of mean
    // 25 ms.
    let span = run[run.len() - 1].start - run[0].start;
    assert!(
        (Duration::from_millis(350)..Duration::from_millis(700)).contains(&span),
        "{span:?}"
    );
}

#[test]
fn arrival_times_end_at_n_over_rate() {
    let mut rng = StdRng::seed_from_u64(5);
    let at = omni_bench::serve::arrival_times(100, 20.0, &mut rng);
    assert_eq!(at.len(), 100);
    assert!(at.windows(2).all(|w| w[0] <= w[1]));
    assert!((at[99].as_secs_f64() - 5.0).abs() < 1e-9, "{:?}", at[99]);
    let gaps: Vec<f64> = std::iter::once(at[0].as_secs_f64())
        .chain(at.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()))
        .collect();
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    assert!((mean - 0.05).abs() < 1e-9);
    assert!(gaps.iter().any(|&g| g > 0.1) && gaps.iter().any(|&g| g < 0.02));
    let all_at_once = omni_bench::serve::arrival_times(7, f64::INFINITY, &mut rng);
    assert_eq!(all_at_once, vec![Duration::ZERO; 7]);
}

#[test]
fn a_failing_test_request_stops_the_run() {
    // Nothing listens on the port; with a 1 s ready check the run fails naming the test request.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let args = Cli::parse_from([
        "bench",
        "--base-url",
        &url,
        "--model",
        "m",
        "--num-prompts",
        "2",
        "--random-input-len",
        "4",
        "--ready-check-timeout-sec",
        "1",
        "--disable-tqdm",
    ])
    .serve;
    let err = omni_bench::serve::run(args).unwrap_err().to_string();
    assert!(err.contains("initial test request"), "{err}");
}
