//! A CPU emulator of the one-launch attention block's indexing and attention arithmetic
//! (`kernels/attention/block1.cu`), to catch its bugs before a GPU runs it: every QKV and
//! o_proj row computed once by a warp whose mbarrier group was issued, the shared-memory
//! regions inside the plan's bytes, every key of every context length in exactly one
//! partition (the new key in the last), every key of a partition scored and summed once, and
//! the partials merged with the kernel's weights giving softmax attention within f32 rounding
//! of an f64 reference. Two mutations of the partition rule fail it.

use super::block1::{
    AttnBlock1Shape, Block1Plan, HEAD_DIM, MAX_GROUP, PLEN_MAX, block1_plan, partitions,
};

const WARPS: usize = 16;
const THREADS: usize = 512;
const GROUP_ROWS: usize = 16;
const MAX_GROUPS: usize = 8;
/// Tokens a round of the scores loop (`TPS`: 16 warps x 2 token groups) and loads a lane (`U`).
const TPS: usize = 32;
const U: usize = 2;

fn shape(hidden: usize, heads: usize, kv: usize, mbps: usize) -> AttnBlock1Shape {
    AttnBlock1Shape {
        hidden,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: HEAD_DIM,
        block_size: 16,
        max_blocks_per_seq: mbps,
        eps: 1e-6,
        scale: (HEAD_DIM as f32).powf(-0.5),
    }
}

/// Rows of a staged GEMV: CTA c's rows c * per .. clipped to n, warp w taking w, w + 16, ..
/// waiting for group j / 16 of the ceil(rows / 16) the CTA issued; every row once.
fn check_rows(n: usize, per: usize, sms: usize, what: &str) {
    let mut seen = vec![0u8; n];
    for c in 0..sms {
        let r0 = c * per;
        let rows = per.min(n.saturating_sub(r0));
        let groups = rows.div_ceil(GROUP_ROWS);
        assert!(groups <= MAX_GROUPS, "{what}: {groups} mbarrier groups");
        for w in 0..WARPS {
            for j in (w..rows).step_by(WARPS) {
                assert!(
                    j / GROUP_ROWS < groups,
                    "{what}: row {j} waits on an unissued group"
                );
                seen[r0 + j] += 1;
            }
        }
    }
    assert!(
        seen.iter().all(|&s| s == 1),
        "{what}: a row not computed exactly once"
    );
}

/// The kernel's dynamic shared-memory regions (offsets from its `ab1_smem`), each inside the
/// plan's bytes, the bulk-copy destination 128-byte aligned.
fn check_smem(s: &AttnBlock1Shape, p: &Block1Plan) {
    let ko = s.num_heads * s.head_dim;
    let xin = (s.hidden.max(ko) * 2).next_multiple_of(128);
    let bars = 16 * MAX_GROUPS;
    let sc = bars + xin;
    let sslot = sc + MAX_GROUP * PLEN_MAX * 4;
    let w = sslot + PLEN_MAX * 4;
    assert_eq!(w % 128, 0, "weight rows misaligned");
    let wbytes = (p.rows_qkv * s.hidden * 2).max(p.rows_o * ko * 2);
    assert_eq!(
        w + wbytes,
        p.smem,
        "the plan's bytes are not the kernel's layout"
    );
    // The P V sums (4 x GM x HD f32) and the merge weights (GM x parts) reuse the scores.
    assert!(4 * MAX_GROUP * s.head_dim <= MAX_GROUP * PLEN_MAX);
    // The merge: GM x parts weights, then the second half's sums (GM x HD / 4 float4).
    assert!(MAX_GROUP * p.parts * 4 + MAX_GROUP * s.head_dim * 4 <= MAX_GROUP * PLEN_MAX * 4);
}

/// Per (CTA, KV head) the kernel's partition of `seq_len` keys: `(start, n)` for the CTAs that
/// take one. `rule` is the partition rule (the kernel's, or a mutation).
type Rule<'a> = &'a dyn Fn(usize, usize) -> (usize, usize);

fn partition_ctas(seq_len: usize, parts: usize, rule: Rule<'_>) -> Vec<(usize, usize)> {
    let (plen, _) = rule(seq_len, parts);
    (0..parts)
        .filter(|&part| seq_len > 0 && part * plen < seq_len)
        .map(|part| (part * plen, plen.min(seq_len - part * plen)))
        .collect()
}

/// Every key of a context in exactly one partition, the number of partitions equal to the
/// merge ticket count `np`, the new key (seq_len - 1) in the last; in each partition's tiles of
/// `tile` keys every key scored and summed once.
fn check_partitions(seq_len: usize, parts: usize, rule: Rule<'_>, tile: usize) {
    let ps = partition_ctas(seq_len, parts, rule);
    let (_, np) = rule(seq_len, parts);
    assert_eq!(
        ps.len(),
        np,
        "seq_len {seq_len}: CTAs with work != merge count"
    );
    let mut seen = vec![0u8; seq_len];
    for &(start, n) in &ps {
        assert!(n >= 1);
        let (mut scored, mut summed) = (vec![0u8; n], vec![0u16; n]);
        for t0 in (0..n).step_by(tile) {
            let tn = tile.min(n - t0);
            // Scores loop: warp w, token group tg, round it, load u.
            for w in 0..WARPS {
                for tg in 0..2 {
                    for it in (w * 2..tn).step_by(TPS * U) {
                        for u in 0..U {
                            let i = it + u * TPS + tg;
                            if i < tn {
                                scored[t0 + i] += 1;
                            }
                        }
                    }
                }
            }
            // P V: thread (sub, g, ch) takes keys sub, sub + 4, ..
            for tid in 0..THREADS {
                let (sub, g, ch) = (tid >> 7, (tid & 127) >> 4, tid & 15);
                if g == 0 && ch == 0 {
                    for i in (sub..tn).step_by(4) {
                        summed[t0 + i] += 1;
                    }
                }
            }
        }
        assert!(
            scored.iter().all(|&s| s == 1),
            "a key scored other than once"
        );
        assert!(
            summed.iter().all(|&s| s == 1),
            "a key summed other than once"
        );
        for s in &mut seen[start..start + n] {
            *s += 1;
        }
    }
    assert!(
        seen.iter().all(|&s| s == 1),
        "seq_len {seq_len}: a key not in one partition"
    );
    if let Some(&(start, n)) = ps.last() {
        assert_eq!(
            start + n,
            seq_len,
            "the new key is not in the last partition"
        );
    }
}

#[test]
fn every_row_and_key_is_taken_once() {
    for (sms, (h, nh, nkv, mbps)) in [
        (132, (2048, 32, 4, 256)),
        (132, (4096, 32, 8, 256)),
        (114, (2048, 32, 4, 128)),
        (132, (1024, 16, 2, 64)),
        (8, (64, 2, 1, 4)),
        // Max-model-len 40960: partitions of ~1242 keys, three tiles.
        (132, (2048, 32, 4, 2560)),
    ] {
        let s = shape(h, nh, nkv, mbps);
        let p = block1_plan(&s, sms);
        check_rows((nh + 2 * nkv) * HEAD_DIM, p.rows_qkv, sms, "qkv");
        check_rows(h, p.rows_o, sms, "o_proj");
        check_smem(&s, &p);
        assert!(nkv * p.parts <= sms);
        // ws rows (h, part) of every head and partition distinct and in range.
        let mut rows = vec![0u8; nh * p.parts];
        let group = nh / nkv;
        for kvh in 0..nkv {
            for g in 0..group {
                for part in 0..p.parts {
                    rows[(kvh * group + g) * p.parts + part] += 1;
                }
            }
        }
        assert!(rows.iter().all(|&r| r == 1));
        let most = mbps * 16;
        for seq_len in (1..=most).filter(|l| *l < 300 || l % 37 == 0 || *l == most) {
            for min_keys in [1, 64, 200] {
                let rule = |l, parts| partitions(l, parts, min_keys);
                check_partitions(seq_len, p.parts, &rule, PLEN_MAX);
                check_partitions(seq_len, p.parts, &rule, 7);
            }
        }
    }
}

/// Two wrong partition rules fail the coverage check: a floored length (keys past the last
/// partition) and a count that is one short.
#[test]
fn the_partition_check_fails_wrong_rules() {
    fn floored(seq_len: usize, parts: usize) -> (usize, usize) {
        let plen = (seq_len / parts).max(1);
        (plen, seq_len.div_ceil(plen))
    }
    fn short(seq_len: usize, parts: usize) -> (usize, usize) {
        let (plen, np) = partitions(seq_len, parts, 1);
        (plen, np.saturating_sub(1))
    }
    for rule in [floored as fn(usize, usize) -> (usize, usize), short] {
        let failed = std::panic::catch_unwind(|| {
            for seq_len in [1000, 1088, 4096] {
                check_partitions(seq_len, 33, &rule, PLEN_MAX);
            }
        });
        assert!(failed.is_err(), "a wrong partition rule passed");
    }
}

/// The attention of one KV head's query heads as the kernel computes it: per partition, tile
/// by tile, the scores in the log2 domain, the running max, the numerators and the running sum
/// (what came before scaled by 2^(old max - new max)), P V over the four key subsets; the
/// partial normalised; then the merge with weights sum_p * 2^(max_p - max), two halves of the
/// partials summed apart. Against f64
/// softmax attention: within 1e-5 relative, with one tile a partition and with several.
#[test]
fn partials_merge_to_softmax_attention() {
    let hd = HEAD_DIM;
    let group = 8;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    for (seq_len, tile) in [
        (1usize, PLEN_MAX),
        (5, PLEN_MAX),
        (33, PLEN_MAX),
        (1088, PLEN_MAX),
        (4000, PLEN_MAX),
        (4000, 48),
        (40000, PLEN_MAX),
    ] {
        let q: Vec<Vec<f32>> = (0..group)
            .map(|_| (0..hd).map(|_| (rnd() * 3.0) as f32).collect())
            .collect();
        let k: Vec<Vec<f32>> = (0..seq_len)
            .map(|_| (0..hd).map(|_| rnd() as f32).collect())
            .collect();
        let v: Vec<Vec<f32>> = (0..seq_len)
            .map(|_| (0..hd).map(|_| rnd() as f32).collect())
            .collect();
        let scale = (hd as f32).powf(-0.5);
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let parts = 33;
        let ps = partition_ctas(seq_len, parts, &|l, p| partitions(l, p, 64));
        for (g, qg) in q.iter().enumerate() {
            let qs: Vec<f32> = qg.iter().map(|x| x * scale_log2).collect();
            // Partials.
            let mut partials = Vec::new();
            for &(start, n) in &ps {
                let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                let mut acc = vec![vec![0f32; hd]; 4];
                for t0 in (0..n).step_by(tile) {
                    let tn = tile.min(n - t0);
                    let sc: Vec<f32> = (0..tn)
                        .map(|i| qs.iter().zip(&k[start + t0 + i]).map(|(a, b)| a * b).sum())
                        .collect();
                    let mt = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let m_new = m.max(mt);
                    let alpha = (m - m_new).exp2();
                    let e: Vec<f32> = sc.iter().map(|s| (s - m_new).exp2()).collect();
                    l = l * alpha + e.iter().sum::<f32>();
                    m = m_new;
                    for (sub, a) in acc.iter_mut().enumerate() {
                        a.iter_mut().for_each(|x| *x *= alpha);
                        for i in (sub..tn).step_by(4) {
                            for d in 0..hd {
                                a[d] = e[i].mul_add(v[start + t0 + i][d], a[d]);
                            }
                        }
                    }
                }
                let o: Vec<f32> = (0..hd)
                    .map(|d| acc.iter().map(|a| a[d]).sum::<f32>() / l)
                    .collect();
                partials.push((o, m, l));
            }
            // Merge (one partition: written directly).
            let out: Vec<f32> = if partials.len() == 1 {
                partials[0].0.clone()
            } else {
                let mx = partials
                    .iter()
                    .map(|p| p.1)
                    .fold(f32::NEG_INFINITY, f32::max);
                let w: Vec<f32> = partials.iter().map(|p| p.2 * (p.1 - mx).exp2()).collect();
                let den: f32 = w.iter().sum();
                // Two halves of the partials summed apart, then added (the kernel's threads).
                let hp = partials.len().div_ceil(2);
                let half = |r: std::ops::Range<usize>, d: usize| -> f32 {
                    r.map(|p| w[p] * partials[p].0[d]).sum()
                };
                (0..hd)
                    .map(|d| (half(0..hp, d) + half(hp..partials.len(), d)) * (1.0 / den))
                    .collect()
            };
            // f64 reference.
            let s64: Vec<f64> = k
                .iter()
                .map(|kr| {
                    qg.iter()
                        .zip(kr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        * f64::from(scale)
                })
                .collect();
            let m64 = s64.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p64: Vec<f64> = s64.iter().map(|s| (s - m64).exp()).collect();
            let z: f64 = p64.iter().sum();
            for d in 0..hd {
                let r: f64 = p64
                    .iter()
                    .zip(&v)
                    .map(|(p, vr)| p * f64::from(vr[d]))
                    .sum::<f64>()
                    / z;
                let err = (f64::from(out[d]) - r).abs();
                assert!(
                    err <= 1e-5 * (1.0 + r.abs()),
                    "seq_len {seq_len} head {g} dim {d}: {} vs {r}",
                    out[d]
                );
            }
        }
    }
}
