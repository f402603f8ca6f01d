//! Local spawn, the one worker launcher so far: start `<exe> <args...>` per rank, write its
//! [`WorkerHandshake`] as one JSON line on its stdin, read its [`WorkerHello`] line from its
//! stdout. The resolved config travels in the handshake, never in argv or the environment.
//! Stdin then stays open: EOF tells the worker that its parent is gone. (Workers started by
//! someone else, e.g. Kubernetes pods on other hosts, would need a rendezvous launcher beside
//! this one; the group after the handshake does not care how a worker was started.)

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use omni_protocol::{WorkerHandshake, WorkerHello};

use crate::executor::ExecutorStartError;

fn spawn_err(what: &str, e: &dyn std::fmt::Display) -> ExecutorStartError {
    ExecutorStartError::Spawn(format!("{what}: {e}"))
}

/// A started worker process and its two pipes.
#[derive(Debug)]
pub(crate) struct Spawned {
    /// The process.
    pub child: Child,
    /// Its stdin, held open for the worker's lifetime.
    pub stdin: ChildStdin,
    /// Its stdout, where the hello comes.
    pub stdout: BufReader<ChildStdout>,
}

/// Starts `exe args...` with piped stdin and stdout (stderr inherited: the child's logs).
pub(crate) fn spawn(exe: &Path, args: &[String]) -> Result<Spawned, ExecutorStartError> {
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| spawn_err(&format!("spawning {}", exe.display()), &e))?;
    match (child.stdin.take(), child.stdout.take()) {
        (Some(stdin), Some(stdout)) => Ok(Spawned {
            child,
            stdin,
            stdout: BufReader::new(stdout),
        }),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            Err(ExecutorStartError::Spawn("worker pipes missing".into()))
        }
    }
}

/// Writes the handshake line to a worker's stdin.
pub(crate) fn send_handshake(
    stdin: &mut ChildStdin,
    hs: &WorkerHandshake,
) -> Result<(), ExecutorStartError> {
    send_line(stdin, hs, &format!("rank {}", hs.rank))
}

/// Writes `value` as one JSON line to a child's stdin (`who` names the child in errors).
pub(crate) fn send_line<T: serde::Serialize>(
    stdin: &mut ChildStdin,
    value: &T,
    who: &str,
) -> Result<(), ExecutorStartError> {
    let line = serde_json::to_string(value).map_err(|e| spawn_err("handshake", &e))?;
    writeln!(stdin, "{line}")
        .and_then(|()| stdin.flush())
        .map_err(|e| spawn_err(&format!("writing the handshake to {who}"), &e))
}

/// Reads rank `rank`'s hello line and checks its protocol version and rank; `None` when the
/// worker closed its stdout first (it died: the monitor knows why).
pub(crate) fn read_hello(
    stdout: &mut BufReader<ChildStdout>,
    rank: usize,
) -> Result<Option<WorkerHello>, ExecutorStartError> {
    let mut line = String::new();
    let n = stdout
        .read_line(&mut line)
        .map_err(|e| spawn_err(&format!("reading rank {rank}'s hello"), &e))?;
    if n == 0 {
        return Ok(None);
    }
    let hello: WorkerHello = serde_json::from_str(&line)
        .map_err(|e| spawn_err(&format!("rank {rank}'s hello {line:?}"), &e))?;
    omni_protocol::check_protocol_version(hello.protocol_version)
        .map_err(|e| spawn_err(&format!("rank {rank}"), &e))?;
    if hello.rank as usize != rank {
        return Err(ExecutorStartError::Spawn(format!(
            "rank {rank}'s hello names rank {}",
            hello.rank
        )));
    }
    Ok(Some(hello))
}
