//! The broadcast queue across real OS processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read};
use std::time::{Duration, Instant};

use common::*;
use omni_ipc::{
    IpcError, MessageQueue, MessageQueueConfig, MessageQueueReader, QueueSpec, ReaderId,
};
use rand::{Rng, SeedableRng};

const SEED: u64 = 0x5EED;

/// Dispatches child roles; a no-op when run as a normal test.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        "reader" => reader_role(),
        "stalled_reader" => {
            let h = child_handle();
            let mut r = MessageQueueReader::attach(&h, ReaderId::Local(env_u64("READER") as usize))
                .unwrap();
            r.wait_until_ready(Duration::from_secs(10)).unwrap();
            for _ in 0..env_u64("READ_FIRST") {
                r.dequeue(Some(Duration::from_secs(10))).unwrap();
            }
            println!("@@ stalled");
            std::thread::sleep(Duration::from_secs(600));
        }
        "idle_reader" => {
            let h = child_handle();
            let mut r = MessageQueueReader::attach(&h, ReaderId::Local(0)).unwrap();
            r.wait_until_ready(Duration::from_secs(10)).unwrap();
            println!("@@ parked");
            let m = r.dequeue(None).unwrap();
            let sent_ns: u64 = m.header().unwrap();
            let now = omni_now_ns();
            println!("@@ latency_ns {}", now.saturating_sub(sent_ns));
        }
        "writer_exit" | "writer_panic" | "writer_hang" => {
            let spec = QueueSpec::local(&omni_ipc::shm::new_instance_id(), "w", 1, small_config());
            let q = MessageQueue::create(spec).unwrap();
            println!("@@ {}", q.handle().ring.unwrap());
            match role.as_str() {
                "writer_panic" => panic!("deliberate panic with a live queue"),
                "writer_hang" => std::thread::sleep(Duration::from_secs(600)),
                _ => drop(q),
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn omni_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn small_config() -> MessageQueueConfig {
    MessageQueueConfig {
        max_chunk_bytes: 40 << 10,
        max_chunks: 2,
        ..MessageQueueConfig::default()
    }
}

fn reader_role() {
    let h = child_handle();
    let id = match std::env::var("REMOTE") {
        Ok(_) => ReaderId::Remote(env_u64("READER") as usize),
        Err(_) => ReaderId::Local(env_u64("READER") as usize),
    };
    let n = env_u64("N");
    let max = env_u64("MAX") as usize;
    let mut r = MessageQueueReader::attach(&h, id).unwrap();
    r.wait_until_ready(Duration::from_secs(20)).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(env_u64("READER"));
    for seq in 0..n {
        let want = payload(SEED, seq, max);
        // Alternate the zero-copy and the owned path.
        if seq % 2 == 0 {
            let g = r.dequeue_borrowed(Some(Duration::from_secs(30))).unwrap();
            let got_seq: u64 = g.header().unwrap();
            assert_eq!(got_seq, seq, "{id}: out of order");
            assert_eq!(g.num_buffers(), 2);
            assert_eq!(g.buffer(0), &want[..], "{id}: message {seq} differs");
            assert_eq!(g.buffer(1), &seq.to_le_bytes());
        } else {
            let m = r.dequeue(Some(Duration::from_secs(30))).unwrap();
            assert_eq!(m.header::<u64>().unwrap(), seq, "{id}: out of order");
            assert_eq!(
                &m.buffers()[0][..],
                &want[..],
                "{id}: message {seq} differs"
            );
        }
        if rng.random_ratio(1, 200) {
            std::thread::sleep(Duration::from_micros(rng.random_range(0..3000)));
        }
    }
    println!("ok {n}");
}

fn run_broadcast(n_local: usize, n_remote: usize, n: u64, max: usize) {
    let spec = QueueSpec {
        instance: omni_ipc::shm::new_instance_id(),
        channel: "bcast".into(),
        n_local_readers: n_local,
        n_remote_readers: n_remote,
        remote_addr: (n_remote > 0).then(|| "127.0.0.1".parse().unwrap()),
        remote_port: 0,
        config: MessageQueueConfig {
            enqueue_timeout: Some(Duration::from_secs(60)),
            ..small_config()
        },
    };
    let mut q = MessageQueue::create(spec).unwrap();
    let h = q.handle();
    let mut kids: Vec<_> = (0..n_local)
        .map(|i| {
            spawn_child(
                "reader",
                Some(&h),
                &[
                    ("READER", i.to_string()),
                    ("N", n.to_string()),
                    ("MAX", max.to_string()),
                ],
            )
        })
        .chain((0..n_remote).map(|i| {
            spawn_child(
                "reader",
                Some(&h),
                &[
                    ("READER", i.to_string()),
                    ("N", n.to_string()),
                    ("MAX", max.to_string()),
                    ("REMOTE", "1".into()),
                ],
            )
        }))
        .collect();
    q.wait_until_ready(Duration::from_secs(20)).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(99);
    let mut overflowed = 0;
    for seq in 0..n {
        let p = payload(SEED, seq, max);
        if p.len() + 200 > 40 << 10 {
            overflowed += 1;
        }
        q.enqueue(&seq, &[&p, &seq.to_le_bytes()]).unwrap();
        if rng.random_ratio(1, 200) {
            std::thread::sleep(Duration::from_micros(rng.random_range(0..3000)));
        }
    }
    assert!(
        overflowed > n / 10 && overflowed < n * 9 / 10,
        "both paths must be exercised ({overflowed})"
    );
    for k in &mut kids {
        let st = wait_with_deadline(k, 120);
        let mut out = String::new();
        k.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        assert!(
            st.success() && out.contains(&format!("ok {n}")),
            "reader failed: {st} {out}"
        );
    }
}

#[test]
fn reader_sees_every_message_in_order() {
    // 3 reader processes, 10,000 messages from 1 B to 3x the 40 KiB chunk: ring and ZeroMQ mix.
    run_broadcast(3, 0, 10_000, 3 * (40 << 10));
}

#[test]
fn remote_reader_over_tcp_sees_every_message_in_order() {
    run_broadcast(1, 1, 2_000, 3 * (40 << 10));
}

fn first_line(child: &mut std::process::Child) -> String {
    // libtest prints its own text first ("test child_entry ... "); our lines carry "@@ ".
    let mut r = BufReader::new(child.stdout.as_mut().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "child exited without a marker line"
        );
        if let Some(i) = line.find("@@ ") {
            return line[i + 3..].trim().to_string();
        }
    }
}

#[test]
fn no_segment_left_after_normal_exit() {
    let mut c = spawn_child("writer_exit", None, &[]);
    let name = first_line(&mut c);
    assert!(wait_with_deadline(&mut c, 30).success());
    assert!(name.starts_with("omni."));
    assert!(!segments_named(&name), "{name} left behind");
}

#[test]
fn no_segment_left_after_a_panic() {
    let mut c = spawn_child("writer_panic", None, &[]);
    let name = first_line(&mut c);
    assert!(!wait_with_deadline(&mut c, 30).success());
    assert!(!segments_named(&name), "{name} left behind after a panic");
}

#[test]
fn segment_of_a_killed_writer_is_swept_at_next_start() {
    let mut c = spawn_child("writer_hang", None, &[]);
    let name = first_line(&mut c);
    assert!(segments_named(&name));
    kill9(c.id());
    c.wait().unwrap();
    assert!(segments_named(&name), "kill -9 cannot run destructors");
    let swept = omni_ipc::shm::sweep_stale();
    assert!(swept.contains(&name), "sweep removed {swept:?}");
    assert!(!segments_named(&name));
}

#[test]
fn killed_reader_makes_the_writer_fail_naming_it() {
    let spec = QueueSpec::local(&omni_ipc::shm::new_instance_id(), "kill", 2, small_config());
    let mut q = MessageQueue::create(spec).unwrap();
    let h = q.handle();
    let mut r0 = spawn_child(
        "stalled_reader",
        Some(&h),
        &[("READER", "0".into()), ("READ_FIRST", "1000000".into())],
    );
    let mut r1 = spawn_child(
        "stalled_reader",
        Some(&h),
        &[("READER", "1".into()), ("READ_FIRST", "3".into())],
    );
    q.wait_until_ready(Duration::from_secs(20)).unwrap();
    for seq in 0..3u64 {
        q.enqueue(&seq, &[]).unwrap();
    }
    assert_eq!(first_line(&mut r1), "stalled");
    kill9(r1.id());
    r1.wait().unwrap();
    let t0 = Instant::now();
    let err = loop {
        match q.enqueue(&0u64, &[]) {
            Ok(()) => assert!(
                t0.elapsed() < Duration::from_secs(5),
                "writer never noticed"
            ),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            err,
            IpcError::ReaderDead {
                reader: ReaderId::Local(1),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("local reader 1"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    kill9(r0.id());
    r0.wait().unwrap();
}

#[test]
fn stalled_reader_makes_enqueue_time_out_naming_it() {
    let cfg = MessageQueueConfig {
        enqueue_timeout: Some(Duration::from_millis(300)),
        ..small_config()
    };
    let spec = QueueSpec::local(&omni_ipc::shm::new_instance_id(), "stall", 1, cfg);
    let mut q = MessageQueue::create(spec).unwrap();
    let h = q.handle();
    let mut r = spawn_child(
        "stalled_reader",
        Some(&h),
        &[("READER", "0".into()), ("READ_FIRST", "0".into())],
    );
    q.wait_until_ready(Duration::from_secs(20)).unwrap();
    q.enqueue(&0u64, &[]).unwrap();
    q.enqueue(&1u64, &[]).unwrap();
    let err = q.enqueue(&2u64, &[]).unwrap_err();
    match &err {
        IpcError::EnqueueTimeout { lagging, waited } => {
            assert_eq!(lagging, &vec![ReaderId::Local(0)]);
            assert!(*waited >= Duration::from_millis(300));
        }
        other => panic!("{other}"),
    }
    kill9(r.id());
    r.wait().unwrap();
}

#[test]
fn idle_reader_sleeps_and_wakes_at_once() {
    let spec = QueueSpec::local(
        &omni_ipc::shm::new_instance_id(),
        "idle",
        1,
        MessageQueueConfig::default(),
    );
    let mut q = MessageQueue::create(spec).unwrap();
    let mut c = spawn_child("idle_reader", Some(&q.handle()), &[]);
    q.wait_until_ready(Duration::from_secs(20)).unwrap();
    assert_eq!(first_line(&mut c), "parked");
    let cpu0 = cpu_seconds(c.id());
    std::thread::sleep(Duration::from_secs(2));
    let cpu = cpu_seconds(c.id()) - cpu0;
    assert!(
        cpu < 0.1,
        "an idle reader burned {cpu:.3} s of CPU in 2 s (limit 5%)"
    );
    q.enqueue(&omni_now_ns(), &[]).unwrap();
    let line = first_line(&mut c);
    let ns: u64 = line.strip_prefix("latency_ns ").unwrap().parse().unwrap();
    // A parked reader is woken by the futex, not by a poll: well under the 50 ms poll slice.
    assert!(ns < 20_000_000, "parked reader took {ns} ns to wake");
    assert!(wait_with_deadline(&mut c, 10).success());
}
