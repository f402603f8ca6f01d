//! CPU tests of the decode kernel's indexing (`kernels/attention/decode.cu`, no GPU needed): a
//! host emulator that runs `attn_decode<HD, GM>` CTA by CTA in a random order, with its warps,
//! token groups and load rounds (the first round's block-table entries and V rows fetched up
//! front), the device-side partition count, the workspace layout, the arrival counters and the
//! last CTA's merge (`attn_merge_partials`), or the reduce kernel (`reduce.cu`) when unfused,
//! against the CPU reference [`crate::attention::paged_attention`]. It checks, beyond the
//! numbers, that every context token is read exactly once, that the prefetched slots are the
//! ones the kernel would compute, that a merge reads only partials written by its own launch
//! (the workspace is shared by shapes of every size), and that every counter is back at zero
//! after a launch (so the next launch, or a graph replay, starts clean).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::needless_range_loop)]

use super::emu_tc::{TcCta, emu_tc_cta};
use super::tests::Lcg;
use super::*;
use crate::attention::{AttentionMetadata, LayerKvCache, paged_attention};
use crate::cuda::bf16;
use crate::cuda::tests::rel_err;

/// Block tables over a shuffled pool of blocks for sequences needing `need[s]` blocks each:
/// the pool holds their sum + 2 blocks, each sequence gets `need[s]` distinct ones in pool
/// order, the flat table has `mbps` = max + 1 entries per sequence (padding entries point at a
/// real block, never read).
pub(super) struct ShuffledTables {
    pub(super) num_blocks: usize,
    pub(super) mbps: usize,
    /// Flat `[sequence][mbps]` table, as the kernels read it.
    pub(super) bt: Vec<i32>,
    /// Each sequence's blocks, as the CPU reference reads them.
    pub(super) tables: Vec<Vec<u32>>,
}

/// [`ShuffledTables`] for `need`, the pool order drawn from `rng`.
pub(super) fn shuffled_tables(need: &[usize], rng: &mut Lcg) -> ShuffledTables {
    let num_blocks = need.iter().sum::<usize>() + 2;
    let mut perm: Vec<usize> = (0..num_blocks).collect();
    for i in (1..num_blocks).rev() {
        perm.swap(i, rng.next(i + 1));
    }
    let mbps = need.iter().copied().max().unwrap_or(0) + 1;
    let mut bt = vec![perm[num_blocks - 1] as i32; need.len() * mbps];
    let mut tables = Vec::new();
    let mut next = 0;
    for (s, &n) in need.iter().enumerate() {
        let t: Vec<u32> = perm[next..next + n].iter().map(|&b| b as u32).collect();
        next += n;
        for (i, &b) in t.iter().enumerate() {
            bt[s * mbps + i] = b as i32;
        }
        tables.push(t);
    }
    ShuffledTables {
        num_blocks,
        mbps,
        bt,
        tables,
    }
}

/// The flat device inputs of one decode call, with the CPU reference output.
pub(super) struct Batch {
    pub(super) nh: usize,
    pub(super) nkv: usize,
    pub(super) hd: usize,
    pub(super) bs: usize,
    pub(super) mbps: usize,
    pub(super) num_blocks: usize,
    pub(super) num_tokens: usize,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) qsl: Vec<i32>,
    pub(super) seq_lens: Vec<i32>,
    pub(super) bt: Vec<i32>,
    pub(super) want: Vec<f32>,
}

impl Batch {
    /// Decode rows of context `lens`; a length of 0 makes a sequence with no query token (its
    /// CTAs must exit at once) and 5 tokens of context.
    fn new(nh: usize, nkv: usize, hd: usize, bs: usize, lens: &[usize], seed: u64) -> Self {
        let mut rng = Lcg(seed);
        let ctx: Vec<usize> = lens.iter().map(|&c| if c == 0 { 5 } else { c }).collect();
        let need: Vec<usize> = ctx.iter().map(|c| c.div_ceil(bs)).collect();
        let ShuffledTables {
            num_blocks,
            mbps,
            bt,
            tables,
        } = shuffled_tables(&need, &mut rng);
        let mut cache = LayerKvCache::new(num_blocks, bs, nkv, hd);
        cache.k.iter_mut().for_each(|x| *x = rng.f32());
        cache.v.iter_mut().for_each(|x| *x = rng.f32());
        let mut qsl = vec![0usize];
        let mut slots = Vec::new();
        for (s, &c) in lens.iter().enumerate() {
            let ql = usize::from(c > 0);
            if ql == 1 {
                let p = c - 1;
                slots.push((tables[s][p / bs] as usize * bs + p % bs) as i64);
            }
            qsl.push(qsl[s] + ql);
        }
        let num_tokens = qsl[lens.len()];
        let q: Vec<f32> = (0..num_tokens * nh * hd).map(|_| rng.f32()).collect();
        let meta = AttentionMetadata {
            slot_mapping: slots,
            block_tables: tables,
            seq_lens: ctx.clone(),
            query_start_loc: qsl.clone(),
        };
        let mut want = vec![0.0; q.len()];
        let scale = 1.0 / (hd as f32).sqrt();
        paged_attention(&q, nh, &cache, &meta, scale, &mut want).unwrap();
        Self {
            nh,
            nkv,
            hd,
            bs,
            mbps,
            num_blocks,
            num_tokens,
            q,
            k: cache.k,
            v: cache.v,
            qsl: qsl.iter().map(|&x| x as i32).collect(),
            seq_lens: ctx.iter().map(|&x| x as i32).collect(),
            bt,
            want,
        }
    }

    fn shape(&self, max_seq_len: usize) -> AttnShape {
        AttnShape {
            num_seqs: self.seq_lens.len(),
            num_tokens: self.num_tokens,
            num_heads: self.nh,
            num_kv_heads: self.nkv,
            head_dim: self.hd,
            block_size: self.bs,
            max_blocks_per_seq: self.mbps,
            max_query_len: 1,
            max_seq_len,
            scale: 1.0 / (self.hd as f32).sqrt(),
        }
    }
}

/// `kv_slot` of `common.cuh`.
pub(super) fn kv_slot(btab: &[i32], key: i32, bs: i32, mbps: i32, num_blocks: i32) -> i32 {
    let bi = (key / bs).min(mbps - 1);
    let off = key - (key / bs) * bs;
    btab[bi as usize].clamp(0, num_blocks - 1) * bs + off
}

/// The device state that outlives a launch: the workspace (with, per row, the launch that wrote
/// it last) and the module's arrival counters.
struct Device {
    ws: Vec<f32>,
    ws_gen: Vec<u64>,
    cnt: Vec<u32>,
    launch: u64,
}

impl Device {
    fn new(ws_len: usize) -> Self {
        Self {
            ws: vec![f32::NAN; ws_len],
            ws_gen: vec![0; ws_len],
            cnt: vec![0; ATTN_COUNTERS],
            launch: 0,
        }
    }
}

fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// The CUDA-core kernel's arithmetic for the heads of one CTA over the tokens `slot_of`:
/// (head in the tile, max, sum, normalized output) each.
fn cuda_core_cta(
    b: &Batch,
    slot_of: &[i32],
    kvh: usize,
    hbase: usize,
    qs: usize,
    heads: &[usize],
    scale_log2: f32,
) -> Vec<(usize, f32, f32, Vec<f32>)> {
    let (hd, nh, nkv, n) = (b.hd, b.nh, b.nkv, slot_of.len());
    let row_of = |slot: i32| (slot as usize * nkv + kvh) * hd;
    heads
        .iter()
        .map(|&g| {
            let qrow = &b.q[(qs * nh + hbase + g) * hd..][..hd];
            let sc: Vec<f32> = slot_of
                .iter()
                .map(|&sl| {
                    let k = &b.k[row_of(sl)..][..hd];
                    qrow.iter().zip(k).map(|(a, c)| a * scale_log2 * c).sum()
                })
                .collect();
            let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let p: Vec<f32> = sc.iter().map(|x| (x - m).exp2()).collect();
            let lsum: f32 = p.iter().sum();
            let o = (0..hd)
                .map(|d| {
                    (0..n)
                        .map(|i| p[i] * b.v[row_of(slot_of[i]) + d])
                        .sum::<f32>()
                        / lsum
                })
                .collect();
            (g, m, lsum, o)
        })
        .collect()
}

/// One launch of the decode kernel (and of the reduce kernel when the plan needs it) on `b`
/// with the grid of `sh` and `plan`, CTAs in an order drawn from `seed`; returns `out`.
fn emu_decode(
    b: &Batch,
    sh: &AttnShape,
    plan: DecodePlan,
    dev: &mut Device,
    seed: u64,
) -> Vec<f32> {
    let (gm, chunks) = (plan.tile, group_size(sh).div_ceil(plan.tile));
    let (hd, nh, nkv) = (b.hd, b.nh, b.nkv);
    // The template's constants.
    let (nw, l) = (4usize, hd / 8);
    let (tpw, u_n) = (32 / l, if gm >= 8 { 4 } else { 8 });
    let tps = nw * tpw;
    let (grid_x, grid_y, grid_z) = (nkv * chunks, sh.num_seqs, plan.parts);
    let max_parts = plan.parts as i32;
    let (bs, mbps, nblk) = (b.bs as i32, b.mbps as i32, b.num_blocks as i32);
    let scale_log2 = sh.scale * std::f32::consts::LOG2_E;
    let g_n = nh / nkv;
    let nrows = grid_y * nh * plan.parts;
    dev.launch += 1;
    let epoch = dev.launch;
    let mut out = vec![0f32; b.q.len()];
    let mut ctas: Vec<(usize, usize, usize)> = (0..grid_z)
        .flat_map(|z| (0..grid_y).flat_map(move |y| (0..grid_x).map(move |x| (x, y, z))))
        .collect();
    let mut rng = Lcg(seed);
    for i in (1..ctas.len()).rev() {
        ctas.swap(i, rng.next(i + 1));
    }
    for (x, s, part) in ctas {
        let kvh = x / chunks;
        let g0 = (x - kvh * chunks) * gm;
        // The partition length: balanced plans read the length first.
        let plen = part_len(&plan, b.seq_lens[s].max(0) as usize) as i32;
        let start = part as i32 * plen;
        let btab = &b.bt[s * b.mbps..(s + 1) * b.mbps];
        // First-round slots, before the metadata: (warp, u, tg) -> slot.
        let mut slot0 = vec![vec![vec![0i32; tpw]; u_n]; nw];
        for w in 0..nw {
            for u in 0..u_n {
                for tg in 0..tpw {
                    let i = ((w * tpw + u * tps + tg) as i32).min(plen - 1);
                    slot0[w][u][tg] = kv_slot(btab, start + i, bs, mbps, nblk);
                }
            }
        }
        let (qs, qe, seq_len) = (b.qsl[s], b.qsl[s + 1], b.seq_lens[s]);
        if qe - qs != 1 || qs < 0 || qs >= b.num_tokens as i32 || start >= seq_len {
            continue;
        }
        let n = plen.min(seq_len - start) as usize;
        let np = ((seq_len + plen - 1) / plen).min(max_parts);
        let hbase = kvh * g_n + g0;
        let heads: Vec<usize> = (0..gm).filter(|g| g0 + g < g_n).collect();
        // (head in the tile, max, sum, normalized output) of the CTA's partition.
        let res = if plan.tc {
            let cta = TcCta {
                kvh,
                hbase,
                rows: heads.len(),
                qs: qs as usize,
                start,
                n,
                scale_log2,
            };
            emu_tc_cta(b, btab, &cta)
        } else {
            // Phase 1 (and phase 3's loads): which lane group reads which token, in which round.
            let mut slot_of = vec![-1i32; n];
            for w in 0..nw {
                let mut it = w * tpw;
                while it < n {
                    let first = it == w * tpw;
                    for u in 0..u_n {
                        for tg in 0..tpw {
                            let i = it + u * tps + tg;
                            if i >= n {
                                continue;
                            }
                            let slot = if first {
                                slot0[w][u][tg]
                            } else {
                                kv_slot(btab, start + i as i32, bs, mbps, nblk)
                            };
                            assert_eq!(slot, kv_slot(btab, start + i as i32, bs, mbps, nblk));
                            assert_eq!(slot_of[i], -1, "token {i} read twice");
                            slot_of[i] = slot;
                        }
                    }
                    it += tps * u_n;
                }
            }
            assert!(
                slot_of.iter().all(|&x| x >= 0),
                "a token of the partition was never read"
            );
            cuda_core_cta(b, &slot_of, kvh, hbase, qs as usize, &heads, scale_log2)
        };
        let direct = max_parts == 1 || (plan.fused && np == 1);
        for (g, m, lsum, o) in res {
            let h = hbase + g;
            let row = (s * nh + h) * plan.parts + part;
            for (d, &v) in o.iter().enumerate() {
                if direct {
                    out[(qs as usize * nh + h) * hd + d] = bf(v);
                } else {
                    dev.ws[row * hd + d] = v;
                    dev.ws_gen[row * hd + d] = epoch;
                }
            }
            if !direct {
                dev.ws[nrows * hd + row] = m;
                dev.ws[nrows * hd + nrows + row] = lsum;
                dev.ws_gen[nrows * hd + row] = epoch;
                dev.ws_gen[nrows * hd + nrows + row] = epoch;
            }
        }
        let direct = max_parts == 1 || np == 1;
        if direct || !plan.fused {
            continue;
        }
        let c = s * grid_x + x;
        let ticket = dev.cnt[c];
        dev.cnt[c] += 1;
        if ticket != (np - 1) as u32 {
            continue;
        }
        dev.cnt[c] = 0;
        let m = Merge {
            nh,
            hd,
            nrows,
            max_parts: plan.parts,
            np: np as usize,
        };
        emu_merge_partials(
            dev,
            epoch,
            &mut out,
            &m,
            (s, hbase, g0, g_n, qs as usize),
            gm,
        );
    }
    if plan.parts > 1 && !plan.fused {
        // reduce.cu: one CTA per (head, sequence), np from the device lengths.
        for s in 0..grid_y {
            let qs = b.qsl[s];
            if b.qsl[s + 1] - qs != 1 || qs < 0 || qs >= b.num_tokens as i32 {
                continue;
            }
            let sl = b.seq_lens[s];
            let plen = part_len(&plan, sl.max(0) as usize) as i32;
            let np = if sl > 0 {
                ((sl + plen - 1) / plen).min(max_parts)
            } else {
                0
            };
            for h in 0..nh {
                merge_row(
                    dev,
                    epoch,
                    &mut out,
                    (s, h, qs as usize),
                    nh,
                    hd,
                    nrows,
                    plan.parts,
                    np as usize,
                );
            }
        }
    }
    assert!(
        dev.cnt.iter().all(|&c| c == 0),
        "a counter was left non-zero"
    );
    out
}

/// The geometry of a merge.
struct Merge {
    nh: usize,
    hd: usize,
    nrows: usize,
    max_parts: usize,
    np: usize,
}

/// `attn_merge_partials<HD, GM>` of the last CTA of a group, thread by thread: warp w computes
/// the weights of heads w, w + 4, .. (lanes striding the partitions) into `sw`, then thread t
/// owns the 4-dim slices t, t + 128, .. of the GM heads and sums them MP partitions at a time.
/// Reads only partials of this launch (`epoch`); writes each output element exactly once.
fn emu_merge_partials(
    dev: &Device,
    epoch: u64,
    out: &mut [f32],
    m: &Merge,
    (s, hbase, g0, g_n, qs): (usize, usize, usize, usize, usize),
    gm: usize,
) {
    let (nw, nt, q4, mp) = (4usize, 128usize, m.hd / 4, 8usize);
    let it_n = (gm * q4).div_ceil(nt);
    let read = |i: usize| {
        assert_eq!(
            dev.ws_gen[i], epoch,
            "merge read workspace element {i} of another launch"
        );
        dev.ws[i]
    };
    let mut sw = vec![f32::NAN; 2 * gm * MAX_FUSED_PARTS];
    let mut sden = vec![f32::NAN; gm];
    assert!(
        m.np <= MAX_FUSED_PARTS,
        "a fused merge of {} partitions",
        m.np
    );
    for w in 0..nw {
        for g in (w..gm).step_by(nw) {
            if g0 + g >= g_n {
                continue;
            }
            let row0 = (s * m.nh + hbase + g) * m.max_parts;
            let (wm, wl) = (m.nrows * m.hd + row0, m.nrows * m.hd + m.nrows + row0);
            let mut mx = f32::NEG_INFINITY;
            for p in 0..m.np {
                sw[g * MAX_FUSED_PARTS + p] = read(wm + p);
                mx = mx.max(read(wm + p));
            }
            let mut den = 0f32;
            for p in 0..m.np {
                let wt = read(wl + p) * (sw[g * MAX_FUSED_PARTS + p] - mx).exp2();
                sw[g * MAX_FUSED_PARTS + p] = wt;
                den += wt;
            }
            sden[g] = den;
        }
    }
    let mut written = vec![0u8; gm * m.hd];
    for t in 0..nt {
        for it in 0..it_n {
            let idx = t + it * nt;
            let (g, d4) = (idx / q4, idx % q4);
            if idx >= gm * q4 || g0 + g >= g_n {
                continue;
            }
            let row0 = (s * m.nh + hbase + g) * m.max_parts;
            let mut acc = [0f32; 4];
            for p0 in (0..m.np).step_by(mp) {
                for p in p0..(p0 + mp).min(m.np) {
                    let wt = sw[g * MAX_FUSED_PARTS + p];
                    assert!(
                        !wt.is_nan(),
                        "weight of partition {p} read before it was written"
                    );
                    for (e, a) in acc.iter_mut().enumerate() {
                        *a += wt * read((row0 + p) * m.hd + d4 * 4 + e);
                    }
                }
            }
            let den = sden[g];
            let inv = if den > 0.0 { 1.0 / den } else { 0.0 };
            for (e, a) in acc.iter().enumerate() {
                out[(qs * m.nh + hbase + g) * m.hd + d4 * 4 + e] = bf(a * inv);
                written[g * m.hd + d4 * 4 + e] += 1;
            }
        }
    }
    for g in (0..gm).filter(|g| g0 + g < g_n) {
        assert!(
            written[g * m.hd..(g + 1) * m.hd].iter().all(|&w| w == 1),
            "head {g}: a dim not written once"
        );
    }
}

/// The merge of `attn_merge_partials` / `attn_decode_reduce` for (sequence, head, token): it
/// must read only partials of this launch (`epoch`).
#[allow(clippy::too_many_arguments)]
fn merge_row(
    dev: &Device,
    epoch: u64,
    out: &mut [f32],
    (s, h, qs): (usize, usize, usize),
    nh: usize,
    hd: usize,
    nrows: usize,
    max_parts: usize,
    np: usize,
) {
    let row0 = (s * nh + h) * max_parts;
    let read = |i: usize| {
        assert_eq!(
            dev.ws_gen[i], epoch,
            "merge read workspace element {i} of another launch"
        );
        dev.ws[i]
    };
    let mx = (0..np)
        .map(|p| read(nrows * hd + row0 + p))
        .fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = (0..np)
        .map(|p| read(nrows * hd + nrows + row0 + p) * (read(nrows * hd + row0 + p) - mx).exp2())
        .collect();
    let den: f32 = w.iter().sum();
    let inv = if den > 0.0 { 1.0 / den } else { 0.0 };
    for d in 0..hd {
        let acc: f32 = (0..np).map(|p| w[p] * read((row0 + p) * hd + d)).sum();
        out[(qs * nh + h) * hd + d] = bf(acc * inv);
    }
}

/// The plan of the partitioning before fused merges: partitions of at least 64 tokens and a
/// reduce kernel (the unfused path that grids beyond [`ATTN_COUNTERS`] groups still take).
pub(super) fn unfused_plan(shape: &AttnShape) -> DecodePlan {
    let (_, chunks) = group_tiling(shape);
    let groups = shape.num_kv_heads * chunks * shape.num_seqs;
    let mut part = MAX_PARTITION;
    while part > 64 && groups * shape.max_seq_len.div_ceil(part) < DECODE_MIN_CTAS {
        part /= 2;
    }
    DecodePlan {
        tile: group_tiling(shape).0,
        part,
        parts: shape.max_seq_len.div_ceil(part).max(1),
        fused: false,
        pdl: false,
        tc: false,
        balanced: false,
    }
}

/// `plan` on the tensor-core kernel (with its tile).
pub(super) fn tensor_core_plan(plan: DecodePlan) -> DecodePlan {
    DecodePlan {
        tile: TC_TILE,
        tc: true,
        ..plan
    }
}

/// Balanced 512-token partitions for `shape` (grid bound `bound`), on tensor cores or not.
fn long_balanced(shape: &AttnShape, bound: usize, tc: bool) -> DecodePlan {
    let plan = DecodePlan {
        part: MAX_PARTITION,
        parts: bound.div_ceil(MAX_PARTITION),
        fused: true,
        balanced: true,
        ..cuda_core_plan(shape)
    };
    if tc { tensor_core_plan(plan) } else { plan }
}

/// `shape`'s plan on the CUDA-core kernel with whole GQA groups per CTA.
pub(super) fn cuda_core_plan(shape: &AttnShape) -> DecodePlan {
    DecodePlan {
        tile: group_tiling(shape).0,
        tc: false,
        ..decode_plan(shape)
    }
}

/// A decode step's shape for the plan tests: `num_seqs` sequences of at most `max_seq_len`
/// tokens, `heads` query and `nkv` KV heads of 128.
fn decode_shape(num_seqs: usize, heads: usize, nkv: usize, max_seq_len: usize) -> AttnShape {
    AttnShape {
        num_seqs,
        num_tokens: num_seqs,
        num_heads: heads,
        num_kv_heads: nkv,
        head_dim: 128,
        block_size: 16,
        max_blocks_per_seq: 256,
        max_query_len: 1,
        max_seq_len,
        scale: 0.1,
    }
}

#[test]
fn decode_plan_splits_small_grids_finer_and_keeps_large_ones() {
    let sh = |num_seqs, nkv, max_seq_len| decode_shape(num_seqs, 32, nkv, max_seq_len);
    // Qwen3-30B-A3B at batch 1 (4 KV heads): 32-token partitions, one merge in the kernel.
    let p = decode_plan(&sh(1, 4, 1056));
    assert_eq!((p.tile, p.part, p.parts, p.fused), (4, 32, 33, true));
    assert!(!p.tc);
    // Batch 64 keeps whole GQA groups per CTA, on tensor cores (groups of 8 and 4 heads; not
    // a group of 2).
    assert_eq!(decode_plan(&sh(64, 4, 1024)).tile, 8);
    assert!(decode_plan(&sh(64, 4, 1024)).tc && decode_plan(&sh(64, 8, 1024)).tc);
    assert!(!decode_plan(&decode_shape(64, 16, 8, 1024)).tc);
    assert_eq!(unfused_plan(&sh(1, 4, 1056)).part, 64);
    // A graph captured for max_model_len 4096 keeps the 32-token partitions.
    assert_eq!(decode_plan(&sh(1, 4, 4096)).part, 32);
    // Batch 64 on tensor cores takes longer partitions than the CUDA-core kernel (Qwen3-8B
    // 512 against 256, Qwen3-30B-A3B 256 against 128).
    for (nkv, tc_part, part) in [(8, 512, 256), (4, 256, 128)] {
        assert_eq!(decode_plan(&sh(64, nkv, 1024)).part, tc_part);
        assert_eq!(unfused_plan(&sh(64, nkv, 1024)).part, part);
    }
    // More groups than counters: the reduce kernel merges.
    let big = sh(ATTN_COUNTERS / 8 + 1, 8, 2048);
    assert!(!decode_plan(&big).fused);
    assert!(decode_plan(&sh(ATTN_COUNTERS / 8, 8, 2048)).fused);
    // More partitions than the merge's shared memory holds (one sequence of 512k tokens).
    let long = decode_plan(&sh(1, 1, 512 << 10));
    assert!(long.parts > MAX_FUSED_PARTS && !long.fused, "{long:?}");
}

#[test]
fn the_workspace_of_the_largest_shape_holds_every_smaller_decode() {
    let sh = decode_shape;
    let need = |s: &AttnShape| decode_workspace_len(s, decode_plan(s).parts);
    // The plan is not monotone: 64 sequences of 3,000 tokens need more than of 4,096 (GQA
    // groups of 2 on the CUDA-core kernel).
    assert!(need(&sh(64, 8, 4, 3000)) > need(&sh(64, 8, 4, 4096)));
    // (heads, KV heads, max_num_seqs, max_model_len, length step): Qwen3-30B-A3B, Qwen3-8B,
    // one KV head, and a long context.
    for (heads, nkv, seqs, len, step) in [
        (32, 4, 64, 4096, 1),
        (32, 8, 256, 4096, 5),
        (8, 1, 16, 2048, 1),
        (32, 4, 4, 40960, 13),
    ] {
        let bound = paged_attention_workspace_len(&sh(seqs, heads, nkv, len));
        for n in 1..=seqs {
            for l in (1..=len).step_by(step).chain([len]) {
                let s = sh(n, heads, nkv, l);
                assert!(need(&s) <= bound, "{n} x {l}: {} > {bound}", need(&s));
                assert!(paged_attention_workspace_len(&s) <= bound, "{n} x {l}");
            }
        }
        // Within 2x of the largest single need: the bound is not wasteful.
        let most = (1..=seqs)
            .flat_map(|n| (1..=len).step_by(step.max(7)).map(move |l| (n, l)))
            .map(|(n, l)| need(&sh(n, heads, nkv, l)))
            .max()
            .unwrap_or(0);
        assert!(bound <= 2 * most.max(1), "{bound} vs {most}");
    }
    assert_eq!(paged_attention_workspace_len(&sh(8, 32, 4, 32)), 0);
}

#[test]
fn emulated_decode_matches_the_reference_for_every_plan() {
    // (heads, KV heads, head_dim, block_size): GQA tiles 8 (30B), 4 (8B), 1, 2 and the
    // chunked tile (12 heads per KV head: two CTAs of 8 and 4).
    let configs = [
        (32, 4, 128, 16),
        (32, 8, 128, 16),
        (4, 4, 64, 4),
        (8, 4, 32, 16),
        (12, 1, 16, 16),
        (4, 2, 256, 16),
    ];
    let lens: [&[usize]; 3] = [&[1056], &[1, 0, 33, 700, 64, 31], &[2000, 5]];
    let plan = long_balanced(&decode_shape(1, 32, 4, 4096), 4096, false);
    assert_eq!((part_len(&plan, 1056), part_len(&plan, 700)), (352, 352));
    assert_eq!((part_len(&plan, 1024), part_len(&plan, 5)), (512, 16));
    // The workspace and the counters are shared by every launch, as in the engine (a buffer
    // sized for the worst shape, one counter array per loaded module).
    let mut dev = Device::new(1 << 22);
    let mut seed = 1;
    for (nh, nkv, hd, bs) in configs {
        for lens in lens {
            let b = Batch::new(nh, nkv, hd, bs, lens, seed);
            let max = *lens.iter().max().unwrap();
            for bound in [max, 4096] {
                let sh = b.shape(bound);
                let plans = [
                    decode_plan(&sh),
                    unfused_plan(&sh),
                    DecodePlan {
                        fused: true,
                        ..unfused_plan(&sh)
                    },
                    DecodePlan {
                        fused: false,
                        ..decode_plan(&sh)
                    },
                    cuda_core_plan(&sh),
                    // The tensor-core kernel on every shape: its own partitions, the finest
                    // ones, and unfused.
                    tensor_core_plan(decode_plan(&sh)),
                    tensor_core_plan(DecodePlan {
                        part: MIN_PARTITION,
                        parts: bound.div_ceil(MIN_PARTITION),
                        fused: bound.div_ceil(MIN_PARTITION) <= MAX_FUSED_PARTS,
                        pdl: true,
                        ..unfused_plan(&sh)
                    }),
                    tensor_core_plan(unfused_plan(&sh)),
                    // Balanced partitions on both kernels, fused and through the reduce.
                    DecodePlan {
                        balanced: true,
                        ..unfused_plan(&sh)
                    },
                    DecodePlan {
                        balanced: true,
                        ..cuda_core_plan(&sh)
                    },
                    tensor_core_plan(DecodePlan {
                        balanced: true,
                        ..decode_plan(&sh)
                    }),
                    tensor_core_plan(DecodePlan {
                        balanced: true,
                        ..unfused_plan(&sh)
                    }),
                    // Long balanced partitions, where they differ from `part` and a tail
                    // (1056 tokens: three of 352; 700: two of 352).
                    long_balanced(&sh, bound, false),
                    long_balanced(&sh, bound, true),
                ];
                for plan in plans {
                    assert!(decode_workspace_len(&sh, plan.parts) <= dev.ws.len());
                    seed += 1;
                    let got = emu_decode(&b, &sh, plan, &mut dev, seed);
                    let err = rel_err(&got, &b.want);
                    assert!(
                        err <= 1e-2,
                        "{nh}/{nkv} hd {hd} bs {bs} {lens:?} bound {bound} {plan:?}: rel err {err}"
                    );
                }
            }
        }
    }
}
