//! How a message sits in a ring slot, and its ZeroMQ framing.
//!
//! Slot layout (little-endian):
//!
//! ```text
//! 0        u8   kind: 0 = inline, 1 = overflow (the message follows over ZeroMQ)
//! 4        u32  number of buffers n
//! 8        u64  header length
//! 16       u64  length of buffer i, for i in 0..n
//! h        header bytes (bincode 2), h = 16 + 8n rounded up to 8
//! b_i      buffer i, each starting on a 64-byte boundary (so f32/bf16 tensors can be viewed
//!          in place)
//! ```
//!
//! Buffers are copied into the slot once, straight from the caller's slices: there is no
//! intermediate serialization of tensor bytes.
//!
//! ZeroMQ messages are multipart: frame 0 is a 16-byte [`Meta`], frame 1 the header, then one
//! frame per buffer. Frames from the network are checked (shape, sequence, size bound) before
//! anything is decoded; the header codec is bincode (data only, nothing executable).

use std::ops::Range;

use crate::IpcError;

/// Kind byte of an inline slot.
pub const KIND_INLINE: u8 = 0;
/// Kind byte of a slot whose message went over ZeroMQ.
pub const KIND_OVERFLOW: u8 = 1;
/// Most buffers in one message.
pub const MAX_BUFFERS: usize = 1 << 16;
const BUFFER_ALIGN: usize = 64;

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Bytes an inline encoding takes (or `None` on overflow of usize).
pub fn inline_len(header_len: usize, buffers: &[&[u8]]) -> usize {
    let mut off = align(16 + 8 * buffers.len(), 8) + header_len;
    for b in buffers {
        off = align(off, BUFFER_ALIGN) + b.len();
    }
    off
}

/// Writes a message inline into `dst[..inline_len]`.
///
/// # Safety
/// `dst` must be valid for writes of `inline_len(header.len(), buffers)` bytes and not be
/// accessed by anyone else during the call.
pub unsafe fn write_inline(dst: *mut u8, header: &[u8], buffers: &[&[u8]]) {
    let put = |off: usize, src: &[u8]| {
        // SAFETY: the caller guarantees `dst` is writable for the whole encoding, and every
        // (off, len) here lies inside it by construction of `inline_len`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add(off), src.len()) }
    };
    put(0, &[KIND_INLINE, 0, 0, 0]);
    put(4, &(buffers.len() as u32).to_le_bytes());
    put(8, &(header.len() as u64).to_le_bytes());
    for (i, b) in buffers.iter().enumerate() {
        put(16 + 8 * i, &(b.len() as u64).to_le_bytes());
    }
    let mut off = align(16 + 8 * buffers.len(), 8);
    put(off, header);
    off += header.len();
    for b in buffers {
        off = align(off, BUFFER_ALIGN);
        if b.len() >= STREAM_MIN {
            // SAFETY: as for `put`; the destination is 64-byte aligned (slots are page aligned
            // and buffers start on BUFFER_ALIGN boundaries).
            unsafe { copy_streaming(b.as_ptr(), dst.add(off), b.len()) };
        } else {
            put(off, b);
        }
        off += b.len();
    }
}

/// Buffers at least this large are copied into the slot with non-temporal stores (smaller ones
/// are better left in the cache, where the reader finds them: 1 MiB fell from 1.1 to 0.6 of
/// memcpy with streaming stores).
const STREAM_MIN: usize = 4 << 20;

/// Copies with non-temporal (streaming) stores on x86-64: the slot's lines go to memory without
/// first being read for ownership and without evicting the writer's working set, which cut the
/// DRAM traffic of a multi-MiB broadcast by a third. Ends with `sfence`, so the stores are
/// globally visible before the caller's Release store that publishes the slot (NT stores are
/// not ordered by Release alone).
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes, not overlapping; `dst` 16-byte aligned.
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let mut i = 0;
        while i + 64 <= len {
            // SAFETY: i + 64 <= len, so every 16-byte load and store is in bounds; `dst + i` is
            // 16-byte aligned because `dst` is and i is a multiple of 64. SSE2 is part of the
            // x86-64 baseline.
            unsafe {
                let a = _mm_loadu_si128(src.add(i) as *const __m128i);
                let b = _mm_loadu_si128(src.add(i + 16) as *const __m128i);
                let c = _mm_loadu_si128(src.add(i + 32) as *const __m128i);
                let d = _mm_loadu_si128(src.add(i + 48) as *const __m128i);
                _mm_stream_si128(dst.add(i) as *mut __m128i, a);
                _mm_stream_si128(dst.add(i + 16) as *mut __m128i, b);
                _mm_stream_si128(dst.add(i + 32) as *mut __m128i, c);
                _mm_stream_si128(dst.add(i + 48) as *mut __m128i, d);
            }
            i += 64;
        }
        // SAFETY: the tail [i, len) is in bounds; sfence orders the streaming stores before
        // any later store (in particular the slot's publishing Release store).
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: guaranteed by the caller.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}

/// Marks a slot as "overflow: read the next ZeroMQ message".
///
/// # Safety
/// `dst` must be valid for writes of 16 bytes and owned by the caller.
pub unsafe fn write_overflow_marker(dst: *mut u8) {
    let marker = [KIND_OVERFLOW, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::copy_nonoverlapping(marker.as_ptr(), dst, marker.len()) }
}

/// Where the parts of an inline message are inside its slot.
#[derive(Debug, Clone)]
pub struct SlotLayout {
    /// Header byte range.
    pub header: Range<usize>,
    /// Buffer byte ranges.
    pub buffers: Vec<Range<usize>>,
}

/// What a slot holds.
#[derive(Debug, Clone)]
pub enum SlotContent {
    /// The message is in the slot.
    Inline(SlotLayout),
    /// The message went over ZeroMQ.
    Overflow,
}

fn rd_u64(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// Parses a slot, checking every length against the slot's size.
pub fn parse_slot(slot: &[u8]) -> Result<SlotContent, IpcError> {
    let bad = |what: &str| IpcError::MalformedFrame(format!("ring slot: {what}"));
    match slot.first() {
        Some(&KIND_OVERFLOW) => return Ok(SlotContent::Overflow),
        Some(&KIND_INLINE) => {}
        _ => return Err(bad("unknown kind")),
    }
    let n = u32::from_le_bytes(
        slot.get(4..8)
            .ok_or_else(|| bad("short"))?
            .try_into()
            .map_err(|_| bad("short"))?,
    ) as usize;
    if n > MAX_BUFFERS {
        return Err(bad("too many buffers"));
    }
    let header_len = rd_u64(slot, 8).ok_or_else(|| bad("short"))? as usize;
    let mut off = align(16 + 8 * n, 8);
    let header = off..off
        .checked_add(header_len)
        .ok_or_else(|| bad("header length"))?;
    off = header.end;
    let mut buffers = Vec::with_capacity(n);
    for i in 0..n {
        let len = rd_u64(slot, 16 + 8 * i).ok_or_else(|| bad("short"))? as usize;
        off = align(off, BUFFER_ALIGN);
        let end = off.checked_add(len).ok_or_else(|| bad("buffer length"))?;
        buffers.push(off..end);
        off = end;
    }
    if off > slot.len() {
        return Err(bad("lengths exceed the slot"));
    }
    Ok(SlotContent::Inline(SlotLayout { header, buffers }))
}

/// Frame-0 kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum MetaKind {
    /// A message: header + buffers follow.
    Data = 0,
    /// Reader -> writer: attached (body: pid as u64).
    Hello = 1,
    /// Writer -> reader: traffic may start.
    Ready = 2,
    /// Remote reader -> writer: consumed message `seq`.
    Ack = 3,
}

/// Frame 0 of every ZeroMQ message: magic, kind, sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    /// What this is.
    pub kind: MetaKind,
    /// Message sequence number (Data, Ack) or payload (Hello: pid).
    pub seq: u64,
}

const META_MAGIC: u32 = u32::from_le_bytes(*b"OMQ1");

impl Meta {
    /// 16 bytes on the wire.
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&META_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&(self.kind as u32).to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    /// Parses and validates frame 0.
    pub fn decode(b: &[u8]) -> Result<Self, IpcError> {
        if b.len() != 16 {
            return Err(IpcError::MalformedFrame(format!(
                "meta frame of {} bytes",
                b.len()
            )));
        }
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != META_MAGIC {
            return Err(IpcError::MalformedFrame("bad magic".into()));
        }
        let kind = match u32::from_le_bytes([b[4], b[5], b[6], b[7]]) {
            0 => MetaKind::Data,
            1 => MetaKind::Hello,
            2 => MetaKind::Ready,
            3 => MetaKind::Ack,
            k => return Err(IpcError::MalformedFrame(format!("unknown kind {k}"))),
        };
        let seq = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
        Ok(Self { kind, seq })
    }
}

/// bincode 2 with a cap on what a length prefix may claim, so a hostile header cannot make
/// the decoder allocate without bound.
fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ 256 << 20 }>()
}

/// Encodes a typed header into `out` (cleared first).
pub fn encode_header<H: serde::Serialize>(header: &H, out: &mut Vec<u8>) -> Result<(), IpcError> {
    out.clear();
    bincode::serde::encode_into_std_write(header, out, bincode_config())
        .map_err(|e| IpcError::Codec(e.to_string()))?;
    Ok(())
}

/// Decodes a typed header; trailing bytes are an error.
pub fn decode_header<H: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<H, IpcError> {
    let (h, used) = bincode::serde::decode_from_slice(bytes, bincode_config())
        .map_err(|e| IpcError::Codec(e.to_string()))?;
    if used != bytes.len() {
        return Err(IpcError::Codec(format!(
            "{} trailing bytes after the header",
            bytes.len() - used
        )));
    }
    Ok(h)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn inline_round_trip_keeps_buffers_aligned() {
        let header = b"hdr";
        let a = vec![1u8; 5];
        let b = vec![2u8; 100];
        let bufs: [&[u8]; 3] = [&a, &[], &b];
        let len = inline_len(header.len(), &bufs);
        let mut slot = vec![0u8; len + 64];
        // SAFETY: `slot` is `len + 64` writable bytes owned by the test.
        unsafe { write_inline(slot.as_mut_ptr(), header, &bufs) };
        let SlotContent::Inline(l) = parse_slot(&slot).unwrap() else {
            panic!("overflow")
        };
        assert_eq!(&slot[l.header.clone()], header);
        assert_eq!(l.buffers.len(), 3);
        for (r, want) in l.buffers.iter().zip(bufs) {
            assert_eq!(r.start % 64, 0);
            assert_eq!(&slot[r.clone()], want);
        }
    }

    #[test]
    fn corrupt_lengths_are_rejected() {
        let mut slot = vec![0u8; 64];
        slot[4] = 1;
        slot[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(parse_slot(&slot).is_err());
        slot[0] = 7;
        assert!(parse_slot(&slot).is_err());
    }

    #[test]
    fn meta_rejects_garbage() {
        let m = Meta {
            kind: MetaKind::Ack,
            seq: 9,
        };
        assert_eq!(Meta::decode(&m.encode()).unwrap(), m);
        assert!(Meta::decode(b"short").is_err());
        let mut bad = m.encode();
        bad[0] ^= 1;
        assert!(Meta::decode(&bad).is_err());
        bad = m.encode();
        bad[4] = 9;
        assert!(Meta::decode(&bad).is_err());
    }

    #[test]
    fn header_codec_rejects_trailing_bytes_and_huge_claims() {
        let mut v = Vec::new();
        encode_header(&(1u32, vec![1u64, 2]), &mut v).unwrap();
        let back: (u32, Vec<u64>) = decode_header(&v).unwrap();
        assert_eq!(back, (1, vec![1, 2]));
        v.push(0);
        assert!(decode_header::<(u32, Vec<u64>)>(&v).is_err());
        // A length prefix claiming 2^40 elements.
        let mut huge = Vec::new();
        encode_header(&(u64::MAX >> 24), &mut huge).unwrap();
        assert!(decode_header::<Vec<u64>>(&huge).is_err());
    }
}
