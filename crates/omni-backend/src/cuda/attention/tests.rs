//! GPU tests of paged attention against the CPU backend, and the host-side heuristics.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaSlice;

use super::emu::{cuda_core_plan, tensor_core_plan, unfused_plan};
use super::source::{REDUCE_FN, attn_wgmma_source, hd_kernels, reduce_source};
use super::*;
use crate::attention::{AttentionMetadata, LayerKvCache, paged_attention, reshape_and_cache};
use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
use crate::cuda::{CudaContext, bf16};

/// Entry-point names match the source (the NVRTC compile check of these sources is
/// `kernels::tests::every_kernel_module_compiles_for_sm90`).
#[test]
fn every_head_dim_source_defines_its_entry_points() {
    assert!(reduce_source().contains(REDUCE_FN));
    for hd in SUPPORTED_HEAD_DIMS {
        let k = hd_kernels(hd).unwrap();
        let src = (k.source)();
        for name in k
            .decode
            .iter()
            .chain(&k.decode_rope)
            .chain([&k.decode_tc, &k.prefill])
        {
            assert!(src.contains(name), "{name} missing from the hd{hd} source");
        }
    }
}

/// The Hopper module defines every wgmma entry point (test builds compile all of them), and the
/// environment switch picks one only for head_dim 128 on sm_90.
#[test]
fn wgmma_prefill_source_and_selection() {
    let src = attn_wgmma_source();
    for (tile, name) in WGMMA_PREFILL {
        assert!(src.contains(name), "{name} missing from the wgmma source");
        assert!(tile.wgmma && tile.warps % 4 == 0 && tile.min_ctas >= 1);
        // Within the 227 KiB a CTA may have, and min_ctas of them within the SM's 228 KiB
        // (1 KiB of each reserved).
        let smem = tile.smem_bytes(WGMMA_HEAD_DIM);
        assert!(
            smem <= 227 * 1024 && tile.min_ctas * (smem + 1024) <= 228 * 1024,
            "{name}"
        );
    }
    let pick = WGMMA_PREFILL[WGMMA_PREFILL_PICK];
    let on = wgmma_prefill_choice(None);
    assert_eq!(on, Some(WGMMA_PREFILL_PICK));
    assert_eq!(wgmma_prefill_choice(Some("1")), on);
    assert_eq!(wgmma_prefill_choice(Some("yes")), on);
    assert_eq!(wgmma_prefill_choice(Some("w1_n128")), Some(2));
    assert_eq!(wgmma_prefill_choice(Some("w2_n128_pp")), Some(5));
    assert_eq!(wgmma_prefill_choice(Some(" 0")), None);
    assert_eq!(wgmma_prefill_for(128, (9, 0), on), Some(pick));
    assert_eq!(wgmma_prefill_for(128, (9, 0), None), None);
    assert_eq!(wgmma_prefill_for(64, (9, 0), on), None);
    assert_eq!(wgmma_prefill_for(128, (8, 9), on), None);
    assert_eq!(wgmma_prefill_for(128, (10, 0), on), None);
}

#[test]
fn unsupported_head_dim_is_a_clear_error() {
    let e = hd_kernels(96).err().unwrap().to_string();
    assert!(e.contains("head_dim 96 is not supported"), "{e}");
}

#[test]
fn workspace_is_zero_off_the_multi_partition_decode_path() {
    let mut sh = AttnShape {
        num_seqs: 64,
        num_tokens: 64,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        max_blocks_per_seq: 64,
        max_query_len: 1,
        max_seq_len: 1024,
        scale: 0.1,
    };
    // Tensor cores: 512-token partitions (1,024 CTAs).
    assert_eq!(decode_plan(&sh).part, 512);
    assert_eq!(
        decode_workspace_len(&sh, decode_plan(&sh).parts),
        64 * 32 * 2 * 130
    );
    // The bound over every smaller decode: below 2 * DECODE_MIN_CTAS CTAs of 8 KV heads.
    assert_eq!(paged_attention_workspace_len(&sh), 400 * 32 * 130);
    sh.max_query_len = 2;
    assert_eq!(paged_attention_workspace_len(&sh), 0);
    sh.max_query_len = 1;
    sh.max_seq_len = MIN_PARTITION;
    assert_eq!(paged_attention_workspace_len(&sh), 0);
    assert_eq!(group_tiling(&sh), (4, 1));
    sh.num_heads = 8 * 12;
    assert_eq!(group_tiling(&sh), (8, 2));
    sh.num_heads = 8 * 3;
    assert_eq!(group_tiling(&sh), (4, 1));
}

/// Small deterministic generator for test layouts (here, the emulator's and the timings').
pub(super) struct Lcg(pub(super) u64);
impl Lcg {
    /// The next value in `0..n` (0 for `n = 0`).
    pub(super) fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }

    /// The next value in [-1, 1), in steps of 2^-19.
    pub(super) fn f32(&mut self) -> f32 {
        self.next(1 << 20) as f32 / (1 << 19) as f32 - 1.0
    }
}

/// A batch on the device with its CPU reference output.
struct Fixture {
    nh: usize,
    nkv: usize,
    hd: usize,
    bs: usize,
    num_tokens: usize,
    mbps: usize,
    max_q: usize,
    max_ctx: usize,
    dq: CudaSlice<bf16>,
    dk_cache: CudaSlice<bf16>,
    dv_cache: CudaSlice<bf16>,
    dqsl: CudaSlice<i32>,
    dseq: CudaSlice<i32>,
    dbt: CudaSlice<i32>,
    want: Vec<f32>,
}

impl Fixture {
    /// `seqs`: (context length, query length) per sequence. Writes the earlier context and
    /// then the new tokens (and a padding token) into the CPU cache with `reshape_and_cache`,
    /// uploads that cache (bf16-exact values) and computes the CPU attention.
    #[allow(clippy::too_many_arguments)]
    fn new(
        cx: &CudaContext,
        nh: usize,
        nkv: usize,
        hd: usize,
        bs: usize,
        seqs: &[(usize, usize)],
        seed: u64,
    ) -> Self {
        let mut rng = Lcg(seed);
        let need: Vec<usize> = seqs.iter().map(|&(c, _)| c.div_ceil(bs)).collect();
        let num_blocks = need.iter().sum::<usize>() + 3;
        let mut perm: Vec<usize> = (0..num_blocks).collect();
        for i in (1..num_blocks).rev() {
            let j = rng.next(i + 1);
            perm.swap(i, j);
        }
        let mbps = need.iter().copied().max().unwrap_or(0) + 1;
        let mut tables: Vec<Vec<u32>> = Vec::new();
        let mut flat_bt = vec![0i32; seqs.len() * mbps];
        let mut next = 0;
        for (s, &n) in need.iter().enumerate() {
            let t: Vec<u32> = perm[next..next + n].iter().map(|&b| b as u32).collect();
            next += n;
            for (i, &b) in t.iter().enumerate() {
                flat_bt[s * mbps + i] = b as i32;
            }
            // Padding entries point at a real block: must never be read.
            flat_bt[s * mbps + n] = perm[num_blocks - 1] as i32;
            tables.push(t);
        }
        let row = nkv * hd;
        let slot = |s: usize, p: usize| (tables[s][p / bs] as usize * bs + p % bs) as i64;
        let (mut old_k, mut old_v, mut old_slots) = (Vec::new(), Vec::new(), Vec::new());
        let (mut new_k, mut new_v, mut new_slots) = (Vec::new(), Vec::new(), Vec::new());
        let mut qsl = vec![0usize];
        for (s, &(ctx, ql)) in seqs.iter().enumerate() {
            assert!(ql <= ctx);
            let k = rand_bf16_f32(ctx * row, seed * 1000 + 2 * s as u64);
            let v = rand_bf16_f32(ctx * row, seed * 1000 + 2 * s as u64 + 1);
            for p in 0..ctx {
                let (dk, dv, ds) = if p < ctx - ql {
                    (&mut old_k, &mut old_v, &mut old_slots)
                } else {
                    (&mut new_k, &mut new_v, &mut new_slots)
                };
                dk.extend_from_slice(&k[p * row..(p + 1) * row]);
                dv.extend_from_slice(&v[p * row..(p + 1) * row]);
                ds.push(slot(s, p));
            }
            qsl.push(qsl[s] + ql);
        }
        let num_tokens = new_slots.len();
        let mut cache = LayerKvCache::new(num_blocks, bs, nkv, hd);
        // A trailing padding token (slot -1) with the new ones.
        new_k.extend(rand_bf16_f32(row, seed + 77));
        new_v.extend(rand_bf16_f32(row, seed + 78));
        new_slots.push(-1);
        for (k, v, slots) in [(&old_k, &old_v, &old_slots), (&new_k, &new_v, &new_slots)] {
            if !slots.is_empty() {
                reshape_and_cache(k, v, slots, &mut cache).unwrap();
            }
        }
        let dk_cache = cx.upload_f32_as_bf16(&cache.k).unwrap();
        let dv_cache = cx.upload_f32_as_bf16(&cache.v).unwrap();
        new_slots.pop();

        let q = rand_bf16_f32(num_tokens * nh * hd, seed + 99);
        let meta = AttentionMetadata {
            slot_mapping: new_slots,
            block_tables: tables,
            seq_lens: seqs.iter().map(|&(c, _)| c).collect(),
            query_start_loc: qsl.clone(),
        };
        let mut want = vec![0.0; q.len()];
        paged_attention(&q, nh, &cache, &meta, 1.0 / (hd as f32).sqrt(), &mut want).unwrap();
        let to_i32 = |v: &[usize]| v.iter().map(|&x| x as i32).collect::<Vec<i32>>();
        Self {
            nh,
            nkv,
            hd,
            bs,
            num_tokens,
            mbps,
            max_q: seqs.iter().map(|&(_, q)| q).max().unwrap_or(0),
            max_ctx: seqs.iter().map(|&(c, _)| c).max().unwrap_or(0),
            dq: cx.upload_f32_as_bf16(&q).unwrap(),
            dk_cache,
            dv_cache,
            dqsl: cx.stream().clone_htod(&to_i32(&qsl)).unwrap(),
            dseq: cx.stream().clone_htod(&to_i32(&meta.seq_lens)).unwrap(),
            dbt: cx.stream().clone_htod(&flat_bt).unwrap(),
            want,
        }
    }

    fn shape(&self, max_query_len: usize, max_seq_len: usize) -> AttnShape {
        AttnShape {
            num_seqs: self.dseq.len(),
            num_tokens: self.num_tokens,
            num_heads: self.nh,
            num_kv_heads: self.nkv,
            head_dim: self.hd,
            block_size: self.bs,
            max_blocks_per_seq: self.mbps,
            max_query_len,
            max_seq_len,
            scale: 1.0 / (self.hd as f32).sqrt(),
        }
    }

    fn run(&self, cx: &CudaContext, shape: &AttnShape, plan: DecodePlan) -> Vec<f32> {
        let mut out = cx.zeros_bf16(self.want.len()).unwrap();
        let mut ws = cx
            .stream()
            .alloc_zeros::<f32>(decode_workspace_len(shape, plan.parts).max(1))
            .unwrap();
        cx.paged_attention_planned(
            &self.dq,
            &self.dk_cache,
            &self.dv_cache,
            &mut out,
            &self.dqsl,
            &self.dseq,
            &self.dbt,
            &mut ws,
            shape,
            plan,
        )
        .unwrap();
        cx.download_f32(&out).unwrap()
    }

    /// The prefill path of `shape` on the tiling `prefill` (a `PrefillTile` and its entry).
    fn run_tiled(
        &self,
        cx: &CudaContext,
        shape: &AttnShape,
        prefill: (PrefillTile, &'static str),
    ) -> Vec<f32> {
        let mut out = cx.zeros_bf16(self.want.len()).unwrap();
        let mut ws = cx.stream().alloc_zeros::<f32>(1).unwrap();
        cx.paged_attention_tiled(
            &self.dq,
            &self.dk_cache,
            &self.dv_cache,
            &mut out,
            &self.dqsl,
            &self.dseq,
            &self.dbt,
            &mut ws,
            shape,
            decode_plan(shape),
            prefill,
            None,
        )
        .unwrap();
        cx.download_f32(&out).unwrap()
    }

    /// Every wgmma prefill tiling on `shape` against the CPU reference (prints and returns
    /// the outputs).
    fn check_wgmma(&self, cx: &CudaContext, what: &str, shape: &AttnShape) -> Vec<Vec<f32>> {
        WGMMA_PREFILL
            .iter()
            .map(|&(tile, name)| {
                let got = self.run_tiled(cx, shape, (tile, name));
                let err = rel_err(&got, &self.want);
                println!(
                    "attention check {what} {name}: nh {} nkv {} bs {} tokens {} max_q {} max_ctx {} (grid bound q {}): rel_err {err:.3e}",
                    self.nh,
                    self.nkv,
                    self.bs,
                    self.num_tokens,
                    self.max_q,
                    self.max_ctx,
                    shape.max_query_len
                );
                assert!(err <= 2e-2, "{what} {name}: rel_err {err}");
                got
            })
            .collect()
    }

    fn check(&self, cx: &CudaContext, what: &str, shape: &AttnShape) -> Vec<f32> {
        self.check_plan(cx, what, shape, decode_plan(shape))
    }

    fn check_plan(
        &self,
        cx: &CudaContext,
        what: &str,
        shape: &AttnShape,
        plan: DecodePlan,
    ) -> Vec<f32> {
        let got = self.run(cx, shape, plan);
        let err = rel_err(&got, &self.want);
        println!(
            "attention check {what}: nh {} nkv {} hd {} bs {} tokens {} max_q {} max_ctx {} (grid bounds q {} ctx {}): rel_err {err:.3e}",
            self.nh,
            self.nkv,
            self.hd,
            self.bs,
            self.num_tokens,
            self.max_q,
            self.max_ctx,
            shape.max_query_len,
            shape.max_seq_len
        );
        assert!(err <= 2e-2, "{what}: rel_err {err}");
        got
    }
}

/// A random mix of full prefills, chunked prefills and decodes.
fn random_mix(seed: u64, n: usize, max_ctx: usize) -> Vec<(usize, usize)> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|_| {
            let ctx = 1 + rng.next(max_ctx);
            match rng.next(3) {
                0 => (ctx, ctx),
                1 => (ctx, 1 + rng.next(ctx)),
                _ => (ctx, 1),
            }
        })
        .collect()
}

#[test]
fn paged_attention_mixed_batches_match_cpu() {
    let Some(cx) = ctx_or_skip("paged_attention_mixed_batches_match_cpu") else {
        return;
    };
    let fixed = vec![
        (200, 200),
        (150, 70),
        (1, 1),
        (77, 1),
        (600, 1),
        (513, 64),
        (64, 64),
        (300, 2),
        (129, 65),
    ];
    let configs: [(usize, usize, usize, usize); 7] = [
        (8, 2, 128, 16),
        (4, 4, 128, 4),
        (8, 2, 64, 16),
        (4, 4, 64, 4),
        (8, 2, 16, 4),
        (6, 2, 32, 16),
        (4, 2, 256, 16),
    ];
    for (i, &(nh, nkv, hd, bs)) in configs.iter().enumerate() {
        for (j, seqs) in [fixed.clone(), random_mix(11 + i as u64, 10, 400)]
            .iter()
            .enumerate()
        {
            let fx = Fixture::new(&cx, nh, nkv, hd, bs, seqs, 100 + (10 * i + j) as u64);
            let sh = fx.shape(fx.max_q, fx.max_ctx);
            fx.check(&cx, "mixed", &sh);
            if hd == WGMMA_HEAD_DIM && cx.info().compute_capability == (9, 0) {
                fx.check_wgmma(&cx, "mixed", &sh);
            }
        }
    }
}

/// The wgmma prefill kernels (sm_90 only) against the CPU reference: ragged chunks with and
/// without a cached prefix (ctx0 > 0), lengths off the tiles, decode rows in the same launch,
/// GQA groups of 1 to 8, odd block sizes, a grid bound above the longest query (identical
/// bits), and long prefills.
#[test]
fn wgmma_prefill_matches_cpu() {
    let Some(cx) = ctx_or_skip("wgmma_prefill_matches_cpu") else {
        return;
    };
    if cx.info().compute_capability != (9, 0) {
        println!("SKIP wgmma_prefill_matches_cpu: not an sm_90 device");
        return;
    }
    let ragged = vec![
        (200, 200),
        (150, 70),
        (1, 1),
        (77, 1),
        (513, 64),
        (64, 64),
        (129, 65),
        (300, 2),
        (128, 128),
        (700, 257),
        (191, 191),
    ];
    let configs: [(usize, usize, usize); 4] = [(8, 1, 16), (32, 4, 16), (4, 4, 5), (6, 2, 32)];
    for (i, &(nh, nkv, bs)) in configs.iter().enumerate() {
        for (j, seqs) in [ragged.clone(), random_mix(31 + i as u64, 12, 600)]
            .iter()
            .enumerate()
        {
            let fx = Fixture::new(&cx, nh, nkv, 128, bs, seqs, 300 + (10 * i + j) as u64);
            let exact = fx.check_wgmma(&cx, "wgmma", &fx.shape(fx.max_q, fx.max_ctx));
            let loose = fx.check_wgmma(&cx, "wgmma loose", &fx.shape(fx.max_q + 200, 8192));
            for ((e, l), (_, name)) in exact.iter().zip(&loose).zip(WGMMA_PREFILL) {
                assert_eq!(e, l, "{name}: an upper-bound grid differs");
            }
        }
    }
    // A long causal prefill and a long chunk after a cached prefix (8 query heads per KV head,
    // as the 30B-A3B shape; fewer heads keep the CPU reference short).
    let fx = Fixture::new(&cx, 8, 1, 128, 16, &[(1200, 1200), (1600, 300)], 399);
    fx.check_wgmma(&cx, "wgmma long", &fx.shape(fx.max_q, fx.max_ctx));
}

#[test]
fn paged_attention_decode_batches_match_cpu() {
    let Some(cx) = ctx_or_skip("paged_attention_decode_batches_match_cpu") else {
        return;
    };
    let lens = [1usize, 17, 512, 513, 1100, 2000, 64, 255, 256, 257];
    let seqs: Vec<(usize, usize)> = lens.iter().map(|&c| (c, 1)).collect();
    let short: Vec<(usize, usize)> = [1usize, 3, 16, 40, 61].iter().map(|&c| (c, 1)).collect();
    let configs: [(usize, usize, usize, usize); 7] = [
        (32, 8, 128, 16),
        (4, 4, 128, 4),
        (8, 2, 64, 16),
        (12, 1, 64, 16),
        (8, 2, 16, 4),
        (6, 2, 32, 4),
        (4, 2, 256, 16),
    ];
    for (i, &(nh, nkv, hd, bs)) in configs.iter().enumerate() {
        for (j, s) in [&seqs, &short].into_iter().enumerate() {
            let fx = Fixture::new(&cx, nh, nkv, hd, bs, s, 500 + (10 * i + j) as u64);
            let sh = fx.shape(1, fx.max_ctx);
            fx.check(&cx, "decode", &sh);
            // The unfused plan (reduce kernel), and fused merges of the finest partitions.
            fx.check_plan(&cx, "decode unfused", &sh, unfused_plan(&sh));
            let fine = DecodePlan {
                tile: group_tiling(&sh).0,
                part: MIN_PARTITION,
                parts: fx.max_ctx.div_ceil(MIN_PARTITION),
                fused: true,
                pdl: true,
                tc: false,
                balanced: false,
            };
            fx.check_plan(&cx, "decode fused 32-token partitions", &sh, fine);
            // Balanced partitions: both kernels, fused and through the reduce.
            for (what, plan) in [
                ("decode balanced", cuda_core_plan(&sh)),
                ("decode balanced unfused", unfused_plan(&sh)),
                (
                    "decode balanced tensor cores",
                    tensor_core_plan(decode_plan(&sh)),
                ),
                (
                    "decode balanced tensor cores unfused",
                    tensor_core_plan(unfused_plan(&sh)),
                ),
            ] {
                let plan = DecodePlan {
                    balanced: true,
                    ..plan
                };
                fx.check_plan(&cx, what, &sh, plan);
            }
            // The tensor-core kernel, whatever the group size, fused and not.
            let tc = tensor_core_plan(fine);
            fx.check_plan(&cx, "decode tensor cores 32-token partitions", &sh, tc);
            let tc = tensor_core_plan(unfused_plan(&sh));
            fx.check_plan(&cx, "decode tensor cores unfused", &sh, tc);
            // The same decodes through the tensor-core path (max_query_len an upper bound).
            let sh = fx.shape(2, fx.max_ctx);
            fx.check(&cx, "decode via prefill kernel", &sh);
        }
    }
    // A large batch: partitions of 256 (exact bound) and 512 (bound 2048) tokens.
    let mut rng = Lcg(3);
    let big: Vec<(usize, usize)> = (0..64).map(|_| (1 + rng.next(1500), 1)).collect();
    let fx = Fixture::new(&cx, 32, 8, 128, 16, &big, 700);
    for bound in [fx.max_ctx, 2048] {
        let sh = fx.shape(1, bound);
        println!(
            "attention decode partition {} for max_seq_len {bound}",
            decode_plan(&sh).part
        );
        assert!(decode_plan(&sh).tc, "{:?}", decode_plan(&sh));
        fx.check(&cx, "large decode batch (tensor cores)", &sh);
        fx.check_plan(
            &cx,
            "large decode batch (CUDA cores)",
            &sh,
            cuda_core_plan(&sh),
        );
    }
}

/// Graph-style launches: grid sized from upper bounds, lengths read on the device.
#[test]
fn paged_attention_upper_bounds_give_the_same_answer() {
    let Some(cx) = ctx_or_skip("paged_attention_upper_bounds_give_the_same_answer") else {
        return;
    };
    for (nh, nkv, hd, bs) in [(32, 8, 128, 16), (8, 2, 64, 4), (8, 8, 16, 16)] {
        // Decode: exact bounds vs a much larger max_seq_len (more partitions, reduce path).
        let seqs: Vec<(usize, usize)> = [5usize, 700, 1300, 90].iter().map(|&c| (c, 1)).collect();
        let fx = Fixture::new(&cx, nh, nkv, hd, bs, &seqs, 900);
        let exact = fx.check(&cx, "decode exact bounds", &fx.shape(1, fx.max_ctx));
        let loose = fx.check(&cx, "decode loose bounds", &fx.shape(1, 6000));
        let d = rel_err(&loose, &exact);
        println!("attention graph-style decode: loose vs exact rel diff {d:.3e}");
        assert!(d <= 1e-2, "decode loose vs exact {d}");
        // Short decodes: one partition exactly (direct write) vs many (reduce).
        let seqs: Vec<(usize, usize)> = [5usize, 30, 64].iter().map(|&c| (c, 1)).collect();
        let fx = Fixture::new(&cx, nh, nkv, hd, bs, &seqs, 901);
        let exact = fx.check(&cx, "short decode exact", &fx.shape(1, fx.max_ctx));
        let loose = fx.check(&cx, "short decode loose", &fx.shape(1, 4096));
        assert!(rel_err(&loose, &exact) <= 1e-2);
        // Prefill: max_query_len twice the real one must give identical bits.
        let seqs = [(300, 300), (150, 40), (77, 1)];
        let fx = Fixture::new(&cx, nh, nkv, hd, bs, &seqs, 902);
        let exact = fx.check(&cx, "prefill exact bounds", &fx.shape(fx.max_q, fx.max_ctx));
        let loose = fx.check(&cx, "prefill loose bounds", &fx.shape(2 * fx.max_q, 4096));
        assert_eq!(loose, exact, "prefill with an upper-bound grid differs");
    }
}

/// A fused decode captured in a CUDA graph (grid sized for a bound, as the engine captures
/// them) replays bit-identically to the eager call, again and again (the arrival counters are
/// back at zero after every launch), and with other lengths uploaded between replays.
#[test]
fn fused_decode_replays_in_a_graph() {
    let Some(cx) = ctx_or_skip("fused_decode_replays_in_a_graph") else {
        return;
    };
    let seqs: Vec<(usize, usize)> = [1056usize, 300, 33, 1].iter().map(|&c| (c, 1)).collect();
    let mut fx = Fixture::new(&cx, 32, 4, 128, 16, &seqs, 950);
    let sh = fx.shape(1, 4096);
    let plan = decode_plan(&sh);
    assert!(plan.fused && plan.parts > 1, "{plan:?}");
    let eager = fx.check(&cx, "fused decode before capture", &sh);
    let mut out = cx.zeros_bf16(fx.want.len()).unwrap();
    let mut ws = cx
        .stream()
        .alloc_zeros::<f32>(paged_attention_workspace_len(&sh))
        .unwrap();
    let call = |fx: &Fixture, out: &mut CudaSlice<bf16>, ws: &mut CudaSlice<f32>| {
        cx.paged_attention_bf16(
            &fx.dq,
            &fx.dk_cache,
            &fx.dv_cache,
            out,
            &fx.dqsl,
            &fx.dseq,
            &fx.dbt,
            ws,
            &sh,
        )
        .unwrap()
    };
    call(&fx, &mut out, &mut ws);
    cx.synchronize().unwrap();
    let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    cx.stream().begin_capture(mode).unwrap();
    call(&fx, &mut out, &mut ws);
    let graph = cx
        .stream()
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    for replay in 0..3 {
        cx.stream().memset_zeros(&mut out).unwrap();
        graph.launch().unwrap();
        let got = cx.download_f32(&out).unwrap();
        assert_eq!(got, eager, "replay {replay} differs from the eager call");
    }
    // Shorter contexts (one sequence now a single partition, one left out of the batch).
    let lens = [700i32, 64, 1, 0];
    cx.stream().memcpy_htod(&lens, &mut fx.dseq).unwrap();
    let want = fx.run(&cx, &sh, plan);
    for replay in 0..2 {
        cx.stream().memset_zeros(&mut out).unwrap();
        graph.launch().unwrap();
        let got = cx.download_f32(&out).unwrap();
        assert_eq!(
            got, want,
            "replay {replay} with new lengths differs from the eager call"
        );
    }
    println!("attention fused decode: graph replays == eager, also after new lengths");
}
