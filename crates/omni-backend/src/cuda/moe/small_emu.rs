//! CPU tests of the small-batch MoE kernels (`small.rs`): host emulators that run each kernel's
//! loops (blocks in any order, warps, lanes, the order of every f32 sum, the router's last-block
//! counter, the expert de-duplication) against plain f64 references, over edge shapes (one
//! token, eight, experts shared by tokens, ids outside the experts, more than eight pairs on one
//! expert, fewer experts than warps, ragged columns). The inputs and references here serve the
//! GPU tests (`small_tests.rs`) too.

// The emulators index like the kernels they mirror (thread, warp and row loops).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::needless_range_loop)]

use super::MoeShape;
use super::small::*;
use super::tests::{cpu_moe_rows, cpu_topk, rand_bf16_scaled};
use crate::cuda::tests::{rand_bf16_f32, rel_err};
use crate::cuda::{CudaContext, bf16, gemv_lane_chunks};

// ---- the host emulators ---------------------------------------------------------------------

/// `for (o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(.., v, o)`: lane 0's value.
fn warp_sum(mut v: [f32; 32]) -> f32 {
    let mut o = 16;
    while o > 0 {
        let prev = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = prev[l] + prev[l ^ o];
        }
        o /= 2;
    }
    v[0]
}

/// `gv_block_sum` over a block of `per_thread.len()` threads.
fn block_sum(per_thread: &[f32]) -> f32 {
    let warps: Vec<f32> = per_thread
        .chunks(32)
        .map(|w| {
            let mut v = [0f32; 32];
            v[..w.len()].copy_from_slice(w);
            warp_sum(v)
        })
        .collect();
    let mut v = [0f32; 32];
    v[..warps.len()].copy_from_slice(&warps);
    warp_sum(v)
}

/// `gv_dot8`: the 8 products of one chunk summed in order (contracted to fma, as nvcc does).
fn dot8(x: &[f32], w: &[f32]) -> f32 {
    x.iter().zip(w).fold(0f32, |s, (a, b)| a.mul_add(*b, s))
}

/// One warp's dot product of two rows of `k` (a multiple of 8) in the GEMV order: each lane
/// sums its 8-wide chunks in `gemv_lane_chunks` order, then the warp reduction.
pub(super) fn warp_dot(x: &[f32], w: &[f32]) -> f32 {
    let mut lanes = [0f32; 32];
    for (lane, acc) in lanes.iter_mut().enumerate() {
        for c in gemv_lane_chunks(lane, x.len()) {
            *acc += dot8(&x[c * 8..c * 8 + 8], &w[c * 8..c * 8 + 8]);
        }
    }
    warp_sum(lanes)
}

pub(super) fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// The softmax of `moe_topk_warp` (both forms): expert i in lane i % 32, each lane's max and
/// sum over its experts in ascending order, the sum's xor tree.
pub(super) fn emu_warp_softmax(row: &[f32]) -> Vec<f32> {
    let mut probs = row.to_vec();
    let mut mx = [f32::NEG_INFINITY; 32];
    for (i, &v) in probs.iter().enumerate() {
        mx[i % 32] = mx[i % 32].max(v);
    }
    let m = mx.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = [0f32; 32];
    for (i, p) in probs.iter_mut().enumerate() {
        let e = if m == f32::NEG_INFINITY {
            0.0
        } else {
            (*p - m).exp()
        };
        *p = e;
        sum[i % 32] += e;
    }
    let total = warp_sum(sum);
    let inv = if m == f32::NEG_INFINITY {
        0.0
    } else {
        1.0 / total
    };
    probs.iter_mut().for_each(|p| *p *= inv);
    probs
}

/// `moe_topk_warp` on one row of logits.
pub(super) fn emu_topk_warp(row: &[f32], k: usize, renorm: bool) -> (Vec<i32>, Vec<f32>) {
    let e_n = row.len();
    let mut probs = emu_warp_softmax(row);
    let (mut ids, mut ws, mut sel) = (Vec::new(), Vec::new(), 0f32);
    for _ in 0..k {
        let mut best = [(-1f32, e_n); 32];
        for (i, &v) in probs.iter().enumerate() {
            if v > best[i % 32].0 {
                best[i % 32] = (v, i);
            }
        }
        let mut o = 16;
        while o > 0 {
            let prev = best;
            for (l, b) in best.iter_mut().enumerate() {
                let (ov, oi) = prev[l ^ o];
                if ov > b.0 || (ov == b.0 && oi < b.1) {
                    *b = (ov, oi);
                }
            }
            o /= 2;
        }
        let (bv, bi) = best[0];
        sel += bv;
        ids.push(bi as i32);
        ws.push(bv);
        if bi < e_n {
            probs[bi] = -2.0;
        }
    }
    if renorm {
        ws.iter_mut().for_each(|w| *w /= sel);
    }
    (ids, ws)
}

/// What `moe_route` writes.
pub(super) struct Routed {
    pub(super) h: Vec<f32>,
    pub(super) logits: Vec<f32>,
    pub(super) ids: Vec<i32>,
    pub(super) ws: Vec<f32>,
    counters: Vec<i32>,
    /// The residual after the call (the sum with `delta`, when given).
    pub(super) residual: Vec<f32>,
}

/// `moe_route`, its blocks run in the order `order` (a permutation of the grid); with `delta`
/// the rows normalised are residual + delta, written back by each tile's last block (asserted:
/// only after every block of the tile read the rows).
#[allow(clippy::too_many_arguments)]
pub(super) fn emu_route(
    s: MoeShape,
    residual: &[f32],
    delta: Option<&[f32]>,
    norm_w: &[f32],
    router: &[f32],
    renorm: bool,
    eps: f32,
    order: &[usize],
) -> Routed {
    let (t_n, h, e_n, k) = (s.tokens, s.hidden, s.num_experts, s.top_k);
    let l = route_launch(t_n, h, e_n);
    assert!(l.smem <= 47 * 1024 && l.threads <= 512);
    let (threads, warps, groups) = (l.threads as usize, l.threads as usize / 32, l.groups);
    assert_eq!(order.len(), l.tiles * groups);
    let mut out = Routed {
        h: vec![f32::NAN; t_n * h],
        logits: vec![f32::NAN; t_n * e_n],
        ids: vec![-7; t_n * k],
        ws: vec![f32::NAN; t_n * k],
        counters: vec![0; t_n],
        residual: residual.to_vec(),
    };
    let mut h_writes = vec![0u8; t_n * h];
    let mut reads = vec![0usize; l.tiles];
    for &b in order {
        let (tile, g) = (b / groups, b % groups);
        let rows = l.rt.min(t_n - tile * l.rt);
        for r in 0..rows {
            let t = tile * l.rt + r;
            let x: Vec<f32> = (0..h)
                .map(|i| {
                    let v = out.residual[t * h + i];
                    delta.map_or(v, |d| v + d[t * h + i])
                })
                .collect();
            let ss: Vec<f32> = (0..threads)
                .map(|tid| {
                    let mut ss = 0f32;
                    let mut i = tid * 4;
                    while i < h {
                        let v = &x[i..i + 4];
                        ss += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
                        i += threads * 4;
                    }
                    ss
                })
                .collect();
            let inv = 1.0 / (block_sum(&ss) / h as f32 + eps).sqrt();
            let xs: Vec<f32> = (0..h).map(|i| norm_w[i] * (x[i] * inv)).collect();
            if g == 0 {
                for i in 0..h {
                    out.h[t * h + i] = bf(xs[i]);
                    h_writes[t * h + i] += 1;
                }
            }
            for w in 0..warps {
                let e = g * warps + w;
                if e >= e_n {
                    continue;
                }
                let wr = &router[e * h..(e + 1) * h];
                let mut lanes = [0f32; 32];
                for (lane, acc) in lanes.iter_mut().enumerate() {
                    for c in (lane..h / 4).step_by(32) {
                        for j in 0..4 {
                            *acc = xs[4 * c + j].mul_add(wr[4 * c + j], *acc);
                        }
                    }
                }
                out.logits[t * e_n + e] = warp_sum(lanes);
            }
        }
        reads[tile] += 1;
        out.counters[tile] += 1;
        if out.counters[tile] == groups as i32 {
            out.counters[tile] = 0;
            assert_eq!(
                reads[tile], groups,
                "the residual is written after every read"
            );
            for r in 0..rows {
                let t = tile * l.rt + r;
                if let Some(d) = delta {
                    for i in 0..h {
                        out.residual[t * h + i] += d[t * h + i];
                    }
                }
                let row = &out.logits[t * e_n..(t + 1) * e_n];
                assert!(row.iter().all(|v| !v.is_nan()), "routed before every logit");
                let (ids, ws) = emu_topk_warp(row, k, renorm);
                out.ids[t * k..(t + 1) * k].copy_from_slice(&ids);
                out.ws[t * k..(t + 1) * k].copy_from_slice(&ws);
            }
        }
    }
    assert!(h_writes.iter().all(|&c| c == 1), "h written once");
    out
}

/// `moe_small_gate_up`: act (NaN where not written) and the write count per element.
pub(super) fn emu_gate_up(s: MoeShape, x: &[f32], w13: &[f32], ids: &[i32]) -> (Vec<f32>, Vec<u8>) {
    let (h, i_n, k) = (s.hidden, s.inter, s.top_k);
    let pairs = s.tokens * k;
    let cb = gate_up_col_blocks(i_n);
    let mut act = vec![f32::NAN; pairs * i_n];
    let mut writes = vec![0u8; pairs * i_n];
    for b in 0..pairs * cb {
        let (p, c) = (b / cb, b % cb);
        let members = pair_members(&ids[..pairs], p, s.num_experts);
        for w in 0..EXPERT_WARPS {
            let o = c * EXPERT_WARPS + w;
            if members.is_empty() || o >= i_n {
                continue;
            }
            let e = ids[p] as usize;
            let gate = &w13[(e * 2 * i_n + o) * h..][..h];
            let up = &w13[(e * 2 * i_n + i_n + o) * h..][..h];
            for batch in members.chunks(8) {
                for &q in batch {
                    let xr = &x[(q / k) * h..][..h];
                    let (g, u) = (warp_dot(xr, gate), warp_dot(xr, up));
                    act[q * i_n + o] = bf(g / (1.0 + (-g).exp()) * u);
                    writes[q * i_n + o] += 1;
                }
            }
        }
    }
    (act, writes)
}

/// `moe_small_down` into `residual`; returns the add count per residual element.
pub(super) fn emu_down(
    s: MoeShape,
    act: &[f32],
    w2: &[f32],
    ids: &[i32],
    ws: &[f32],
    residual: &mut [f32],
) -> Vec<u8> {
    let (t_n, h, i_n, k, e_n) = (s.tokens, s.hidden, s.inter, s.top_k, s.num_experts);
    let pairs = t_n * k;
    let s_ids: Vec<i32> = ids[..pairs]
        .iter()
        .map(|&e| if (0..e_n as i32).contains(&e) { e } else { -1 })
        .collect();
    let owners = distinct_owners(&ids[..pairs], e_n);
    let group = down_group(i_n);
    assert!(group * down_chunks_per_lane(i_n) <= DOWN_SLOTS);
    assert!(
        32 * 8 * down_chunks_per_lane(i_n) >= i_n,
        "a lane's chunks cover a w2 row"
    );
    let mut adds = vec![0u8; t_n * h];
    for b in 0..h.div_ceil(DOWN_ROWS) {
        for w in 0..DOWN_ROWS {
            let n = b * DOWN_ROWS + w;
            if n >= h {
                continue;
            }
            let mut s_y = vec![f32::NAN; pairs];
            for u0 in (0..owners.len()).step_by(group) {
                for &p in &owners[u0..(u0 + group).min(owners.len())] {
                    let ex = s_ids[p];
                    let wr = &w2[(ex as usize * h + n) * i_n..][..i_n];
                    for q in p..pairs {
                        if s_ids[q] == ex {
                            assert!(s_y[q].is_nan(), "y written twice");
                            s_y[q] = bf(warp_dot(&act[q * i_n..][..i_n], wr));
                        }
                    }
                }
            }
            for t in 0..t_n {
                let mut acc = 0f32;
                for slot in 0..k {
                    let q = t * k + slot;
                    if s_ids[q] < 0 {
                        continue;
                    }
                    assert!(!s_y[q].is_nan(), "pair {q} row {n}: y not computed");
                    acc = ws[q].mul_add(s_y[q], acc);
                }
                residual[t * h + n] += bf(acc);
                adds[t * h + n] += 1;
            }
        }
    }
    adds
}

// ---- references and inputs ------------------------------------------------------------------

pub(super) fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Within `ulps` bf16 steps of `want` (plus an absolute floor for values near 0).
pub(super) fn near_bf16(got: f32, want: f32, ulps: f32) -> bool {
    (got - want).abs() <= ulps * want.abs() / 128.0 + 1e-5
}

/// The routing is comparable where every gap between neighbours of the first k + 1 sorted
/// probabilities is an exact tie (both sides break it by the lower id) or clearly wider than
/// the rounding of the logits.
pub(super) fn routing_is_clear(probs: &[f32], k: usize) -> bool {
    let mut p = probs.to_vec();
    p.sort_by(|a, b| b.total_cmp(a));
    p.windows(2)
        .take(k.min(p.len() - 1))
        .all(|w| w[0] == w[1] || w[0] - w[1] > 1e-4 * w[0])
}

/// Deterministic residual rows with a few large entries (like a real residual stream).
pub(super) fn test_residual(t: usize, h: usize, seed: u64) -> Vec<f32> {
    let mut r: Vec<f32> = rand_bf16_f32(t * h, seed).iter().map(|v| 3.0 * v).collect();
    for row in r.chunks_exact_mut(h) {
        row[h / 3] = 40.0;
    }
    r
}

/// Router rows with an exact tie: experts 1 and `e - 1` share a row aligned with token 0's
/// normed input (a logit of about 4), so they top token 0's routing with equal logits.
pub(super) fn test_router(e: usize, h: usize, seed: u64, normed0: &[f32]) -> Vec<f32> {
    let mut w: Vec<f32> = rand_bf16_f32(e * h, seed)
        .iter()
        .map(|v| v / (h as f32).sqrt())
        .collect();
    if e > 2 && !normed0.is_empty() {
        let scale = 4.0 / normed0.iter().map(|v| v * v).sum::<f32>();
        let tied: Vec<f32> = normed0.iter().map(|v| bf(scale * v)).collect();
        w[h..2 * h].copy_from_slice(&tied);
        w[(e - 1) * h..].copy_from_slice(&tied);
    }
    w
}

pub(super) fn rms_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| *v as f64 * *v as f64).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| (*w as f64 * (*v as f64 * inv)) as f32)
        .collect()
}

/// Shapes of the emulator tests: (tokens, hidden, inter, experts, top_k).
const EMU_SHAPES: &[(usize, usize, usize, usize, usize)] = &[
    (1, 64, 32, 8, 2),
    (2, 128, 40, 16, 4),
    (8, 256, 24, 5, 5),
    (8, 8, 8, 3, 1),
    (3, 520, 72, 33, 8),
    (1, 2048, 64, 128, 8),
    (8, 2048, 16, 128, 8),
    (6, 2048, 16, 128, 8),
];

pub(super) fn shape(t: usize, h: usize, i: usize, e: usize, k: usize) -> MoeShape {
    MoeShape {
        tokens: t,
        hidden: h,
        inter: i,
        num_experts: e,
        top_k: k,
    }
}

// ---- CPU tests ------------------------------------------------------------------------------

#[test]
fn small_moe_fits_and_launch_shapes() {
    let real = shape(1, 2048, 768, 128, 8);
    assert!(CudaContext::moe_small_fits(&real));
    assert!(CudaContext::moe_small_fits(&shape(8, 2048, 768, 128, 8)));
    assert!(!CudaContext::moe_small_fits(&shape(9, 2048, 768, 128, 8)));
    assert!(!CudaContext::moe_small_fits(&shape(0, 2048, 768, 128, 8)));
    assert!(!CudaContext::moe_small_fits(&shape(1, 4096, 768, 128, 8)));
    assert!(!CudaContext::moe_small_fits(&shape(1, 12, 768, 128, 8)));
    assert!(!CudaContext::moe_small_fits(&shape(1, 2048, 4096, 128, 8)));
    assert!(!CudaContext::moe_small_fits(&shape(8, 2048, 768, 128, 33)));
    assert!(!CudaContext::moe_small_fits(&shape(1, 2048, 768, 4, 8)));
    assert!(!CudaContext::moe_small_fits(&shape(1, 2048, 768, 2048, 8)));
    // The real shape: 8 groups of 16 warps (512 threads, the unfused norm's block), 8.5 KiB
    // for one token, tiles of 4 tokens (34 KiB) for more.
    let one = route_launch(1, 2048, 128);
    assert_eq!((one.rt, one.tiles, one.groups, one.threads), (1, 1, 8, 512));
    assert_eq!(one.smem, (2048 + 128) * 4);
    let many = route_launch(64, 2048, 128);
    assert_eq!((many.rt, many.tiles, many.groups), (4, 16, 8));
    assert_eq!(many.smem, 4 * (2048 + 128) * 4);
    let odd = route_launch(5, 8, 3);
    assert_eq!((odd.rt, odd.tiles, odd.groups, odd.threads), (4, 2, 3, 32));
    assert_eq!(gate_up_col_blocks(768), 96);
    assert_eq!(gate_up_col_blocks(40), 5);
    assert_eq!(moe_small_act_len(real), 8 * 768);
    // Owners and members partition the valid pairs: the first pair of each expert owns it.
    let ids = [3, 1, 3, 7, -1, 1, 9, 3];
    assert_eq!(distinct_owners(&ids, 8), vec![0, 1, 3]);
    assert_eq!(pair_members(&ids, 0, 8), vec![0, 2, 7]);
    assert_eq!(pair_members(&ids, 1, 8), vec![1, 5]);
    assert!(pair_members(&ids, 2, 8).is_empty());
    assert!(pair_members(&ids, 4, 8).is_empty());
    assert!(pair_members(&ids, 6, 8).is_empty(), "9 is no expert of 8");
}

/// The router kernel's emulation, its blocks in forward and reverse order (the counter picks
/// whichever finishes last), equals the plain reference: the same h to a bf16 step, logits to
/// f32 rounding, the same experts (exact ties to the lower id) and weights; counters back at 0.
#[test]
fn emulated_router_matches_the_reference() {
    let eps = 1e-6;
    for &(t, h, _, e, k) in EMU_SHAPES {
        let s = shape(t, h, 8, e, k);
        let x = test_residual(t, h, 11 + h as u64);
        let nw: Vec<f32> = rand_bf16_f32(h, 12).iter().map(|v| 1.0 + v / 4.0).collect();
        let normed: Vec<Vec<f32>> = x.chunks(h).map(|r| rms_ref(r, &nw, eps)).collect();
        let router = test_router(e, h, 13 + e as u64, &normed[0]);
        let l = route_launch(t, h, e);
        let fwd: Vec<usize> = (0..l.tiles * l.groups).collect();
        let rev: Vec<usize> = fwd.iter().rev().copied().collect();
        // The same sum split into a residual and a delta (the unfused path's form).
        let half: Vec<f32> = x.iter().map(|v| bf(v / 2.0)).collect();
        let rest: Vec<f32> = x.iter().zip(&half).map(|(v, a)| v - a).collect();
        for renorm in [true, false] {
            let a = emu_route(s, &x, None, &nw, &router, renorm, eps, &fwd);
            let b = emu_route(s, &x, None, &nw, &router, renorm, eps, &rev);
            assert_eq!(a.ids, b.ids, "block order changed the routing");
            assert_eq!(a.logits, b.logits);
            assert!(a.counters.iter().all(|&c| c == 0), "counters left non-zero");
            assert_eq!(a.residual, x, "no delta: the residual is only read");
            let d = emu_route(s, &half, Some(&rest), &nw, &router, renorm, eps, &rev);
            let sum: Vec<f32> = half.iter().zip(&rest).map(|(a, b)| a + b).collect();
            assert_eq!(d.residual, sum, "the residual holds the sum");
            let c = emu_route(s, &sum, None, &nw, &router, renorm, eps, &fwd);
            assert_eq!(
                (&d.h, &d.logits, &d.ids),
                (&c.h, &c.logits, &c.ids),
                "{s:?} delta"
            );
            let mut checked = 0;
            for tok in 0..t {
                for i in 0..h {
                    let want = normed[tok][i];
                    assert!(
                        near_bf16(a.h[tok * h + i], want, 1.0),
                        "{s:?} h[{tok}, {i}]: {} vs {want}",
                        a.h[tok * h + i]
                    );
                }
                let logits: Vec<f32> = (0..e)
                    .map(|j| dot64(&normed[tok], &router[j * h..(j + 1) * h]) as f32)
                    .collect();
                for j in 0..e {
                    let got = a.logits[tok * e + j];
                    assert!(
                        (got - logits[j]).abs() <= 1e-5 * (1.0 + logits[j].abs()),
                        "{s:?} logit[{tok}, {j}]: {got} vs {}",
                        logits[j]
                    );
                }
                let (ids, ws) = cpu_topk(&a.logits[tok * e..(tok + 1) * e], e, k, renorm);
                let mut probs = a.logits[tok * e..(tok + 1) * e].to_vec();
                crate::ops::softmax_inplace(&mut probs);
                if !routing_is_clear(&probs, k) {
                    continue;
                }
                assert_eq!(a.ids[tok * k..(tok + 1) * k], ids[..], "{s:?} token {tok}");
                for j in 0..k {
                    let (g, w) = (a.ws[tok * k + j], ws[j]);
                    assert!((g - w).abs() <= 1e-5 * (1.0 + w), "{s:?} weight {g} vs {w}");
                }
                checked += 1;
            }
            assert!(checked > 0, "{s:?}: no token with a clear routing");
            if e > 2 && k >= 2 {
                // The tie: experts 1 and e - 1 lead token 0, the lower id first.
                assert_eq!(a.ids[..2], [1, e as i32 - 1], "{s:?}");
                assert_eq!(a.ws[0], a.ws[1]);
            }
        }
    }
}

/// The expert kernels' emulation (gate_up, then down into a residual) writes every valid
/// pair's act row once and every residual element once, and equals the plain reference (act to
/// a bf16 step, y and the weighted sum as the grouped-GEMM path rounds them), and the unrounded
/// CPU expert block to bf16 accuracy; ids outside the experts contribute nothing.
#[test]
fn emulated_experts_match_the_reference() {
    for (si, &(t, h, i_n, e, k)) in EMU_SHAPES.iter().enumerate() {
        let s = shape(t, h, i_n, e, k);
        let pairs = t * k;
        let x = rand_bf16_f32(t * h, 21 + si as u64);
        let w13 = rand_bf16_scaled(e * 2 * i_n * h, 22 + si as u64, 2.0 / (h as f32).sqrt());
        let w2 = rand_bf16_scaled(e * h * i_n, 23 + si as u64, 2.0 / (i_n as f32).sqrt());
        let (w13f, w2f): (Vec<f32>, Vec<f32>) = (
            w13.iter().map(|v| v.to_f32()).collect(),
            w2.iter().map(|v| v.to_f32()).collect(),
        );
        // Routings: the router's (distinct experts per token), every token on the same experts,
        // and a malformed one (repeats within a token, ids outside 0..e, > 8 pairs on one).
        let logits: Vec<f32> = rand_bf16_f32(t * e, 24).iter().map(|v| 4.0 * v).collect();
        let (ids_a, ws_a) = cpu_topk(&logits, e, k, true);
        let (ids_b, ws_b) = cpu_topk(&logits[..e].repeat(t), e, k, false);
        let ids_c: Vec<i32> = (0..pairs)
            .map(|p| match p % 5 {
                0 => -1,
                1 => e as i32,
                _ => (p % 2) as i32 * (e as i32 - 1),
            })
            .collect();
        let ws_c: Vec<f32> = (0..pairs).map(|p| 0.1 + p as f32 / 100.0).collect();
        for (name, ids, ws) in [
            ("router", &ids_a, &ws_a),
            ("shared", &ids_b, &ws_b),
            ("malformed", &ids_c, &ws_c),
        ] {
            let (act, writes) = emu_gate_up(s, &x, &w13f, ids);
            for q in 0..pairs {
                let ok = (0..e as i32).contains(&ids[q]);
                for o in 0..i_n {
                    assert_eq!(
                        writes[q * i_n + o],
                        u8::from(ok),
                        "{s:?} {name} act[{q}, {o}]"
                    );
                    if !ok {
                        continue;
                    }
                    let ex = ids[q] as usize;
                    let xr = &x[(q / k) * h..][..h];
                    let g = dot64(xr, &w13f[(ex * 2 * i_n + o) * h..][..h]);
                    let u = dot64(xr, &w13f[(ex * 2 * i_n + i_n + o) * h..][..h]);
                    let want = (g / (1.0 + (-g).exp()) * u) as f32;
                    let got = act[q * i_n + o];
                    assert!(
                        near_bf16(got, want, 1.5),
                        "{s:?} {name} act {got} vs {want}"
                    );
                }
            }
            let base = rand_bf16_f32(t * h, 25);
            let mut res = base.clone();
            let adds = emu_down(s, &act, &w2f, ids, ws, &mut res);
            assert!(adds.iter().all(|&c| c == 1), "{s:?} {name}: residual adds");
            let mut got_out = vec![0f32; t * h];
            for tok in 0..t {
                for n in 0..h {
                    let (mut acc, mut mag) = (0f64, 0f64);
                    for slot in 0..k {
                        let q = tok * k + slot;
                        if !(0..e as i32).contains(&ids[q]) {
                            continue;
                        }
                        let wr = &w2f[(ids[q] as usize * h + n) * i_n..][..i_n];
                        let y = ws[q] as f64 * bf(dot64(&act[q * i_n..][..i_n], wr) as f32) as f64;
                        acc += y;
                        mag += y.abs();
                    }
                    let want = bf(acc as f32);
                    let got = res[tok * h + n] - base[tok * h + n];
                    got_out[tok * h + n] = got;
                    // A bf16 step of the sum, and of each y (they may round either way).
                    assert!(
                        (got - want).abs() <= 1.5 * (want.abs() + mag as f32) / 128.0 + 1e-5,
                        "{s:?} {name} out[{tok}, {n}]: {got} vs {want}"
                    );
                }
            }
            if name != "malformed" {
                let cpu = cpu_moe_rows(&x, &w13, &w2, ids, ws, s, &(0..t).collect::<Vec<_>>());
                let err = rel_err(&got_out, &cpu);
                assert!(err <= 2e-2, "{s:?} {name}: rel err vs the CPU block {err}");
            }
        }
    }
}
