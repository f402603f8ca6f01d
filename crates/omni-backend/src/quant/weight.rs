//! [`WeightMatrix`]: a linear layer's weight as loaded, f32 or quantized blocks.

use std::borrow::Cow;

use super::QMatrix;
use crate::{Error, Result, check_len};

/// A `[rows, cols]` weight (`[out_features, in_features]`): f32 values, or ggml blocks kept as
/// stored ([`QMatrix`]).
#[derive(Debug, Clone, PartialEq)]
pub enum WeightMatrix {
    /// Row-major f32.
    F32 {
        /// `rows * cols` values.
        data: Vec<f32>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// Quantized blocks.
    Quant(QMatrix),
}

impl WeightMatrix {
    /// An f32 weight; `data` must hold `rows * cols` values.
    pub fn f32(data: Vec<f32>, rows: usize, cols: usize) -> Result<Self> {
        check_len("weight", data.len(), rows * cols)?;
        Ok(Self::F32 { data, rows, cols })
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        match self {
            Self::F32 { rows, .. } => *rows,
            Self::Quant(q) => q.rows(),
        }
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        match self {
            Self::F32 { cols, .. } => *cols,
            Self::Quant(q) => q.cols(),
        }
    }

    /// Bytes the weight takes in memory.
    pub fn resident_bytes(&self) -> usize {
        match self {
            Self::F32 { data, .. } => data.len() * 4,
            Self::Quant(q) => q.bytes().len(),
        }
    }

    /// The values in f32 (a copy for quantized blocks).
    pub fn to_f32(&self) -> Cow<'_, [f32]> {
        match self {
            Self::F32 { data, .. } => Cow::Borrowed(data),
            Self::Quant(q) => Cow::Owned(q.dequantize()),
        }
    }

    /// Rows `start..start + len`.
    pub fn take_rows(self, start: usize, len: usize) -> Result<Self> {
        let (rows, cols) = (self.rows(), self.cols());
        if start + len > rows {
            return Err(Error::Shape {
                what: "weight row range",
                expected: rows,
                got: start + len,
            });
        }
        if start == 0 && len == rows {
            return Ok(self);
        }
        match self {
            Self::F32 { data, .. } => {
                Self::f32(data[start * cols..(start + len) * cols].to_vec(), len, cols)
            }
            Self::Quant(q) => Ok(Self::Quant(q.take_rows(start, len)?)),
        }
    }

    /// Columns `start..start + len`; quantized blocks stay blocks when the range falls on
    /// block edges, and become f32 otherwise.
    pub fn take_cols(self, start: usize, len: usize) -> Result<Self> {
        let (rows, cols) = (self.rows(), self.cols());
        if start + len > cols {
            return Err(Error::Shape {
                what: "weight column range",
                expected: cols,
                got: start + len,
            });
        }
        if start == 0 && len == cols {
            return Ok(self);
        }
        if let Self::Quant(q) = &self
            && let Some(part) = q.take_cols(start, len)
        {
            return Ok(Self::Quant(part));
        }
        let data = self
            .to_f32()
            .chunks_exact(cols.max(1))
            .flat_map(|r| r[start..start + len].iter().copied())
            .collect();
        Self::f32(data, rows, len)
    }

    /// Weights of one width stacked row-wise: quantized when all are blocks of one type, f32
    /// otherwise.
    pub fn stack(mut parts: Vec<Self>) -> Result<Self> {
        let cols = parts.first().map_or(0, Self::cols);
        if let Some(bad) = parts.iter().find(|p| p.cols() != cols) {
            return Err(Error::Shape {
                what: "stacked weight width",
                expected: cols,
                got: bad.cols(),
            });
        }
        if parts.len() == 1
            && let Some(only) = parts.pop()
        {
            return Ok(only);
        }
        let quant: Option<Vec<&QMatrix>> = parts
            .iter()
            .map(|p| match p {
                Self::Quant(q) => Some(q),
                Self::F32 { .. } => None,
            })
            .collect();
        if let Some(stacked) = quant.and_then(|q| QMatrix::stack(&q)) {
            return Ok(Self::Quant(stacked));
        }
        let rows = parts.iter().map(Self::rows).sum();
        let data = parts.iter().flat_map(|p| p.to_f32().into_owned()).collect();
        Self::f32(data, rows, cols)
    }

    /// The linear layer: `out[m, rows] = a[m, cols] @ self^T`.
    pub fn matmul_nt(&self, a: &[f32], out: &mut [f32], m: usize) -> Result<()> {
        match self {
            Self::F32 { data, rows, cols } => {
                crate::linalg::matmul_nt(a, data, out, m, *cols, *rows)
            }
            Self::Quant(q) => q.matmul_nt(a, out, m),
        }
    }

    /// The output head: as [`WeightMatrix::matmul_nt`], with Q8_0 blocks multiplied against the
    /// f32 activations ([`QMatrix::matmul_nt_head`]).
    pub fn matmul_nt_head(&self, a: &[f32], out: &mut [f32], m: usize) -> Result<()> {
        match self {
            Self::F32 { .. } => self.matmul_nt(a, out, m),
            Self::Quant(q) => q.matmul_nt_head(a, out, m),
        }
    }

    /// Gathers rows `ids` into `out` (`[ids.len(), cols]`): the embedding lookup.
    pub fn embedding(&self, ids: &[u32], out: &mut [f32]) -> Result<()> {
        let (rows, cols) = (self.rows(), self.cols());
        match self {
            Self::F32 { data, .. } => crate::ops::embedding(data, cols, ids, out),
            Self::Quant(q) => {
                check_len("embedding out", out.len(), ids.len() * cols)?;
                for (&id, o) in ids.iter().zip(out.chunks_exact_mut(cols.max(1))) {
                    if id as usize >= rows {
                        return Err(Error::Shape {
                            what: "embedding token id (vocab size)",
                            expected: rows,
                            got: id as usize,
                        });
                    }
                    q.dequantize_rows(id as usize, o)?;
                }
                Ok(())
            }
        }
    }
}
