//! ggml tensor types and their dequantization to f32.
//!
//! Block layouts (all little-endian, `d`/`m` are IEEE half floats):
//!
//! | type | elements/block | bytes/block | layout | value of element `j` |
//! |---|---|---|---|---|
//! | F32  | 1  | 4  | `f32` | itself |
//! | F16  | 1  | 2  | `f16` | itself |
//! | BF16 | 1  | 2  | `bf16` | itself |
//! | Q4_0 | 32 | 18 | `d`, `qs[16]` | `(nibble(j) - 8) * d` |
//! | Q4_1 | 32 | 20 | `d`, `m`, `qs[16]` | `nibble(j) * d + m` |
//! | Q5_0 | 32 | 22 | `d`, `qh[4]`, `qs[16]` | `((nibble(j) \| bit(j) << 4) - 16) * d` |
//! | Q5_1 | 32 | 24 | `d`, `m`, `qh[4]`, `qs[16]` | `(nibble(j) \| bit(j) << 4) * d + m` |
//! | Q8_0 | 32 | 34 | `d`, `qs: [i8; 32]` | `qs[j] * d` |
//!
//! `nibble(j)` is the low nibble of `qs[j]` for `j < 16` and the high nibble of `qs[j - 16]`
//! otherwise; `bit(j)` is bit `j` of the little-endian `u32` `qh`.

use half::{bf16, f16};

/// A ggml tensor element type (`ggml_type`), by its on-disk tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 0
    F32,
    /// 1
    F16,
    /// 2
    Q4_0,
    /// 3
    Q4_1,
    /// 6
    Q5_0,
    /// 7
    Q5_1,
    /// 8
    Q8_0,
    /// 30
    Bf16,
    /// Any other tag (k-quants, i-quants, integer types): readable as bytes, not dequantized.
    Other(u32),
}

impl GgmlType {
    /// The type for an on-disk tag.
    pub fn from_tag(tag: u32) -> Self {
        match tag {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            30 => Self::Bf16,
            other => Self::Other(other),
        }
    }

    /// The on-disk tag.
    pub fn tag(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Bf16 => 30,
            Self::Other(tag) => tag,
        }
    }

    /// `(elements per block, bytes per block)`, `None` for a type this crate cannot size.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        Some(match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Other(_) => return None,
        })
    }

    /// Bytes taken by `n_elements` of this type, `None` when the type is unknown or
    /// `n_elements` is not a whole number of blocks.
    pub fn byte_size(self, n_elements: usize) -> Option<usize> {
        let (block, bytes) = self.block_layout()?;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(bytes)
    }

    /// llama.cpp's name for the type.
    pub fn name(self) -> String {
        match self {
            Self::F32 => "F32".into(),
            Self::F16 => "F16".into(),
            Self::Q4_0 => "Q4_0".into(),
            Self::Q4_1 => "Q4_1".into(),
            Self::Q5_0 => "Q5_0".into(),
            Self::Q5_1 => "Q5_1".into(),
            Self::Q8_0 => "Q8_0".into(),
            Self::Bf16 => "BF16".into(),
            Self::Other(tag) => format!("ggml type {tag}"),
        }
    }
}

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantizeError {
    /// The type has no dequantizer here.
    #[error("dequantizing {0} is not supported")]
    Unsupported(String),
    /// The element count is not a whole number of blocks.
    #[error("{n_elements} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        /// Elements asked for.
        n_elements: usize,
        /// Elements per block of the type.
        block: usize,
    },
    /// The buffer's length does not match the element count.
    #[error("expected {expected} bytes, got {actual}")]
    Length {
        /// Bytes that `n_elements` take.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
}

/// Dequantizes `n_elements` values of type `ty` from `bytes` (exactly their size) to f32.
pub fn dequantize(
    ty: GgmlType,
    bytes: &[u8],
    n_elements: usize,
) -> Result<Vec<f32>, DequantizeError> {
    let (block, block_bytes) = ty
        .block_layout()
        .ok_or_else(|| DequantizeError::Unsupported(ty.name()))?;
    if !n_elements.is_multiple_of(block) {
        return Err(DequantizeError::PartialBlock { n_elements, block });
    }
    let expected = (n_elements / block) * block_bytes;
    if bytes.len() != expected {
        return Err(DequantizeError::Length {
            expected,
            actual: bytes.len(),
        });
    }
    let mut out = Vec::with_capacity(n_elements);
    let blocks = bytes.chunks_exact(block_bytes);
    match ty {
        GgmlType::F32 => out.extend(blocks.map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        GgmlType::F16 => out.extend(blocks.map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::Bf16 => out.extend(blocks.map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::Q4_0 => {
            blocks.for_each(|b| q4(half_at(b, 0), -8.0 * half_at(b, 0), &b[2..18], &mut out))
        }
        GgmlType::Q4_1 => {
            blocks.for_each(|b| q4(half_at(b, 0), half_at(b, 2), &b[4..20], &mut out))
        }
        GgmlType::Q5_0 => blocks.for_each(|b| {
            q5(
                half_at(b, 0),
                -16.0 * half_at(b, 0),
                &b[2..6],
                &b[6..22],
                &mut out,
            )
        }),
        GgmlType::Q5_1 => {
            blocks.for_each(|b| q5(half_at(b, 0), half_at(b, 2), &b[4..8], &b[8..24], &mut out))
        }
        GgmlType::Q8_0 => blocks.for_each(|b| {
            let d = half_at(b, 0);
            out.extend(b[2..34].iter().map(|&q| f32::from(q as i8) * d));
        }),
        GgmlType::Other(_) => return Err(DequantizeError::Unsupported(ty.name())),
    }
    Ok(out)
}

/// The f16 at `at` in `b`, as f32.
fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// One 32-element block of 4-bit values: `q * d + m` (Q4_0 passes `m = -8 d`).
fn q4(d: f32, m: f32, qs: &[u8], out: &mut Vec<f32>) {
    out.extend(qs.iter().map(|&q| f32::from(q & 0x0f) * d + m));
    out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
}

/// One 32-element block of 5-bit values: `q * d + m` (Q5_0 passes `m = -16 d`).
fn q5(d: f32, m: f32, qh: &[u8], qs: &[u8], out: &mut Vec<f32>) {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let bit = |j: usize| ((high >> j) & 1) as u8;
    out.extend(
        qs.iter()
            .enumerate()
            .map(|(j, &q)| f32::from((q & 0x0f) | bit(j) << 4) * d + m),
    );
    out.extend(
        qs.iter()
            .enumerate()
            .map(|(j, &q)| f32::from((q >> 4) | bit(j + 16) << 4) * d + m),
    );
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    /// Packs 32 4-bit values into llama.cpp's order: element j < 16 in the low nibble of byte j,
    /// element j >= 16 in the high nibble of byte j - 16.
    fn pack_nibbles(q: &[u8; 32]) -> [u8; 16] {
        let mut qs = [0u8; 16];
        for j in 0..16 {
            qs[j] = (q[j] & 0x0f) | (q[j + 16] & 0x0f) << 4;
        }
        qs
    }

    fn ramp() -> [u8; 32] {
        let mut q = [0u8; 32];
        for (j, v) in q.iter_mut().enumerate() {
            *v = (j * 7 % 16) as u8;
        }
        q
    }

    #[test]
    fn q4_0_block_centres_nibbles_on_eight() {
        let q = ramp();
        let mut block = Vec::new();
        block.extend(h(0.5));
        block.extend(pack_nibbles(&q));
        let got = dequantize(GgmlType::Q4_0, &block, 32).unwrap();
        let want: Vec<f32> = q.iter().map(|&v| (f32::from(v) - 8.0) * 0.5).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn q4_1_block_scales_and_offsets_nibbles() {
        let q = ramp();
        let mut block = Vec::new();
        block.extend(h(0.25));
        block.extend(h(-1.0));
        block.extend(pack_nibbles(&q));
        let got = dequantize(GgmlType::Q4_1, &block, 32).unwrap();
        let want: Vec<f32> = q.iter().map(|&v| f32::from(v) * 0.25 - 1.0).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn q5_blocks_take_the_fifth_bit_from_qh() {
        let mut q = [0u8; 32];
        for (j, v) in q.iter_mut().enumerate() {
            *v = (j * 11 % 32) as u8;
        }
        let mut qh = 0u32;
        for (j, &v) in q.iter().enumerate() {
            qh |= u32::from(v >> 4) << j;
        }
        let mut b0 = Vec::new();
        b0.extend(h(2.0));
        b0.extend(qh.to_le_bytes());
        b0.extend(pack_nibbles(&q));
        let got = dequantize(GgmlType::Q5_0, &b0, 32).unwrap();
        let want: Vec<f32> = q.iter().map(|&v| (f32::from(v) - 16.0) * 2.0).collect();
        assert_eq!(got, want);

        let mut b1 = Vec::new();
        b1.extend(h(0.5));
        b1.extend(h(3.0));
        b1.extend(qh.to_le_bytes());
        b1.extend(pack_nibbles(&q));
        let got = dequantize(GgmlType::Q5_1, &b1, 32).unwrap();
        let want: Vec<f32> = q.iter().map(|&v| f32::from(v) * 0.5 + 3.0).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn q8_0_blocks_are_signed_bytes_times_scale() {
        let mut blocks = Vec::new();
        let mut want = Vec::new();
        for (d, base) in [(0.125f32, -16i32), (4.0, -128)] {
            blocks.extend(h(d));
            for j in 0..32 {
                let q = (base + j * 8).clamp(-128, 127) as i8;
                blocks.push(q as u8);
                want.push(f32::from(q) * d);
            }
        }
        assert_eq!(dequantize(GgmlType::Q8_0, &blocks, 64).unwrap(), want);
    }

    #[test]
    fn float_types_decode_little_endian() {
        let vals = [1.5f32, -2.25, 0.0, 65504.0];
        let f32_bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(dequantize(GgmlType::F32, &f32_bytes, 4).unwrap(), vals);
        let f16_bytes: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
        assert_eq!(dequantize(GgmlType::F16, &f16_bytes, 4).unwrap(), vals);
        let bf16_bytes: Vec<u8> = [1.5f32, -2.25, 0.0, 256.0]
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        assert_eq!(
            dequantize(GgmlType::Bf16, &bf16_bytes, 4).unwrap(),
            [1.5, -2.25, 0.0, 256.0]
        );
    }

    #[test]
    fn wrong_lengths_and_unknown_types_are_errors() {
        assert_eq!(
            dequantize(GgmlType::Q8_0, &[0; 34], 16),
            Err(DequantizeError::PartialBlock {
                n_elements: 16,
                block: 32
            })
        );
        assert_eq!(
            dequantize(GgmlType::Q8_0, &[0; 33], 32),
            Err(DequantizeError::Length {
                expected: 34,
                actual: 33
            })
        );
        assert!(matches!(
            dequantize(GgmlType::Other(14), &[0; 210], 256),
            Err(DequantizeError::Unsupported(_))
        ));
    }

    #[test]
    fn type_tags_round_trip_and_sizes_match_llama_cpp() {
        for tag in [0, 1, 2, 3, 6, 7, 8, 30, 14] {
            assert_eq!(GgmlType::from_tag(tag).tag(), tag);
        }
        assert_eq!(
            GgmlType::Q4_1.byte_size(576 * 576),
            Some(576 * 576 / 32 * 20)
        );
        assert_eq!(GgmlType::Q8_0.byte_size(31), None);
    }
}
