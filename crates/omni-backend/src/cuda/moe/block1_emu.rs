//! CPU test of the one-launch MoE block's partition (`kernels/moe/block1.cu`): a host emulator
//! that runs its CTA, warp and lane loops (which CTA and warp computes each logit, each CTA's
//! share of the gate_up outputs, the w2 rows a CTA stages and where, the output rows it owns)
//! over grids of several sizes, asserts that every logit, act element and residual element is
//! written exactly once and that the down phase reads back the w2 rows the staging copied, and
//! compares the result bit for bit with the emulators of the three kernels it replaces
//! (`small_emu.rs`). The GPU test (`block1_tests.rs`) checks the kernel itself.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::needless_range_loop)]

use super::MoeShape;
use super::block1::{THREADS, block1_launch};
use super::small::route_launch;
use super::small_emu::{bf, emu_down, emu_gate_up, emu_route, shape, warp_dot};
use super::tests::rand_bf16_scaled;
use crate::cuda::tests::rand_bf16_f32;

const WARPS: usize = THREADS as usize / 32;

/// The router kernel's blocks in grid order.
fn route_order(s: MoeShape) -> Vec<usize> {
    let l = route_launch(s.tokens, s.hidden, s.num_experts);
    (0..l.tiles * l.groups).collect()
}

/// The kernel's outputs, emulated.
struct Block1 {
    residual: Vec<f32>,
    act: Vec<f32>,
}

/// `moe_block1` over a grid of `sms` CTAs. Phase 1's arithmetic is `moe_route`'s (its
/// emulator's values are taken); what is emulated here is the partition of every phase.
#[allow(clippy::too_many_arguments)]
fn emu_block1(
    s: MoeShape,
    residual: &[f32],
    delta: &[f32],
    (norm_w, router): (&[f32], &[f32]),
    (w13, w2): (&[f32], &[f32]),
    sms: usize,
) -> Block1 {
    let (h, i_n, e_n, k) = (s.hidden, s.inter, s.num_experts, s.top_k);
    let (ci, g) = (i_n / 8, sms);
    let (rows_per_cta, _) = block1_launch(&s, sms);
    let routed = emu_route(
        s,
        residual,
        Some(delta),
        norm_w,
        router,
        true,
        1e-6,
        &route_order(s),
    );
    // Phase 1: expert e's logit by warp wid of CTA c for e = c + G wid + G W j.
    let mut logit_by = vec![0u8; e_n];
    for c in 0..g {
        for wid in 0..WARPS {
            let mut e = c + g * wid;
            while e < e_n {
                logit_by[e] += 1;
                e += g * WARPS;
            }
        }
    }
    assert!(
        logit_by.iter().all(|&n| n == 1),
        "{s:?} G={g}: a logit per expert"
    );
    let (ids, ws) = (&routed.ids, &routed.ws);
    let valid = |kk: usize| (0..e_n as i32).contains(&ids[kk]);
    // Phase 2: CTA c's outputs [K I c / G, K I (c + 1) / G), warp w every W-th of them.
    let total = k * i_n;
    let mut act = vec![f32::NAN; total];
    let mut act_writes = vec![0u8; total];
    for c in 0..g {
        let (o0, o1) = (total * c / g, total * (c + 1) / g);
        for w in 0..WARPS {
            for o in (o0 + w..o1).step_by(WARPS) {
                let (kk, j) = (o / i_n, o % i_n);
                if !valid(kk) {
                    continue;
                }
                let e = ids[kk] as usize;
                let gate = &w13[(e * 2 * i_n + j) * h..][..h];
                let up = &w13[(e * 2 * i_n + i_n + j) * h..][..h];
                let (gv, uv) = (warp_dot(&routed.h, gate), warp_dot(&routed.h, up));
                act[o] = bf(gv / (1.0 + (-gv).exp()) * uv);
                act_writes[o] += 1;
            }
        }
    }
    for o in 0..total {
        assert_eq!(
            act_writes[o],
            u8::from(valid(o / i_n)),
            "{s:?} G={g}: act[{o}]"
        );
    }
    // The staging: slot i of CTA c holds chunk ch of w2 row n0 + r of expert ids[kk].
    let mut out = residual.to_vec();
    let mut res_writes = vec![0u8; h];
    for c in 0..g {
        let n0 = c * rows_per_cta;
        let rows = rows_per_cta.min(h.saturating_sub(n0));
        let mut staged: Vec<Option<(usize, usize, usize)>> = vec![None; rows_per_cta * k * ci];
        for i in 0..rows * k * ci {
            let (rk, ch) = (i / ci, i % ci);
            let (r, kk) = (rk / k, rk % k);
            if valid(kk) {
                staged[i] = Some((ids[kk] as usize, n0 + r, ch));
            }
        }
        // Phase 3: warp w owns rows w, w + W, ...
        for w in 0..WARPS {
            for r in (w..rows).step_by(WARPS) {
                let n = n0 + r;
                let mut sum = 0f32;
                for kk in 0..k {
                    if !valid(kk) {
                        continue;
                    }
                    let e = ids[kk] as usize;
                    for ch in 0..ci {
                        assert_eq!(
                            staged[(r * k + kk) * ci + ch],
                            Some((e, n, ch)),
                            "{s:?} G={g}: staged slot of row {n} slot {kk} chunk {ch}"
                        );
                    }
                    let wr = &w2[(e * h + n) * i_n..][..i_n];
                    let y = bf(warp_dot(&act[kk * i_n..][..i_n], wr));
                    sum = ws[kk].mul_add(y, sum);
                }
                out[n] = (residual[n] + delta[n]) + bf(sum);
                res_writes[n] += 1;
            }
        }
    }
    assert!(
        res_writes.iter().all(|&n| n == 1),
        "{s:?} G={g}: residual rows"
    );
    Block1 { residual: out, act }
}

/// The emulated block against the three kernels' emulators, bit for bit, over grids from 7
/// CTAs (ragged row shares, several experts a warp) to 132 (more CTAs than rows at hidden 8).
#[test]
fn emulated_block1_matches_the_three_kernels() {
    let cases = [
        // hidden, inter, experts, top-k, grid
        (1024usize, 256usize, 16usize, 8usize, 132usize),
        (256, 40, 300, 6, 7),
        (512, 96, 60, 4, 33),
        (8, 8, 3, 3, 132),
    ];
    for (ci, &(h, i_n, e, k, sms)) in cases.iter().enumerate() {
        let s = shape(1, h, i_n, e, k);
        let seed = 90 + 10 * ci as u64;
        let residual: Vec<f32> = rand_bf16_f32(h, seed).iter().map(|v| 3.0 * v).collect();
        let delta = rand_bf16_f32(h, seed + 1);
        let norm_w: Vec<f32> = rand_bf16_f32(h, seed + 2)
            .iter()
            .map(|v| 1.0 + v / 4.0)
            .collect();
        let router = rand_bf16_f32(e * h, seed + 3);
        let w13: Vec<f32> = rand_bf16_scaled(e * 2 * i_n * h, seed + 4, 0.05)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let w2: Vec<f32> = rand_bf16_scaled(e * h * i_n, seed + 5, 0.05)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let got = emu_block1(s, &residual, &delta, (&norm_w, &router), (&w13, &w2), sms);
        let order = route_order(s);
        let mut routed = emu_route(
            s,
            &residual,
            Some(&delta),
            &norm_w,
            &router,
            true,
            1e-6,
            &order,
        );
        let (act, _) = emu_gate_up(s, &routed.h, &w13, &routed.ids);
        let ids = routed.ids.clone();
        emu_down(s, &act, &w2, &ids, &routed.ws, &mut routed.residual);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.act), bits(&act[..k * i_n]), "{s:?} G={sms}: act");
        assert_eq!(
            bits(&got.residual),
            bits(&routed.residual),
            "{s:?} G={sms}: residual"
        );
    }
}

/// The flip barrier's arithmetic (`MB1_FLIP_BARRIER` in `kernels/moe/block1.cu`), under random
/// interleavings: each CTA's thread 0 adds its addend (CTA 0: 2^31 - (G - 1), the others 1) and
/// keeps the old word, then leaves once the word's top bit differs from the old one's. No CTA
/// leaves a barrier before every CTA has arrived at it, every CTA leaves each barrier (no
/// deadlock), and the word's low bits are back at their start after each barrier, from any
/// starting top bit and across wrap-around.
#[test]
fn flip_barrier_releases_no_cta_early() {
    const BARRIERS: usize = 7;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize % n
    };
    for g in [1usize, 2, 3, 7, 132] {
        for start in [0u32, 0x8000_0000] {
            for _ in 0..20 {
                let mut word = start;
                // Per CTA: the barrier it is at, and its arrival's old word once arrived.
                let mut at = vec![0usize; g];
                let mut old: Vec<Option<u32>> = vec![None; g];
                let mut arrived = [0usize; BARRIERS];
                let mut steps = 0;
                while at.iter().any(|&b| b < BARRIERS) {
                    steps += 1;
                    assert!(steps < 1_000_000, "g={g}: no progress (deadlock)");
                    let c = next(g);
                    if at[c] >= BARRIERS {
                        continue;
                    }
                    match old[c] {
                        None => {
                            let add = if c == 0 {
                                0x8000_0000u32 - (g as u32 - 1)
                            } else {
                                1
                            };
                            old[c] = Some(word);
                            word = word.wrapping_add(add);
                            arrived[at[c]] += 1;
                        }
                        Some(o) if (word ^ o) & 0x8000_0000 != 0 => {
                            assert_eq!(
                                arrived[at[c]], g,
                                "g={g}: CTA {c} left barrier {} early",
                                at[c]
                            );
                            old[c] = None;
                            at[c] += 1;
                        }
                        Some(_) => {}
                    }
                }
                assert_eq!(word & 0x7fff_ffff, start & 0x7fff_ffff, "g={g}: low bits");
                let flips = u32::from(BARRIERS % 2 == 1) << 31;
                assert_eq!(word, start ^ flips, "g={g}: top bit");
            }
        }
    }
}
