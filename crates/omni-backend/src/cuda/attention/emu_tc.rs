//! CPU emulation of one CTA of the tensor-core decode kernel (`kernels/attention/decode_tc.cu`),
//! lane by lane: each warp's cp.async pieces into its two-stage ring (swizzled), issued in the
//! kernel's order (the next chunk lands before this one is computed, so a stage mix-up shows),
//! `ldmatrix` (plain and `.trans`) and `mma.m16n8k16` with the PTX fragment layouts, the masked
//! online softmax, P rounded to bf16 as the A operand, the quad shuffles, and the warps' merge
//! through shared memory. `emu.rs` runs it inside its launch emulation (partitions, workspace,
//! counters, the fused merge) and compares with the CPU reference.
//!
//! Beyond the numbers it checks that every piece of every context token is loaded exactly once,
//! that no chunk slot of a ring is written twice by one load, and that every output element of
//! a warp's result is written exactly once.

#![allow(clippy::needless_range_loop)]

use super::TC_TILE;
use crate::cuda::bf16;
use crate::cuda::mma_emu::{ldsm_x4, mma};

/// The kernel's constants.
const NW: usize = 4;
const CHUNK: usize = 16;
const GM: usize = TC_TILE;

/// What one CTA serves: KV head, its first query head `hbase`, `rows` heads of the tile, the
/// query token, the partition's first position and its length.
pub(super) struct TcCta {
    pub(super) kvh: usize,
    pub(super) hbase: usize,
    pub(super) rows: usize,
    pub(super) qs: usize,
    pub(super) start: i32,
    pub(super) n: usize,
    pub(super) scale_log2: f32,
}

fn bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
/// `pack_bf16x2(lo, hi)` (round to nearest even).
fn pack(lo: f32, hi: f32) -> u32 {
    u32::from(bits(lo)) | (u32::from(bits(hi)) << 16)
}
/// `swz<C>` of prefill.cu.
fn swz(c: usize, r: usize, ch: usize) -> usize {
    if c >= 8 { ch ^ (r & 7) } else { ch }
}

/// `v[t] = op(v[t], __shfl_xor_sync(v, 1))`, then the same with 2 (a quad's reduction).
fn quad(v: &mut [f32; 32], op: fn(f32, f32) -> f32) {
    for m in [1, 2] {
        let old = *v;
        for t in 0..32 {
            v[t] = op(old[t], old[t ^ m]);
        }
    }
}

/// One warp's (max, sum, O) of rows 0..GM over its chunks w, w + 4, ..
struct WarpResult {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

/// One CTA: (head in the tile, max, sum, normalized output) for its `rows` heads.
pub(super) fn emu_tc_cta(
    b: &super::emu::Batch,
    btab: &[i32],
    cta: &TcCta,
) -> Vec<(usize, f32, f32, Vec<f32>)> {
    let (hd, nkv) = (b.hd, b.nkv);
    let c_n = hd / 8;
    let tile = CHUNK * hd;
    let cpl = CHUNK * c_n / 32;
    let nchunks = cta.n.div_ceil(CHUNK);
    let (bs, mbps, nblk) = (b.bs as i32, b.mbps as i32, b.num_blocks as i32);
    // Pieces of each context token loaded (K and V go together).
    let mut loaded = vec![0u8; cta.n * c_n];
    // Q fragments, the same for every warp.
    let qrow = |g: usize| &b.q[(cta.qs * b.nh + cta.hbase + g) * hd..][..hd];
    let mut qf = vec![[[0u32; 4]; 32]; hd / 16];
    for (kk, frag) in qf.iter_mut().enumerate() {
        for t in 0..32 {
            let (g, q) = (t / 4, t % 4);
            if g < cta.rows {
                let r = qrow(g);
                frag[t][0] = pack(r[kk * 16 + 2 * q], r[kk * 16 + 2 * q + 1]);
                frag[t][2] = pack(r[kk * 16 + 8 + 2 * q], r[kk * 16 + 8 + 2 * q + 1]);
            }
        }
    }
    let mut warps = Vec::new();
    for w in 0..NW {
        // ring[st]: K chunk then V chunk.
        let mut ring = vec![vec![0u16; 2 * tile]; 2];
        let mut load = |chunk: usize, ring: &mut Vec<u16>| {
            let mut wrote = vec![0u8; CHUNK * c_n];
            for lane in 0..32 {
                for k in 0..cpl {
                    let idx = lane + 32 * k;
                    let (r, ch) = (idx / c_n, idx % c_n);
                    let i = chunk * CHUNK + r;
                    let at = r * hd + swz(c_n, r, ch) * 8;
                    wrote[at / 8] += 1;
                    for e in 0..8 {
                        ring[at + e] = 0;
                        ring[tile + at + e] = 0;
                    }
                    if i < cta.n {
                        loaded[i * c_n + ch] += 1;
                        let slot = super::emu::kv_slot(btab, cta.start + i as i32, bs, mbps, nblk);
                        let src = (slot as usize * nkv + cta.kvh) * hd + ch * 8;
                        for e in 0..8 {
                            ring[at + e] = bits(b.k[src + e]);
                            ring[tile + at + e] = bits(b.v[src + e]);
                        }
                    }
                }
            }
            assert!(wrote.iter().all(|&x| x == 1), "a ring piece written twice");
        };
        let mut o = vec![vec![[0f32; 4]; hd / 8]; 32];
        let mut m_run = [f32::NEG_INFINITY; 32];
        let mut l_run = [0f32; 32];
        let mut st = 0;
        if w < nchunks {
            load(w, &mut ring[0]);
        }
        for chunk in (w..nchunks).step_by(NW) {
            if chunk + NW < nchunks {
                load(chunk + NW, &mut ring[st ^ 1]);
            }
            let (sk, sv) = ring[st].split_at(tile);
            let mut sacc = [[[0f32; 4]; 32]; 2];
            for kk in 0..hd / 16 {
                let mut addr = [0usize; 32];
                for (lane, a) in addr.iter_mut().enumerate() {
                    let (lrow, lsel1, lsel2) = (lane & 7, (lane >> 3) & 1, lane >> 4);
                    let (r, ck) = (lrow + 8 * lsel2, 2 * kk + lsel1);
                    *a = r * hd + swz(c_n, r, ck) * 8;
                }
                let bf = ldsm_x4(sk, &addr, false);
                let (b0, b1, b2, b3) = (
                    bf.map(|r| r[0]),
                    bf.map(|r| r[1]),
                    bf.map(|r| r[2]),
                    bf.map(|r| r[3]),
                );
                mma(&mut sacc[0], &qf[kk], &b0, &b1);
                mma(&mut sacc[1], &qf[kk], &b2, &b3);
            }
            let mut tmax = [f32::NEG_INFINITY; 32];
            for t in 0..32 {
                for nt in 0..2 {
                    for e in 0..2 {
                        let key = chunk * CHUNK + nt * 8 + 2 * (t % 4) + e;
                        let v = if key < cta.n {
                            sacc[nt][t][e] * cta.scale_log2
                        } else {
                            f32::NEG_INFINITY
                        };
                        sacc[nt][t][e] = v;
                        tmax[t] = tmax[t].max(v);
                    }
                }
            }
            quad(&mut tmax, f32::max);
            let mut a = [[0u32; 4]; 32];
            for t in 0..32 {
                let m_new = m_run[t].max(tmax[t]);
                assert!(m_new.is_finite(), "chunk {chunk} without a key");
                let alpha = (m_run[t] - m_new).exp2();
                m_run[t] = m_new;
                let mut rs = 0.0;
                for nt in 0..2 {
                    for e in 0..2 {
                        let p = (sacc[nt][t][e] - m_new).exp2();
                        sacc[nt][t][e] = p;
                        rs += p;
                    }
                }
                l_run[t] = l_run[t] * alpha + rs;
                for od in o[t].iter_mut() {
                    od[0] *= alpha;
                    od[1] *= alpha;
                }
                a[t] = [
                    pack(sacc[0][t][0], sacc[0][t][1]),
                    0,
                    pack(sacc[1][t][0], sacc[1][t][1]),
                    0,
                ];
            }
            for dd in 0..hd / 16 {
                let mut addr = [0usize; 32];
                for (lane, ad) in addr.iter_mut().enumerate() {
                    let (lrow, lsel1, lsel2) = (lane & 7, (lane >> 3) & 1, lane >> 4);
                    let (r, cv) = (lrow + 8 * lsel1, 2 * dd + lsel2);
                    *ad = r * hd + swz(c_n, r, cv) * 8;
                }
                let bf = ldsm_x4(sv, &addr, true);
                for (half, (i0, i1)) in [(0usize, (0usize, 1usize)), (1, (2, 3))] {
                    let mut c: [[f32; 4]; 32] = std::array::from_fn(|t| o[t][2 * dd + half]);
                    mma(&mut c, &a, &bf.map(|r| r[i0]), &bf.map(|r| r[i1]));
                    for t in 0..32 {
                        o[t][2 * dd + half] = c[t];
                    }
                }
            }
            st ^= 1;
        }
        quad(&mut l_run, |x, y| x + y);
        let mut res = WarpResult {
            m: vec![f32::NAN; GM],
            l: vec![f32::NAN; GM],
            o: vec![f32::NAN; GM * hd],
        };
        let mut wrote = vec![0u8; GM * hd];
        for t in 0..32 {
            let (g, q) = (t / 4, t % 4);
            for dt in 0..hd / 8 {
                for e in 0..2 {
                    let at = g * hd + dt * 8 + 2 * q + e;
                    res.o[at] = o[t][dt][e];
                    wrote[at] += 1;
                }
            }
            if q == 0 {
                res.m[g] = m_run[t];
                res.l[g] = l_run[t];
            }
        }
        assert!(
            wrote.iter().all(|&x| x == 1),
            "warp {w}: a result element not written once"
        );
        warps.push(res);
    }
    assert!(
        loaded.iter().all(|&x| x == 1),
        "a piece of a context token not loaded exactly once"
    );
    (0..cta.rows)
        .map(|r| {
            let mx = warps
                .iter()
                .map(|w| w.m[r])
                .fold(f32::NEG_INFINITY, f32::max);
            let lv: f32 = warps.iter().map(|w| w.l[r] * (w.m[r] - mx).exp2()).sum();
            let o = (0..hd)
                .map(|d| {
                    let ov: f32 = warps
                        .iter()
                        .map(|w| (w.m[r] - mx).exp2() * w.o[r * hd + d])
                        .sum();
                    ov / lv
                })
                .collect();
            (r, mx, lv, o)
        })
        .collect()
}
