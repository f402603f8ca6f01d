//! A worker's links to its peers: the activations it passes along the pipeline
//! ([`PipelineLink`]) and, when its tensor-parallel group spans nodes, the partial sums it
//! exchanges with the group ([`QueueAllReduce`]). Both ride `omni-ipc` queues this worker
//! writes and its peers read (shared memory on one node, TCP across nodes; see
//! [`omni_protocol::ParallelLayout`]).
//!
//! Set-up, in the worker process between its hello and its first command:
//! 1. [`PeerWriters::create`]: the queues this rank writes; their handles go out in its hello;
//! 2. the executor answers with every rank's handles ([`WorkerPeers`]);
//! 3. [`PeerWriters::connect`]: attach to the peers' queues while a thread waits for this
//!    rank's own readers (attaching waits for the writer's greeting, so a rank that only
//!    attached, or only waited, could deadlock with a peer doing the other), then wait for
//!    every writer's go-ahead.

use std::sync::Mutex;
use std::time::Duration;

use omni_backend::comm::AllReduce;
use omni_ipc::{IpcError, MessageQueue, MessageQueueReader, QueueSpec};
use omni_protocol::{ParallelLayout, PeerQueues, WorkerHandshake, WorkerPeers};

/// The queues one rank writes to its peers, before they are connected.
#[derive(Debug, Default)]
pub struct PeerWriters {
    pp_send: Option<MessageQueue>,
    tp_gather: Option<MessageQueue>,
}

/// Why the peer links could not be set up or used.
#[derive(Debug, thiserror::Error)]
pub enum PeerLinkError {
    /// A queue operation failed (a peer died, a timeout).
    #[error("{what}: {source}")]
    Ipc {
        /// Which link.
        what: String,
        /// The queue's error.
        source: IpcError,
    },
    /// A peer's queue handle is missing from [`WorkerPeers`].
    #[error("rank {0} sent no handle for its {1} queue")]
    MissingHandle(usize, &'static str),
    /// A message from a peer does not have the expected shape.
    #[error("{0}")]
    Malformed(String),
}

fn ipc(what: impl Into<String>) -> impl FnOnce(IpcError) -> PeerLinkError {
    let what = what.into();
    move |source| PeerLinkError::Ipc { what, source }
}

/// The shared-memory channel names of a rank's peer queues (so its process can remove them).
pub fn peer_channels(rank: usize) -> [String; 2] {
    [format!("pp{rank}"), format!("tpg{rank}")]
}

impl PeerWriters {
    /// Creates the queues rank `hs.rank` writes: to the next pipeline stage, and to the rest of
    /// its tensor-parallel group when that group spans nodes.
    pub fn create(hs: &WorkerHandshake) -> Result<Self, PeerLinkError> {
        let l = &hs.layout;
        let rank = hs.rank as usize;
        let node = l.node(rank);
        let spec = |channel: String, readers: &[usize], config| {
            let (n_local, n_remote) = l.reader_counts(node, readers);
            QueueSpec {
                instance: hs.instance.clone(),
                channel,
                n_local_readers: n_local,
                n_remote_readers: n_remote,
                remote_addr: if n_remote > 0 { hs.host_ip } else { None },
                remote_port: 0,
                config,
            }
        };
        let [pp_channel, tp_channel] = peer_channels(rank);
        let pp_send = l
            .next_stage(rank)
            .map(|next| {
                let s = spec(pp_channel, &[next], activation_queue_config(hs));
                MessageQueue::create(s).map_err(ipc("creating the pipeline queue"))
            })
            .transpose()?;
        let peers = l.tp_peers(rank);
        let tp_gather = (!peers.is_empty() && !l.tp_group_on_one_node(rank))
            .then(|| {
                let s = spec(tp_channel, &peers, activation_queue_config(hs));
                MessageQueue::create(s).map_err(ipc("creating the all-reduce queue"))
            })
            .transpose()?;
        Ok(Self { pp_send, tp_gather })
    }

    /// The handles for this rank's hello.
    pub fn handles(&self) -> PeerQueues {
        PeerQueues {
            pp_send: self.pp_send.as_ref().map(MessageQueue::handle),
            tp_gather: self.tp_gather.as_ref().map(MessageQueue::handle),
        }
    }

    /// Attaches to the peers' queues named in `all` and waits until every link is ready.
    pub fn connect(
        self,
        hs: &WorkerHandshake,
        all: &WorkerPeers,
    ) -> Result<PeerLinks, PeerLinkError> {
        let l = &hs.layout;
        let rank = hs.rank as usize;
        let timeout = hs.ready_timeout;
        let Self {
            mut pp_send,
            mut tp_gather,
        } = self;
        // This rank's readers attach while its peers attach to theirs: wait on a thread.
        let waiter = std::thread::Builder::new()
            .name("peer-ready".into())
            .spawn(move || -> Result<_, PeerLinkError> {
                for (q, what) in [(&mut pp_send, "pipeline"), (&mut tp_gather, "all-reduce")] {
                    if let Some(q) = q.as_mut() {
                        q.wait_until_ready(timeout)
                            .map_err(ipc(format!("waiting for the {what} queue's readers")))?;
                    }
                }
                Ok((pp_send, tp_gather))
            })
            .map_err(|e| PeerLinkError::Malformed(format!("no peer-ready thread: {e}")))?;
        let attached = attach_peers(l, rank, all);
        let (pp_send, tp_gather) = waiter
            .join()
            .map_err(|_| PeerLinkError::Malformed("the peer-ready thread panicked".into()))??;
        let (mut pp_recv, mut gather_from) = attached?;
        if let Some(r) = pp_recv.as_mut() {
            r.wait_until_ready(timeout)
                .map_err(ipc("waiting for the previous stage"))?;
        }
        for (peer, r) in gather_from.iter_mut() {
            r.wait_until_ready(timeout)
                .map_err(ipc(format!("waiting for rank {peer}'s partial sums")))?;
        }
        let all_reduce = tp_gather.map(|tx| QueueAllReduce {
            tp_rank: l.tp_rank(rank),
            size: l.tp_group(rank).len(),
            first: l.tp_group(rank).start,
            state: Mutex::new(GatherState {
                tx,
                rx: gather_from,
                parts: Vec::new(),
            }),
        });
        Ok(PeerLinks {
            pipeline: PipelineLink {
                recv: pp_recv,
                send: pp_send,
            },
            all_reduce,
        })
    }
}

type Attached = (Option<MessageQueueReader>, Vec<(usize, MessageQueueReader)>);

fn attach_peers(
    l: &ParallelLayout,
    rank: usize,
    all: &WorkerPeers,
) -> Result<Attached, PeerLinkError> {
    let handle_of = |peer: usize, pick: fn(&PeerQueues) -> Option<&omni_ipc::Handle>, what| {
        all.peers
            .get(peer)
            .and_then(pick)
            .ok_or(PeerLinkError::MissingHandle(peer, what))
    };
    let pp_recv = l
        .prev_stage(rank)
        .map(|prev| {
            let h = handle_of(prev, |p| p.pp_send.as_ref(), "pipeline")?;
            let id = l
                .reader_id(l.node(prev), &[rank], rank)
                .ok_or(PeerLinkError::MissingHandle(prev, "pipeline"))?;
            MessageQueueReader::attach(h, id).map_err(ipc(format!("attaching to rank {prev}")))
        })
        .transpose()?;
    let mut gather_from = Vec::new();
    if !l.tp_group_on_one_node(rank) {
        for peer in l.tp_peers(rank) {
            let h = handle_of(peer, |p| p.tp_gather.as_ref(), "all-reduce")?;
            let id = l
                .reader_id(l.node(peer), &l.tp_peers(peer), rank)
                .ok_or(PeerLinkError::MissingHandle(peer, "all-reduce"))?;
            let r = MessageQueueReader::attach(h, id)
                .map_err(ipc(format!("attaching to rank {peer}'s partial sums")))?;
            gather_from.push((peer, r));
        }
    }
    Ok((pp_recv, gather_from))
}

/// A queue for activations and partial sums: 4 slots of the broadcast queue's chunk size, so a
/// prefill's hidden states (tokens x hidden x 4 bytes) usually fit a slot; larger ones take the
/// overflow path.
fn activation_queue_config(hs: &WorkerHandshake) -> omni_ipc::MessageQueueConfig {
    omni_ipc::MessageQueueConfig {
        max_chunks: 4,
        enqueue_timeout: None,
        ..hs.broadcast.config.clone()
    }
}

/// A worker's connected peer links.
#[derive(Debug, Default)]
pub struct PeerLinks {
    /// Activations from the previous stage and to the next.
    pub pipeline: PipelineLink,
    /// The all-reduce of a tensor-parallel group that spans nodes.
    pub all_reduce: Option<QueueAllReduce>,
}

/// The activations of one pipeline stage: received from the previous stage, sent to the next.
#[derive(Debug, Default)]
pub struct PipelineLink {
    recv: Option<MessageQueueReader>,
    send: Option<MessageQueue>,
}

/// The header of one stage's activations.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Activations {
    tokens: u32,
    width: u32,
}

impl PipelineLink {
    /// Whether this rank has a previous stage (it does not embed tokens).
    pub fn has_prev(&self) -> bool {
        self.recv.is_some()
    }

    /// Whether this rank has a next stage (it does not sample).
    pub fn has_next(&self) -> bool {
        self.send.is_some()
    }

    /// The previous stage's residual stream of this step, `[tokens, width]`.
    pub fn recv(&mut self, tokens: usize, timeout: Duration) -> Result<Vec<f32>, PeerLinkError> {
        let Some(r) = self.recv.as_mut() else {
            return Err(PeerLinkError::Malformed(
                "no previous pipeline stage".into(),
            ));
        };
        let msg = r
            .dequeue_borrowed(Some(timeout))
            .map_err(ipc("receiving the previous stage's activations"))?;
        let head: Activations = msg
            .header()
            .map_err(ipc("decoding the previous stage's activations"))?;
        let bytes: &[u8] = if msg.num_buffers() == 1 {
            msg.buffer(0)
        } else {
            &[]
        };
        let width = head.width as usize;
        if head.tokens as usize != tokens || width == 0 || bytes.len() != tokens * width * 4 {
            return Err(PeerLinkError::Malformed(format!(
                "the previous stage sent {}x{width} activations ({} bytes) for a step of {tokens} \
                 tokens",
                head.tokens,
                bytes.len()
            )));
        }
        Ok(f32_from_le(bytes))
    }

    /// Sends this stage's residual stream, `[tokens, width]`, to the next stage.
    pub fn send(&mut self, x: &[f32], tokens: usize, width: usize) -> Result<(), PeerLinkError> {
        let Some(q) = self.send.as_mut() else {
            return Err(PeerLinkError::Malformed("no next pipeline stage".into()));
        };
        let head = Activations {
            tokens: tokens as u32,
            width: width as u32,
        };
        q.enqueue(&head, &[f32_as_le(x)])
            .map_err(ipc("sending activations to the next stage"))
    }
}

/// `x` as little-endian bytes (the in-memory layout on every target this engine runs on).
fn f32_as_le(x: &[f32]) -> &[u8] {
    const _: () = assert!(cfg!(target_endian = "little"));
    // SAFETY: f32 has no padding and every bit pattern of its 4 bytes is a valid u8; the slice
    // covers exactly the `x.len() * 4` bytes of `x` and borrows it for the same lifetime.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

fn f32_from_le(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[derive(Debug)]
struct GatherState {
    tx: MessageQueue,
    /// `(peer rank, reader)` in rank order.
    rx: Vec<(usize, MessageQueueReader)>,
    parts: Vec<Vec<f32>>,
}

/// The all-reduce of a tensor-parallel group whose ranks are on several nodes: each rank sends
/// its partial sums to every other rank of the group and adds all partials in rank order, so
/// every rank gets bit-identical sums (the order [`crate::ShmAllReduce`] uses on one node).
#[derive(Debug)]
pub struct QueueAllReduce {
    tp_rank: usize,
    size: usize,
    /// The global rank of the group's TP rank 0.
    first: usize,
    state: Mutex<GatherState>,
}

/// Longest wait for a peer's partial sums (a dead peer fails sooner, through the queue's
/// liveness checks).
const GATHER_TIMEOUT: Duration = Duration::from_secs(300);

impl QueueAllReduce {
    /// Sends `bytes` from the group's TP rank 0 to every other rank of the group over its
    /// partial-sum queue: rank 0 passes `Some` and gets its bytes back, the others pass `None`
    /// and get rank 0's. For set-up before the first all-reduce (a CUDA group's NCCL id).
    pub fn broadcast_from_first(&self, bytes: Option<&[u8]>) -> Result<Vec<u8>, PeerLinkError> {
        let mut st = self
            .state
            .lock()
            .map_err(|_| PeerLinkError::Malformed("all-reduce state poisoned".into()))?;
        let GatherState { tx, rx, .. } = &mut *st;
        match (self.tp_rank, bytes) {
            (0, Some(b)) => {
                tx.enqueue(&(b.len() as u64), &[b])
                    .map_err(ipc("sending to the tensor-parallel group"))?;
                Ok(b.to_vec())
            }
            (0, None) => Err(PeerLinkError::Malformed(
                "TP rank 0 has nothing to send to its group".into(),
            )),
            (_, _) => {
                let first = self.first;
                let (_, r) = rx
                    .iter_mut()
                    .find(|(peer, _)| *peer == first)
                    .ok_or(PeerLinkError::MissingHandle(first, "all-reduce"))?;
                let msg = r
                    .dequeue(Some(GATHER_TIMEOUT))
                    .map_err(ipc(format!("receiving from TP rank 0 (rank {first})")))?;
                Ok(msg
                    .buffers()
                    .first()
                    .map(|b| b.to_vec())
                    .unwrap_or_default())
            }
        }
    }
}

impl AllReduce for QueueAllReduce {
    fn all_reduce_sum(&self, x: &mut [f32]) -> omni_backend::Result<()> {
        let err = |e: String| omni_backend::Error::AllReduce(e);
        let mut st = self
            .state
            .lock()
            .map_err(|_| err("all-reduce state poisoned".into()))?;
        let GatherState { tx, rx, parts } = &mut *st;
        tx.enqueue(&(x.len() as u64), &[f32_as_le(x)])
            .map_err(|e| err(format!("sending partial sums: {e}")))?;
        // `parts[i]` holds TP rank i's partial sums (this rank's own slot stays unused); the
        // buffers are reused from call to call.
        parts.resize_with(self.size, Vec::new);
        for (peer, r) in rx.iter_mut() {
            let msg = r
                .dequeue_borrowed(Some(GATHER_TIMEOUT))
                .map_err(|e| err(format!("partial sums of rank {peer}: {e}")))?;
            let bytes: &[u8] = if msg.num_buffers() == 1 {
                msg.buffer(0)
            } else {
                &[]
            };
            if bytes.len() != x.len() * 4 {
                return Err(err(format!(
                    "rank {peer} sent {} bytes of partial sums, this rank has {} values",
                    bytes.len(),
                    x.len()
                )));
            }
            let part = &mut parts[*peer - self.first];
            part.clear();
            part.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        // Sum in rank order (((p0 + p1) + p2) + ...), this rank's own values in its place, so
        // every rank computes the same bits.
        let me = self.tp_rank;
        for (i, v) in x.iter_mut().enumerate() {
            let at = |j: usize| if j == me { *v } else { parts[j][i] };
            let mut acc = at(0);
            for j in 1..self.size {
                acc += at(j);
            }
            *v = acc;
        }
        Ok(())
    }

    fn world_size(&self) -> usize {
        self.size
    }
}
