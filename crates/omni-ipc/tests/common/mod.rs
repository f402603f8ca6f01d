//! Child-process plumbing for the IPC tests: a test binary re-executes itself with
//! `OMNI_IPC_CHILD=<role>` and runs only the `child_entry` test, which dispatches on the role.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::process::{Child, Command, Stdio};

use omni_ipc::Handle;

pub const ROLE: &str = "OMNI_IPC_CHILD";
pub const HANDLE: &str = "OMNI_IPC_HANDLE";

/// Starts this test binary as a child process in `role`, with extra env vars.
pub fn spawn_child(role: &str, handle: Option<&Handle>, env: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(h) = handle {
        cmd.env(HANDLE, serde_json::to_string(h).unwrap());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

pub fn child_handle() -> Handle {
    serde_json::from_str(&std::env::var(HANDLE).unwrap()).unwrap()
}

pub fn env_u64(k: &str) -> u64 {
    std::env::var(k).unwrap().parse().unwrap()
}

/// Deterministic payload of message `seq`: size in [1, max] and bytes derived from seq.
pub fn payload(seed: u64, seq: u64, max: usize) -> Vec<u8> {
    let mut x = seed ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let len = 1 + (next() as usize % max);
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        v.extend_from_slice(&next().to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Waits for a child with a deadline, killing it when the deadline passes.
pub fn wait_with_deadline(child: &mut Child, secs: u64) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("child {} did not finish within {secs} s", child.id());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

pub fn segments_named(name: &str) -> bool {
    std::path::Path::new("/dev/shm").join(name).exists()
}

pub fn kill9(pid: u32) {
    // SAFETY: sending a signal to a child pid we own.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

/// CPU time (user + system) of a process in seconds, from /proc.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3; utime is field 14, stime 15 -> indexes 11, 12.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks as f64 / hz
}

/// A tracing writer that keeps what was logged (to check warning lines).
#[derive(Clone, Default)]
pub struct Capture(pub std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
