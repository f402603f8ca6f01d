//! The quantized products against dequantize-then-f32, and the SIMD kernels against the
//! scalar ones.

#![allow(clippy::unwrap_used)]

use half::f16;

use super::q8::Q8Rows;
use super::*;

/// SplitMix64: deterministic values without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random blocks of `ty` with scales of varied size (and an all-zero block now and then).
fn random_matrix(ty: QuantType, rows: usize, cols: usize, rng: &mut Rng) -> QMatrix {
    let mut data = Vec::new();
    for blk in 0..rows * cols / BLOCK {
        let scale = if blk % 7 == 3 {
            0.0
        } else {
            0.01 * (1.0 + 4.0 * rng.unit().abs())
        };
        data.extend(f16::from_f32(scale).to_le_bytes());
        match ty {
            QuantType::Q4_1 => {
                data.extend(f16::from_f32(-8.0 * scale + 0.01 * rng.unit()).to_le_bytes());
                data.extend((0..16).map(|_| rng.next() as u8));
            }
            // Every byte, -128 included.
            QuantType::Q8_0 => data.extend((0..32).map(|_| rng.next() as u8)),
        }
    }
    QMatrix::new(ty, rows, cols, data).unwrap()
}

fn random_acts(m: usize, k: usize, rng: &mut Rng) -> Vec<f32> {
    // Rows of different magnitudes, a few outliers, and an all-zero block in row 0.
    let mut a: Vec<f32> = (0..m * k)
        .map(|i| rng.unit() * (1.0 + (i / k) as f32) * if i % 97 == 5 { 20.0 } else { 1.0 })
        .collect();
    a[..BLOCK.min(k)].fill(0.0);
    a
}

fn f32_reference(w: &QMatrix, a: &[f32], m: usize) -> Vec<f32> {
    let (n, k) = (w.rows(), w.cols());
    let wf = w.dequantize();
    let mut out = vec![0.0; m * n];
    crate::linalg::matmul_nt(a, &wf, &mut out, m, k, n).unwrap();
    out
}

/// `|quantized - exact| <= sum_j |w_j| d_block(j) / 2` (each activation moves by at most half
/// its block's step) plus f32 rounding of sums of `k` terms.
fn check_against_reference(w: &QMatrix, a: &[f32], m: usize, got: &[f32]) {
    let (n, k) = (w.rows(), w.cols());
    let want = f32_reference(w, a, m);
    let wf = w.dequantize();
    let acts = Q8Rows::quantize(a, m, k);
    for i in 0..m {
        let d = acts.row(i).d;
        for r in 0..n {
            let wr = &wf[r * k..(r + 1) * k];
            let bound: f32 = wr
                .iter()
                .enumerate()
                .map(|(j, w)| w.abs() * d[j / BLOCK] / 2.0)
                .sum();
            let mag: f32 = wr.iter().zip(&a[i * k..]).map(|(w, x)| (w * x).abs()).sum();
            let tol = bound * 1.001 + mag * 1e-5 + 1e-6;
            let (g, e) = (got[i * n + r], want[i * n + r]);
            assert!(
                (g - e).abs() <= tol,
                "{:?} m={m} row {i} col {r}: {g} vs {e} (tolerance {tol})",
                w.ty()
            );
        }
    }
}

#[test]
fn quantized_matmul_matches_dequantized_f32_within_the_q8_rounding_bound() {
    let mut rng = Rng(1);
    for ty in [QuantType::Q4_1, QuantType::Q8_0] {
        for &(m, k, n) in &[(1, 32, 1), (1, 576, 300), (3, 96, 40), (8, 1536, 64)] {
            let w = random_matrix(ty, n, k, &mut rng);
            let a = random_acts(m, k, &mut rng);
            let mut out = vec![f32::NAN; m * n];
            w.matmul_nt(&a, &mut out, m).unwrap();
            check_against_reference(&w, &a, m, &out);
        }
    }
}

#[test]
fn quantized_matmul_equals_the_exact_dot_of_the_q8_activations() {
    // With the activations taken as their Q8 values, the integer path is exact up to f32
    // rounding: this catches a wrong nibble order or sign that the looser bound might hide.
    let mut rng = Rng(2);
    for ty in [QuantType::Q4_1, QuantType::Q8_0] {
        let (m, k, n) = (2, 256, 24);
        let w = random_matrix(ty, n, k, &mut rng);
        let a = random_acts(m, k, &mut rng);
        let acts = Q8Rows::quantize(&a, m, k);
        let aq: Vec<f32> = (0..m).flat_map(|i| acts.dequantize_row(i)).collect();
        let want = f32_reference(&w, &aq, m);
        let mut got = vec![0.0; m * n];
        w.matmul_nt(&a, &mut got, m).unwrap();
        for (g, e) in got.iter().zip(&want) {
            assert!(
                (g - e).abs() <= 1e-4 * (1.0 + e.abs()),
                "{ty:?}: {g} vs {e}"
            );
        }
    }
}

/// The SIMD kernels this CPU runs; prints a line for each one it does not.
fn simd_kernels() -> Vec<Kernel> {
    let all = [
        ("avx2", Kernel::avx2()),
        ("avxvnni", Kernel::avx_vnni()),
        ("avx512vnni", Kernel::avx512_vnni()),
    ];
    for (name, k) in &all {
        if k.is_none() {
            println!("SKIPPED: this CPU does not run the {name} kernel");
        }
    }
    all.into_iter().filter_map(|(_, k)| k).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn simd_kernels_give_the_scalar_kernels_bits() {
    let mut rng = Rng(3);
    let kernels = simd_kernels();
    for ty in [QuantType::Q4_1, QuantType::Q8_0] {
        // Rows of 1 to 7 blocks and the model's 18 and 48: every tail of the 4-group and
        // 2-blocks-per-vector loops.
        for &(m, k, n) in &[
            (1, 576, 203),
            (1, 1536, 17),
            (1, 32, 3),
            (1, 64, 5),
            (1, 96, 5),
            (1, 128, 4),
            (1, 160, 6),
            (1, 192, 3),
            (1, 224, 7),
            (2, 64, 9),
            (3, 96, 5),
            (5, 160, 4),
            (7, 1536, 33),
        ] {
            let w = random_matrix(ty, n, k, &mut rng);
            let a = random_acts(m, k, &mut rng);
            let mut scalar = vec![0.0; m * n];
            w.matmul_nt_with(&a, &mut scalar, m, Kernel::SCALAR)
                .unwrap();
            for &simd in &kernels {
                let mut fast = vec![f32::NAN; m * n];
                w.matmul_nt_with(&a, &mut fast, m, simd).unwrap();
                assert_eq!(
                    bits(&scalar),
                    bits(&fast),
                    "{} {ty:?} m={m} k={k} n={n}",
                    simd.name()
                );
            }
        }
    }
}

#[test]
fn simd_kernels_give_the_scalar_bits_at_the_extremes() {
    // Weights of -128 (Q8_0) and 15 (Q4_1), activations of +-127 everywhere: the largest
    // pair sums `maddubs` and `dpbusd` see.
    let kernels = simd_kernels();
    let k = 224;
    let a: Vec<f32> = (0..k)
        .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    for (ty, byte) in [(QuantType::Q8_0, 0x80u8), (QuantType::Q4_1, 0xff)] {
        let mut data = Vec::new();
        for _ in 0..k / BLOCK {
            data.extend(f16::from_f32(0.5).to_le_bytes());
            if ty == QuantType::Q4_1 {
                data.extend(f16::from_f32(-1.0).to_le_bytes());
                data.extend([byte; 16]);
            } else {
                data.extend([byte; 32]);
            }
        }
        let w = QMatrix::new(ty, 1, k, data).unwrap();
        let mut scalar = [0.0f32];
        w.matmul_nt_with(&a, &mut scalar, 1, Kernel::SCALAR)
            .unwrap();
        for &simd in &kernels {
            let mut fast = [f32::NAN];
            w.matmul_nt_with(&a, &mut fast, 1, simd).unwrap();
            assert_eq!(
                scalar[0].to_bits(),
                fast[0].to_bits(),
                "{} {ty:?}",
                simd.name()
            );
        }
    }
}

#[test]
fn detect_picks_a_kernel_this_cpu_runs() {
    let k = Kernel::detect();
    assert!(Kernel::available().contains(&k));
    assert_eq!(Kernel::by_name(k.name()), Some(k));
    assert_eq!(Kernel::detect(), k);
}

#[test]
fn head_product_keeps_activations_in_f32() {
    // Q8_0 against f32 activations: only f32 rounding separates it from the dequantized
    // product, far inside the Q8 activation bound the integer path needs.
    let mut rng = Rng(6);
    for &(m, k, n) in &[(1, 576, 301), (3, 96, 40), (1, 32, 1)] {
        let w = random_matrix(QuantType::Q8_0, n, k, &mut rng);
        let a = random_acts(m, k, &mut rng);
        let mut got = vec![f32::NAN; m * n];
        w.matmul_nt_head(&a, &mut got, m).unwrap();
        let want = f32_reference(&w, &a, m);
        let wf = w.dequantize();
        for (j, (g, e)) in got.iter().zip(&want).enumerate() {
            let (i, r) = (j / n, j % n);
            let mag: f32 = wf[r * k..(r + 1) * k]
                .iter()
                .zip(&a[i * k..(i + 1) * k])
                .map(|(w, x)| (w * x).abs())
                .sum();
            assert!((g - e).abs() <= 1e-5 * mag + 1e-7, "m={m} {j}: {g} vs {e}");
        }
        let mut scalar = vec![0.0; m * n];
        w.matmul_nt_head_with(&a, &mut scalar, m, Kernel::SCALAR)
            .unwrap();
        for simd in simd_kernels() {
            let mut fast = vec![f32::NAN; m * n];
            w.matmul_nt_head_with(&a, &mut fast, m, simd).unwrap();
            assert_eq!(
                bits(&scalar),
                bits(&fast),
                "{} m={m} k={k} n={n}",
                simd.name()
            );
        }
    }
}

#[test]
fn many_rows_take_the_f32_tiles_and_match_the_reference() {
    let mut rng = Rng(4);
    for ty in [QuantType::Q4_1, QuantType::Q8_0] {
        // Tiles of 448 rows at k = 576: 1000 rows are three tiles, the last one partial.
        let (m, k, n) = (F32_MIN_ROWS + 3, 576, 1000);
        let w = random_matrix(ty, n, k, &mut rng);
        let a = random_acts(m, k, &mut rng);
        let mut got = vec![f32::NAN; m * n];
        w.matmul_nt(&a, &mut got, m).unwrap();
        let want = f32_reference(&w, &a, m);
        for (g, e) in got.iter().zip(&want) {
            assert!(
                (g - e).abs() <= 1e-4 * (1.0 + e.abs()),
                "{ty:?}: {g} vs {e}"
            );
        }
    }
}

#[test]
fn activation_blocks_round_to_127_steps() {
    let mut a = vec![0.0f32; 64];
    a[0] = -2.54;
    a[1] = 1.0;
    a[40] = 0.5;
    let q = Q8Rows::quantize(&a, 1, 64);
    let super::q8::Q8Row { q: vals, d, s } = q.row(0);
    assert_eq!((vals[0], vals[1]), (-127, 50));
    assert!((d[0] - 0.02).abs() < 1e-7 && d[1] == 0.5 / 127.0);
    assert_eq!(vals[40], 127);
    assert!((s[0] - d[0] * -77.0).abs() < 1e-6);
}

#[test]
fn slicing_stacking_and_embedding_keep_the_blocks() {
    let mut rng = Rng(5);
    let w = random_matrix(QuantType::Q4_1, 6, 96, &mut rng);
    let full = w.dequantize();
    let rows = w.take_rows(2, 3).unwrap();
    assert_eq!(rows.dequantize(), full[2 * 96..5 * 96]);
    let cols = w.take_cols(32, 64).unwrap();
    let want: Vec<f32> = full.chunks(96).flat_map(|r| r[32..96].to_vec()).collect();
    assert_eq!(cols.dequantize(), want);
    assert!(w.take_cols(16, 32).is_none());
    let (top, bottom) = (w.take_rows(0, 2).unwrap(), w.take_rows(2, 4).unwrap());
    assert_eq!(QMatrix::stack(&[&top, &bottom]).as_ref(), Some(&w));
    let mixed = WeightMatrix::stack(vec![
        WeightMatrix::Quant(top),
        WeightMatrix::f32(bottom.dequantize(), 4, 96).unwrap(),
    ])
    .unwrap();
    assert_eq!(mixed, WeightMatrix::f32(full.clone(), 6, 96).unwrap());
    let sliced = WeightMatrix::Quant(w.clone()).take_cols(16, 32).unwrap();
    let want16: Vec<f32> = full.chunks(96).flat_map(|r| r[16..48].to_vec()).collect();
    assert_eq!(sliced, WeightMatrix::f32(want16, 6, 32).unwrap());
    let emb = WeightMatrix::Quant(w);
    let mut out = vec![0.0; 2 * 96];
    emb.embedding(&[5, 1], &mut out).unwrap();
    assert_eq!(out[..96], full[5 * 96..]);
    assert_eq!(out[96..], full[96..2 * 96]);
    assert!(emb.embedding(&[6], &mut out[..96]).is_err());
}

#[test]
fn bad_shapes_are_errors() {
    assert!(QMatrix::new(QuantType::Q8_0, 1, 31, vec![0; 34]).is_err());
    assert!(QMatrix::new(QuantType::Q8_0, 1, 32, vec![0; 33]).is_err());
    let w = QMatrix::new(QuantType::Q8_0, 2, 32, vec![0; 68]).unwrap();
    assert!(w.matmul_nt(&[0.0; 31], &mut [0.0; 2], 1).is_err());
    assert!(w.matmul_nt(&[0.0; 32], &mut [0.0; 3], 1).is_err());
}
