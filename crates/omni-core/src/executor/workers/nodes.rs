//! The leader's side of a multi-node group (vLLM's `--nnodes` without Ray): the master
//! rendezvous where follower nodes (`serve --headless`) join, and one control connection per
//! follower for the group's life.
//!
//! ```text
//! follower ──TCP connect (retried until its deadline)──▶ leader --master-addr:--master-port
//! follower ── NodeJoin {node rank, layout} ───────────▶ leader   (a mismatch is refused)
//! follower ◀─ NodeAssignment {its ranks' handshakes} ─── leader   (broadcast over TCP, …)
//! follower ── NodeHellos {its workers' hellos} ───────▶ leader
//! follower ◀─ LeaderMessage::Peers ───────────────────── leader   (relayed to its workers)
//! follower ── NodeEvent::WorkerDied {rank, cause} ────▶ leader   (then it exits non-zero)
//! follower ◀─ LeaderMessage::Shutdown ────────────────── leader
//! ```
//!
//! Every line is one JSON value. A follower whose connection closes is lost: the group is dead,
//! naming the node and its first rank (LeaderWorkerSet then recreates the group).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use omni_protocol::{
    LeaderMessage, NodeAssignment, NodeEvent, NodeJoin, PROTOCOL_VERSION, ParallelLayout,
};

use super::monitor::{DeathNotice, dead_rank};
use crate::executor::ExecutorStartError;

/// The multi-node part of an executor's start-up (leader and followers alike).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// Nodes in the group.
    pub nnodes: u32,
    /// The leader's address (followers resolve it on every try).
    pub master_addr: String,
    /// The rendezvous port.
    pub master_port: u16,
    /// This node's address for its peers (default: the rendezvous connection's own end).
    pub host_ip: Option<IpAddr>,
    /// Longest wait for every node to join.
    pub join_timeout: Duration,
}

fn spawn_err(what: &str, e: &dyn std::fmt::Display) -> ExecutorStartError {
    ExecutorStartError::Spawn(format!("{what}: {e}"))
}

/// Writes `value` as one JSON line.
pub(crate) fn write_json<T: serde::Serialize>(
    stream: &mut TcpStream,
    value: &T,
) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)?;
    stream.flush()
}

/// Reads one JSON line, waiting at most until `deadline` (`None`: no limit).
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(
    reader: &mut BufReader<TcpStream>,
    deadline: Option<Instant>,
) -> std::io::Result<T> {
    let timeout = deadline.map(|d| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    });
    reader.get_ref().set_read_timeout(timeout)?;
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    serde_json::from_str(&line).map_err(std::io::Error::other)
}

/// A joined follower, seen from the leader.
#[derive(Debug)]
pub(crate) struct Follower {
    /// Its node rank.
    pub node: u32,
    /// Its address, as this connection sees it (where its queues bind).
    pub ip: IpAddr,
    /// This leader's address on the follower's network.
    pub local_ip: IpAddr,
    stream: TcpStream,
    reader: Option<BufReader<TcpStream>>,
}

impl Follower {
    /// Sends one line to the follower.
    pub fn send<T: serde::Serialize>(&mut self, value: &T) -> Result<(), ExecutorStartError> {
        write_json(&mut self.stream, value)
            .map_err(|e| spawn_err(&format!("writing to node {}", self.node), &e))
    }

    /// Reads one line from the follower before `deadline`.
    pub fn recv<T: serde::de::DeserializeOwned>(
        &mut self,
        deadline: Instant,
    ) -> Result<T, ExecutorStartError> {
        let node = self.node;
        let reader = self
            .reader
            .as_mut()
            .ok_or_else(|| ExecutorStartError::Spawn(format!("node {node} is being watched")))?;
        read_json(reader, Some(deadline)).map_err(|e| spawn_err(&format!("node {node}"), &e))
    }

    /// From now on a thread reads the follower's events: a worker death or a lost connection
    /// is recorded in `dead`, naming the node (and the rank), unless `stopping` is set.
    pub fn watch(&mut self, layout: &ParallelLayout, dead: DeathNotice, stopping: Arc<AtomicBool>) {
        let Some(mut reader) = self.reader.take() else {
            return;
        };
        let node = self.node;
        let first = layout.ranks_on(node).first().copied().unwrap_or(0);
        let spawned = std::thread::Builder::new()
            .name(format!("omni-node-{node}"))
            .spawn(move || {
                let e = loop {
                    match read_json::<NodeEvent>(&mut reader, None) {
                        Ok(NodeEvent::WorkerDied { rank, cause }) => {
                            break dead_rank(rank as usize, format!("node {node}: {cause}"));
                        }
                        Ok(NodeEvent::Failed { message }) => {
                            break dead_rank(first, format!("node {node}: {message}"));
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(e) => {
                            break dead_rank(
                                first,
                                format!("node {node} lost: its control connection ended ({e})"),
                            );
                        }
                    }
                };
                if !stopping.load(Ordering::Acquire) {
                    dead.set(e);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(node, "no thread to watch the node: {e}");
        }
    }

    /// Tells the follower to stop (best effort) and closes the connection.
    pub fn shutdown(&mut self) {
        let _ = write_json(&mut self.stream, &LeaderMessage::Shutdown);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Binds the rendezvous and waits until every follower of `layout` joined with the same
/// layout, or `cfg.join_timeout` passes. A follower that joins with another layout or
/// version fails the start-up (after being told why).
pub(crate) fn accept_followers(
    cfg: &NodeConfig,
    layout: &ParallelLayout,
) -> Result<Vec<Follower>, ExecutorStartError> {
    let addr = (cfg.master_addr.as_str(), cfg.master_port)
        .to_socket_addrs()
        .map_err(|e| spawn_err(&format!("resolving --master-addr {}", cfg.master_addr), &e))?
        .next()
        .ok_or_else(|| ExecutorStartError::Spawn(format!("{} has no address", cfg.master_addr)))?;
    let listener =
        TcpListener::bind(addr).map_err(|e| spawn_err(&format!("binding {addr}"), &e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| spawn_err("rendezvous", &e))?;
    tracing::info!(%addr, nnodes = cfg.nnodes, "waiting for the follower nodes to join");
    let deadline = Instant::now() + cfg.join_timeout;
    let mut joined: Vec<Follower> = Vec::new();
    while joined.len() + 1 < cfg.nnodes as usize {
        let (stream, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let have: Vec<u32> = joined.iter().map(|f| f.node).collect();
                    return Err(ExecutorStartError::Spawn(format!(
                        "only nodes {have:?} of {} joined within {:?} at {addr}",
                        cfg.nnodes - 1,
                        cfg.join_timeout
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(spawn_err("accepting a follower", &e)),
        };
        let f = join(stream, peer.ip(), cfg, layout, &joined)?;
        tracing::info!(node = f.node, ip = %f.ip, "node joined");
        joined.push(f);
    }
    joined.sort_by_key(|f| f.node);
    Ok(joined)
}

fn join(
    stream: TcpStream,
    ip: IpAddr,
    cfg: &NodeConfig,
    layout: &ParallelLayout,
    joined: &[Follower],
) -> Result<Follower, ExecutorStartError> {
    let io = |e: std::io::Error| spawn_err("a joining node", &e);
    stream.set_nonblocking(false).map_err(io)?;
    stream.set_nodelay(true).map_err(io)?;
    let local_ip = stream.local_addr().map_err(io)?.ip();
    let mut reader = BufReader::new(stream.try_clone().map_err(io)?);
    let hello: NodeJoin =
        read_json(&mut reader, Some(Instant::now() + Duration::from_secs(10))).map_err(io)?;
    let mut f = Follower {
        node: hello.node_rank,
        ip,
        local_ip,
        stream,
        reader: Some(reader),
    };
    let ours = (
        PROTOCOL_VERSION,
        cfg.nnodes,
        layout.tensor_parallel_size,
        layout.pipeline_parallel_size,
    );
    let theirs = (
        hello.protocol_version,
        hello.nnodes,
        hello.tensor_parallel_size,
        hello.pipeline_parallel_size,
    );
    let problem = if theirs != ours {
        Some(format!(
            "node {} joined with (protocol, nnodes, tp, pp) = {theirs:?}, the leader runs {ours:?}",
            hello.node_rank
        ))
    } else if hello.node_rank == 0 || hello.node_rank >= cfg.nnodes {
        Some(format!(
            "node rank {} is not a follower of {} nodes",
            hello.node_rank, cfg.nnodes
        ))
    } else if joined.iter().any(|j| j.node == hello.node_rank) {
        Some(format!("node {} joined twice", hello.node_rank))
    } else {
        None
    };
    if let Some(message) = problem {
        let _ = f.send(&NodeAssignment::Refused {
            message: message.clone(),
        });
        return Err(ExecutorStartError::Spawn(message));
    }
    Ok(f)
}
