//! `MessageQueue`: a 1 -> N broadcast of typed messages. Local readers read from the
//! [`ShmRingBuffer`]; a message too large for a slot goes over ZeroMQ and its slot is marked, so
//! order holds across both paths. Remote readers receive every message over ZeroMQ TCP, with
//! credit-based flow control (an ack per message), so the writer never runs more than
//! `max_chunks` messages ahead of any reader, local or remote.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::codec::{self, Meta, MetaKind, SlotContent};
use crate::ring::ShmRingBuffer;
use crate::zmtp::{self, Listener, Stream};
use crate::{IpcError, MessageQueueConfig, ReaderId};

/// Version of the handle and wire format; checked when a reader attaches.
pub const WIRE_VERSION: u32 = 1;
/// How often a blocked call re-checks shutdown, deadlines and peer liveness.
const POLL_SLICE: Duration = Duration::from_millis(50);
/// Time a reader that has connected gets to finish the ready handshake.
const HANDSHAKE_GRACE: Duration = Duration::from_secs(5);

/// What to create.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueueSpec {
    /// Engine instance id (see [`crate::shm::new_instance_id`]); names the segment.
    pub instance: String,
    /// Channel name within the instance (`"bcast"`, `"resp0"`, ...).
    pub channel: String,
    /// Readers on this host (shared memory).
    pub n_local_readers: usize,
    /// Readers on other hosts (ZeroMQ TCP).
    pub n_remote_readers: usize,
    /// The address of this host to bind for remote readers (required when there are any).
    pub remote_addr: Option<IpAddr>,
    /// TCP port for remote readers (0: any free port).
    pub remote_port: u16,
    /// Sizes and timings.
    pub config: MessageQueueConfig,
}

impl QueueSpec {
    /// A spec for `n` local readers with the given config.
    pub fn local(instance: &str, channel: &str, n: usize, config: MessageQueueConfig) -> Self {
        Self {
            instance: instance.to_string(),
            channel: channel.to_string(),
            n_local_readers: n,
            n_remote_readers: 0,
            remote_addr: None,
            remote_port: 0,
            config,
        }
    }
}

/// Everything a reader process needs to attach. Serialize it (JSON, bincode) and send it over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Handle {
    /// [`WIRE_VERSION`] of the writer.
    pub version: u32,
    /// Ring segment name (when there are local readers).
    pub ring: Option<String>,
    /// Local readers.
    pub n_local_readers: usize,
    /// Remote readers.
    pub n_remote_readers: usize,
    /// `ipc://@...` endpoint for local overflow traffic.
    pub local_endpoint: Option<String>,
    /// `tcp://ip:port` endpoint for remote readers.
    pub remote_endpoint: Option<String>,
    /// Writer's pid.
    pub writer_pid: u32,
    /// The writer's config (readers use its bounds and timings).
    pub config: MessageQueueConfig,
}

struct Peer {
    stream: Stream,
    pid: u32,
    /// Remote readers: sequence number of the last message acked (+1); updated by a thread.
    acked: Arc<AtomicU64>,
    /// Set by the watcher thread when the connection drops.
    gone: Arc<AtomicBool>,
}

/// The writer side of a broadcast queue.
pub struct MessageQueue {
    spec: QueueSpec,
    ring: Option<ShmRingBuffer>,
    local_listener: Option<Listener>,
    remote_listener: Option<Listener>,
    handle: Handle,
    peers: HashMap<ReaderId, Peer>,
    ready: bool,
    seq: u64,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for MessageQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageQueue")
            .field("handle", &self.handle)
            .field("seq", &self.seq)
            .finish()
    }
}

fn meta_frame(kind: MetaKind, seq: u64) -> [u8; 16] {
    Meta { kind, seq }.encode()
}

fn identity(id: ReaderId) -> Vec<u8> {
    match id {
        ReaderId::Local(i) => format!("L{i}").into_bytes(),
        ReaderId::Remote(i) => format!("R{i}").into_bytes(),
    }
}

fn parse_identity(b: &[u8]) -> Option<ReaderId> {
    let s = std::str::from_utf8(b).ok()?;
    let n: usize = s.get(1..)?.parse().ok()?;
    match s.as_bytes().first()? {
        b'L' => Some(ReaderId::Local(n)),
        b'R' => Some(ReaderId::Remote(n)),
        _ => None,
    }
}

impl MessageQueue {
    /// Creates the ring (if there are local readers) and the listening sockets.
    pub fn create(spec: QueueSpec) -> Result<Self, IpcError> {
        spec.config.validate()?;
        let name = crate::shm::segment_name(&spec.instance, &spec.channel);
        let ring = if spec.n_local_readers > 0 {
            Some(ShmRingBuffer::create(
                &name,
                spec.n_local_readers,
                spec.config.max_chunks,
                spec.config.max_chunk_bytes,
            )?)
        } else {
            None
        };
        let local_listener = if spec.n_local_readers > 0 {
            Some(Listener::bind_abstract(&name)?)
        } else {
            None
        };
        let remote_listener = if spec.n_remote_readers > 0 {
            let addr = spec.remote_addr.ok_or_else(|| {
                IpcError::Config("remote readers need remote_addr (an address of this host)".into())
            })?;
            Some(Listener::bind_tcp(addr, spec.remote_port)?)
        } else {
            None
        };
        let handle = Handle {
            version: WIRE_VERSION,
            ring: ring.as_ref().map(|r| r.name().to_string()),
            n_local_readers: spec.n_local_readers,
            n_remote_readers: spec.n_remote_readers,
            local_endpoint: local_listener
                .as_ref()
                .map(|l| l.endpoint(&name))
                .transpose()?,
            remote_endpoint: remote_listener
                .as_ref()
                .map(|l| l.endpoint(&name))
                .transpose()?,
            writer_pid: std::process::id(),
            config: spec.config.clone(),
        };
        Ok(Self {
            spec,
            ring,
            local_listener,
            remote_listener,
            handle,
            peers: HashMap::new(),
            ready: false,
            seq: 0,
            scratch: Vec::with_capacity(4096),
        })
    }

    /// The handle readers attach with.
    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// Messages enqueued so far.
    pub fn sequence(&self) -> u64 {
        self.seq
    }

    fn expected(&self) -> impl Iterator<Item = ReaderId> + use<> {
        let l = self.spec.n_local_readers;
        let r = self.spec.n_remote_readers;
        (0..l)
            .map(ReaderId::Local)
            .chain((0..r).map(ReaderId::Remote))
    }

    /// Waits until every reader has attached and said hello, then tells each that traffic may
    /// start. Call once before the first `enqueue` (which otherwise calls it with the
    /// configured enqueue timeout, or 300 s).
    pub fn wait_until_ready(&mut self, timeout: Duration) -> Result<(), IpcError> {
        if self.ready {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        let total = self.spec.n_local_readers + self.spec.n_remote_readers;
        while self.peers.len() < total {
            let mut progressed = false;
            for listener in [&self.local_listener, &self.remote_listener]
                .into_iter()
                .flatten()
            {
                if let Some(mut s) = listener.try_accept()? {
                    progressed = true;
                    // A reader that connected gets its own time to finish the handshake, even
                    // when this call's (possibly short) timeout is about to end: dropping it
                    // half-way would fail a legitimate reader on a loaded machine.
                    let handshake_deadline = deadline.max(Instant::now() + HANDSHAKE_GRACE);
                    // A stranger that fails the handshake is dropped; it does not fail the queue.
                    match Self::accept_reader(&mut s, handshake_deadline, &self.handle) {
                        Ok((id, pid))
                            if !self.peers.contains_key(&id)
                                && self.expected().any(|e| e == id) =>
                        {
                            let remote = s.is_tcp();
                            if remote != matches!(id, ReaderId::Remote(_)) {
                                tracing::warn!(%id, "reader connected over the wrong transport; dropped");
                                continue;
                            }
                            let peer = Self::watch(s, id, pid)?;
                            self.peers.insert(id, peer);
                        }
                        Ok((id, _)) => {
                            tracing::warn!(%id, "unexpected or duplicate reader; dropped")
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "rejected a connection during the ready handshake")
                        }
                    }
                }
            }
            if self.peers.len() < total && !progressed {
                if Instant::now() >= deadline {
                    let missing: Vec<ReaderId> = self
                        .expected()
                        .filter(|id| !self.peers.contains_key(id))
                        .collect();
                    return Err(IpcError::ReadyTimeout {
                        waited: timeout,
                        missing,
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        for peer in self.peers.values_mut() {
            peer.stream.send(&[&meta_frame(MetaKind::Ready, 0)])?;
        }
        self.ready = true;
        Ok(())
    }

    fn accept_reader(
        s: &mut Stream,
        deadline: Instant,
        handle: &Handle,
    ) -> Result<(ReaderId, u32), IpcError> {
        let ident = s.handshake("ROUTER", b"", deadline)?;
        let id = parse_identity(&ident)
            .ok_or_else(|| IpcError::MalformedFrame("bad reader identity".into()))?;
        let frames = s
            .recv(Some(deadline), 4096, 4)?
            .ok_or_else(|| IpcError::Zmq {
                op: "wait_until_ready",
                message: format!("{id} sent no hello"),
            })?;
        let meta = Meta::decode(frames.first().map(|f| &f[..]).unwrap_or_default())?;
        if meta.kind != MetaKind::Hello || frames.len() != 2 {
            return Err(IpcError::MalformedFrame("expected hello".into()));
        }
        let version = u32::from_le_bytes(
            frames[1]
                .get(..4)
                .and_then(|b| b.try_into().ok())
                .unwrap_or_default(),
        );
        if version != handle.version {
            return Err(IpcError::Config(format!(
                "{id} speaks wire version {version}, writer {}",
                handle.version
            )));
        }
        Ok((id, meta.seq as u32))
    }

    /// Spawns a thread that reads the peer's acks and notices when the connection drops.
    fn watch(stream: Stream, id: ReaderId, pid: u32) -> Result<Peer, IpcError> {
        let acked = Arc::new(AtomicU64::new(0));
        let gone = Arc::new(AtomicBool::new(false));
        let mut rx = stream.try_clone().map_err(|e| IpcError::Zmq {
            op: "watch",
            message: e.to_string(),
        })?;
        let (a, g) = (acked.clone(), gone.clone());
        std::thread::Builder::new()
            .name(format!("omni-mq-watch-{id}"))
            .spawn(move || {
                loop {
                    match rx.recv(None, 64, 2) {
                        Ok(Some(frames)) => {
                            if let Some(Ok(m)) = frames.first().map(|f| Meta::decode(f))
                                && m.kind == MetaKind::Ack
                            {
                                // Release pairs with the writer's Acquire load of the credit.
                                a.fetch_max(m.seq + 1, Ordering::Release);
                            }
                        }
                        Ok(None) => {}
                        Err(_) => break,
                    }
                }
                g.store(true, Ordering::Release);
            })
            .map_err(|e| IpcError::Zmq {
                op: "watch",
                message: e.to_string(),
            })?;
        Ok(Peer {
            stream,
            pid,
            acked,
            gone,
        })
    }

    /// Encodes `header` (bincode 2) and broadcasts it with `buffers` (sent without any
    /// serialization copy). Blocks while the slowest reader is `max_chunks` messages behind.
    pub fn enqueue<H: Serialize>(&mut self, header: &H, buffers: &[&[u8]]) -> Result<(), IpcError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let r = codec::encode_header(header, &mut scratch)
            .and_then(|()| self.enqueue_raw(&scratch, buffers));
        self.scratch = scratch;
        r
    }

    /// [`Self::enqueue`] with an already-encoded header.
    pub fn enqueue_raw(&mut self, header: &[u8], buffers: &[&[u8]]) -> Result<(), IpcError> {
        if buffers.len() + 2 > codec::MAX_BUFFERS {
            return Err(IpcError::Config(format!(
                "{} buffers is more than one message carries",
                buffers.len()
            )));
        }
        if !self.ready {
            self.wait_until_ready(
                self.spec
                    .config
                    .enqueue_timeout
                    .unwrap_or(Duration::from_secs(300)),
            )?;
        }
        let seq = self.seq;
        let started = Instant::now();
        self.wait_for_credit(seq, started)?;
        let meta = meta_frame(MetaKind::Data, seq);
        let mut frames: Vec<&[u8]> = Vec::with_capacity(buffers.len() + 2);
        frames.push(&meta);
        frames.push(header);
        frames.extend_from_slice(buffers);
        if let Some(ring) = &self.ring {
            let slot = (seq % ring.max_chunks() as u64) as usize;
            let flags = ring.flags();
            flags.begin_write(slot);
            let len = codec::inline_len(header.len(), buffers);
            if len <= ring.max_chunk_bytes() {
                // SAFETY: begin_write gave the writer exclusive use of the slot (every reader
                // released it, see ring.rs), and the slot is max_chunk_bytes >= len long.
                unsafe { codec::write_inline(ring.slot_ptr(slot), header, buffers) };
                flags.publish(slot);
                ring.notify_readers(false);
            } else {
                // SAFETY: as above; the marker is 16 bytes, slots are at least 4096.
                unsafe { codec::write_overflow_marker(ring.slot_ptr(slot)) };
                // Publish the marker first: a reader takes the frames off its socket only after
                // it sees the marker, and a large message does not fit the socket's buffer, so
                // sending before publishing would block both sides.
                flags.publish(slot);
                ring.notify_readers(false);
                send_all(
                    &mut self.peers,
                    |id| matches!(id, ReaderId::Local(_)),
                    &frames,
                )?;
            }
        }
        if self.spec.n_remote_readers > 0 {
            send_all(
                &mut self.peers,
                |id| matches!(id, ReaderId::Remote(_)),
                &frames,
            )?;
        }
        self.seq += 1;
        Ok(())
    }

    /// Waits until message `seq` may be written: its ring slot released by every local reader
    /// and every remote reader within `max_chunks` acks.
    fn wait_for_credit(&self, seq: u64, started: Instant) -> Result<(), IpcError> {
        let cfg = &self.spec.config;
        let max_chunks = cfg.max_chunks as u64;
        let slot = (seq % max_chunks) as usize;
        let need_ring = seq >= max_chunks;
        let remote_ok = || {
            self.peers.iter().all(|(id, p)| {
                matches!(id, ReaderId::Local(_))
                    || p.acked.load(Ordering::Acquire) + max_chunks > seq
            })
        };
        let ring_ok = || !need_ring || self.ring.as_ref().is_none_or(|r| r.flags().all_read(slot));
        let ready = || ring_ok() && remote_ok();
        if spin_wait(started + cfg.spin, ready) {
            return Ok(());
        }
        let mut next_warn = cfg.warn_interval;
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(ring) = &self.ring
                && ring.header().shutdown.load(Ordering::SeqCst) != 0
            {
                return Err(IpcError::Cancelled);
            }
            let lagging = self.lagging(slot, need_ring, seq);
            for id in &lagging {
                if let Some(pid) = self.dead_reader(*id) {
                    return Err(IpcError::ReaderDead { reader: *id, pid });
                }
            }
            let waited = started.elapsed();
            if waited >= next_warn {
                tracing::warn!(
                    lagging = %lagging.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "),
                    "No available shared memory broadcast block found in {} seconds. This typically happens \
                     when some processes are hanging or doing some time-consuming work (e.g. compilation).",
                    waited.as_secs()
                );
                next_warn += cfg.warn_interval;
            }
            if let Some(t) = cfg.enqueue_timeout
                && waited >= t
            {
                return Err(IpcError::EnqueueTimeout { waited, lagging });
            }
            let slice = POLL_SLICE
                .min(next_warn.saturating_sub(waited))
                .max(Duration::from_millis(1));
            match &self.ring {
                Some(ring) if need_ring && !ring_ok() => ring.park_writer(slice, ring_ok),
                // Remote credit arrives on a socket thread: poll it.
                _ => std::thread::sleep(Duration::from_micros(200).min(slice)),
            }
        }
    }

    fn lagging(&self, slot: usize, need_ring: bool, seq: u64) -> Vec<ReaderId> {
        let mut v = Vec::new();
        if let (Some(ring), true) = (&self.ring, need_ring) {
            v.extend(ring.flags().lagging(slot).into_iter().map(ReaderId::Local));
        }
        let max_chunks = self.spec.config.max_chunks as u64;
        let mut remote: Vec<ReaderId> = self
            .peers
            .iter()
            .filter(|(id, p)| {
                matches!(id, ReaderId::Remote(_))
                    && p.acked.load(Ordering::Acquire) + max_chunks <= seq
            })
            .map(|(id, _)| *id)
            .collect();
        remote.sort_by_key(|id| match id {
            ReaderId::Local(i) | ReaderId::Remote(i) => *i,
        });
        v.extend(remote);
        v
    }

    /// The pid of reader `id` if its process (or, for remote readers, its connection) is gone.
    fn dead_reader(&self, id: ReaderId) -> Option<u32> {
        let peer = self.peers.get(&id)?;
        if peer.gone.load(Ordering::Acquire) {
            return Some(peer.pid);
        }
        if let (ReaderId::Local(r), Some(ring)) = (id, &self.ring)
            && let Some((pid, start)) = ring.reader(r)
            && !crate::shm::process_alive(pid, start)
        {
            return Some(pid);
        }
        None
    }

    /// Wakes every waiting reader (and later calls) with [`IpcError::Cancelled`].
    pub fn shutdown(&self) {
        if let Some(ring) = &self.ring {
            ring.header().shutdown.store(1, Ordering::SeqCst);
            ring.notify_readers(true);
        }
        for p in self.peers.values() {
            p.stream.shutdown();
        }
    }

    /// Waits until every local reader has read every message (used before a clean exit and
    /// by benchmarks).
    pub fn wait_drained(&self, timeout: Duration) -> Result<(), IpcError> {
        let Some(ring) = &self.ring else {
            return Ok(());
        };
        let deadline = Instant::now() + timeout;
        let spin_until = Instant::now() + self.spec.config.spin;
        let n = ring.max_chunks() as u64;
        for seq in self.seq.saturating_sub(n)..self.seq {
            let slot = (seq % n) as usize;
            if spin_wait(spin_until, || ring.flags().all_read(slot)) {
                continue;
            }
            while !ring.flags().all_read(slot) {
                if Instant::now() >= deadline {
                    return Err(IpcError::Timeout(timeout));
                }
                ring.park_writer(POLL_SLICE, || ring.flags().all_read(slot));
            }
        }
        Ok(())
    }
}

/// Waits for `ready()` until `until` without sleeping: a few pure spins (about a microsecond:
/// the hot path, where the other side is already running on another core), then `sched_yield`
/// between checks so that, when there are more runnable processes than cores (or a VM's vCPUs
/// share a physical core), the process we wait for gets the CPU. Spinning longer before the
/// first yield was measured to hurt on this project's 2-vCPU VMs: 64 B latency went from
/// ~4.5 us to ~52 us whenever the host ran both vCPUs on one core.
fn spin_wait(until: Instant, ready: impl Fn() -> bool) -> bool {
    for _ in 0..128 {
        if ready() {
            return true;
        }
        std::hint::spin_loop();
    }
    while Instant::now() < until {
        if ready() {
            return true;
        }
        std::thread::yield_now();
    }
    ready()
}

fn send_all(
    peers: &mut HashMap<ReaderId, Peer>,
    which: impl Fn(ReaderId) -> bool,
    frames: &[&[u8]],
) -> Result<(), IpcError> {
    let mut targets: Vec<(&ReaderId, &mut Peer)> =
        peers.iter_mut().filter(|(id, _)| which(**id)).collect();
    let fail = |id: ReaderId, pid: u32, e: IpcError| match e {
        IpcError::Zmq { .. } => IpcError::ReaderDead { reader: id, pid },
        other => other,
    };
    if targets.len() == 1 {
        let (id, p) = targets.remove(0);
        return p.stream.send(frames).map_err(|e| fail(*id, p.pid, e));
    }
    // Several readers: one sender thread each, so they receive in parallel.
    std::thread::scope(|s| {
        let handles: Vec<_> = targets
            .into_iter()
            .map(|(id, p)| {
                let id = *id;
                s.spawn(move || p.stream.send(frames).map_err(|e| fail(id, p.pid, e)))
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| IpcError::Zmq {
                op: "send",
                message: "sender thread panicked".into(),
            })??;
        }
        Ok(())
    })
}

impl Drop for MessageQueue {
    fn drop(&mut self) {
        if let Some(ring) = &self.ring {
            ring.header().closed.store(1, Ordering::SeqCst);
            ring.notify_readers(true);
        }
        for p in self.peers.values() {
            p.stream.shutdown();
        }
    }
}

/// A received message, owned.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    header: Bytes,
    buffers: Vec<Bytes>,
}

impl Message {
    /// Decodes the typed header.
    pub fn header<H: serde::de::DeserializeOwned>(&self) -> Result<H, IpcError> {
        codec::decode_header(&self.header)
    }
    /// The encoded header bytes.
    pub fn header_bytes(&self) -> &[u8] {
        &self.header
    }
    /// The out-of-band buffers, in the order they were sent.
    pub fn buffers(&self) -> &[Bytes] {
        &self.buffers
    }
    /// Takes the buffers.
    pub fn into_buffers(self) -> Vec<Bytes> {
        self.buffers
    }
}

/// Cancels a reader's blocked `dequeue` from another thread.
#[derive(Debug, Clone)]
pub struct Canceller {
    flag: Arc<AtomicBool>,
    ring: Option<Arc<ShmRingBuffer>>,
}

impl Canceller {
    /// The reader's current and next `dequeue` return [`IpcError::Cancelled`].
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::SeqCst);
        if let Some(ring) = &self.ring {
            ring.notify_readers(true);
        }
    }
}

/// The reader side of a broadcast queue.
pub struct MessageQueueReader {
    id: ReaderId,
    ring: Option<Arc<ShmRingBuffer>>,
    stream: Stream,
    config: MessageQueueConfig,
    writer_pid: u32,
    writer_start: u64,
    cursor: u64,
    cancelled: Arc<AtomicBool>,
    ready: bool,
}

impl std::fmt::Debug for MessageQueueReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageQueueReader")
            .field("id", &self.id)
            .field("cursor", &self.cursor)
            .finish()
    }
}

/// A message borrowed from its ring slot: zero-copy until dropped, which releases the slot.
#[derive(Debug)]
pub struct ReadGuard<'a> {
    reader: &'a mut MessageQueueReader,
    body: Body,
}

#[derive(Debug)]
enum Body {
    Slot {
        slot: usize,
        layout: codec::SlotLayout,
    },
    Owned(Message),
}

impl ReadGuard<'_> {
    fn slot_bytes(&self, slot: usize) -> &[u8] {
        let ring = self
            .reader
            .ring
            .as_ref()
            .map(|r| (r.slot_ptr(slot), r.max_chunk_bytes()));
        match ring {
            // SAFETY: this guard holds the slot (its read flag is still 0, so the writer cannot
            // reuse it), the slot is max_chunk_bytes long, and the borrow ends with the guard.
            Some((p, n)) => unsafe { std::slice::from_raw_parts(p, n) },
            None => &[],
        }
    }

    /// The encoded header.
    pub fn header_bytes(&self) -> &[u8] {
        match &self.body {
            Body::Slot { slot, layout } => &self.slot_bytes(*slot)[layout.header.clone()],
            Body::Owned(m) => m.header_bytes(),
        }
    }

    /// Decodes the typed header.
    pub fn header<H: serde::de::DeserializeOwned>(&self) -> Result<H, IpcError> {
        codec::decode_header(self.header_bytes())
    }

    /// Number of buffers.
    pub fn num_buffers(&self) -> usize {
        match &self.body {
            Body::Slot { layout, .. } => layout.buffers.len(),
            Body::Owned(m) => m.buffers.len(),
        }
    }

    /// Buffer `i`, borrowed (from the slot when the message was inline).
    pub fn buffer(&self, i: usize) -> &[u8] {
        match &self.body {
            Body::Slot { slot, layout } => &self.slot_bytes(*slot)[layout.buffers[i].clone()],
            Body::Owned(m) => &m.buffers[i],
        }
    }

    /// Whether the message came through the ring (vs. overflow / network).
    pub fn is_zero_copy(&self) -> bool {
        matches!(self.body, Body::Slot { .. })
    }

    /// An owned copy; the slot is released when the guard drops.
    pub fn to_message(&self) -> Message {
        match &self.body {
            Body::Slot { .. } => Message {
                header: Bytes::copy_from_slice(self.header_bytes()),
                buffers: (0..self.num_buffers())
                    .map(|i| Bytes::copy_from_slice(self.buffer(i)))
                    .collect(),
            },
            Body::Owned(m) => m.clone(),
        }
    }
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        if let Body::Slot { slot, .. } = self.body {
            self.reader.release(slot);
        }
    }
}

impl MessageQueueReader {
    /// Attaches to the writer of `handle` as `reader` and says hello. Call
    /// [`Self::wait_until_ready`] before the first `dequeue` (which otherwise calls it).
    pub fn attach(handle: &Handle, reader: ReaderId) -> Result<Self, IpcError> {
        if handle.version != WIRE_VERSION {
            return Err(IpcError::Config(format!(
                "handle version {} != ours {WIRE_VERSION}",
                handle.version
            )));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let (ring, endpoint) = match reader {
            ReaderId::Local(i) => {
                if i >= handle.n_local_readers {
                    return Err(IpcError::Config(format!(
                        "local reader {i} of {}",
                        handle.n_local_readers
                    )));
                }
                let name = handle
                    .ring
                    .as_deref()
                    .ok_or_else(|| IpcError::Config("handle has no ring".into()))?;
                let ring = ShmRingBuffer::open(name)?;
                ring.register_reader(i);
                (Some(Arc::new(ring)), handle.local_endpoint.clone())
            }
            ReaderId::Remote(i) => {
                if i >= handle.n_remote_readers {
                    return Err(IpcError::Config(format!(
                        "remote reader {i} of {}",
                        handle.n_remote_readers
                    )));
                }
                (None, handle.remote_endpoint.clone())
            }
        };
        let endpoint = endpoint
            .ok_or_else(|| IpcError::Config("handle has no endpoint for this reader".into()))?;
        let mut stream = zmtp::connect(&endpoint, deadline)?;
        stream.handshake("DEALER", &identity(reader), deadline)?;
        stream.send(&[
            &meta_frame(MetaKind::Hello, u64::from(std::process::id())),
            &WIRE_VERSION.to_le_bytes(),
        ])?;
        let (writer_pid, writer_start) = match &ring {
            Some(r) => r.writer(),
            None => (handle.writer_pid, 0),
        };
        Ok(Self {
            id: reader,
            ring,
            stream,
            config: handle.config.clone(),
            writer_pid,
            writer_start,
            cursor: 0,
            cancelled: Arc::new(AtomicBool::new(false)),
            ready: false,
        })
    }

    /// This reader's id.
    pub fn id(&self) -> ReaderId {
        self.id
    }

    /// A handle that cancels this reader's waits from another thread.
    pub fn canceller(&self) -> Canceller {
        Canceller {
            flag: self.cancelled.clone(),
            ring: self.ring.clone(),
        }
    }

    /// Waits for the writer's go-ahead.
    pub fn wait_until_ready(&mut self, timeout: Duration) -> Result<(), IpcError> {
        if self.ready {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            let slice =
                Instant::now() + POLL_SLICE.min(deadline.saturating_duration_since(Instant::now()));
            match self
                .stream
                .recv(Some(slice), 64, 1)
                .map_err(|e| self.writer_error(e))?
            {
                Some(f) if f.len() == 1 && Meta::decode(&f[0])?.kind == MetaKind::Ready => {
                    self.ready = true;
                    return Ok(());
                }
                Some(_) => return Err(IpcError::MalformedFrame("expected READY".into())),
                None if Instant::now() >= deadline => return Err(IpcError::Timeout(timeout)),
                None => {}
            }
        }
    }

    fn check_alive(&self) -> Result<(), IpcError> {
        if self.cancelled.load(Ordering::SeqCst) {
            return Err(IpcError::Cancelled);
        }
        if let Some(ring) = &self.ring
            && ring.header().shutdown.load(Ordering::SeqCst) != 0
        {
            return Err(IpcError::Cancelled);
        }
        Ok(())
    }

    /// A transport error while the writer is dead is reported as its death.
    fn writer_error(&self, e: IpcError) -> IpcError {
        if self.ring.is_some() && !crate::shm::process_alive(self.writer_pid, self.writer_start) {
            return IpcError::WriterDead {
                pid: self.writer_pid,
            };
        }
        if self
            .ring
            .as_ref()
            .is_some_and(|r| r.header().closed.load(Ordering::SeqCst) != 0)
        {
            return IpcError::Closed;
        }
        e
    }

    /// Receives the next message as an owned copy.
    pub fn dequeue(&mut self, timeout: Option<Duration>) -> Result<Message, IpcError> {
        let mut g = self.dequeue_borrowed(timeout)?;
        if let Body::Owned(m) = &mut g.body {
            return Ok(std::mem::replace(
                m,
                Message {
                    header: Bytes::new(),
                    buffers: Vec::new(),
                },
            ));
        }
        Ok(g.to_message())
    }

    /// Receives the next message, borrowing it from the ring slot when it is there (zero-copy)
    /// until the guard drops.
    pub fn dequeue_borrowed(
        &mut self,
        timeout: Option<Duration>,
    ) -> Result<ReadGuard<'_>, IpcError> {
        if !self.ready {
            self.wait_until_ready(timeout.unwrap_or(Duration::from_secs(300)))?;
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        match self.ring.clone() {
            Some(ring) => self.dequeue_local(&ring, deadline, timeout),
            None => self.dequeue_remote(deadline, timeout),
        }
    }

    fn dequeue_local(
        &mut self,
        ring: &Arc<ShmRingBuffer>,
        deadline: Option<Instant>,
        timeout: Option<Duration>,
    ) -> Result<ReadGuard<'_>, IpcError> {
        let ReaderId::Local(r) = self.id else {
            return Err(IpcError::Config("not a local reader".into()));
        };
        let slot = (self.cursor % ring.max_chunks() as u64) as usize;
        let readable = || ring.flags().readable(slot, r);
        spin_wait(Instant::now() + self.config.spin, readable);
        while !readable() {
            self.check_alive()?;
            if ring.header().closed.load(Ordering::SeqCst) != 0 && !readable() {
                return Err(IpcError::Closed);
            }
            if !crate::shm::process_alive(self.writer_pid, self.writer_start) {
                return Err(IpcError::WriterDead {
                    pid: self.writer_pid,
                });
            }
            let slice = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(IpcError::Timeout(timeout.unwrap_or_default()));
                    }
                    left.min(POLL_SLICE)
                }
                None => POLL_SLICE,
            };
            ring.park_reader(slice, readable);
        }
        self.check_alive()?;
        // SAFETY: the slot is readable for us: published and not yet released by this reader,
        // so the writer does not touch it until we release; it is max_chunk_bytes long.
        let bytes =
            unsafe { std::slice::from_raw_parts(ring.slot_ptr(slot), ring.max_chunk_bytes()) };
        match codec::parse_slot(bytes)? {
            SlotContent::Inline(layout) => Ok(ReadGuard {
                reader: self,
                body: Body::Slot { slot, layout },
            }),
            SlotContent::Overflow => {
                let msg = self.recv_frames(deadline, timeout)?;
                self.release(slot);
                Ok(ReadGuard {
                    reader: self,
                    body: Body::Owned(msg),
                })
            }
        }
    }

    fn dequeue_remote(
        &mut self,
        deadline: Option<Instant>,
        timeout: Option<Duration>,
    ) -> Result<ReadGuard<'_>, IpcError> {
        let msg = self.recv_frames(deadline, timeout)?;
        let seq = self.cursor;
        self.stream
            .send(&[&meta_frame(MetaKind::Ack, seq)])
            .map_err(|e| self.writer_error(e))?;
        self.cursor += 1;
        Ok(ReadGuard {
            reader: self,
            body: Body::Owned(msg),
        })
    }

    /// Reads the next data message from the socket, checking its sequence number.
    fn recv_frames(
        &mut self,
        deadline: Option<Instant>,
        timeout: Option<Duration>,
    ) -> Result<Message, IpcError> {
        loop {
            self.check_alive()?;
            let slice = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(IpcError::Timeout(timeout.unwrap_or_default()));
                    }
                    now + (d - now).min(POLL_SLICE)
                }
                None => Instant::now() + POLL_SLICE,
            };
            let got = self
                .stream
                .recv(
                    Some(slice),
                    self.config.max_message_bytes,
                    codec::MAX_BUFFERS,
                )
                .map_err(|e| self.writer_error(e))?;
            let Some(frames) = got else { continue };
            if frames.len() < 2 {
                return Err(IpcError::MalformedFrame(format!(
                    "data message of {} frames",
                    frames.len()
                )));
            }
            let meta = Meta::decode(&frames[0])?;
            if meta.kind != MetaKind::Data {
                return Err(IpcError::MalformedFrame(format!(
                    "expected data, got {:?}",
                    meta.kind
                )));
            }
            if meta.seq != self.cursor {
                return Err(IpcError::MalformedFrame(format!(
                    "message {} arrived, expected {}",
                    meta.seq, self.cursor
                )));
            }
            let mut it = frames.into_iter().skip(1);
            let header = it.next().unwrap_or_default();
            return Ok(Message {
                header,
                buffers: it.collect(),
            });
        }
    }

    fn release(&mut self, slot: usize) {
        if let (Some(ring), ReaderId::Local(r)) = (&self.ring, self.id) {
            ring.flags().release(slot, r);
            ring.notify_writer();
        }
        self.cursor += 1;
    }
}
