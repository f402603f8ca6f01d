//! Content hashes of processed items (the cache key the model side sees as `mm_hash`).
//!
//! BLAKE3 (256-bit) over a domain tag, the modality, the shape and the tensor's little-endian
//! bytes. vLLM hashes multimodal items with blake3 too; it builds in seconds with no extra
//! dependencies beyond `cc` (its SIMD assembly), and hashes at several GB/s, which matters for
//! a 12.8-megapixel image's 300 MB of f32 patches.

use crate::prompt::Modality;

/// A 256-bit BLAKE3 digest of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    /// The first 8 bytes as a little-endian `u64` (the model interface's `mm_hash`).
    pub fn as_u64(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }

    /// Lower-case hex.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The tensor element bytes a hash covers.
#[derive(Debug, Clone, Copy)]
pub enum TensorData<'a> {
    /// f32 values, hashed as little-endian bytes.
    F32(&'a [f32]),
    /// Raw bytes (e.g. bf16 wire bytes).
    Bytes(&'a [u8]),
}

/// BLAKE3 of `data` as a little-endian byte stream (no unsafe, no copy of the whole tensor).
pub(crate) fn hash_f32_le(hasher: &mut blake3::Hasher, data: &[f32]) {
    let mut buf = [0u8; 16 * 1024];
    for chunk in data.chunks(buf.len() / 4) {
        for (dst, v) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        hasher.update(&buf[..chunk.len() * 4]);
    }
}

/// The content hash of one processed item: modality, shape (as u64 LE, length-prefixed) and data.
pub fn content_hash(modality: Modality, shape: &[u64], data: TensorData<'_>) -> ContentHash {
    let mut h = blake3::Hasher::new();
    h.update(b"omni-mm item v1\0");
    h.update(&[match modality {
        Modality::Image => 0u8,
        Modality::Audio => 1,
        Modality::Video => 2,
    }]);
    h.update(&(shape.len() as u64).to_le_bytes());
    for d in shape {
        h.update(&d.to_le_bytes());
    }
    match data {
        TensorData::F32(v) => {
            h.update(&[0]);
            hash_f32_le(&mut h, v);
        }
        TensorData::Bytes(b) => {
            h.update(&[1]);
            h.update(b);
        }
    }
    ContentHash(*h.finalize().as_bytes())
}

/// A hash of one item's source: modality, the declared media type (it selects the decoder) and
/// the fetched bytes, before any decoding. Equal sources preprocess to equal items, so this keys
/// the API server's processor cache.
pub fn source_hash(modality: Modality, media_type: Option<&str>, bytes: &[u8]) -> ContentHash {
    let mut h = blake3::Hasher::new();
    h.update(b"omni-mm source v1\0");
    h.update(&[modality as u8]);
    let t = media_type.unwrap_or("");
    h.update(&(t.len() as u64).to_le_bytes());
    h.update(t.as_bytes());
    h.update(bytes);
    ContentHash(*h.finalize().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_hash_depends_on_modality_type_and_bytes() {
        let a = source_hash(Modality::Image, Some("image/png"), b"abc");
        assert_eq!(a, source_hash(Modality::Image, Some("image/png"), b"abc"));
        assert_ne!(a, source_hash(Modality::Audio, Some("image/png"), b"abc"));
        assert_ne!(a, source_hash(Modality::Image, None, b"abc"));
        assert_ne!(a, source_hash(Modality::Image, Some("image/png"), b"abd"));
        // The type's length is part of the hash: no two (type, bytes) splits collide.
        assert_ne!(
            source_hash(Modality::Image, Some("ab"), b"c"),
            source_hash(Modality::Image, Some("a"), b"bc")
        );
    }

    #[test]
    fn hash_depends_on_shape_modality_and_data() {
        let d = [1.0f32, 2.0, 3.0, 4.0];
        let a = content_hash(Modality::Image, &[2, 2], TensorData::F32(&d));
        assert_ne!(
            a,
            content_hash(Modality::Image, &[4, 1], TensorData::F32(&d))
        );
        assert_ne!(
            a,
            content_hash(Modality::Video, &[2, 2], TensorData::F32(&d))
        );
        assert_ne!(
            a,
            content_hash(
                Modality::Image,
                &[2, 2],
                TensorData::F32(&[1.0, 2.0, 3.0, 5.0])
            )
        );
        assert_eq!(
            a,
            content_hash(Modality::Image, &[2, 2], TensorData::F32(&d))
        );
        assert_eq!(a.as_u64().to_le_bytes(), a.0[..8]);
    }

    #[test]
    fn f32_stream_equals_le_bytes() {
        let d: Vec<f32> = (0..10_000).map(|i| i as f32 * 0.5).collect();
        let bytes: Vec<u8> = d.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut h = blake3::Hasher::new();
        hash_f32_le(&mut h, &d);
        assert_eq!(h.finalize(), blake3::hash(&bytes));
    }
}
