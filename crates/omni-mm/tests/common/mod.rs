//! Fixture loading shared by the integration tests (`tests/fixtures/`, made by
//! `scripts/make-mm-golden.sh`).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

pub fn bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

pub fn f32s(name: &str) -> Vec<f32> {
    bytes(name)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn golden() -> serde_json::Value {
    serde_json::from_slice(&bytes("golden.json")).expect("golden.json")
}

pub fn blake3_f32(v: &[f32]) -> String {
    // The crate's own hash streams f32 as little-endian bytes; an empty-shape "hash" of the raw
    // bytes is the same blake3 the script computes, so go through a hasher in chunks.
    let mut h = blake3::Hasher::new();
    let mut buf = Vec::with_capacity(1 << 16);
    for chunk in v.chunks(1 << 14) {
        buf.clear();
        for x in chunk {
            buf.extend_from_slice(&x.to_le_bytes());
        }
        h.update(&buf);
    }
    h.finalize().to_hex().to_string()
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

pub fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("int") as u32)
        .collect()
}
