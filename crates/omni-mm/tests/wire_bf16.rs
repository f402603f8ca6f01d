//! `to_bf16_bytes` against torch's `tensor.to(torch.bfloat16)` (round to nearest even).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{f32s, golden};
use omni_mm::to_bf16_bytes;

#[test]
fn bf16_bytes_equal_torch() {
    let g = golden();
    let vals = f32s(g["bf16"]["file"].as_str().unwrap());
    let bytes = to_bf16_bytes(&vals);
    assert_eq!(bytes.len(), vals.len() * 2);
    assert_eq!(
        blake3::hash(&bytes).to_hex().to_string(),
        g["bf16"]["blake3_of_bf16_le"].as_str().unwrap()
    );
}
