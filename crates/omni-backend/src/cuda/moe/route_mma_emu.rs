//! CPU emulator of `moe_route_mma` (`kernels/moe/route_mma.cu`), thread by thread where the
//! kernel's indexing lives: each thread's cp.async chunks into the stage ring (shared memory
//! starts poisoned with NaN, so a read of a chunk no copy wrote shows), the pipeline's order
//! (a stage is computed only from the slot its own tile was copied into), `ldmatrix` and
//! `mma.m16n8k16` with the PTX fragment layouts (`mma_emu.rs`), the partial sums' layout (each
//! element written once), the last CTA's sum in split order and the warps' routing
//! (`emu_topk_warp`; the kernel's register top-k gives the same bits, `topk_emu.rs`). Tested
//! against an f64 reference of the same products over shapes with a partial token block, a
//! partial last split, padding experts and a non-bf16 router.

#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

use super::route_mma::{
    ROUTE_BK, ROUTE_BM, ROUTE_KC, ROUTE_STAGES, ROUTE_THREADS, moe_route_mma_workspace_len,
    route_splits,
};
use super::small_emu::emu_topk_warp;
use crate::cuda::bf16;
use crate::cuda::mma_emu::{ldsm_x4, mma};
use crate::cuda::tests::rand_bf16_f32;

const LDS: usize = ROUTE_BK + 8;
const A_TILE: usize = ROUTE_BM * LDS;
const B_TILE: usize = 128 * LDS;
/// A bf16 NaN: what unwritten shared memory holds here.
const POISON: u16 = 0x7fc1;

/// The kernel's inputs as bf16 bits: `h` `[t, hidden]`, `h_lo` `[t, 2 hidden]`, `w_hi2`
/// `[e, 2 hidden]`, `w_lo` `[e, hidden]` or none.
struct Inputs {
    h: Vec<u16>,
    h_lo: Vec<u16>,
    w_hi2: Vec<u16>,
    w_lo: Option<Vec<u16>>,
    tokens: usize,
    hidden: usize,
    e: usize,
}

impl Inputs {
    fn nb(&self) -> usize {
        if self.w_lo.is_some() { 2 } else { 1 }
    }
    fn stage(&self) -> usize {
        3 * A_TILE + self.nb() * B_TILE
    }
}

/// `load_stage(slot, kt)` of CTA (mb, s) by every thread.
fn load_stage(inp: &Inputs, sm: &mut [u16], mb: usize, s: usize, slot: usize, kt: usize) {
    let (hd, m0) = (inp.hidden, mb * ROUTE_BM);
    let k0 = (s * (ROUTE_KC / ROUTE_BK) + kt) * ROUTE_BK;
    let base = slot * inp.stage();
    // Each (tile, row, chunk) of the stage is written once by this load.
    let mut seen = vec![0u8; inp.stage()];
    for tid in 0..ROUTE_THREADS {
        let (chunk, row0) = (tid & 3, tid >> 2);
        let kin = k0 + chunk * 8 < hd;
        let d = row0 * LDS + chunk * 8;
        let mut put = |off: usize, src: Option<&[u16]>| {
            assert_eq!(seen[off], 0, "stage offset {off} copied twice");
            seen[off] = 1;
            for j in 0..8 {
                sm[base + off + j] = src.map_or(0, |v| v[j]);
            }
        };
        let tok = m0 + row0;
        let a_ok = tok < inp.tokens && kin;
        let a_rows = [
            (&inp.h, tok * hd),
            (&inp.h_lo, tok * 2 * hd),
            (&inp.h_lo, tok * 2 * hd + hd),
        ];
        for (m, (src, row)) in a_rows.into_iter().enumerate() {
            let at = row + k0 + chunk * 8;
            put(m * A_TILE + d, a_ok.then(|| &src[at..at + 8]));
        }
        for i in 0..2 {
            let e = row0 + 64 * i;
            let ok = e < inp.e && kin;
            let off = 3 * A_TILE + i * 64 * LDS + d;
            let at = e * 2 * hd + k0 + chunk * 8;
            put(off, ok.then(|| &inp.w_hi2[at..at + 8]));
            if let Some(lo) = &inp.w_lo {
                let at = e * hd + k0 + chunk * 8;
                put(off + B_TILE, ok.then(|| &lo[at..at + 8]));
            }
        }
    }
}

/// CTA (mb, s) of a grid of `blocks` token blocks: its partial sums into `part` (`written`
/// counts the stores of each element).
fn emu_cta(inp: &Inputs, mb: usize, s: usize, blocks: usize, part: &mut [f32], written: &mut [u8]) {
    let hd = inp.hidden;
    let kts = ROUTE_KC / ROUTE_BK;
    let kt_all = hd.div_ceil(ROUTE_BK);
    let kt_n = kts.min(kt_all - s * kts);
    let stage = inp.stage();
    let mut sm = vec![POISON; ROUTE_STAGES * stage];
    let mut slot_tile = [usize::MAX; ROUTE_STAGES];
    for st in 0..ROUTE_STAGES - 1 {
        if st < kt_n {
            load_stage(inp, &mut sm, mb, s, st, st);
            slot_tile[st] = st;
        }
    }
    // acc[warp][nf]: the m16n8 accumulators of 32 lanes.
    let mut acc = vec![[[[0f32; 4]; 32]; 8]; 8];
    for kt in 0..kt_n {
        let nk = kt + ROUTE_STAGES - 1;
        if nk < kt_n {
            // Refills the slot of tile kt - 1, whose MMAs every warp finished before the barrier.
            load_stage(inp, &mut sm, mb, s, nk % ROUTE_STAGES, nk);
            slot_tile[nk % ROUTE_STAGES] = nk;
        }
        assert_eq!(
            slot_tile[kt % ROUTE_STAGES],
            kt,
            "tile {kt} not in its slot"
        );
        let t = (kt % ROUTE_STAGES) * stage;
        for warp in 0..8 {
            let (wm, wn) = (warp & 3, warp >> 2);
            let a_off = |l: usize| (16 * wm + (l & 15)) * LDS + (l >> 4) * 8;
            let b_off = |l: usize| (64 * wn + (l >> 4) * 8 + (l & 7)) * LDS + ((l >> 3) & 1) * 8;
            for ks in 0..ROUTE_BK / 16 {
                let a: Vec<[[u32; 4]; 32]> = (0..3)
                    .map(|m| {
                        let addr = std::array::from_fn(|l| t + m * A_TILE + a_off(l) + ks * 16);
                        ldsm_x4(&sm, &addr, false)
                    })
                    .collect();
                for np in 0..4 {
                    for (bt, a_used) in [(0usize, 0..3usize), (1, 0..1)] {
                        if bt >= inp.nb() {
                            continue;
                        }
                        let addr = std::array::from_fn(|l| {
                            t + 3 * A_TILE + bt * B_TILE + b_off(l) + np * 16 * LDS + ks * 16
                        });
                        let b = ldsm_x4(&sm, &addr, false);
                        let r = |j: usize| -> [u32; 32] { std::array::from_fn(|l| b[l][j]) };
                        for m in a_used {
                            mma(&mut acc[warp][2 * np], &a[m], &r(0), &r(1));
                            mma(&mut acc[warp][2 * np + 1], &a[m], &r(2), &r(3));
                        }
                    }
                }
            }
        }
    }
    let (m0, e) = (mb * ROUTE_BM, inp.e);
    let mpad = blocks * ROUTE_BM;
    for warp in 0..8 {
        let (wm, wn) = (warp & 3, warp >> 2);
        for lane in 0..32 {
            let (g, t4) = (lane >> 2, lane & 3);
            for nf in 0..8 {
                for hh in 0..2 {
                    let (r, c) = (16 * wm + g + 8 * hh, 64 * wn + 8 * nf + 2 * t4);
                    if m0 + r >= inp.tokens {
                        continue;
                    }
                    for j in 0..2 {
                        if c + j < e {
                            let at = (s * mpad + m0 + r) * e + c + j;
                            part[at] = acc[warp][nf][lane][2 * hh + j];
                            written[at] += 1;
                        }
                    }
                }
            }
        }
    }
}

/// The launch: logits, ids and weights.
fn emu_route_mma(inp: &Inputs, k: usize, renorm: bool) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let (t, e) = (inp.tokens, inp.e);
    let blocks = t.div_ceil(ROUTE_BM);
    let splits = route_splits(inp.hidden);
    let (part_len, _) = moe_route_mma_workspace_len(t, inp.hidden, e);
    let mut part = vec![f32::NAN; part_len];
    let mut written = vec![0u8; part_len];
    for mb in 0..blocks {
        for s in 0..splits {
            emu_cta(inp, mb, s, blocks, &mut part, &mut written);
        }
    }
    let mpad = blocks * ROUTE_BM;
    for s in 0..splits {
        for r in 0..mpad {
            for c in 0..e {
                let want = u8::from(r < t);
                assert_eq!(
                    written[(s * mpad + r) * e + c],
                    want,
                    "split {s} row {r} col {c}"
                );
            }
        }
    }
    // The last CTA of each block: the splits in order over the block's run of nrows * E floats
    // (float4s, then the tail), each logit written once; then a warp per token.
    let mut logits = vec![f32::NAN; t * e];
    let mut once = vec![0u8; t * e];
    for mb in 0..blocks {
        let (m0, nrows) = (mb * ROUTE_BM, ROUTE_BM.min(t - mb * ROUTE_BM));
        let (n, p0) = (nrows * e, mb * ROUTE_BM * e);
        let n4 = n / 4;
        let elems = (0..n4)
            .flat_map(|i| (0..4).map(move |j| 4 * i + j))
            .chain(4 * n4..n);
        for i in elems {
            let mut v = part[p0 + i];
            for q in 1..splits {
                v += part[p0 + q * mpad * e + i];
            }
            logits[m0 * e + i] = v;
            once[m0 * e + i] += 1;
        }
    }
    assert!(
        once.iter().all(|&c| c == 1),
        "a logit written {:?} times",
        once.iter().max()
    );
    let (mut ids, mut wts) = (Vec::new(), Vec::new());
    for row in logits.chunks(e) {
        let (i, w) = emu_topk_warp(row, k, renorm);
        ids.extend(i);
        wts.extend(w);
    }
    (logits, ids, wts)
}

fn bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
fn val(b: u16) -> f64 {
    f64::from(bf16::from_bits(b).to_f32())
}

#[test]
fn route_mma_emulator_matches_the_f64_sums() {
    // (tokens, hidden, experts, top_k, non-bf16 router): a partial token block, a last split
    // of one tile with half its chunks past the hidden size, padding experts (100, 16), w_lo.
    for (t, hd, e, k, lo) in [
        (70usize, 1040usize, 100usize, 8usize, false),
        (9, 256, 16, 4, true),
        (64, 512, 128, 8, false),
    ] {
        let what = format!("t={t} h={hd} e={e} lo={lo}");
        // x = hi + mid + lo exactly, as the norm writes it.
        let x: Vec<f32> = rand_bf16_f32(t * hd, 5 + t as u64)
            .iter()
            .zip(rand_bf16_f32(t * hd, 6))
            .map(|(a, b)| a + b / 3000.0)
            .collect();
        let (mut h, mut h_lo) = (vec![0u16; t * hd], vec![0u16; 2 * t * hd]);
        for r in 0..t {
            for i in 0..hd {
                let v = x[r * hd + i];
                let hi = bits(v);
                let rest = v - bf16::from_bits(hi).to_f32();
                let mid = bits(rest);
                h[r * hd + i] = hi;
                h_lo[r * 2 * hd + i] = mid;
                h_lo[r * 2 * hd + hd + i] = bits(rest - bf16::from_bits(mid).to_f32());
            }
        }
        let w: Vec<f32> = rand_bf16_f32(e * hd, 7 + e as u64)
            .iter()
            .zip(rand_bf16_f32(e * hd, 8))
            .map(|(a, b)| if lo { a + b / 1000.0 } else { *a })
            .collect();
        let w_hi: Vec<u16> = w.iter().map(|&v| bits(v)).collect();
        let w_lo: Vec<u16> = w
            .iter()
            .zip(&w_hi)
            .map(|(&v, &b)| bits(v - bf16::from_bits(b).to_f32()))
            .collect();
        let mut w_hi2 = Vec::with_capacity(2 * e * hd);
        for row in w_hi.chunks(hd) {
            w_hi2.extend_from_slice(row);
            w_hi2.extend_from_slice(row);
        }
        let inp = Inputs {
            h,
            h_lo,
            w_hi2,
            w_lo: lo.then(|| w_lo.clone()),
            tokens: t,
            hidden: hd,
            e,
        };
        let (logits, ids, wts) = emu_route_mma(&inp, k, true);
        // The kernel's products in f64: (hi + mid + lo) w_hi (+ hi w_lo).
        let mut worst = 0f64;
        for r in 0..t {
            for j in 0..e {
                let (mut want, mut scale) = (0f64, 0f64);
                for i in 0..hd {
                    let xi = val(inp.h[r * hd + i])
                        + val(inp.h_lo[r * 2 * hd + i])
                        + val(inp.h_lo[r * 2 * hd + hd + i]);
                    let mut p = xi * val(w_hi[j * hd + i]);
                    if lo {
                        p += val(inp.h[r * hd + i]) * val(w_lo[j * hd + i]);
                    }
                    want += p;
                    scale += p.abs();
                }
                let err = (f64::from(logits[r * e + j]) - want).abs() / scale;
                worst = worst.max(err);
            }
        }
        println!("{what}: worst logit error / sum |x w| {worst:.2e}");
        assert!(worst < 1e-6, "{what}: {worst:e}");
        // Every token routed, ids in range, renormalized weights summing to 1.
        for r in 0..t {
            let (ri, rw) = (&ids[r * k..(r + 1) * k], &wts[r * k..(r + 1) * k]);
            assert!(
                ri.iter().all(|&i| (0..e as i32).contains(&i)),
                "{what}: {ri:?}"
            );
            let sum: f32 = rw.iter().sum();
            assert!((sum - 1.0).abs() < 1e-5, "{what}: token {r} weights {rw:?}");
        }
    }
}
