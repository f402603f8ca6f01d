//! CPU emulation of the wgmma prefill kernel (`kernels/attention/prefill_wg.cu`, no GPU needed),
//! CTA by CTA and thread by thread: the slot table, every `cp.async` piece (swizzled) into its
//! stage with the kernel's commit groups and waits, and the two `wgmma` forms as the PTX ISA
//! defines them, independent of how the kernel stores its tiles: operands read through the
//! matrix descriptors' canonical layouts (K-major and MN-major, 128-byte swizzle applied to the
//! address), the A register fragment and the accumulators placed by CUTLASS's
//! `ALayout_64x16` / `CLayout_64xN`. Then the mask, the online softmax with its quad shuffles,
//! P rounded to bf16, and the epilogue, compared with [`crate::attention::paged_attention`].
//!
//! Beyond the numbers it checks that no operand is read while a copy into it is in flight or
//! before a barrier made it visible (a copy's chunks are poisoned from issue to the wait that
//! lands it), that no copy is issued into a chunk an unretired `wgmma` reads, that the slot
//! table is read only after a barrier since it was written, and that every output element of
//! a query token is written exactly once (and nothing else).
//!
//! Here: the hardware model (swizzle, descriptors, fragments, shared memory with the copy
//! pipeline's state, the two `wgmma` forms); in `pingpong.rs` the ping-pong variant's barriers
//! and programs; in `cta.rs` the CTA walk, the launch and the comparison with the reference.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::needless_range_loop)]

use std::collections::VecDeque;

use super::WGMMA_HEAD_DIM;
use crate::cuda::bf16;

const HD: usize = WGMMA_HEAD_DIM;

fn bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
fn val(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}
fn round(x: f32) -> f32 {
    val(bits(x))
}
/// `pack_bf16x2(lo, hi)`.
fn pack(lo: f32, hi: f32) -> u32 {
    u32::from(bits(lo)) | (u32::from(bits(hi)) << 16)
}

mod cta;
mod pingpong;

use pingpong::Bar;

/// The hardware's 128-byte swizzle of a shared-memory byte address: bits 4-6 ^= bits 7-9.
fn swizzle128(addr: usize) -> usize {
    addr ^ (((addr >> 7) & 7) << 4)
}

/// A wgmma descriptor's fields (start address, leading and stride byte offsets), checked to be
/// the 128-byte swizzle with base offset 0.
fn desc_fields(desc: u64) -> (usize, usize, usize) {
    assert_eq!(
        desc >> 62,
        1,
        "descriptor {desc:#x}: not the 128-byte swizzle"
    );
    assert_eq!((desc >> 49) & 7, 0, "descriptor {desc:#x}: base offset");
    let f = |shift: u32| (((desc >> shift) & 0x3FFF) as usize) << 4;
    (f(0), f(16), f(32))
}

/// `apw_desc_k` of the kernel.
fn desc_k(addr: u32) -> u64 {
    u64::from((addr & 0x3FFFF) >> 4) | (64 << 32) | (1 << 62)
}
/// `apw_desc_mn` of the kernel.
fn desc_mn(addr: u32, lbo: u32) -> u64 {
    u64::from((addr & 0x3FFFF) >> 4)
        | (u64::from((lbo & 0x3FFFF) >> 4) << 16)
        | (64 << 32)
        | (1 << 62)
}

/// Byte address of element (mn, k) of a K-major 128B-swizzled operand, k < 16: the canonical
/// layout ((8,m),(T,2k)):((8T,SBO),(1,T)) in elements (PTX ISA, T = 8 bf16 per 16 bytes).
fn k_major_addr(desc: u64, mn: usize, k: usize) -> usize {
    let (start, _lbo, sbo) = desc_fields(desc);
    swizzle128(start + (mn / 8) * sbo + (mn % 8) * 128 + 2 * k)
}
/// Byte address of element (k, n) of an MN-major 128B-swizzled operand, k < 16: the canonical
/// layout ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) in elements.
fn mn_major_addr(desc: u64, k: usize, n: usize) -> usize {
    let (start, lbo, sbo) = desc_fields(desc);
    swizzle128(start + (n / 64) * lbo + (n % 64) * 2 + (k % 8) * 128 + (k / 8) * sbo)
}

/// (row, column) of value `v` of thread `t` of a warpgroup in an m64 fragment of column-major
/// (64 x cols) index `thread-stride . t + value-stride . v`: CUTLASS's `CLayout_64xN`
/// ((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512)) and, for the bf16 A registers,
/// `ALayout_64x16` ((4,8,4),(2,2,2)):((128,1,16),(64,8,512)).
fn frag_coord(t: usize, v: usize) -> (usize, usize) {
    let idx = (t % 4) * 128
        + ((t / 4) % 8)
        + (t / 32) * 16
        + (v % 2) * 64
        + ((v / 2) % 2) * 8
        + (v / 4) * 512;
    (idx % 64, idx / 64)
}

/// Shared memory of one CTA with the copy pipeline's state per 16-byte chunk.
struct Smem {
    data: Vec<u16>,
    /// `None` while a copy into the chunk is in flight, else the barrier phase it landed in.
    landed: Vec<Option<u64>>,
    groups: VecDeque<Vec<(usize, [u16; 8])>>,
    open: Vec<(usize, [u16; 8])>,
    phase: u64,
    /// Per warpgroup, the chunks each unretired wgmma group reads.
    inflight: Vec<VecDeque<Vec<usize>>>,
    /// The slot table (`s_slot`): value and the phase it was written in.
    slots: Vec<Option<(i32, u64)>>,
    /// Ping-pong: the mbarrier and tile whose copy last landed in the chunk.
    owner: Vec<Option<(Bar, usize)>>,
}

impl Smem {
    fn new(bytes: usize, wgs: usize, bn: usize) -> Self {
        Self {
            data: vec![0; bytes / 2],
            landed: vec![Some(0); bytes / 16],
            groups: VecDeque::new(),
            open: Vec::new(),
            phase: 1,
            inflight: vec![VecDeque::new(); wgs],
            slots: vec![None; 3 * bn],
            owner: vec![None; bytes / 16],
        }
    }
    fn cp16(&mut self, dst: usize, src: Option<&[f32]>) {
        assert_eq!(dst % 16, 0);
        let chunk = dst / 16;
        for (w, groups) in self.inflight.iter().enumerate() {
            assert!(
                !groups.iter().any(|g| g.contains(&chunk)),
                "cp.async into chunk {chunk} while warpgroup {w}'s wgmma reads it"
            );
        }
        let mut v = [0u16; 8];
        if let Some(src) = src {
            for e in 0..8 {
                v[e] = bits(src[e]);
            }
        }
        self.landed[chunk] = None;
        self.open.push((chunk, v));
    }
    fn commit(&mut self) {
        let g = std::mem::take(&mut self.open);
        self.groups.push_back(g);
    }
    /// `cp.async.wait_group n`.
    fn wait(&mut self, n: usize) {
        while self.groups.len() > n {
            for (chunk, v) in self.groups.pop_front().unwrap() {
                self.data[chunk * 8..chunk * 8 + 8].copy_from_slice(&v);
                self.landed[chunk] = Some(self.phase);
            }
        }
    }
    fn barrier(&mut self) {
        self.phase += 1;
    }
    /// An operand element as wgmma reads it, recorded for the warpgroup's open wgmma group.
    fn operand(&self, addr: usize, reads: &mut Vec<usize>) -> f32 {
        let chunk = addr / 16;
        match self.landed[chunk] {
            Some(p) if p < self.phase => {}
            other => panic!(
                "wgmma reads chunk {chunk} (landed {other:?}) in phase {}",
                self.phase
            ),
        }
        if reads.last() != Some(&chunk) {
            reads.push(chunk);
        }
        val(self.data[addr / 2])
    }
    fn write_slot(&mut self, i: usize, v: i32) {
        self.slots[i] = Some((v, self.phase));
    }
    fn read_slot(&self, i: usize) -> i32 {
        let (v, p) = self.slots[i].expect("slot read before any write");
        assert!(p < self.phase, "slot {i} read in the phase it was written");
        v
    }
}

/// One warpgroup's registers: per thread O, S, P and the softmax state.
struct Wg {
    o: Vec<[f32; HD / 2]>,
    s: Vec<Vec<f32>>,
    p: Vec<Vec<[u32; 4]>>,
    m: Vec<[f32; 2]>,
    l: Vec<[f32; 2]>,
    alpha: Vec<[f32; 2]>,
}

/// `wgmma m64n{n}k16` with both operands K-major in shared memory: d (+)= A B^T.
fn wgmma_ss(sm: &Smem, d: &mut [Vec<f32>], da: u64, db: u64, n: usize, first: bool) -> Vec<usize> {
    let mut reads = Vec::new();
    let a: Vec<Vec<f32>> = (0..64)
        .map(|m| {
            (0..16)
                .map(|k| sm.operand(k_major_addr(da, m, k), &mut reads))
                .collect()
        })
        .collect();
    let b: Vec<Vec<f32>> = (0..n)
        .map(|c| {
            (0..16)
                .map(|k| sm.operand(k_major_addr(db, c, k), &mut reads))
                .collect()
        })
        .collect();
    for t in 0..128 {
        for v in 0..n / 2 {
            let (r, c) = frag_coord(t, v);
            let x: f32 = (0..16).map(|k| a[r][k] * b[c][k]).sum();
            d[t][v] = if first { x } else { d[t][v] + x };
        }
    }
    reads
}

/// `wgmma m64n128k16` with A from registers and B MN-major in shared memory: d += A B.
fn wgmma_rs(sm: &Smem, d: &mut [[f32; HD / 2]], a: &[[u32; 4]], db: u64) -> Vec<usize> {
    let mut reads = Vec::new();
    let mut am = [[f32::NAN; 16]; 64];
    for t in 0..128 {
        for v in 0..8 {
            let (r, k) = frag_coord(t, v);
            let reg = a[t][v / 2];
            am[r][k] = val(if v % 2 == 0 {
                reg as u16
            } else {
                (reg >> 16) as u16
            });
        }
    }
    let b: Vec<Vec<f32>> = (0..16)
        .map(|k| {
            (0..HD)
                .map(|c| sm.operand(mn_major_addr(db, k, c), &mut reads))
                .collect()
        })
        .collect();
    for t in 0..128 {
        for v in 0..HD / 2 {
            let (r, c) = frag_coord(t, v);
            d[t][v] += (0..16).map(|k| am[r][k] * b[k][c]).sum::<f32>();
        }
    }
    reads
}

#[test]
fn descriptor_layouts_address_the_kernels_swizzled_tiles() {
    // K-major: element (row r, k) of k16 step ks lives at chunk (2 ks + k / 8) ^ (r % 8) of row r.
    for ks in 0..4u32 {
        let d = desc_k(4096 + 32 * ks);
        for r in 0..64 {
            for k in 0..16 {
                let ch = (2 * ks as usize + k / 8) ^ (r % 8);
                assert_eq!(
                    k_major_addr(d, r, k),
                    4096 + r * 128 + ch * 16 + 2 * (k % 8)
                );
            }
        }
    }
    // MN-major V: element (key 16 kk + k, dim n) of a [64 keys][64 dims] x 2 tile.
    for kk in 0..4u32 {
        let d = desc_mn(8192 + 2048 * kk, 64 * 128);
        for k in 0..16 {
            for n in 0..128 {
                let key = 16 * kk as usize + k;
                let ch = ((n % 64) / 8) ^ (key % 8);
                let want = 8192 + (n / 64) * 64 * 128 + key * 128 + ch * 16 + 2 * (n % 8);
                assert_eq!(mn_major_addr(d, k, n), want);
            }
        }
    }
    // The CUTLASS fragments are the m16n8 layout per warp.
    for t in 0..128 {
        let (w, g, c) = (t / 32, (t % 32) / 4, t % 4);
        for v in 0..64 {
            let want = (16 * w + g + 8 * ((v % 4) / 2), 8 * (v / 4) + 2 * c + v % 2);
            assert_eq!(frag_coord(t, v), want);
        }
    }
}
