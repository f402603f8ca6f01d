//! The reader side of the broadcast queue: attach, the ready wait, `dequeue` from the ring
//! (zero-copy) or from the overflow socket, and the canceller.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::wait::{spin_until, spin_wait};
use super::{Handle, WIRE_VERSION, identity, meta_frame};
use crate::codec::{self, Meta, MetaKind, SlotContent};
use crate::ring::ShmRingBuffer;
use crate::zmtp::{self, Stream};
use crate::{IpcError, MessageQueueConfig, ReaderId};

/// The least time a reader gives the frames of a published overflow message, whatever its
/// caller's timeout: their transfer is under way.
const OVERFLOW_READ_GRACE: Duration = Duration::from_secs(1);

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

/// What ends a reader's wait early: its canceller, the writer's shutdown, the writer's close.
///
/// Wake-up argument: each of these is a SeqCst store followed by a forced `notify_readers`
/// (a SeqCst `write_epoch += 1`, then FUTEX_WAKE). A parked reader's condition includes
/// [`Self::any`], loaded after its SeqCst load of the epoch (`ring::park`). If the increment
/// precedes that load in the single SeqCst order, so does the flag store and the re-check
/// sees it; if it follows, FUTEX_WAIT's atomic compare fails or the wake finds the reader
/// queued. So an interrupt is never slept through (`loom_park_never_sleeps_through_a_cancel`).
struct Interrupts<'a> {
    cancelled: &'a AtomicBool,
    ring: Option<&'a ShmRingBuffer>,
}

impl<'a> Interrupts<'a> {
    fn of(r: &'a MessageQueueReader) -> Self {
        Self {
            cancelled: &r.cancelled,
            ring: r.ring.as_deref(),
        }
    }

    /// Whether any interrupt is set (closed included: the caller drains before reporting it).
    fn any(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
            || self.ring.is_some_and(|r| {
                let h = r.header();
                h.shutdown.load(Ordering::SeqCst) != 0 || h.closed.load(Ordering::SeqCst) != 0
            })
    }

    /// `Cancelled` if this reader was cancelled or the queue shut down.
    fn check(&self) -> Result<(), IpcError> {
        let shut = self
            .ring
            .is_some_and(|r| r.header().shutdown.load(Ordering::SeqCst) != 0);
        if self.cancelled.load(Ordering::SeqCst) || shut {
            return Err(IpcError::Cancelled);
        }
        Ok(())
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
            let slice = Instant::now()
                + self
                    .config
                    .liveness_interval
                    .min(deadline.saturating_duration_since(Instant::now()));
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
        Interrupts::of(self).check()
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
    /// until the guard drops. `timeout` bounds the wait for a message to be published; the
    /// frames of a published overflow message then get at least [`OVERFLOW_READ_GRACE`] (their
    /// transfer is under way), so a call with a shorter `timeout` may outlast it by that much.
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
        let interrupts = Interrupts::of(self);
        // Cancel, shutdown and close are part of the condition both the spin and the parked
        // wait end on, so neither can sleep through one (argument on `Interrupts`).
        let wake = || readable() || interrupts.any();
        spin_wait(spin_until(Instant::now(), self.config.spin, deadline), wake);
        while !readable() {
            interrupts.check()?;
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
                    left.min(self.config.liveness_interval)
                }
                None => self.config.liveness_interval,
            };
            ring.park_reader(slice, wake);
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
                // The writer published this marker and is sending the frames now: give them at
                // least OVERFLOW_READ_GRACE whatever the caller's timeout (a zero or tiny one
                // would return before the first byte every time, and a busy caller polling
                // with zero timeouts would never get the message). A writer stalled longer
                // than that still ends the wait with a timeout (then the connection is cut).
                let frames_deadline = deadline.map(|d| d.max(Instant::now() + OVERFLOW_READ_GRACE));
                let msg = self.recv_frames(frames_deadline, timeout)?;
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

    /// Reads the next data message from the socket, checking its sequence number. The wait
    /// for its first byte and for the rest of it obey the same deadline, cancel and liveness
    /// rules; a message cut off part-way leaves the connection unusable.
    fn recv_frames(
        &mut self,
        deadline: Option<Instant>,
        timeout: Option<Duration>,
    ) -> Result<Message, IpcError> {
        let slice_len = self.config.liveness_interval;
        loop {
            self.check_alive()?;
            let slice = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(IpcError::Timeout(timeout.unwrap_or_default()));
                    }
                    now + (d - now).min(slice_len)
                }
                None => Instant::now() + slice_len,
            };
            let interrupts = Interrupts {
                cancelled: &self.cancelled,
                ring: self.ring.as_deref(),
            };
            let (writer_pid, writer_start) = (self.writer_pid, self.writer_start);
            let local = self.ring.is_some();
            let mut on_stall = || {
                interrupts.check()?;
                if local && !crate::shm::process_alive(writer_pid, writer_start) {
                    return Err(IpcError::WriterDead { pid: writer_pid });
                }
                match deadline {
                    Some(d) if Instant::now() >= d => {
                        Err(IpcError::Timeout(timeout.unwrap_or_default()))
                    }
                    _ => Ok(()),
                }
            };
            let got = self.stream.recv_watched(
                Some(slice),
                self.config.max_message_bytes,
                codec::MAX_BUFFERS,
                Some(slice_len),
                &mut on_stall,
            );
            let id = self.id;
            let got = got.map_err(|e| match e {
                IpcError::Unusable { reason, .. } => IpcError::Unusable {
                    what: format!("the overflow connection of {id} to the queue's writer"),
                    reason,
                },
                e => self.writer_error(e),
            })?;
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
