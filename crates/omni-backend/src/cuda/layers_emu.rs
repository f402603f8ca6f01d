//! CPU emulator of the wide q/k norm + RoPE kernel (`qkv_rope_cache_wide_bf16` in
//! `kernels/layers.cu`), lane by lane: which warp takes which token and rounds of 4 heads, the
//! 16-byte words each lane loads and stores (dims `8 (lane % 8) ..` and their partners 64
//! further), the sum of squares over a head's 8 lanes (xor shuffles 1, 2, 4), the value heads
//! copied in the same rounds and padding tokens' keys and values left alone. Every output
//! element is written exactly once, and the values match an f64 norm + rotate-half reference.

#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

use crate::cuda::bf16;
use crate::cuda::tests::rand_bf16_f32;

const HD: usize = 128;
const WARPS: usize = 4; // QKR_WARPS
const ROUNDS: usize = 5; // QKW_ROUNDS

fn bf(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
fn fl(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}

/// The kernel's outputs, and how often each element was written.
struct Out {
    q: Vec<u16>,
    k: Vec<u16>,
    v: Vec<u16>,
    wq: Vec<u8>,
    wk: Vec<u8>,
    wv: Vec<u8>,
}

#[allow(clippy::too_many_arguments)]
fn emu_wide(
    qkv: &[u16],
    (lq, lkv, tokens): (usize, usize, usize),
    pos: &[i32],
    slots: &[i64],
    inv_freq: &[f32],
    norms: Option<(&[u16], &[u16])>,
    eps: f32,
    cache_slots: usize,
) -> Out {
    let all = lq + 2 * lkv;
    let rounds = all.div_ceil(4);
    let wpt = rounds.div_ceil(ROUNDS);
    let mut o = Out {
        q: vec![0; tokens * lq * HD],
        k: vec![0; cache_slots * lkv * HD],
        v: vec![0; cache_slots * lkv * HD],
        wq: vec![0; tokens * lq * HD],
        wk: vec![0; cache_slots * lkv * HD],
        wv: vec![0; cache_slots * lkv * HD],
    };
    let blocks = (tokens * wpt).div_ceil(WARPS);
    for block in 0..blocks {
        for warp in 0..WARPS {
            let w = block * WARPS + warp;
            if w >= tokens * wpt {
                continue;
            }
            let t = w / wpt;
            let r0 = (w - t * wpt) * ROUNDS;
            let r1 = (r0 + ROUNDS).min(rounds);
            let slot = slots[t];
            for k in 0..ROUNDS {
                if r0 + k >= r1 {
                    break;
                }
                // Each lane's 8 + 8 values and sum of squares, then the group's shuffles.
                let mut a = [[0f32; 8]; 32];
                let mut b = [[0f32; 8]; 32];
                let mut ss = [0f32; 32];
                let mut live = [false; 32];
                for lane in 0..32 {
                    let (grp, sub) = (lane & 7, lane >> 3);
                    let hh = 4 * (r0 + k) + sub;
                    live[lane] = hh < all && (hh < lq || slot >= 0);
                    if !live[lane] {
                        continue;
                    }
                    let row = &qkv[(t * all + hh) * HD..(t * all + hh + 1) * HD];
                    for e in 0..8 {
                        a[lane][e] = fl(row[8 * grp + e]);
                        b[lane][e] = fl(row[64 + 8 * grp + e]);
                        ss[lane] += a[lane][e] * a[lane][e] + b[lane][e] * b[lane][e];
                    }
                }
                for m in [1, 2, 4] {
                    let prev = ss;
                    for lane in 0..32 {
                        ss[lane] = prev[lane] + prev[lane ^ m];
                    }
                }
                for lane in 0..32 {
                    if !live[lane] {
                        continue;
                    }
                    let (grp, sub) = (lane & 7, lane >> 3);
                    let hh = 4 * (r0 + k) + sub;
                    if hh >= lq + lkv {
                        let j = hh - lq - lkv;
                        let base = (slot as usize * lkv + j) * HD;
                        for e in 0..8 {
                            for (d, x) in
                                [(8 * grp + e, a[lane][e]), (64 + 8 * grp + e, b[lane][e])]
                            {
                                o.v[base + d] = bf(x);
                                o.wv[base + d] += 1;
                            }
                        }
                        continue;
                    }
                    let (mut x, mut y) = (a[lane], b[lane]);
                    if let Some((qn, kn)) = norms {
                        let nw = if hh < lq { qn } else { kn };
                        let inv = 1.0 / (ss[lane] / HD as f32 + eps).sqrt();
                        for e in 0..8 {
                            x[e] = x[e] * inv * fl(nw[8 * grp + e]);
                            y[e] = y[e] * inv * fl(nw[64 + 8 * grp + e]);
                        }
                    }
                    let (out, wr, base) = if hh < lq {
                        (&mut o.q, &mut o.wq, (t * lq + hh) * HD)
                    } else {
                        (&mut o.k, &mut o.wk, (slot as usize * lkv + hh - lq) * HD)
                    };
                    for e in 0..8 {
                        let (sn, cs) = (pos[t] as f32 * inv_freq[8 * grp + e]).sin_cos();
                        let (d0, d1) = (base + 8 * grp + e, base + 64 + 8 * grp + e);
                        out[d0] = bf(x[e] * cs - y[e] * sn);
                        out[d1] = bf(y[e] * cs + x[e] * sn);
                        wr[d0] += 1;
                        wr[d1] += 1;
                    }
                }
            }
        }
    }
    o
}

/// The f64 reference of one head row: normed (when `nw`), rotated half against half.
fn reference(row: &[u16], nw: Option<&[u16]>, p: i32, inv_freq: &[f32], eps: f64) -> Vec<f64> {
    let x: Vec<f64> = row.iter().map(|&v| f64::from(fl(v))).collect();
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / HD as f64 + eps).sqrt();
    let y: Vec<f64> = match nw {
        Some(w) => x
            .iter()
            .zip(w)
            .map(|(v, &w)| v * inv * f64::from(fl(w)))
            .collect(),
        None => x,
    };
    let mut out = vec![0f64; HD];
    for i in 0..HD / 2 {
        let (sn, cs) = (f64::from(p) * f64::from(inv_freq[i])).sin_cos();
        out[i] = y[i] * cs - y[i + 64] * sn;
        out[i + 64] = y[i + 64] * cs + y[i] * sn;
    }
    out
}

#[test]
fn wide_qkv_rope_writes_each_element_once_and_matches_f64() {
    // (q heads, kv heads, tokens, q/k norm): Qwen3-30B-A3B's 32/4 (10 rounds, two warps a
    // token), 8/1 (a round of q and k heads mixed with the value head), 6/2 (rounds past the
    // heads).
    for (lq, lkv, tokens, norm) in [(32, 4, 9, true), (8, 1, 7, true), (6, 2, 5, false)] {
        let all = lq + 2 * lkv;
        let qkv: Vec<u16> = rand_bf16_f32(tokens * all * HD, 3 + lq as u64)
            .iter()
            .map(|&v| bf(4.0 * v))
            .collect();
        let pos: Vec<i32> = (0..tokens as i32).map(|i| 37 * i + 5).collect();
        // Token 1 is padding (slot -1); the others land on scattered slots.
        let slots: Vec<i64> = (0..tokens as i64)
            .map(|i| if i == 1 { -1 } else { (3 * i + 2) % 32 })
            .collect();
        let inv_freq: Vec<f32> = (0..HD / 2)
            .map(|i| 1_000_000f32.powf(-((2 * i) as f32) / HD as f32))
            .collect();
        let qn: Vec<u16> = rand_bf16_f32(HD, 11)
            .iter()
            .map(|&v| bf(1.0 + 0.5 * v))
            .collect();
        let kn: Vec<u16> = rand_bf16_f32(HD, 12)
            .iter()
            .map(|&v| bf(1.0 + 0.5 * v))
            .collect();
        let norms = norm.then_some((&qn[..], &kn[..]));
        let o = emu_wide(
            &qkv,
            (lq, lkv, tokens),
            &pos,
            &slots,
            &inv_freq,
            norms,
            1e-6,
            32,
        );
        let what = format!("{lq}/{lkv} heads, {tokens} tokens, norm {norm}");
        assert!(
            o.wq.iter().all(|&c| c == 1),
            "{what}: q written {:?}",
            o.wq.iter().max()
        );
        for s in 0..32 {
            let owner = slots.iter().position(|&x| x == s as i64);
            for (name, wr) in [("k", &o.wk), ("v", &o.wv)] {
                let want = u8::from(owner.is_some());
                let got = &wr[s * lkv * HD..(s + 1) * lkv * HD];
                assert!(got.iter().all(|&c| c == want), "{what}: {name} slot {s}");
            }
        }
        let mut worst = 0f64;
        for t in 0..tokens {
            let row = |h: usize| &qkv[(t * all + h) * HD..(t * all + h + 1) * HD];
            let mut check = |got: &[u16], want: Vec<f64>| {
                for (g, w) in got.iter().zip(want) {
                    worst = worst.max((f64::from(fl(*g)) - w).abs() / (w.abs() + 1e-2));
                }
            };
            for h in 0..lq {
                let want = reference(row(h), norm.then_some(&qn[..]), pos[t], &inv_freq, 1e-6);
                check(&o.q[(t * lq + h) * HD..(t * lq + h + 1) * HD], want);
            }
            if slots[t] < 0 {
                continue;
            }
            let s = slots[t] as usize;
            for j in 0..lkv {
                let want = reference(
                    row(lq + j),
                    norm.then_some(&kn[..]),
                    pos[t],
                    &inv_freq,
                    1e-6,
                );
                check(&o.k[(s * lkv + j) * HD..(s * lkv + j + 1) * HD], want);
                let v = row(lq + lkv + j);
                assert_eq!(
                    &o.v[(s * lkv + j) * HD..(s * lkv + j + 1) * HD],
                    v,
                    "{what}: v"
                );
            }
        }
        println!("{what}: worst relative error {worst:.2e}");
        // bf16 outputs: within a few of their ulps (2^-8 relative).
        assert!(worst < 6e-3, "{what}: {worst:e}");
    }
}
