//! Stalls, across real processes: a peer that is alive but stops moving, in the middle of an
//! overflow message or while the other side is parked, never hangs the queue. Each test here
//! failed before the waiting rules of `queue/mod.rs` (see its doc) were applied to the
//! overflow path, the wake-up condition and the spin phase.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use omni_ipc::{
    Handle, IpcError, MessageQueue, MessageQueueConfig, MessageQueueReader, QueueSpec, ReaderId,
};
use rand::{Rng, SeedableRng};

/// Larger than the 40 KiB slots and than the sockets' buffers, so its send blocks part-way.
const BIG: usize = 64 << 20;

fn small_config() -> MessageQueueConfig {
    MessageQueueConfig {
        max_chunk_bytes: 40 << 10,
        max_chunks: 2,
        ..MessageQueueConfig::default()
    }
}

/// Dispatches child roles; a no-op when run as a normal test.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        // Attaches, reads nothing, stays alive.
        "stalled_reader" => {
            let mut r = MessageQueueReader::attach(&child_handle(), ReaderId::Local(0)).unwrap();
            r.wait_until_ready(Duration::from_secs(10)).unwrap();
            println!("@@ stalled");
            std::thread::sleep(Duration::from_secs(600));
        }
        // Sends one overflow message (the test stops this process part-way through), then
        // reports how the send ended and exits, removing its segment.
        "overflow_writer" => {
            let spec =
                QueueSpec::local(&omni_ipc::shm::new_instance_id(), "ovf", 1, small_config());
            let mut q = MessageQueue::create(spec).unwrap();
            println!("@@ {}", serde_json::to_string(&q.handle()).unwrap());
            q.wait_until_ready(Duration::from_secs(20)).unwrap();
            println!("@@ sending");
            let r = q.enqueue(&1u64, &[&vec![7u8; BIG]]);
            println!(
                "@@ sent {}",
                r.map_or_else(|e| e.to_string(), |()| "ok".into())
            );
        }
        // N queues of one reader each. With SHUTDOWN, after queue i is ready it waits for a
        // line on stdin, then a random few hundred microseconds, then shuts the queue down.
        // Exits when the test closes its stdin.
        "many_writer" => {
            let n = env_u64("N") as usize;
            let shutdown = std::env::var("SHUTDOWN").is_ok();
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let mut qs: Vec<MessageQueue> = (0..n)
                .map(|i| {
                    let spec = QueueSpec::local(
                        &omni_ipc::shm::new_instance_id(),
                        &format!("m{i}"),
                        1,
                        trial_config(),
                    );
                    MessageQueue::create(spec).unwrap()
                })
                .collect();
            for q in &qs {
                println!("@@ {}", serde_json::to_string(&q.handle()).unwrap());
            }
            for (i, q) in qs.iter_mut().enumerate() {
                q.wait_until_ready(Duration::from_secs(30)).unwrap();
                if shutdown {
                    // The test says "go" just before its reader starts waiting.
                    let mut go = String::new();
                    std::io::stdin().read_line(&mut go).unwrap();
                    spin_for(Duration::from_micros(rng.random_range(0..800)));
                    q.shutdown();
                    println!("@@ shut {i}");
                }
            }
            println!("@@ done");
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        }
        other => panic!("unknown role {other}"),
    }
}

/// A liveness re-check far longer than any wake-up: a cancel or shutdown slept through shows
/// as a wait of seconds instead of microseconds.
fn trial_config() -> MessageQueueConfig {
    let spin = std::env::var("SPIN_MS").map_or(Duration::from_micros(200), |ms| {
        Duration::from_millis(ms.parse().unwrap())
    });
    MessageQueueConfig {
        max_chunk_bytes: 4096,
        max_chunks: 2,
        liveness_interval: Duration::from_secs(5),
        spin,
        ..MessageQueueConfig::default()
    }
}

fn spin_for(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// The child's "@@ " lines, read through one buffered reader.
struct Lines(BufReader<ChildStdout>);

impl Lines {
    fn of(child: &mut Child) -> Self {
        Lines(BufReader::new(child.stdout.take().unwrap()))
    }
    fn next(&mut self) -> String {
        loop {
            let mut line = String::new();
            assert!(
                self.0.read_line(&mut line).unwrap() > 0,
                "child exited without a marker line"
            );
            if let Some(i) = line.find("@@ ") {
                return line[i + 3..].trim().to_string();
            }
        }
    }
}

/// Runs `f` on a thread and waits at most `limit` for it: a hang fails the test instead of
/// hanging it.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("did not return within {limit:?}"))
}

#[test]
fn overflow_send_to_a_stalled_reader_warns_times_out_and_leaves_the_queue_unusable() {
    let cfg = MessageQueueConfig {
        warn_interval: Duration::from_secs(1),
        enqueue_timeout: Some(Duration::from_millis(2300)),
        ..small_config()
    };
    let spec = QueueSpec::local(&omni_ipc::shm::new_instance_id(), "stall", 1, cfg);
    let mut q = MessageQueue::create(spec).unwrap();
    let mut r = spawn_child("stalled_reader", Some(&q.handle()), &[]);
    let mut lines = Lines::of(&mut r);
    q.wait_until_ready(Duration::from_secs(20)).unwrap();
    assert_eq!(lines.next(), "stalled");
    let cap = Capture::default();
    let sub = tracing_subscriber::fmt().with_writer({
        let c = cap.clone();
        move || c.clone()
    });
    let big = vec![1u8; BIG];
    // Before the fix this send blocked until the reader died: bounded here, so a hang fails.
    let (mut q, err, waited) = within(Duration::from_secs(10), move || {
        let t0 = Instant::now();
        let err = tracing::subscriber::with_default(sub.finish(), || {
            q.enqueue(&0u64, &[&big]).unwrap_err()
        });
        (q, err, t0.elapsed())
    });
    match &err {
        IpcError::EnqueueTimeout { lagging, .. } => assert_eq!(lagging, &vec![ReaderId::Local(0)]),
        other => panic!("expected an enqueue timeout, got {other}"),
    }
    assert!(
        waited >= Duration::from_millis(2300) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    let log = String::from_utf8(cap.0.lock().unwrap().clone()).unwrap();
    for s in [1, 2] {
        assert!(
            log.contains(&format!(
                "No available shared memory broadcast block found in {s} seconds"
            )),
            "{log}"
        );
    }
    assert!(log.contains("local reader 0"), "{log}");
    // The reader expects the rest of that message: nothing may follow it on this queue.
    let t0 = Instant::now();
    let err = q.enqueue(&1u64, &[]).unwrap_err();
    assert!(matches!(err, IpcError::Unusable { .. }), "{err}");
    assert!(err.to_string().contains("overflow message 0"), "{err}");
    assert!(t0.elapsed() < Duration::from_millis(100));
    kill9(r.id());
    r.wait().unwrap();
}

/// Starts an `overflow_writer`, attaches to it, and stops it (SIGSTOP) part-way through its
/// overflow message, with the reader not yet reading.
fn writer_stopped_mid_message() -> (Child, Lines, MessageQueueReader) {
    let mut w = spawn_child("overflow_writer", None, &[]);
    let mut lines = Lines::of(&mut w);
    let h: Handle = serde_json::from_str(&lines.next()).unwrap();
    let mut r = MessageQueueReader::attach(&h, ReaderId::Local(0)).unwrap();
    r.wait_until_ready(Duration::from_secs(20)).unwrap();
    assert_eq!(lines.next(), "sending");
    // The marker is published and the socket buffers fill within this; the send then blocks.
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(w.id() as i32, libc::SIGSTOP) };
    (w, lines, r)
}

/// Lets the stopped writer go on: its send fails at once (the reader shut the connection
/// when it cut the message off), it says so, and it exits, removing its segment.
fn resume_and_reap(mut w: Child, mut lines: Lines) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(w.id() as i32, libc::SIGCONT) };
    let sent = lines.next();
    assert!(sent.starts_with("sent ") && sent != "sent ok", "{sent}");
    assert!(wait_with_deadline(&mut w, 10).success());
}

#[test]
fn reader_times_out_when_the_writer_stalls_mid_message_and_the_connection_is_then_unusable() {
    let (w, lines, r) = writer_stopped_mid_message();
    let (r, err, waited) = within(Duration::from_secs(8), move || {
        let mut r = r;
        let t0 = Instant::now();
        let e = r.dequeue(Some(Duration::from_secs(1))).unwrap_err();
        (r, e, t0.elapsed())
    });
    assert!(matches!(err, IpcError::Timeout(_)), "{err}");
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_millis(2500),
        "dequeue(1 s) returned after {waited:?}"
    );
    let mut r = r;
    let err = r.dequeue(Some(Duration::from_secs(1))).unwrap_err();
    assert!(matches!(err, IpcError::Unusable { .. }), "{err}");
    assert!(err.to_string().contains("cut off"), "{err}");
    resume_and_reap(w, lines);
}

#[test]
fn canceller_interrupts_a_reader_stuck_mid_message() {
    let (w, lines, r) = writer_stopped_mid_message();
    let c = r.canceller();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        c.cancel();
    });
    let (err, waited) = within(Duration::from_secs(8), move || {
        let mut r = r;
        let t0 = Instant::now();
        (r.dequeue(None).unwrap_err(), t0.elapsed())
    });
    t.join().unwrap();
    assert!(matches!(err, IpcError::Cancelled), "{err}");
    assert!(waited < Duration::from_millis(1500), "{waited:?}");
    resume_and_reap(w, lines);
}

/// Attaches to each of the `many_writer`'s queues.
fn attach_all(lines: &mut Lines, n: usize) -> Vec<MessageQueueReader> {
    let handles: Vec<Handle> = (0..n)
        .map(|_| serde_json::from_str(&lines.next()).unwrap())
        .collect();
    handles
        .iter()
        .map(|h| {
            let mut r = MessageQueueReader::attach(h, ReaderId::Local(0)).unwrap();
            r.wait_until_ready(Duration::from_secs(30)).unwrap();
            r
        })
        .collect()
}

/// Cancels aimed at the moment a reader goes from spinning to parking (the spin is 200 us;
/// the liveness check before the first park reads /proc): before the fix, about one in
/// twenty of these landed between that check and the futex word's re-read and was slept
/// through until the next liveness re-check (5 s here).
#[test]
fn an_aimed_cancel_is_never_slept_through() {
    const N: usize = 60;
    let mut w = spawn_child("many_writer", None, &[("N", N.to_string())]);
    let mut lines = Lines::of(&mut w);
    let readers = attach_all(&mut lines, N);
    assert_eq!(lines.next(), "done");
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut slow = Vec::new();
    for (i, mut r) in readers.into_iter().enumerate() {
        let c = r.canceller();
        let (tx, rx) = mpsc::channel();
        let t = std::thread::spawn(move || {
            tx.send(Instant::now()).unwrap();
            let e = r.dequeue(None).unwrap_err();
            (e, Instant::now())
        });
        let started = rx.recv().unwrap();
        spin_for(Duration::from_micros(rng.random_range(100..700)));
        let cancelled_at = Instant::now();
        c.cancel();
        let (e, ended) = t.join().unwrap();
        assert!(matches!(e, IpcError::Cancelled), "trial {i}: {e}");
        let latency = ended.saturating_duration_since(cancelled_at);
        if latency > Duration::from_secs(1) {
            slow.push((i, ended - started, latency));
        }
    }
    assert!(slow.is_empty(), "cancels slept through: {slow:?}");
    drop(w.stdin.take());
    assert!(wait_with_deadline(&mut w, 10).success());
}

/// The writer process shuts each queue down a random few hundred microseconds after the
/// reader starts waiting: every reader returns `Cancelled` at once, never a liveness
/// re-check (5 s) later.
#[test]
fn a_shutdown_from_the_writer_process_is_never_slept_through() {
    const N: usize = 30;
    let mut w = spawn_child(
        "many_writer",
        None,
        &[("N", N.to_string()), ("SHUTDOWN", "1".into())],
    );
    let mut stdin = w.stdin.take().unwrap();
    let mut lines = Lines::of(&mut w);
    let handles: Vec<Handle> = (0..N)
        .map(|_| serde_json::from_str(&lines.next()).unwrap())
        .collect();
    for (i, h) in handles.iter().enumerate() {
        let mut r = MessageQueueReader::attach(h, ReaderId::Local(0)).unwrap();
        r.wait_until_ready(Duration::from_secs(30)).unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
        let t0 = Instant::now();
        let e = r.dequeue(None).unwrap_err();
        let waited = t0.elapsed();
        assert!(matches!(e, IpcError::Cancelled), "trial {i}: {e}");
        assert!(waited < Duration::from_secs(1), "trial {i}: {waited:?}");
        assert_eq!(lines.next(), format!("shut {i}"));
    }
    assert_eq!(lines.next(), "done");
    drop(stdin);
    assert!(wait_with_deadline(&mut w, 10).success());
}

/// A spin far longer than the deadline: `dequeue(10 ms)` still returns after about 10 ms, and
/// a cancel during the spin ends it.
#[test]
fn the_spin_phase_obeys_the_deadline_and_the_canceller() {
    let mut w = spawn_child(
        "many_writer",
        None,
        &[("N", "1".into()), ("SPIN_MS", "3000".into())],
    );
    let mut lines = Lines::of(&mut w);
    let mut r = attach_all(&mut lines, 1).pop().unwrap();
    assert_eq!(lines.next(), "done");
    let t0 = Instant::now();
    let e = r.dequeue(Some(Duration::from_millis(10))).unwrap_err();
    assert!(matches!(e, IpcError::Timeout(_)), "{e}");
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    let c = r.canceller();
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        c.cancel();
    });
    let t0 = Instant::now();
    let e = r.dequeue(None).unwrap_err();
    canceller.join().unwrap();
    assert!(matches!(e, IpcError::Cancelled), "{e}");
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    drop(w.stdin.take());
    assert!(wait_with_deadline(&mut w, 10).success());
}

/// The writer's spin obeys `enqueue_timeout` too: a full ring and a stalled reader process
/// give `EnqueueTimeout` after the timeout, not after the 3 s spin.
#[test]
fn the_writer_spin_obeys_the_enqueue_timeout() {
    let cfg = MessageQueueConfig {
        spin: Duration::from_secs(3),
        enqueue_timeout: Some(Duration::from_millis(100)),
        ..small_config()
    };
    let spec = QueueSpec::local(&omni_ipc::shm::new_instance_id(), "wspin", 1, cfg);
    let mut q = MessageQueue::create(spec).unwrap();
    let mut r = spawn_child("stalled_reader", Some(&q.handle()), &[]);
    q.wait_until_ready(Duration::from_secs(20)).unwrap();
    q.enqueue(&0u64, &[]).unwrap();
    q.enqueue(&1u64, &[]).unwrap();
    let t0 = Instant::now();
    let e = q.enqueue(&2u64, &[]).unwrap_err();
    assert!(matches!(e, IpcError::EnqueueTimeout { .. }), "{e}");
    assert!(
        t0.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t0.elapsed()
    );
    kill9(r.id());
    r.wait().unwrap();
}
