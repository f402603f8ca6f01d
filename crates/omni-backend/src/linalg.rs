//! Matrix products through the `gemm` crate.
//!
//! [`matmul_nt`] is the linear layer: `out[m, n] = a[m, k] @ w[n, k]^T` with `w` in Hugging Face
//! `[out_features, in_features]` layout, so weights are used as loaded, without a transpose.
//! [`gemm_strided`] is the general strided form that paged attention uses.

use crate::{Error, Result};

/// Products with at least this many multiply-adds run on the rayon pool; smaller ones stay on the
/// calling thread (thread start-up would cost more than it saves).
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// A read-only strided matrix view over a slice: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    /// Backing storage.
    pub data: &'a [f32],
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
    /// Row stride in elements.
    pub rs: usize,
    /// Column stride in elements.
    pub cs: usize,
}

/// A mutable strided matrix view; see [`MatRef`].
#[derive(Debug)]
pub struct MatMut<'a> {
    /// Backing storage.
    pub data: &'a mut [f32],
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
    /// Row stride in elements.
    pub rs: usize,
    /// Column stride in elements.
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows x cols` view (`rs = cols`, `cs = 1`).
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose, as a view (no copy).
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

impl<'a> MatMut<'a> {
    /// A row-major `rows x cols` view (`rs = cols`, `cs = 1`).
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }
}

/// Elements a strided view reaches: one past its last element.
fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

fn check_view(
    what: &'static str,
    len: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
) -> Result<()> {
    let need = span(rows, cols, rs, cs);
    if need > len {
        return Err(Error::Shape {
            what,
            expected: need,
            got: len,
        });
    }
    Ok(())
}

/// Runs `f` on a thread of the rayon pool (at once when called from one), so that the parallel
/// products inside it start from a pool thread: called from outside the pool, each product
/// would hand its work to the pool and wait to be woken, twice per product, which on a decode
/// step of a small model (a hundred products of tens of microseconds) costs milliseconds.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// How a product may use threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// On the rayon pool when the product is large enough.
    Auto,
    /// Always on the calling thread (for products issued from inside a rayon task).
    Single,
}

/// `dst = scale * lhs @ rhs`, or `dst += scale * lhs @ rhs` with `accumulate`.
pub fn gemm_strided(
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    scale: f32,
    accumulate: bool,
    threads: Threads,
) -> Result<()> {
    let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
    if lhs.rows != m || rhs.cols != n || rhs.rows != k {
        return Err(Error::Shape {
            what: "gemm operands (m x k) @ (k x n) -> (m x n)",
            expected: m * n,
            got: lhs.rows * rhs.cols,
        });
    }
    check_view("gemm dst", dst.data.len(), m, n, dst.rs, dst.cs)?;
    check_view("gemm lhs", lhs.data.len(), m, k, lhs.rs, lhs.cs)?;
    check_view("gemm rhs", rhs.data.len(), k, n, rhs.rs, rhs.cs)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst.data[i * dst.rs + j * dst.cs] = 0.0;
                }
            }
        }
        return Ok(());
    }
    let parallelism = match threads {
        Threads::Auto if m * n * k >= PARALLEL_MIN_FLOPS => {
            gemm::Parallelism::Rayon(rayon::current_num_threads())
        }
        _ => gemm::Parallelism::None,
    };
    let to_isize =
        |x: usize| isize::try_from(x).map_err(|_| Error::Metadata("stride overflow".into()));
    let (dst_rs, dst_cs) = (to_isize(dst.rs)?, to_isize(dst.cs)?);
    let (lhs_rs, lhs_cs) = (to_isize(lhs.rs)?, to_isize(lhs.cs)?);
    let (rhs_rs, rhs_cs) = (to_isize(rhs.rs)?, to_isize(rhs.cs)?);
    // SAFETY: every element the kernel touches, (i, j) at ptr + i*rs + j*cs for i < rows and
    // j < cols, lies inside its slice (checked by `check_view` above). `dst` is a unique borrow,
    // so it cannot alias `lhs` or `rhs`, which are only read. T = f32 is a supported type.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            dst_cs,
            dst_rs,
            accumulate,
            lhs.data.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.data.as_ptr(),
            rhs_cs,
            rhs_rs,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

/// The linear layer without bias: `out[m, n] = a[m, k] @ w[n, k]^T`, all row-major.
pub fn matmul_nt(
    a: &[f32],
    w: &[f32],
    out: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    crate::check_len("matmul lhs", a.len(), m * k)?;
    crate::check_len("matmul weight", w.len(), n * k)?;
    crate::check_len("matmul out", out.len(), m * n)?;
    gemm_strided(
        MatMut::row_major(out, m, n),
        MatRef::row_major(a, m, k),
        MatRef::row_major(w, n, k).t(),
        1.0,
        false,
        Threads::Auto,
    )
}

/// Splits f32 values into two bf16 terms, `hi = bf16(v)` (round to nearest even) and
/// `lo = bf16(v - hi)`: `hi + lo` keeps 16 or more of v's 24 significand bits, and `lo` is 0
/// wherever v is a bf16 value (every weight of a bf16 checkpoint). The GPU's MoE router takes
/// them to compute f32-accurate logits with bf16 tensor-core products.
pub fn split_bf16(v: &[f32]) -> (Vec<half::bf16>, Vec<half::bf16>) {
    v.iter()
        .map(|&x| {
            let hi = half::bf16::from_f32(x);
            (hi, half::bf16::from_f32(x - hi.to_f32()))
        })
        .unzip()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn naive(a: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * w[j * k + p]).sum();
            }
        }
        out
    }

    #[test]
    fn matmul_nt_matches_naive_product_small_and_parallel() {
        for &(m, k, n) in &[(1, 3, 2), (5, 7, 3), (70, 64, 90)] {
            let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 5) % 11) as f32 - 5.0).collect();
            let mut out = vec![0.0; m * n];
            matmul_nt(&a, &w, &mut out, m, k, n).unwrap();
            assert_eq!(out, naive(&a, &w, m, k, n));
        }
    }

    #[test]
    fn matmul_rejects_short_buffers() {
        let mut out = [0.0; 4];
        assert!(matmul_nt(&[1.0; 3], &[1.0; 4], &mut out, 2, 2, 2).is_err());
    }

    #[test]
    fn gemm_strided_accumulates_and_scales() {
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [1.0, 0.0, 0.0, 1.0];
        let mut d = [1.0; 4];
        gemm_strided(
            MatMut::row_major(&mut d, 2, 2),
            MatRef::row_major(&a, 2, 2),
            MatRef::row_major(&b, 2, 2),
            2.0,
            true,
            Threads::Single,
        )
        .unwrap();
        assert_eq!(d, [3.0, 5.0, 7.0, 9.0]);
    }
    #[test]
    fn split_bf16_keeps_sixteen_bits_and_is_exact_on_bf16_values() {
        let v: Vec<f32> = (0..4096)
            .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 3.0f32.powi(i % 9 - 4))
            .collect();
        let (hi, lo) = split_bf16(&v);
        let mut inexact_hi = 0;
        for ((&x, h), l) in v.iter().zip(&hi).zip(&lo) {
            let (x64, h64, l64) = (x as f64, h.to_f32() as f64, l.to_f32() as f64);
            assert!((x64 - h64).abs() <= x64.abs() * 2f64.powi(-8), "{x}");
            assert!((x64 - h64 - l64).abs() <= x64.abs() * 2f64.powi(-16), "{x}");
            inexact_hi += usize::from(x64 != h64);
        }
        assert!(
            inexact_hi > 3000,
            "the values are mostly not bf16 ones: {inexact_hi}"
        );
        // bf16 values (a bf16 checkpoint's weights) split into themselves and zeros.
        let exact: Vec<f32> = hi.iter().map(|h| h.to_f32()).collect();
        let (hi2, lo2) = split_bf16(&exact);
        assert_eq!(hi2, hi);
        assert!(lo2.iter().all(|l| l.to_f32() == 0.0));
    }
}
