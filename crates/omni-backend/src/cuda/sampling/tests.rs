//! Tests of device sampling: greedy against the CPU argmax, seeded reproducibility, the filtered
//! distribution, path agreement and edge rows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::cuda::tests::ctx_or_skip;

#[test]
fn params_pack_into_eight_words_in_field_order() {
    let p = DeviceSamplingParams {
        temperature: 0.5,
        top_k: -1,
        top_p: 0.9,
        min_p: 0.0,
        seed: 0x1122_3344_5566_7788,
        offset: 42,
    };
    assert_eq!(std::mem::size_of::<DeviceSamplingParams>(), 32);
    assert_eq!(
        p.words(),
        [
            0.5f32.to_bits(),
            u32::MAX,
            0.9f32.to_bits(),
            0,
            0x5566_7788,
            0x1122_3344,
            42,
            0
        ]
    );
}

/// Deterministic pseudo-random f32 in [0, 1).
fn rng(state: &mut u64) -> f64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*state >> 11) as f64) / (1u64 << 53) as f64
}

/// LLM-like logits: a Gaussian-ish bulk plus a few large ones.
fn llm_row(vocab: usize, seed: u64) -> Vec<f32> {
    let mut s = seed ^ 0x5eed;
    (0..vocab)
        .map(|_| {
            let g: f64 = (0..4).map(|_| rng(&mut s)).sum::<f64>() - 2.0;
            let spike = if rng(&mut s) < 2e-4 { 12.0 } else { 0.0 };
            (3.0 * g + spike) as f32
        })
        .collect()
}

fn cpu_argmax(row: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in row.iter().enumerate() {
        if l > f32::NEG_INFINITY && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// The exactly filtered and renormalized distribution, in f64: the CPU sampler's
/// `candidates` (temperature, min-p, top-k, top-p, in that order), with this kernel's tie
/// rule (entries equal to a cut-off value are kept). Also returns the smallest relative
/// distance of a top-p / min-p decision to its boundary, so tests can insist on
/// well-conditioned inputs.
fn reference(row: &[f32], p: &DeviceSamplingParams) -> (Vec<f64>, f64) {
    let max = row
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / f64::from(p.temperature);
    let mut w: Vec<f64> = row
        .iter()
        .map(|&l| {
            if l > f32::NEG_INFINITY {
                (f64::from(l - max) * inv_t).exp()
            } else {
                0.0
            }
        })
        .collect();
    let mut margin = f64::INFINITY;
    if p.min_p > 0.0 {
        let t = f64::from(p.min_p.min(1.0));
        for x in &mut w {
            if *x > 0.0 {
                margin = margin.min(((*x - t) / t).abs());
            }
            if *x < t {
                *x = 0.0;
            }
        }
    }
    let mut order: Vec<usize> = (0..row.len()).filter(|&i| w[i] > 0.0).collect();
    order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    if p.top_k > 0 && (p.top_k as usize) < order.len() {
        let cut = w[order[p.top_k as usize - 1]];
        for &i in &order[p.top_k as usize..] {
            if w[i] < cut {
                w[i] = 0.0;
            }
        }
        order.retain(|&i| w[i] > 0.0);
    }
    if p.top_p < 1.0 {
        let total: f64 = order.iter().map(|&i| w[i]).sum();
        let target = f64::from(p.top_p.max(0.0)) * total;
        let mut cum = 0.0;
        let mut cut = None;
        for &i in &order {
            let before = cum;
            cum += w[i];
            if cut.is_none() {
                margin = margin.min((cum - target).abs() / total);
                if before > 0.0 {
                    margin = margin.min((before - target).abs() / total);
                }
                if cum >= target {
                    cut = Some(w[i]);
                }
            }
        }
        if let Some(c) = cut {
            for x in &mut w {
                if *x < c {
                    *x = 0.0;
                }
            }
        }
    }
    let total: f64 = w.iter().sum();
    (w.iter().map(|x| x / total).collect(), margin)
}

/// Whether `token` survives the filters of `p` (tie-inclusive reference).
fn kept(row: &[f32], p: &DeviceSamplingParams, token: u32) -> bool {
    reference(row, p).0[token as usize] > 0.0
}

fn sample(
    cx: &CudaContext,
    logits: &[f32],
    params: &[DeviceSamplingParams],
    vocab: usize,
    flags: i32,
) -> Vec<Option<u32>> {
    let d = cx.stream().clone_htod(logits).unwrap();
    let mut out = cx.stream().alloc_zeros::<i32>(params.len()).unwrap();
    cx.sample_rows_f32_flags(&d, params, vocab, &mut out, flags)
        .unwrap()
}

fn filtered(temperature: f32, top_k: i32, top_p: f32, min_p: f32) -> DeviceSamplingParams {
    DeviceSamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: 7,
        offset: 0,
    }
}

#[test]
fn greedy_matches_cpu_argmax() {
    let Some(cx) = ctx_or_skip("greedy_matches_cpu_argmax") else {
        return;
    };
    for &vocab in &[1usize, 5, 1000, 151_936] {
        let rows = 6;
        let mut logits: Vec<f32> = (0..rows)
            .flat_map(|r| llm_row(vocab, 100 + r as u64))
            .collect();
        // Row 1: a tie for the max (lowest index wins); row 2: NaN and +-inf noise.
        if vocab > 3 {
            let r1 = &mut logits[vocab..2 * vocab];
            let mx = r1.iter().copied().fold(f32::NEG_INFINITY, f32::max) + 1.0;
            r1[vocab - 1] = mx;
            r1[vocab / 2] = mx;
            let r2 = &mut logits[2 * vocab..3 * vocab];
            r2[0] = f32::NAN;
            r2[1] = f32::NEG_INFINITY;
        }
        // Row 3: nothing to sample; row 4: everything NaN but one.
        logits[3 * vocab..4 * vocab].fill(f32::NEG_INFINITY);
        logits[4 * vocab..5 * vocab].fill(f32::NAN);
        logits[4 * vocab + vocab / 3] = -5.0;
        let mut params = vec![DeviceSamplingParams::greedy(); rows];
        // Greedy ignores the filters and the seed.
        params[5] = DeviceSamplingParams {
            temperature: 0.0,
            top_k: 3,
            top_p: 0.1,
            min_p: 0.5,
            seed: 99,
            offset: 3,
        };
        let got = sample(&cx, &logits, &params, vocab, 0);
        let want: Vec<Option<u32>> = logits.chunks(vocab).map(cpu_argmax).collect();
        println!("sampling greedy vocab={vocab}: {got:?}");
        assert_eq!(got, want, "vocab {vocab}");
        assert_eq!(got[3], None);
    }
}

#[test]
fn seeded_rows_are_reproducible_and_offsets_vary() {
    let Some(cx) = ctx_or_skip("seeded_rows_are_reproducible_and_offsets_vary") else {
        return;
    };
    let vocab = 32_000;
    let row = llm_row(vocab, 5);
    let base = DeviceSamplingParams {
        temperature: 1.5,
        top_k: 0,
        top_p: 0.95,
        min_p: 0.0,
        seed: 1234,
        offset: 0,
    };
    // 64 offsets of one seed, then the same 64 again in reverse batch order.
    let params: Vec<_> = (0..64u64)
        .chain((0..64u64).rev())
        .map(|o| DeviceSamplingParams { offset: o, ..base })
        .collect();
    let logits: Vec<f32> = (0..params.len()).flat_map(|_| row.clone()).collect();
    let a = sample(&cx, &logits, &params, vocab, 0);
    let b = sample(&cx, &logits, &params, vocab, 0);
    assert_eq!(a, b, "same inputs, same tokens");
    for i in 0..64 {
        assert_eq!(a[i], a[127 - i], "offset {i} depends on its batch position");
    }
    let distinct: std::collections::HashSet<_> = a[..64].iter().collect();
    println!(
        "sampling seeded: {} distinct tokens over 64 offsets",
        distinct.len()
    );
    assert!(distinct.len() > 16, "offsets must draw differently: {a:?}");
    // Another seed gives another sequence.
    let other: Vec<_> = params
        .iter()
        .map(|p| DeviceSamplingParams { seed: 4321, ..*p })
        .collect();
    let c = sample(&cx, &logits, &other, vocab, 0);
    assert_ne!(a, c);
    for (t, p) in a.iter().zip(&params) {
        assert!(kept(&row, p, t.unwrap()));
    }
}

/// Logits whose temperature-1 softmax is proportional to `(i + 1.3)^-1.1`, shuffled.
fn small_logits() -> Vec<f32> {
    let perm = [5usize, 12, 0, 9, 3, 14, 7, 1, 10, 15, 2, 8, 13, 4, 11, 6];
    let mut l = vec![0f32; 16];
    for (rank, &i) in perm.iter().enumerate() {
        l[i] = (-1.1 * (rank as f64 + 1.3).ln()) as f32 + 2.0;
    }
    l
}

fn combos() -> Vec<DeviceSamplingParams> {
    vec![
        filtered(1.0, 0, 1.0, 0.0),
        filtered(0.6, 0, 1.0, 0.0),
        filtered(1.7, 0, 1.0, 0.0),
        filtered(1.0, 5, 1.0, 0.0),
        filtered(0.8, 1, 1.0, 0.0),
        filtered(1.0, 0, 0.7, 0.0),
        filtered(1.3, 0, 0.9, 0.0),
        filtered(1.0, 0, 1.0, 0.14),
        filtered(2.0, 0, 1.0, 0.3),
        filtered(1.0, 10, 0.8, 0.0),
        filtered(1.2, 12, 0.9, 0.06),
        filtered(0.9, 0, 0.75, 0.1),
        filtered(1.0, 3, 0.0, 0.0),
    ]
}

#[test]
fn reference_inputs_are_well_conditioned() {
    // Runs everywhere: the distribution test's boundaries are far from the decision points.
    let l = small_logits();
    for p in combos() {
        let (probs, margin) = reference(&l, &p);
        assert!(margin > 2e-3, "{p:?}: margin {margin}");
        assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }
}

#[test]
fn draws_follow_the_filtered_distribution() {
    let Some(cx) = ctx_or_skip("draws_follow_the_filtered_distribution") else {
        return;
    };
    let vocab = 16;
    let row = small_logits();
    let draws = 20_000usize;
    for p in combos() {
        let (probs, _) = reference(&row, &p);
        let params: Vec<_> = (0..draws as u64)
            .map(|o| DeviceSamplingParams { offset: o, ..p })
            .collect();
        let logits: Vec<f32> = (0..draws).flat_map(|_| row.iter().copied()).collect();
        for flags in [0, FLAG_FORCE_GLOBAL] {
            let got = sample(&cx, &logits, &params, vocab, flags);
            let mut counts = [0usize; 16];
            for t in &got {
                counts[t.expect("a token") as usize] += 1;
            }
            let mut chi2 = 0.0;
            let mut df = 0i32;
            for (i, (&c, &q)) in counts.iter().zip(&probs).enumerate() {
                if q == 0.0 {
                    assert_eq!(c, 0, "{p:?}: filtered token {i} sampled {c} times");
                } else {
                    let e = q * draws as f64;
                    chi2 += (c as f64 - e).powi(2) / e;
                    df += 1;
                }
            }
            let df = f64::from((df - 1).max(1));
            // ~p < 1e-5 for these degrees of freedom.
            let bound = df + 6.0 * (2.0 * df).sqrt() + 8.0;
            println!(
                "sampling distribution {p:?} flags={flags}: chi2 {chi2:.1} (df {df}, bound {bound:.1})"
            );
            assert!(chi2 < bound, "{p:?} flags {flags}: chi2 {chi2} >= {bound}");
        }
    }
}

/// Rows that exercise every path: peaked (shared memory), flat with top-p (global search),
/// top-k above 1024 (no bound), ties at the cut-offs, NaN / -inf entries.
fn mixed_batch(vocab: usize) -> (Vec<f32>, Vec<DeviceSamplingParams>) {
    let mut logits = Vec::new();
    let mut params = Vec::new();
    let cases = [
        filtered(0.7, 50, 0.9, 0.0),
        filtered(1.0, 20, 1.0, 0.0),
        filtered(1.0, 0, 0.95, 0.0),
        filtered(1.0, 0, 0.5, 0.02),
        filtered(0.8, 2000, 0.99, 0.0),
        filtered(1.0, 1, 1.0, 0.0),
        filtered(1.0, 0, 1.0, 0.05),
        filtered(1.0, 0, 1.0, 0.0),
    ];
    for (r, p) in cases.iter().enumerate() {
        for flat in [false, true] {
            let mut row = llm_row(vocab, 1000 + r as u64);
            if flat {
                for x in &mut row {
                    *x *= 0.05;
                }
            }
            // Ties: repeat some values, sprinkle NaN / -inf.
            for j in (0..vocab).step_by(97) {
                row[j] = row[(j * 7 + 3) % vocab];
            }
            if vocab > 10 {
                row[1] = f32::NAN;
                row[2] = f32::NEG_INFINITY;
            }
            logits.extend_from_slice(&row);
            for o in 0..3u64 {
                if o > 0 {
                    logits.extend_from_slice(&row);
                }
                params.push(DeviceSamplingParams {
                    seed: 77 + r as u64,
                    offset: o,
                    ..*p
                });
            }
        }
    }
    (logits, params)
}

#[test]
fn every_path_picks_the_same_kept_token() {
    let Some(cx) = ctx_or_skip("every_path_picks_the_same_kept_token") else {
        return;
    };
    for &vocab in &[16usize, 1000, 151_936] {
        let (logits, params) = mixed_batch(vocab);
        let base = sample(&cx, &logits, &params, vocab, 0);
        for flags in [
            FLAG_FORCE_GLOBAL,
            FLAG_NO_BOUNDS,
            FLAG_FORCE_GLOBAL | FLAG_NO_BOUNDS,
        ] {
            let other = sample(&cx, &logits, &params, vocab, flags);
            assert_eq!(
                base, other,
                "vocab {vocab}: flags {flags} changed the tokens"
            );
        }
        for ((row, p), t) in logits.chunks(vocab).zip(&params).zip(&base) {
            let t = t.expect("a token");
            assert!(
                kept(row, p, t),
                "vocab {vocab} {p:?}: token {t} was filtered out"
            );
        }
        println!(
            "sampling paths agree on {} rows of vocab {vocab}",
            params.len()
        );
    }
}

#[test]
fn edge_rows_keep_ties_and_handle_inf_and_nan() {
    let Some(cx) = ctx_or_skip("edge_rows_keep_ties_and_handle_inf_and_nan") else {
        return;
    };
    let inf = f32::INFINITY;
    let f = filtered;
    let cases: Vec<(Vec<f32>, DeviceSamplingParams, Vec<i64>)> = vec![
        // Ties at the cut-off are all kept.
        (vec![1.5; 50], f(1.0, 3, 1.0, 0.0), (0..50).collect()),
        (vec![1.5; 50], f(1.0, 0, 0.5, 0.0), (0..50).collect()),
        (
            [0.0, -0.0].repeat(10),
            f(1.0, 1, 1.0, 0.0),
            (0..20).collect(),
        ),
        // +inf logits share all the mass.
        (
            vec![1.0, inf, 3.0, inf, -2.0],
            f(1.0, 0, 1.0, 0.0),
            vec![1, 3],
        ),
        (
            vec![1.0, inf, 3.0, inf, -2.0],
            f(1.0, 1, 0.9, 0.1),
            vec![1, 3],
        ),
        (vec![0.3], f(1.0, 0, 0.9, 0.1), vec![0]),
        // min_p > 1 and top_p <= 0 keep the most likely value; NaN switches a filter off.
        (
            vec![0.1, 2.0, 1.9, -1.0, 2.0],
            f(1.0, 0, 1.0, 5.0),
            vec![1, 4],
        ),
        (
            vec![0.1, 2.0, 1.9, -1.0, 2.0],
            f(1.0, 0, -1.0, 0.0),
            vec![1, 4],
        ),
        (
            vec![0.1, 2.0, 1.9, -1.0, 2.0],
            f(1.0, -5, f32::NAN, f32::NAN),
            (0..5).collect(),
        ),
        // NaN or tiny temperature is greedy.
        (
            vec![0.1, 2.0, 1.9, -1.0, 2.0],
            f(f32::NAN, 0, 1.0, 0.0),
            vec![1],
        ),
        (
            vec![0.1, 2.0, 1.9, -1.0, 2.0],
            f(1e-6, 0, 1.0, 0.0),
            vec![1],
        ),
        (
            vec![f32::NAN, f32::NEG_INFINITY, 4.0, f32::NAN],
            f(1.0, 2, 0.9, 0.0),
            vec![2],
        ),
        (
            vec![f32::NAN, f32::NEG_INFINITY, f32::NAN],
            f(1.0, 2, 0.9, 0.0),
            vec![-1],
        ),
    ];
    for (row, p, allowed) in cases {
        let n = 200;
        let params: Vec<_> = (0..n as u64)
            .map(|o| DeviceSamplingParams { offset: o, ..p })
            .collect();
        let logits: Vec<f32> = (0..n).flat_map(|_| row.iter().copied()).collect();
        let base = sample(&cx, &logits, &params, row.len(), 0);
        let mut seen = std::collections::BTreeSet::new();
        for flags in [0, FLAG_FORCE_GLOBAL, FLAG_NO_BOUNDS] {
            let got = sample(&cx, &logits, &params, row.len(), flags);
            assert_eq!(got, base, "{row:?} {p:?}: flags {flags} changed the tokens");
            seen.extend(got.iter().map(|t| t.map_or(-1, i64::from)));
        }
        println!("sampling edge {row:?} {p:?}: drew {seen:?}");
        assert!(
            seen.iter().all(|t| allowed.contains(t)),
            "{row:?} {p:?}: {seen:?}"
        );
        if allowed.len() <= 2 {
            assert_eq!(seen.len(), allowed.len(), "{row:?} {p:?}: {seen:?}");
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let Some(cx) = ctx_or_skip("sampling bad_shapes_are_errors") else {
        return;
    };
    let d = cx.stream().clone_htod(&[0f32; 10]).unwrap();
    let mut out = cx.stream().alloc_zeros::<i32>(2).unwrap();
    let p = [DeviceSamplingParams::greedy(); 2];
    assert!(matches!(
        cx.sample_rows_f32(&d, &p, 4, &mut out),
        Err(CudaError::Shape(_))
    ));
    assert!(matches!(
        cx.sample_rows_f32(&d, &p[..1], 10, &mut out),
        Err(CudaError::Shape(_))
    ));
    assert_eq!(cx.sample_rows_f32(&d, &p, 5, &mut out).unwrap().len(), 2);
}

#[test]
fn sampling_timing_64_rows_151936() {
    let Some(cx) = ctx_or_skip("sampling_timing_64_rows_151936") else {
        return;
    };
    let (rows, vocab) = (64usize, 151_936usize);
    let logits: Vec<f32> = (0..rows)
        .flat_map(|r| llm_row(vocab, 7000 + r as u64))
        .collect();
    let flat: Vec<f32> = logits.iter().map(|x| x * 0.05).collect();
    let d = cx.stream().clone_htod(&logits).unwrap();
    let dflat = cx.stream().clone_htod(&flat).unwrap();
    let mut out = cx.stream().alloc_zeros::<i32>(rows).unwrap();
    let cases = [
        ("greedy", DeviceSamplingParams::greedy(), false),
        ("temperature 0.8", filtered(0.8, 0, 1.0, 0.0), false),
        ("min_p 0.05", filtered(1.0, 0, 1.0, 0.05), false),
        (
            "top_k 50 top_p 0.9 T 0.7",
            filtered(0.7, 50, 0.9, 0.0),
            false,
        ),
        ("top_k 20", filtered(1.0, 20, 1.0, 0.0), false),
        ("top_p 0.95", filtered(1.0, 0, 0.95, 0.0), false),
        ("top_k 4096", filtered(1.0, 4096, 1.0, 0.0), false),
        (
            "flat top_p 0.95 (global search)",
            filtered(1.0, 0, 0.95, 0.0),
            true,
        ),
    ];
    for (name, p, use_flat) in cases {
        let params: Vec<_> = (0..rows as u64)
            .map(|o| DeviceSamplingParams { offset: o, ..p })
            .collect();
        let src = if use_flat { &dflat } else { &d };
        cx.sample_rows_f32(src, &params, vocab, &mut out).unwrap();
        let iters = 20;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            cx.sample_rows_f32(src, &params, vocab, &mut out).unwrap();
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
        println!("sampling {rows}x{vocab} {name}: {us:.0} us per call (upload + kernel + sync)");
    }
}
