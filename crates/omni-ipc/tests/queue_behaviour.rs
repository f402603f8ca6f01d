//! Queue behaviour that does not need a second process: timeouts, shutdown, warnings, errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use omni_ipc::{
    IpcError, MessageQueue, MessageQueueConfig, MessageQueueReader, QueueSpec, ReaderId,
};

fn pair(cfg: MessageQueueConfig) -> (MessageQueue, MessageQueueReader) {
    let spec = QueueSpec::local(&omni_ipc::shm::new_instance_id(), "t", 1, cfg);
    let mut q = MessageQueue::create(spec).unwrap();
    let h = q.handle();
    let t = std::thread::spawn(move || {
        let mut r = MessageQueueReader::attach(&h, ReaderId::Local(0)).unwrap();
        r.wait_until_ready(Duration::from_secs(10)).unwrap();
        r
    });
    q.wait_until_ready(Duration::from_secs(10)).unwrap();
    (q, t.join().unwrap())
}

fn small() -> MessageQueueConfig {
    MessageQueueConfig {
        max_chunk_bytes: 8192,
        max_chunks: 2,
        ..MessageQueueConfig::default()
    }
}

#[test]
fn dequeue_times_out() {
    let (_q, mut r) = pair(small());
    let t0 = Instant::now();
    let err = r.dequeue(Some(Duration::from_millis(120))).unwrap_err();
    assert!(matches!(err, IpcError::Timeout(_)), "{err}");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(120) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
}

#[test]
fn shutdown_wakes_an_idle_reader_with_cancelled() {
    let (q, mut r) = pair(small());
    let t = std::thread::spawn(move || {
        let t0 = Instant::now();
        let e = r.dequeue(None).unwrap_err();
        (e, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    q.shutdown();
    let (e, waited) = t.join().unwrap();
    assert!(matches!(e, IpcError::Cancelled), "{e}");
    assert!(waited < Duration::from_secs(2));
}

#[test]
fn shutdown_stops_a_busy_reader() {
    let (mut q, mut r) = pair(small());
    let t = std::thread::spawn(move || {
        let mut n = 0u64;
        loop {
            match r.dequeue(Some(Duration::from_secs(10))) {
                Ok(m) => {
                    assert_eq!(m.header::<u64>().unwrap(), n);
                    n += 1;
                }
                Err(e) => return (e, n),
            }
        }
    });
    for i in 0..2000u64 {
        q.enqueue(&i, &[&[7u8; 3000]]).unwrap();
    }
    q.shutdown();
    let (e, n) = t.join().unwrap();
    assert!(matches!(e, IpcError::Cancelled), "{e}");
    assert!(n > 0 && n <= 2000);
    // The writer sees the shutdown too.
    assert!(matches!(
        q.enqueue(&0u64, &[]),
        Err(IpcError::Cancelled) | Ok(())
    ));
}

#[test]
fn canceller_interrupts_a_blocked_dequeue_from_another_thread() {
    let (_q, mut r) = pair(small());
    let c = r.canceller();
    let t = std::thread::spawn(move || r.dequeue(None).unwrap_err());
    std::thread::sleep(Duration::from_millis(100));
    c.cancel();
    assert!(matches!(t.join().unwrap(), IpcError::Cancelled));
}

#[test]
fn writer_drop_lets_readers_drain_then_closed() {
    let (mut q, mut r) = pair(small());
    q.enqueue(&1u64, &[]).unwrap();
    drop(q);
    assert_eq!(
        r.dequeue(Some(Duration::from_secs(1)))
            .unwrap()
            .header::<u64>()
            .unwrap(),
        1
    );
    assert!(matches!(
        r.dequeue(Some(Duration::from_secs(1))),
        Err(IpcError::Closed)
    ));
}

#[test]
fn blocked_writer_logs_the_warning_line_and_times_out() {
    let cfg = MessageQueueConfig {
        warn_interval: Duration::from_secs(1),
        enqueue_timeout: Some(Duration::from_millis(2300)),
        ..small()
    };
    let (mut q, _r) = pair(cfg);
    let cap = common::Capture::default();
    let sub = tracing_subscriber::fmt().with_writer({
        let c = cap.clone();
        move || c.clone()
    });
    let err = tracing::subscriber::with_default(sub.finish(), || {
        q.enqueue(&0u64, &[]).unwrap();
        q.enqueue(&1u64, &[]).unwrap();
        q.enqueue(&2u64, &[]).unwrap_err()
    });
    assert!(matches!(err, IpcError::EnqueueTimeout { .. }), "{err}");
    let log = String::from_utf8(cap.0.lock().unwrap().clone()).unwrap();
    assert!(
        log.contains("No available shared memory broadcast block found in 1 seconds"),
        "{log}"
    );
    assert!(
        log.contains("No available shared memory broadcast block found in 2 seconds"),
        "{log}"
    );
    assert!(log.contains("local reader 0"), "{log}");
}

#[test]
fn binding_remote_readers_to_a_non_local_address_fails_clearly() {
    let spec = QueueSpec {
        n_remote_readers: 1,
        remote_addr: Some("203.0.113.7".parse().unwrap()),
        ..QueueSpec::local(&omni_ipc::shm::new_instance_id(), "remote", 1, small())
    };
    let err = MessageQueue::create(spec).unwrap_err();
    assert!(matches!(err, IpcError::NonLocalBind { .. }), "{err}");
    assert!(err.to_string().contains("203.0.113.7"), "{err}");
}

#[test]
fn ring_segment_is_0600_and_gone_after_drop() {
    let (q, r) = pair(small());
    let name = q.handle().ring.unwrap();
    let path = std::path::Path::new("/dev/shm").join(&name);
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    drop(r);
    drop(q);
    assert!(!path.exists());
}

#[test]
fn too_small_dev_shm_is_a_clear_error_at_create() {
    let free = omni_ipc::shm::free_bytes(std::path::Path::new("/dev/shm")).unwrap();
    let cfg = MessageQueueConfig {
        max_chunk_bytes: (free as usize / 4).max(1 << 20),
        max_chunks: 8,
        max_message_bytes: usize::MAX,
        ..MessageQueueConfig::default()
    };
    let err = MessageQueue::create(QueueSpec::local(
        &omni_ipc::shm::new_instance_id(),
        "big",
        1,
        cfg,
    ))
    .unwrap_err();
    assert!(matches!(err, IpcError::ShmTooSmall { .. }), "{err}");
    assert!(err.to_string().contains("/dev/shm"));
}

#[test]
fn zero_copy_view_is_aligned_and_overflow_is_owned() {
    let (mut q, mut r) = pair(small());
    let small_buf = vec![3u8; 1000];
    let big = vec![5u8; 20_000];
    q.enqueue(&"a", &[&small_buf]).unwrap();
    q.enqueue(&"b", &[&big]).unwrap();
    {
        let g = r.dequeue_borrowed(Some(Duration::from_secs(5))).unwrap();
        assert!(g.is_zero_copy());
        assert_eq!(g.buffer(0).as_ptr() as usize % 64, 0);
        assert_eq!(g.header::<String>().unwrap(), "a");
    }
    let g = r.dequeue_borrowed(Some(Duration::from_secs(5))).unwrap();
    assert!(!g.is_zero_copy());
    assert_eq!(g.buffer(0), &big[..]);
}

#[test]
fn bad_config_is_rejected_with_every_problem() {
    let cfg = MessageQueueConfig {
        max_chunk_bytes: 10,
        max_chunks: 0,
        ..MessageQueueConfig::default()
    };
    let err = MessageQueue::create(QueueSpec::local("x", "y", 1, cfg))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("max_chunk_bytes") && err.contains("max_chunks"),
        "{err}"
    );
}

/// The executor waits for its workers in short slices (checking for dead children between
/// them): a slice that ends names the readers still missing with a typed error, and the next
/// call goes on waiting for them, keeping those that already attached.
#[test]
fn ready_wait_in_slices_names_the_missing_reader_then_completes() {
    let spec = QueueSpec::local(&omni_ipc::shm::new_instance_id(), "slices", 2, small());
    let mut q = MessageQueue::create(spec).unwrap();
    let h = q.handle();
    let h1 = h.clone();
    let first = std::thread::spawn(move || {
        let mut r = MessageQueueReader::attach(&h1, ReaderId::Local(0)).unwrap();
        r.wait_until_ready(Duration::from_secs(10)).unwrap();
        r
    });
    // Reader 0 attaches; reader 1 has not started: every slice names reader 1 only.
    let deadline = Instant::now() + Duration::from_secs(5);
    let missing = loop {
        match q.wait_until_ready(Duration::from_millis(50)) {
            Err(IpcError::ReadyTimeout { missing, .. }) if missing.len() == 1 => break missing,
            Err(IpcError::ReadyTimeout { .. }) if Instant::now() < deadline => continue,
            other => panic!("expected a ready timeout naming one reader, got {other:?}"),
        }
    };
    assert_eq!(missing, vec![ReaderId::Local(1)]);
    let second = std::thread::spawn(move || {
        let mut r = MessageQueueReader::attach(&h, ReaderId::Local(1)).unwrap();
        r.wait_until_ready(Duration::from_secs(10)).unwrap();
        r
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match q.wait_until_ready(Duration::from_millis(50)) {
            Ok(()) => break,
            Err(IpcError::ReadyTimeout { .. }) if Instant::now() < deadline => {}
            Err(e) => panic!("{e}"),
        }
    }
    let (mut r0, mut r1) = (first.join().unwrap(), second.join().unwrap());
    q.enqueue(&7u32, &[]).unwrap();
    for r in [&mut r0, &mut r1] {
        let m = r.dequeue(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(m.header::<u32>().unwrap(), 7);
    }
}

/// A busy reader polls with zero timeouts between steps (an omni stage does): an overflow
/// message published meanwhile is still read whole, not timed out before its first byte on
/// every call (which starved such a reader for good).
#[test]
fn a_reader_polling_with_zero_timeouts_still_gets_overflow_messages() {
    let (mut q, mut r) = pair(small());
    let big = vec![7u8; 3 << 20];
    let writer = std::thread::spawn(move || {
        for i in 0..4u32 {
            q.enqueue(&i, &[&big]).unwrap();
        }
        q
    });
    let mut got = Vec::new();
    let t0 = Instant::now();
    while got.len() < 4 && t0.elapsed() < Duration::from_secs(20) {
        match r.dequeue(Some(Duration::ZERO)) {
            Ok(m) => {
                assert_eq!(m.buffers()[0].len(), 3 << 20);
                got.push(m.header::<u32>().unwrap());
            }
            Err(IpcError::Timeout(_)) => std::thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(got, vec![0, 1, 2, 3]);
    drop(writer.join().unwrap());
}

#[test]
fn stats_count_a_message_over_the_chunk_as_overflow_with_its_bytes() {
    let (mut q, mut r) = pair(small());
    assert_eq!(q.stats(), omni_ipc::MessageQueueStats::default());
    let small_buf = vec![3u8; 1000];
    let big = vec![5u8; 20_000];
    q.enqueue_raw(b"hdr", &[&small_buf]).unwrap();
    q.enqueue_raw(b"header", &[&big, &small_buf]).unwrap();
    for _ in 0..2 {
        r.dequeue_borrowed(Some(Duration::from_secs(5))).unwrap();
    }
    let s = q.stats();
    assert_eq!(s.messages, 2);
    assert_eq!(s.overflow_messages, 1);
    assert_eq!(s.ring_bytes, 3 + 1000);
    assert_eq!(s.overflow_bytes, 6 + 20_000 + 1000);
}
