//! The writer side of the broadcast queue: creation, the ready handshake, `enqueue` over the
//! ring or the overflow sockets, credit, shutdown.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::wait::{next_multiple, spin_until, spin_wait, warn_blocked};
use super::{Handle, MessageQueueStats, QueueSpec, WIRE_VERSION, meta_frame, parse_identity};
use crate::codec::{self, Meta, MetaKind};
use crate::ring::ShmRingBuffer;
use crate::zmtp::{Listener, Stream};
use crate::{IpcError, MessageQueueConfig, ReaderId};

/// Time a reader that has connected gets to finish the ready handshake.
const HANDSHAKE_GRACE: Duration = Duration::from_secs(5);

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
    /// Set when an enqueue failed after its point of no return (the overflow marker was
    /// published, or a send was cut off): the ring and the readers' sockets no longer agree
    /// on what comes next, so every later enqueue fails with this.
    poisoned: Option<(String, String)>,
    /// Plain counters: the writer is single-threaded.
    stats: MessageQueueStats,
}

impl std::fmt::Debug for MessageQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageQueue")
            .field("handle", &self.handle)
            .field("seq", &self.seq)
            .finish()
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
            poisoned: None,
            stats: MessageQueueStats::default(),
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

    /// Messages and bytes sent so far, over the ring and over the overflow sockets.
    pub fn stats(&self) -> MessageQueueStats {
        self.stats
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
                            let peer = Self::watch(s, id, pid, &self.spec.config)?;
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
    fn watch(
        stream: Stream,
        id: ReaderId,
        pid: u32,
        config: &MessageQueueConfig,
    ) -> Result<Peer, IpcError> {
        // A send that moves no byte for this long runs the stall check (`SendRules`).
        stream
            .set_write_timeout(Some(config.liveness_interval))
            .map_err(|e| IpcError::Zmq {
                op: "watch",
                message: e.to_string(),
            })?;
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
        if let Some((what, reason)) = &self.poisoned {
            return Err(IpcError::Unusable {
                what: what.clone(),
                reason: reason.clone(),
            });
        }
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
        let watch = SendRules {
            config: &self.spec.config,
            ring: self.ring.as_ref(),
            started,
        };
        let payload = (header.len() + buffers.iter().map(|b| b.len()).sum::<usize>()) as u64;
        let mut overflowed = false;
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
                overflowed = true;
                // Publish the marker first: a reader takes the frames off its socket only after
                // it sees the marker, and a large message does not fit the socket's buffer, so
                // sending before publishing would block both sides.
                flags.publish(slot);
                ring.notify_readers(false);
                // From here on the readers expect this message on their sockets: a failure
                // leaves the queue unusable (see `poisoned`).
                if let Err(e) = send_all(
                    &mut self.peers,
                    |id| matches!(id, ReaderId::Local(_)),
                    &frames,
                    &watch,
                ) {
                    self.poisoned = Some((
                        "the broadcast queue".into(),
                        format!("overflow message {seq} did not reach every reader ({e})"),
                    ));
                    return Err(e);
                }
            }
        }
        if self.spec.n_remote_readers > 0
            && let Err(e) = send_all(
                &mut self.peers,
                |id| matches!(id, ReaderId::Remote(_)),
                &frames,
                &watch,
            )
        {
            self.poisoned = Some((
                "the broadcast queue".into(),
                format!("message {seq} did not reach every remote reader ({e})"),
            ));
            return Err(e);
        }
        self.seq += 1;
        self.stats.messages += 1;
        if overflowed {
            self.stats.overflow_messages += 1;
            self.stats.overflow_bytes += payload;
        } else if self.ring.is_some() {
            self.stats.ring_bytes += payload;
        }
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
        let shut = || {
            self.ring
                .as_ref()
                .is_some_and(|r| r.header().shutdown.load(Ordering::SeqCst) != 0)
        };
        let ready = || ring_ok() && remote_ok();
        // The spin ends at the enqueue timeout too, and a shutdown ends it (checked below).
        let deadline = cfg.enqueue_timeout.map(|t| started + t);
        if spin_wait(spin_until(started, cfg.spin, deadline), || {
            ready() || shut()
        }) && ready()
        {
            return Ok(());
        }
        let mut next_warn = cfg.warn_interval;
        loop {
            if ready() {
                return Ok(());
            }
            if shut() {
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
                warn_blocked(waited, &lagging);
                next_warn += cfg.warn_interval;
            }
            if let Some(t) = cfg.enqueue_timeout
                && waited >= t
            {
                return Err(IpcError::EnqueueTimeout { waited, lagging });
            }
            let mut slice = cfg.liveness_interval.min(next_warn.saturating_sub(waited));
            if let Some(t) = cfg.enqueue_timeout {
                slice = slice.min(t.saturating_sub(waited));
            }
            let slice = slice.max(Duration::from_millis(1));
            match &self.ring {
                Some(ring) if need_ring && !ring_ok() => {
                    ring.park_writer(slice, || ring_ok() || shut())
                }
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
                ring.park_writer(self.spec.config.liveness_interval, || {
                    ring.flags().all_read(slot)
                });
            }
        }
        Ok(())
    }
}

/// What a stalled overflow send checks (the same rules as the credit wait): shutdown, the
/// reader's liveness, the warning every `warn_interval`, and `enqueue_timeout`, all measured
/// from the start of the enqueue.
struct SendRules<'a> {
    config: &'a MessageQueueConfig,
    ring: Option<&'a ShmRingBuffer>,
    started: Instant,
}

impl SendRules<'_> {
    /// The stall check for the send to reader `id`.
    fn check_for<'p>(
        &'p self,
        id: ReaderId,
        pid: u32,
        gone: &'p AtomicBool,
    ) -> impl FnMut() -> Result<(), IpcError> + 'p {
        let mut next_warn = next_multiple(self.started.elapsed(), self.config.warn_interval);
        move || {
            if self
                .ring
                .is_some_and(|r| r.header().shutdown.load(Ordering::SeqCst) != 0)
            {
                return Err(IpcError::Cancelled);
            }
            if let Some(e) = self.peer_gone(id, pid, gone) {
                return Err(e);
            }
            let waited = self.started.elapsed();
            if waited >= next_warn {
                warn_blocked(waited, &[id]);
                next_warn = next_multiple(waited, self.config.warn_interval);
            }
            match self.config.enqueue_timeout {
                Some(t) if waited >= t => Err(IpcError::EnqueueTimeout {
                    waited,
                    lagging: vec![id],
                }),
                _ => Ok(()),
            }
        }
    }

    /// Why the connection to reader `id` can no longer take data, if it cannot.
    fn peer_gone(&self, id: ReaderId, pid: u32, gone: &AtomicBool) -> Option<IpcError> {
        let local_alive = match (id, self.ring) {
            (ReaderId::Local(r), Some(ring)) => Some(
                ring.reader(r)
                    .is_none_or(|(pid, start)| crate::shm::process_alive(pid, start)),
            ),
            _ => None,
        };
        match (local_alive, gone.load(Ordering::Acquire)) {
            (Some(false), _) | (None, true) => Some(IpcError::ReaderDead { reader: id, pid }),
            (Some(true), true) => Some(IpcError::Unusable {
                what: format!("the overflow connection to {id}"),
                reason: "the reader closed it".into(),
            }),
            _ => None,
        }
    }

    /// The error for a failed send to `id`: a transport error is the reader's death or its
    /// closing of the connection; the rules' own errors pass through.
    fn send_error(&self, id: ReaderId, pid: u32, gone: &AtomicBool, e: IpcError) -> IpcError {
        match e {
            IpcError::Zmq { .. } => match self.peer_gone(id, pid, gone) {
                Some(known) => known,
                // A local reader that is alive: the connection failed under it.
                None if matches!(id, ReaderId::Local(_)) => IpcError::Unusable {
                    what: format!("the overflow connection to {id}"),
                    reason: e.to_string(),
                },
                None => IpcError::ReaderDead { reader: id, pid },
            },
            other => other,
        }
    }
}

fn send_all(
    peers: &mut HashMap<ReaderId, Peer>,
    which: impl Fn(ReaderId) -> bool,
    frames: &[&[u8]],
    rules: &SendRules<'_>,
) -> Result<(), IpcError> {
    let mut targets: Vec<(&ReaderId, &mut Peer)> =
        peers.iter_mut().filter(|(id, _)| which(**id)).collect();
    let send_one = |id: ReaderId, p: &mut Peer| {
        let (pid, gone) = (p.pid, &p.gone);
        let mut check = rules.check_for(id, pid, gone);
        p.stream
            .send_watched(frames, &mut check)
            .map_err(|e| rules.send_error(id, pid, gone, e))
    };
    if targets.len() == 1 {
        let (id, p) = targets.remove(0);
        return send_one(*id, p);
    }
    // Several readers: one sender thread each, so they receive in parallel.
    std::thread::scope(|s| {
        let handles: Vec<_> = targets
            .into_iter()
            .map(|(id, p)| {
                let id = *id;
                s.spawn(move || send_one(id, p))
            })
            .collect();
        let mut first_err = None;
        for h in handles {
            let r = h.join().unwrap_or_else(|_| {
                Err(IpcError::Zmq {
                    op: "send",
                    message: "sender thread panicked".into(),
                })
            });
            if let (Err(e), None) = (r, &first_err) {
                first_err = Some(e);
            }
        }
        first_err.map_or(Ok(()), Err)
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
