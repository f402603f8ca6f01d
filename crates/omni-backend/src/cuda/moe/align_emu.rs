//! CPU emulator of `moe_align` (`kernels/moe/align.cu`) over its threads: each thread's pairs
//! `p0 + j nt` read `MOE_ALIGN_ILP` at a time (`moe_align_ids`), the counts, the prefix sum of
//! the padded block counts, the padding and the scatter. Checked against the definition: every
//! valid pair lands exactly once in its expert's blocks, each expert's blocks are its padded
//! count, padding rows are -1 and blocks past the used ones have expert -1.

#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

/// `MOE_ALIGN_ILP`.
const ILP: usize = 8;

/// The pairs thread `tid` of `nt` visits, in its order.
fn thread_pairs(tid: usize, nt: usize, pairs: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut p0 = tid;
    while p0 < pairs {
        for j in 0..ILP {
            let p = p0 + j * nt;
            if p < pairs {
                out.push(p);
            }
        }
        p0 += ILP * nt;
    }
    out
}

/// `moe_align` with `nt` threads: (sorted_ids, block_expert).
fn emu_align(
    ids: &[i32],
    e: usize,
    bm: usize,
    max_blocks: usize,
    nt: usize,
) -> (Vec<i32>, Vec<i32>) {
    let pairs = ids.len();
    let valid = |x: i32| x >= 0 && (x as usize) < e;
    let mut cnt = vec![0usize; e];
    let mut seen = vec![0u8; pairs];
    for tid in 0..nt {
        for p in thread_pairs(tid, nt, pairs) {
            seen[p] += 1;
            if valid(ids[p]) {
                cnt[ids[p] as usize] += 1;
            }
        }
    }
    assert!(seen.iter().all(|&c| c == 1), "a pair read other than once");
    let mut boff = vec![0usize; e];
    let mut total = 0;
    for x in 0..e {
        boff[x] = total;
        total += cnt[x].div_ceil(bm);
    }
    let mut sorted = vec![i32::MIN; max_blocks * bm];
    let mut bexp = vec![i32::MIN; max_blocks];
    for x in 0..e {
        let nb = cnt[x].div_ceil(bm);
        for b in 0..nb {
            if boff[x] + b < max_blocks {
                bexp[boff[x] + b] = x as i32;
            }
        }
        for q in cnt[x]..nb * bm {
            if boff[x] + q / bm < max_blocks {
                sorted[boff[x] * bm + q] = -1;
            }
        }
    }
    for b in total..max_blocks {
        bexp[b] = -1;
    }
    // The scatter: threads in reverse order (any order of the atomics is legal).
    let mut cur = vec![0usize; e];
    for tid in (0..nt).rev() {
        for p in thread_pairs(tid, nt, pairs) {
            if valid(ids[p]) {
                let x = ids[p] as usize;
                let slot = cur[x];
                cur[x] += 1;
                if boff[x] + slot / bm < max_blocks {
                    sorted[boff[x] * bm + slot] = p as i32;
                }
            }
        }
    }
    (sorted, bexp)
}

#[test]
fn align_places_every_pair_once_in_its_experts_blocks() {
    // (pairs, experts, block rows, threads): more pairs than ILP x threads, fewer than threads,
    // a partial last round, ids out of range.
    for (pairs, e, bm, nt) in [(16384, 128, 128, 1024), (37, 8, 16, 64), (1000, 60, 64, 96)] {
        let ids: Vec<i32> = (0..pairs)
            .map(|p| match p % 97 {
                0 => -1,
                1 => e as i32,
                _ => ((p * 2_654_435_761usize) >> 7) as i32 % e as i32,
            })
            .collect();
        let max_blocks = (pairs + e * (bm - 1)).div_ceil(bm);
        let (sorted, bexp) = emu_align(&ids, e, bm, max_blocks, nt);
        let what = format!("pairs={pairs} e={e} bm={bm} nt={nt}");
        let mut placed = vec![0u8; pairs];
        for (b, &x) in bexp.iter().enumerate() {
            assert_ne!(x, i32::MIN, "{what}: block {b} expert unset");
            let rows = &sorted[b * bm..(b + 1) * bm];
            if x < 0 {
                continue;
            }
            for &p in rows {
                assert_ne!(p, i32::MIN, "{what}: block {b} row unset");
                if p >= 0 {
                    assert_eq!(ids[p as usize], x, "{what}: pair {p} in expert {x}'s block");
                    placed[p as usize] += 1;
                }
            }
        }
        for p in 0..pairs {
            let want = u8::from(ids[p] >= 0 && (ids[p] as usize) < e);
            assert_eq!(placed[p], want, "{what}: pair {p}");
        }
    }
}
