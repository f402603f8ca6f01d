//! Linear layers over weights kept in ggml's quantized blocks (Q4_1, Q8_0), never upcast.
//!
//! A [`QMatrix`] holds a `[rows, cols]` weight (Hugging Face `[out, in]` layout) as the GGUF
//! file stores it: each row is `cols / 32` blocks, little-endian, `d`/`m` IEEE halves:
//!
//! | type | bytes/block | layout | value of element `j` |
//! |---|---|---|---|
//! | Q4_1 | 20 | `d`, `m`, `qs[16]` | `nibble(j) * d + m` (`j < 16`: low nibble of `qs[j]`, else high nibble of `qs[j - 16]`) |
//! | Q8_0 | 34 | `d`, `qs: [i8; 32]` | `qs[j] * d` |
//!
//! [`QMatrix::matmul_nt`] is `out[m, n] = a[m, k] @ w[n, k]^T`, two ways:
//! - few rows (decode): each row of `a` is quantized to Q8 blocks ([`q8::Q8Rows`]: 32 values,
//!   an f32 scale `d = max|x| / 127`, and `s = d * sum(q)` for Q4_1's offset), then every
//!   (weight row, activation row) pair is a sum over blocks of integer dot products
//!   (`d_w d_a sum(q_w q_a)`, plus `m_w s_a` for Q4_1), with AVX-512 VNNI, AVX-VNNI or AVX2
//!   when the CPU has them ([`vnni`], [`avx2`]: [`Kernel::detect`] picks once per process) and
//!   a portable scalar kernel that gives the same bits otherwise. Weight rows are
//!   split over the rayon pool. This reads the weight in its quantized size (Q4_1 is 5 bits per
//!   value: a sixth of f32), which is what bounds batch-1 decode.
//! - the output head ([`QMatrix::matmul_nt_head`], Q8_0): the same, but against the f32
//!   activations ([`head`]): the logits are where a rounding flips tokens.
//! - many rows (prefill, `m >= F32_MIN_ROWS`): tiles of weight rows are dequantized to f32 in a
//!   scratch buffer of about a megabyte and multiplied by the f32 GEMM ([`crate::linalg`]); the
//!   dequantization is `n k` work against the product's `m n k`. No f32 copy of the weight stays
//!   resident.
//!
//! ```
//! use omni_backend::quant::{QMatrix, QuantType};
//! // One Q8_0 row of 32 values: d = 0.5, q = 2 everywhere -> every weight is 1.0.
//! let mut block = half::f16::from_f32(0.5).to_le_bytes().to_vec();
//! block.extend([2u8; 32]);
//! let w = QMatrix::new(QuantType::Q8_0, 1, 32, block).unwrap();
//! let a = [1.0f32; 32];
//! let mut out = [0.0f32];
//! w.matmul_nt(&a, &mut out, 1).unwrap();
//! assert_eq!(out, [32.0]);
//! ```

#[cfg(target_arch = "x86_64")]
pub mod avx2;
pub mod head;
pub mod q8;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
pub mod vnni;
mod weight;

use half::f16;
use rayon::prelude::*;

use crate::linalg::{MatMut, MatRef, Threads, gemm_strided};
use crate::{Error, Result, check_len};
use q8::Q8Rows;
pub use weight::WeightMatrix;

/// Values per block of every type here.
pub const BLOCK: usize = 32;

/// Products with at least this many rows of `a` go through f32 tiles and the GEMM; fewer take
/// the integer kernels (measured on the 2-core development VM: see `bench/results/cpu-quant-*`).
pub const F32_MIN_ROWS: usize = 32;

/// f32 elements of one dequantized tile of weight rows on the GEMM path (1 MiB).
const TILE_ELEMS: usize = 1 << 18;

/// Multiply-adds below which a product stays on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 18;

/// A quantized block type with kernels here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// 4-bit with a scale and a minimum per 32 values (ggml type 3).
    Q4_1,
    /// 8-bit with a scale per 32 values (ggml type 8).
    Q8_0,
}

impl QuantType {
    /// Bytes of one 32-value block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// llama.cpp's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
        }
    }
}

/// A `[rows, cols]` weight in quantized blocks, row-major (each row a whole number of blocks).
#[derive(Clone, PartialEq, Eq)]
pub struct QMatrix {
    ty: QuantType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// The f16 at `at` in `b`, as f32.
#[inline]
pub(crate) fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

impl QMatrix {
    /// Wraps `data`: `rows` rows of `cols / 32` blocks of `ty`.
    pub fn new(ty: QuantType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(Error::Shape {
                what: "quantized row length (multiple of 32)",
                expected: cols.next_multiple_of(BLOCK),
                got: cols,
            });
        }
        check_len(
            "quantized weight bytes",
            data.len(),
            rows * cols / BLOCK * ty.block_bytes(),
        )?;
        Ok(Self {
            ty,
            rows,
            cols,
            data,
        })
    }

    /// The block type.
    pub fn ty(&self) -> QuantType {
        self.ty
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The blocks, row after row.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.ty.block_bytes()
    }

    /// The blocks of row `r`.
    fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `start..start + len` as their own matrix.
    pub fn take_rows(&self, start: usize, len: usize) -> Result<Self> {
        if start + len > self.rows {
            return Err(Error::Shape {
                what: "quantized row range",
                expected: self.rows,
                got: start + len,
            });
        }
        let rb = self.row_bytes();
        Self::new(
            self.ty,
            len,
            self.cols,
            self.data[start * rb..(start + len) * rb].to_vec(),
        )
    }

    /// Columns `start..start + len` (both multiples of 32) as their own matrix; `None` when the
    /// range does not fall on block edges.
    pub fn take_cols(&self, start: usize, len: usize) -> Option<Self> {
        if !start.is_multiple_of(BLOCK) || !len.is_multiple_of(BLOCK) || start + len > self.cols {
            return None;
        }
        let bb = self.ty.block_bytes();
        let (b0, nb) = (start / BLOCK * bb, len / BLOCK * bb);
        let data = (0..self.rows)
            .flat_map(|r| self.row(r)[b0..b0 + nb].iter().copied())
            .collect();
        Self::new(self.ty, self.rows, len, data).ok()
    }

    /// Matrices of one type and width stacked row-wise; `None` when types or widths differ.
    pub fn stack(parts: &[&Self]) -> Option<Self> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.ty != first.ty || p.cols != first.cols)
        {
            return None;
        }
        let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        let rows = parts.iter().map(|p| p.rows).sum();
        Self::new(first.ty, rows, first.cols, data).ok()
    }

    /// Dequantizes rows `start..start + out.len() / cols` into `out`.
    pub fn dequantize_rows(&self, start: usize, out: &mut [f32]) -> Result<()> {
        let n = out.len() / self.cols.max(1);
        if n * self.cols != out.len() || start + n > self.rows {
            return Err(Error::Shape {
                what: "dequantized rows",
                expected: (self.rows - start.min(self.rows)) * self.cols,
                got: out.len(),
            });
        }
        let bb = self.ty.block_bytes();
        let blocks = self.data[start * self.row_bytes()..(start + n) * self.row_bytes()]
            .chunks_exact(bb)
            .zip(out.chunks_exact_mut(BLOCK));
        match self.ty {
            QuantType::Q4_1 => blocks.for_each(|(b, o)| {
                let (d, m) = (half_at(b, 0), half_at(b, 2));
                for (j, &q) in b[4..20].iter().enumerate() {
                    o[j] = f32::from(q & 0x0f) * d + m;
                    o[j + 16] = f32::from(q >> 4) * d + m;
                }
            }),
            QuantType::Q8_0 => blocks.for_each(|(b, o)| {
                let d = half_at(b, 0);
                for (o, &q) in o.iter_mut().zip(&b[2..34]) {
                    *o = f32::from(q as i8) * d;
                }
            }),
        }
        Ok(())
    }

    /// The whole matrix in f32 (tests and reference paths).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        // The length is rows * cols by construction.
        let _ = self.dequantize_rows(0, &mut out);
        out
    }

    /// The linear layer: `out[m, n] = a[m, k] @ self[n, k]^T` (`k = cols`, `n = rows`), by
    /// the integer kernels below [`F32_MIN_ROWS`] rows of `a`, by f32 tiles from there on.
    pub fn matmul_nt(&self, a: &[f32], out: &mut [f32], m: usize) -> Result<()> {
        if m >= F32_MIN_ROWS {
            self.matmul_nt_f32_tiles(a, out, m)
        } else {
            self.matmul_nt_with(a, out, m, Kernel::detect())
        }
    }

    /// [`QMatrix::matmul_nt`] by the integer path whatever `m`, with a chosen kernel.
    pub fn matmul_nt_with(
        &self,
        a: &[f32],
        out: &mut [f32],
        m: usize,
        kernel: Kernel,
    ) -> Result<()> {
        let (n, k) = (self.rows, self.cols);
        check_len("quantized matmul lhs", a.len(), m * k)?;
        check_len("quantized matmul out", out.len(), m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let acts = Q8Rows::quantize(a, m, k);
        let rb = self.row_bytes();
        self.for_row_chunks(m, out, |rows, t| {
            let w = &self.data[rows.start * rb..rows.end * rb];
            kernel.fill(self.ty, w, rb, &acts, t);
        });
        Ok(())
    }

    /// The output head (the logits): Q8_0 weights against the activations kept in f32
    /// ([`head`]), since the logits pick the tokens and the Q8 rounding of the final hidden
    /// state can flip a near-tie; a head of another type, or of [`F32_MIN_ROWS`] rows or more,
    /// goes as [`QMatrix::matmul_nt`].
    pub fn matmul_nt_head(&self, a: &[f32], out: &mut [f32], m: usize) -> Result<()> {
        self.matmul_nt_head_with(a, out, m, Kernel::detect())
    }

    /// [`QMatrix::matmul_nt_head`] with a chosen kernel.
    pub fn matmul_nt_head_with(
        &self,
        a: &[f32],
        out: &mut [f32],
        m: usize,
        kernel: Kernel,
    ) -> Result<()> {
        if self.ty != QuantType::Q8_0 || m >= F32_MIN_ROWS {
            return self.matmul_nt(a, out, m);
        }
        let (n, k) = (self.rows, self.cols);
        check_len("quantized matmul lhs", a.len(), m * k)?;
        check_len("quantized matmul out", out.len(), m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let rb = self.row_bytes();
        self.for_row_chunks(m, out, |rows, t| {
            let w = &self.data[rows.start * rb..rows.end * rb];
            head::fill_q8_0(kernel, w, rb, a, k, t);
        });
        Ok(())
    }

    /// Splits the weight rows over the rayon pool (for products large enough): `fill(rows, t)`
    /// fills `t`, `[rows.len(), m]`, out transposed; the pieces land in `out` (`[m, rows]`).
    fn for_row_chunks(
        &self,
        m: usize,
        out: &mut [f32],
        fill: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
    ) {
        let n = self.rows;
        let parallel = m * n * self.cols >= PARALLEL_MIN_MACS;
        let chunk = chunk_rows(n, parallel);
        let piece = |(c, t): (usize, &mut [f32])| fill(c * chunk..c * chunk + t.len() / m, t);
        let mut transposed = Vec::new();
        let t: &mut [f32] = if m == 1 {
            out
        } else {
            transposed.resize(n * m, 0.0);
            &mut transposed
        };
        if parallel {
            // The spinning pool, not rayon's: ~120 of these products make a decode step, tens
            // of µs apart, and rayon's threads sleep between them (`crate::spin_pool`).
            let (len, step) = (t.len(), chunk * m);
            let base = t.as_mut_ptr() as usize;
            crate::spin_pool::SpinPool::global().run(len.div_ceil(step), &|c| {
                let start = c * step;
                let part = step.min(len - start);
                // SAFETY: task c takes elements start .. start + part of `t`, disjoint from
                // every other task's and inside it; `t` is borrowed until `run` returns, after
                // every task.
                let chunk_t =
                    unsafe { std::slice::from_raw_parts_mut((base as *mut f32).add(start), part) };
                piece((c, chunk_t));
            });
        } else {
            t.chunks_mut(chunk * m).enumerate().for_each(piece);
        }
        if m > 1 {
            for (r, vals) in transposed.chunks_exact(m).enumerate() {
                for (i, &v) in vals.iter().enumerate() {
                    out[i * n + r] = v;
                }
            }
        }
    }

    /// [`QMatrix::matmul_nt`] by the GEMM path whatever `m`: tiles of weight rows
    /// dequantized into a scratch buffer, each multiplied into its columns of `out`.
    pub fn matmul_nt_f32_tiles(&self, a: &[f32], out: &mut [f32], m: usize) -> Result<()> {
        let (n, k) = (self.rows, self.cols);
        check_len("quantized matmul lhs", a.len(), m * k)?;
        check_len("quantized matmul out", out.len(), m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let tile_rows = (TILE_ELEMS / k)
            .clamp(16, n.max(16))
            .next_multiple_of(16)
            .min(n);
        let mut scratch = vec![0.0f32; tile_rows * k];
        let mut r0 = 0;
        while r0 < n {
            let rows = tile_rows.min(n - r0);
            let w = &mut scratch[..rows * k];
            w.par_chunks_mut(k * 16)
                .enumerate()
                .try_for_each(|(i, chunk)| self.dequantize_rows(r0 + i * 16, chunk))?;
            let dst = MatMut {
                data: &mut out[r0..],
                rows: m,
                cols: rows,
                rs: n,
                cs: 1,
            };
            gemm_strided(
                dst,
                MatRef::row_major(a, m, k),
                MatRef::row_major(w, rows, k).t(),
                1.0,
                false,
                Threads::Auto,
            )?;
            r0 += rows;
        }
        Ok(())
    }
}

/// Tasks per pool thread of a parallel product.
const TASKS_PER_THREAD: usize = 4;

/// Weight rows per task: about [`TASKS_PER_THREAD`] tasks per thread of the pool that runs
/// them ([`crate::spin_pool::SpinPool::global`]), at least 16 rows.
fn chunk_rows(n: usize, parallel: bool) -> usize {
    if !parallel {
        return n.max(1);
    }
    n.div_ceil(TASKS_PER_THREAD * crate::spin_pool::SpinPool::global().threads())
        .max(16)
}

/// Which integer dot-product kernel runs: the portable one, or a SIMD one this CPU has (only
/// [`Kernel::detect`] and the constructors that check the CPU make one). All give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel(KernelKind);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KernelKind {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Kernel {
    /// Portable Rust: the same bits as every SIMD kernel.
    pub const SCALAR: Self = Self(KernelKind::Scalar);

    /// The fastest kernel this CPU runs (AVX-512 VNNI, then AVX-VNNI, then AVX2), chosen on the
    /// first call and kept.
    pub fn detect() -> Self {
        static CHOSEN: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            Self::avx512_vnni()
                .or_else(Self::avx_vnni)
                .or_else(Self::avx2)
                .unwrap_or(Self::SCALAR)
        })
    }

    /// Every kernel this CPU runs, the portable one first.
    pub fn available() -> Vec<Self> {
        [
            Some(Self::SCALAR),
            Self::avx2(),
            Self::avx_vnni(),
            Self::avx512_vnni(),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// The kernel of this [`Kernel::name`], when this CPU runs it.
    pub fn by_name(name: &str) -> Option<Self> {
        Self::available().into_iter().find(|k| k.name() == name)
    }

    /// AVX2 + FMA + F16C, when this CPU has them (checked at run time).
    pub fn avx2() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            return Some(Self(KernelKind::Avx2));
        }
        None
    }

    /// AVX-VNNI (256-bit `dpbusd`) on top of [`Kernel::avx2`]'s features, when this CPU has it.
    pub fn avx_vnni() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if vnni::avx::available() {
            return Some(Self(KernelKind::AvxVnni));
        }
        None
    }

    /// AVX-512 F/BW/VL/VNNI on top of [`Kernel::avx2`]'s features, when this CPU has them.
    pub fn avx512_vnni() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if vnni::avx512::available() {
            return Some(Self(KernelKind::Avx512Vnni));
        }
        None
    }

    /// `scalar`, `avx2`, `avxvnni` or `avx512vnni`.
    pub fn name(self) -> &'static str {
        match self.0 {
            KernelKind::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            KernelKind::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            KernelKind::AvxVnni => "avxvnni",
            #[cfg(target_arch = "x86_64")]
            KernelKind::Avx512Vnni => "avx512vnni",
        }
    }

    /// Fills `t` (`[rows, m]`: out transposed) with the products of the weight rows `w` (of
    /// type `ty`, `rb` bytes each) and every row of `acts`.
    pub fn fill(self, ty: QuantType, w: &[u8], rb: usize, acts: &Q8Rows, t: &mut [f32]) {
        let m = acts.rows();
        match self.0 {
            KernelKind::Scalar => {
                let groups = if m == 1 { q8::SINGLE_ROW_GROUPS } else { 1 };
                for (wr, vals) in w.chunks_exact(rb).zip(t.chunks_exact_mut(m)) {
                    for (i, v) in vals.iter_mut().enumerate() {
                        *v = match ty {
                            QuantType::Q4_1 => q8::dot_q4_1(wr, acts.row(i), groups),
                            QuantType::Q8_0 => q8::dot_q8_0(wr, acts.row(i), groups),
                        };
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `KernelKind::Avx2` is only made by `Kernel::avx2`, after
            // `avx2::available()` saw AVX2, FMA and F16C on this CPU. The kernel bound-checks
            // the row lengths against the activation rows before reading.
            KernelKind::Avx2 => unsafe { avx2::fill(ty, w, rb, acts, t) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `KernelKind::AvxVnni` is only made by `Kernel::avx_vnni`, after
            // `vnni::avx::available()` saw AVX2, FMA, F16C and AVX-VNNI on this CPU; the kernel
            // bound-checks the row lengths as the AVX2 one.
            KernelKind::AvxVnni => unsafe { vnni::avx::fill(ty, w, rb, acts, t) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `KernelKind::Avx512Vnni` is only made by `Kernel::avx512_vnni`, after
            // `vnni::avx512::available()` saw AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI on this
            // CPU; the kernel bound-checks the row lengths as the AVX2 one.
            KernelKind::Avx512Vnni => unsafe { vnni::avx512::fill(ty, w, rb, acts, t) },
        }
    }
}
