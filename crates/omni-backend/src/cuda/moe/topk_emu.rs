//! CPU test of the register form of the warp's top-k (`moe_topk_regs` in
//! `kernels/moe/topk_warp.cuh`): a host emulator of its lanes (expert `lane + 32 m` in slot
//! `m`, the shared-memory form's softmax, picks by the warp's largest key
//! `bits + 1` and, among the lanes holding it, the smallest id) against the emulator of the
//! shared-memory form (`emu_topk_warp`), bit for bit, over rows with ties inside a lane and
//! across lanes, -inf logits, NaN rows and every expert count the register form takes.

#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

use super::small_emu::{emu_topk_warp, emu_warp_softmax};
use crate::cuda::tests::rand_bf16_f32;

/// Slots a lane holds (`MOE_TOPK_REG`).
const REG: usize = 8;

/// `moe_topk_regs` on one row of logits (`row.len() <= 32 * REG`).
fn emu_topk_regs(row: &[f32], k: usize, renorm: bool) -> (Vec<i32>, Vec<f32>) {
    let e_n = row.len();
    assert!(e_n <= 32 * REG);
    // The softmax is the shared-memory form's (`emu_warp_softmax`); expert lane + 32 m sits in
    // slot m of its lane.
    let probs = emu_warp_softmax(row);
    let mut key = [[0u32; REG]; 32];
    for lane in 0..32 {
        for m in 0..REG {
            key[lane][m] = match probs.get(lane + 32 * m) {
                Some(&v) if v >= 0.0 => v.to_bits() + 1,
                _ => 0,
            };
        }
    }
    let (mut ids, mut ws, mut sel) = (Vec::new(), Vec::new(), 0f32);
    for _ in 0..k {
        // Each lane's largest key, its lowest slot on ties (the ascending scan, strict >).
        let best: Vec<(u32, usize)> = (0..32)
            .map(|lane| {
                let (mut bk, mut bm) = (0u32, 0usize);
                for m in 0..REG {
                    if key[lane][m] > bk {
                        bk = key[lane][m];
                        bm = m;
                    }
                }
                (bk, lane + 32 * bm)
            })
            .collect();
        let kmax = best.iter().map(|b| b.0).max().unwrap();
        let bi = best
            .iter()
            .map(|&(bk, i)| {
                if bk == kmax && kmax != 0 {
                    i as u32
                } else {
                    u32::MAX
                }
            })
            .min()
            .unwrap();
        let bv = if kmax != 0 {
            f32::from_bits(kmax - 1)
        } else {
            -1.0
        };
        sel += bv;
        ids.push(if kmax != 0 { bi as i32 } else { e_n as i32 });
        ws.push(bv);
        if kmax != 0 {
            key[bi as usize % 32][bi as usize / 32] = 0;
        }
    }
    if renorm {
        ws.iter_mut().for_each(|w| *w /= sel);
    }
    (ids, ws)
}

/// Rows of `e` logits: random, a row of equal values, ties across lanes and inside a lane, a
/// row with -inf entries, a row all -inf, a row with a NaN.
fn rows(e: usize, seed: u64) -> Vec<Vec<f32>> {
    let rand: Vec<f32> = rand_bf16_f32(4 * e, seed).iter().map(|v| 4.0 * v).collect();
    let mut out: Vec<Vec<f32>> = rand.chunks(e).map(<[f32]>::to_vec).collect();
    out.push(vec![0.25; e]);
    let mut ties = out[0].clone();
    for i in (0..e).step_by(7) {
        ties[i] = 5.0;
    }
    out.push(ties);
    let mut holes = out[1].clone();
    for v in holes.iter_mut().step_by(2) {
        *v = f32::NEG_INFINITY;
    }
    out.push(holes);
    out.push(vec![f32::NEG_INFINITY; e]);
    let mut nan = out[2].clone();
    nan[e / 2] = f32::NAN;
    out.push(nan);
    out
}

#[test]
fn register_top_k_is_the_shared_memory_top_k() {
    for e in [1usize, 3, 8, 31, 32, 33, 60, 128, 200, 256] {
        for row in rows(e, 11 + e as u64) {
            for k in [1usize, 2, 8.min(e), e] {
                for renorm in [false, true] {
                    let (want_i, want_w) = emu_topk_warp(&row, k, renorm);
                    let (got_i, got_w) = emu_topk_regs(&row, k, renorm);
                    let what = format!("e={e} k={k} renorm={renorm} row={:?}", &row[..e.min(4)]);
                    assert_eq!(got_i, want_i, "ids {what}");
                    let bits = |w: &[f32]| w.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got_w), bits(&want_w), "weights {what}");
                }
            }
        }
    }
}
