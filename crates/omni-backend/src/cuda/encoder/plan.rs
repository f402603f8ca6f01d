//! Host-side geometry of the encoder launchers, kept free of device types so that the CPU
//! emulators in `tests.rs` run exactly what the launchers run: the cuBLAS strided-batched GEMMs
//! of segment attention ([`segment_attention_plan`]), and the weight reorders of the audio
//! convolution stem ([`conv3x3_weight_gemm`], [`freq_major_columns`]).

/// One cuBLAS `gemm_strided_batched_ex` call in cuBLAS's own column-major terms:
/// `C_b = alpha * op(A_b) op(B_b)` for `b < batch`, `op(A_b)` `m x k`, `op(B_b)` `k x n`, `C_b`
/// `m x n` at `ldc`; operand `X_b` starts `x_off + b * stride_x` elements into its buffer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StridedGemm {
    /// `op(A) = A^T` (A stored `k x m`) instead of `A` (stored `m x k`).
    pub trans_a: bool,
    /// `op(B) = B^T` (B stored `n x k`) instead of `B` (stored `k x n`).
    pub trans_b: bool,
    /// Rows of `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// First element of `A_0`.
    pub a_off: usize,
    /// Leading dimension of `A`.
    pub lda: usize,
    /// Elements from `A_b` to `A_{b+1}`.
    pub stride_a: usize,
    /// First element of `B_0`.
    pub b_off: usize,
    /// Leading dimension of `B`.
    pub ldb: usize,
    /// Elements from `B_b` to `B_{b+1}`.
    pub stride_b: usize,
    /// First element of `C_0`.
    pub c_off: usize,
    /// Leading dimension of `C`.
    pub ldc: usize,
    /// Elements from `C_b` to `C_{b+1}`.
    pub stride_c: usize,
    /// Batch count.
    pub batch: usize,
    /// Scale of the product.
    pub alpha: f32,
}

impl StridedGemm {
    /// One past the last element of `A`, `B` and `C` the call touches (for the length checks).
    pub fn extents(&self) -> [usize; 3] {
        let last = |off: usize, stride: usize, ld: usize, rows: usize, cols: usize| {
            if self.batch == 0 || rows == 0 || cols == 0 {
                0
            } else {
                off + (self.batch - 1) * stride + (cols - 1) * ld + rows
            }
        };
        let (ar, ac) = if self.trans_a {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (br, bc) = if self.trans_b {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        [
            last(self.a_off, self.stride_a, self.lda, ar, ac),
            last(self.b_off, self.stride_b, self.ldb, br, bc),
            last(self.c_off, self.stride_c, self.ldc, self.m, self.n),
        ]
    }
}

/// One block of query rows of one segment: scores `S = Q K^T * scale` (f32, `[heads, rows,
/// keys]` in the scratch), a softmax per row into bf16 `P` (same layout), then `O = P V` into
/// the output rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnStep {
    /// The scores GEMM: A = the key part of `qkv`, B = the query part, C = the f32 scratch.
    pub qk: StridedGemm,
    /// Softmax rows (`heads * rows`).
    pub softmax_rows: usize,
    /// Keys per row.
    pub keys: usize,
    /// The value GEMM: A = the value part of `qkv`, B = the bf16 probabilities, C = `out`.
    pub pv: StridedGemm,
}

/// The shape of [`segment_attention_plan`]'s input: `qkv` rows `[q | k | v]` of `heads *
/// head_dim` each (heads outermost), `out` rows of `heads * head_dim`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SegmentAttnShape {
    /// Heads (as many key/value heads as query heads).
    pub heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Softmax scale (`1 / sqrt(head_dim)`).
    pub scale: f32,
}

/// Largest scratch (elements of the f32 scores, and of the bf16 probabilities) that
/// [`segment_attention_scratch_len`] asks for: 1 GiB of f32. A 1280x720 image (one segment of
/// 3520 patches, 16 heads: 198M) fits in one step; longer segments run in blocks of query rows.
pub const MAX_SCRATCH_ELEMS: usize = 256 << 20;

/// Scratch elements for the segments of `cu_seqlens`: every head's `L x L` scores of the longest
/// segment, capped at [`MAX_SCRATCH_ELEMS`] but never below one query row of every head.
pub fn segment_attention_scratch_len(cu_seqlens: &[usize], heads: usize) -> usize {
    let l = cu_seqlens
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]))
        .max()
        .unwrap_or(0);
    (heads * l * l).min(MAX_SCRATCH_ELEMS).max(heads * l)
}

/// The steps of bidirectional attention within each segment `cu_seqlens[s]..cu_seqlens[s+1]`,
/// with scratch for `scratch` elements: per segment of `L` tokens, query blocks of
/// `R = min(L, scratch / (heads * L))` rows, each three launches over all heads at once.
///
/// In cuBLAS's column-major view a row-major `[rows, ld]` matrix is its transpose, so for head
/// `h` (operands of successive heads `head_dim` apart): `S_h^T (L x R, ld L) = op_T(K_h) Q_h^T`
/// with `K_h` stored `head_dim x L` and `Q_h` stored `head_dim x R` (both at ld `3 * dim`), then
/// `O_h^T (head_dim x R, ld dim) = V_h^T P_h^T` with `V_h` stored `head_dim x L` (ld `3 * dim`)
/// and `P_h` stored `L x R` (ld `L`).
pub fn segment_attention_plan(
    cu_seqlens: &[usize],
    shape: SegmentAttnShape,
    scratch: usize,
) -> Vec<AttnStep> {
    let SegmentAttnShape {
        heads,
        head_dim: hd,
        scale,
    } = shape;
    let dim = heads * hd;
    let row = 3 * dim;
    let mut steps = Vec::new();
    for w in cu_seqlens.windows(2) {
        let (s0, l) = (w[0], w[1].saturating_sub(w[0]));
        if l == 0 || heads == 0 {
            continue;
        }
        let block = (scratch / (heads * l)).clamp(1, l);
        let mut q0 = 0;
        while q0 < l {
            let r = block.min(l - q0);
            let qk = StridedGemm {
                trans_a: true,
                trans_b: false,
                m: l,
                n: r,
                k: hd,
                a_off: s0 * row + dim,
                lda: row,
                stride_a: hd,
                b_off: (s0 + q0) * row,
                ldb: row,
                stride_b: hd,
                c_off: 0,
                ldc: l,
                stride_c: r * l,
                batch: heads,
                alpha: scale,
            };
            let pv = StridedGemm {
                trans_a: false,
                trans_b: false,
                m: hd,
                n: r,
                k: l,
                a_off: s0 * row + 2 * dim,
                lda: row,
                stride_a: hd,
                b_off: 0,
                ldb: l,
                stride_b: r * l,
                c_off: (s0 + q0) * dim,
                ldc: dim,
                stride_c: hd,
                batch: heads,
                alpha: 1.0,
            };
            steps.push(AttnStep {
                qk,
                softmax_rows: heads * r,
                keys: l,
                pv,
            });
            q0 += r;
        }
    }
    steps
}

/// A 3x3 Conv2d weight `[out, in, 3, 3]` (PyTorch) as the GEMM matrix `[out, 9 * in]` whose
/// column `(ky * 3 + kx) * in + c` meets `enc_im2col_s2`'s column of tap `(ky, kx)`, channel `c`.
pub fn conv3x3_weight_gemm(w: &[f32], out: usize, inp: usize) -> Vec<f32> {
    let mut g = vec![0.0; out * inp * 9];
    for o in 0..out {
        for c in 0..inp {
            for tap in 0..9 {
                g[(o * 9 + tap) * inp + c] = w[(o * inp + c) * 9 + tap];
            }
        }
    }
    g
}

/// A linear weight `[rows, channels * freq]` over channel-major features (column `c * freq +
/// f`) with its columns reordered to frequency-major (column `f * channels + c`): the audio
/// stem's `conv_out`, fed the `[time, freq, channels]` rows of the device convolutions.
pub fn freq_major_columns(w: &[f32], rows: usize, channels: usize, freq: usize) -> Vec<f32> {
    let cols = channels * freq;
    let mut g = vec![0.0; rows * cols];
    for r in 0..rows {
        for c in 0..channels {
            for f in 0..freq {
                g[r * cols + f * channels + c] = w[r * cols + c * freq + f];
            }
        }
    }
    g
}
