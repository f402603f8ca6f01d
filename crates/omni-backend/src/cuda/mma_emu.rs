//! CPU emulation of the warp-level tensor-core instructions the kernels use, lane by lane
//! (test builds): `ldmatrix` (plain and `.trans`) and `mma.sync.m16n8k16` bf16 -> f32 with the
//! PTX fragment layouts. The kernel emulators (`attention/emu_tc.rs`, `moe/route_mma_emu.rs`)
//! build on them, so a wrong row address or fragment index shows as a wrong number.

#![allow(clippy::needless_range_loop)]

use crate::cuda::bf16;

fn unpack(r: u32) -> (f32, f32) {
    (
        bf16::from_bits(r as u16).to_f32(),
        bf16::from_bits((r >> 16) as u16).to_f32(),
    )
}

/// `ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16`: lane 8j + i gives row i of matrix j
/// (8 bf16 at `addr[lane]`); lane t receives, in register j, elements (t / 4, 2 (t % 4) + {0,
/// 1}) of matrix j, or with `.trans` elements (2 (t % 4) + {0, 1}, t / 4).
pub(crate) fn ldsm_x4(smem: &[u16], addr: &[usize; 32], trans: bool) -> [[u32; 4]; 32] {
    let mut out = [[0u32; 4]; 32];
    for (t, regs) in out.iter_mut().enumerate() {
        for (j, reg) in regs.iter_mut().enumerate() {
            let el = |row: usize, col: usize| smem[addr[8 * j + row] + col];
            let (r0, c0, r1, c1) = if trans {
                (2 * (t % 4), t / 4, 2 * (t % 4) + 1, t / 4)
            } else {
                (t / 4, 2 * (t % 4), t / 4, 2 * (t % 4) + 1)
            };
            *reg = u32::from(el(r0, c0)) | (u32::from(el(r1, c1)) << 16);
        }
    }
    out
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, c += a b, with lane t = 4 g + c:
/// a = {A[g][2c..], A[g+8][2c..], A[g][2c+8..], A[g+8][2c+8..]}, b = {B[2c..][g],
/// B[2c+8..][g]}, c = {D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1]}.
pub(crate) fn mma(c: &mut [[f32; 4]; 32], a: &[[u32; 4]; 32], b0: &[u32; 32], b1: &[u32; 32]) {
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    for t in 0..32 {
        let (g, q) = (t / 4, t % 4);
        for (reg, (row, col)) in [
            (g, 2 * q),
            (g + 8, 2 * q),
            (g, 2 * q + 8),
            (g + 8, 2 * q + 8),
        ]
        .into_iter()
        .enumerate()
        {
            let (lo, hi) = unpack(a[t][reg]);
            am[row][col] = lo;
            am[row][col + 1] = hi;
        }
        for (reg, k) in [(b0[t], 2 * q), (b1[t], 2 * q + 8)] {
            let (lo, hi) = unpack(reg);
            bm[k][g] = lo;
            bm[k + 1][g] = hi;
        }
    }
    let d = |row: usize, col: usize| (0..16).map(|k| am[row][k] * bm[k][col]).sum::<f32>();
    for t in 0..32 {
        let (g, q) = (t / 4, t % 4);
        c[t][0] += d(g, 2 * q);
        c[t][1] += d(g, 2 * q + 1);
        c[t][2] += d(g + 8, 2 * q);
        c[t][3] += d(g + 8, 2 * q + 1);
    }
}
