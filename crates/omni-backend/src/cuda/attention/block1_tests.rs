//! GPU tests of the one-launch attention block (`block1.rs`; each SKIPs without a CUDA driver
//! or on a device it does not run on): against the four launches it replaces (the staged QKV
//! GEMV with the input norm, `qkv_rope_cache_bf16`, `paged_attention_bf16`, the staged o_proj
//! GEMV) on the same inputs, with the new token's cache slot poisoned with NaN; and its timing
//! against them in CUDA graphs, with each CTA's timestamps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaSlice;

use super::block1::STAMPS;
use super::emu::{ShuffledTables, shuffled_tables};
use super::tests::Lcg;
use super::*;
use crate::cuda::tests::{
    bits16, bits32, ctx_or_skip, graph_us, print_stamps, rand_bf16_f32, rel_err,
};
use crate::cuda::{CudaContext, GemvIn, L2Prefetch, MropeAxes, QkvBuffers, QkvShape, bf16};

const BS: usize = 16;

/// One layer and one decode step of a sequence with `ctx` keys (the new one included).
struct Case {
    s: AttnBlock1Shape,
    nq: usize,
    norm: CudaSlice<bf16>,
    wq: CudaSlice<bf16>,
    wo: CudaSlice<bf16>,
    qk_norm: Option<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    x: Vec<f32>,
    init: Option<CudaSlice<bf16>>,
    k: Vec<f32>,
    v: Vec<f32>,
    positions: CudaSlice<i32>,
    axes: Option<CudaSlice<u8>>,
    slot: CudaSlice<i64>,
    seq_lens: CudaSlice<i32>,
    bt: CudaSlice<i32>,
    inv_freq: CudaSlice<f32>,
    qsl: CudaSlice<i32>,
    new_slot: usize,
    ctx: usize,
}

/// The outputs of one path.
struct Out {
    x: CudaSlice<f32>,
    qkv: CudaSlice<bf16>,
    kc: CudaSlice<bf16>,
    vc: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    proj: CudaSlice<f32>,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cx: &CudaContext,
        (h, nh, nkv): (usize, usize, usize),
        ctx: usize,
        (qk_norm, mrope, set): (bool, bool, bool),
        seed: u64,
    ) -> Self {
        let st = cx.stream();
        let hd = 128;
        let nq = (nh + 2 * nkv) * hd;
        let mut rng = Lcg(seed);
        let ShuffledTables {
            num_blocks,
            mbps,
            bt,
            tables,
        } = shuffled_tables(&[ctx.div_ceil(BS)], &mut rng);
        let cache = num_blocks * BS * nkv * hd;
        let mut k: Vec<f32> = (0..cache).map(|_| rng.f32()).collect();
        let mut v: Vec<f32> = (0..cache).map(|_| rng.f32()).collect();
        let p = ctx - 1;
        let slot = tables[0][p / BS] as usize * BS + p % BS;
        // The new token's slot poisoned: a CTA that read it from memory would spread NaN.
        for i in slot * nkv * hd..(slot + 1) * nkv * hd {
            k[i] = f32::NAN;
            v[i] = f32::NAN;
        }
        let pos = (p + 3) as i32;
        let positions = if mrope {
            vec![pos, 0, 0, pos + 5, 0, 0, pos + 10]
        } else {
            vec![pos]
        };
        let scaled = |n: usize, seed: u64, by: f32| -> Vec<f32> {
            rand_bf16_f32(n, seed).iter().map(|w| w * by).collect()
        };
        let around_one = |n: usize, seed: u64| -> Vec<f32> {
            rand_bf16_f32(n, seed)
                .iter()
                .map(|w| 1.0 + 0.5 * w)
                .collect()
        };
        let half = hd / 2;
        Self {
            s: AttnBlock1Shape {
                hidden: h,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                block_size: BS,
                max_blocks_per_seq: mbps,
                eps: 1e-6,
                scale: 1.0 / (hd as f32).sqrt(),
            },
            nq,
            norm: cx.upload_f32_as_bf16(&around_one(h, seed + 1)).unwrap(),
            wq: cx
                .upload_f32_as_bf16(&scaled(nq * h, seed + 2, 2.0 / (h as f32).sqrt()))
                .unwrap(),
            wo: cx
                .upload_f32_as_bf16(&scaled(
                    h * nh * hd,
                    seed + 3,
                    1.0 / ((nh * hd) as f32).sqrt(),
                ))
                .unwrap(),
            qk_norm: qk_norm.then(|| {
                (
                    cx.upload_f32_as_bf16(&around_one(hd, seed + 4)).unwrap(),
                    cx.upload_f32_as_bf16(&around_one(hd, seed + 5)).unwrap(),
                )
            }),
            x: scaled(h, seed + 6, 3.0),
            init: set.then(|| cx.upload_f32_as_bf16(&scaled(h, seed + 7, 2.0)).unwrap()),
            k,
            v,
            positions: st.clone_htod(&positions).unwrap(),
            axes: mrope.then(|| {
                st.clone_htod(&(0..half).map(|i| (i % 3) as u8).collect::<Vec<_>>())
                    .unwrap()
            }),
            slot: st.clone_htod(&[slot as i64]).unwrap(),
            seq_lens: st.clone_htod(&[ctx as i32]).unwrap(),
            bt: st.clone_htod(&bt).unwrap(),
            inv_freq: st
                .clone_htod(
                    &(0..half)
                        .map(|i| 1e6f32.powf(-((2 * i) as f32) / hd as f32))
                        .collect::<Vec<_>>(),
                )
                .unwrap(),
            qsl: st.clone_htod(&[0i32, 1]).unwrap(),
            new_slot: slot,
            ctx,
        }
    }

    fn fresh(&self, cx: &CudaContext) -> Out {
        let st = cx.stream();
        let nh = self.s.num_heads;
        Out {
            x: st.clone_htod(&self.x).unwrap(),
            qkv: cx.zeros_bf16(self.nq).unwrap(),
            kc: cx.upload_f32_as_bf16(&self.k).unwrap(),
            vc: cx.upload_f32_as_bf16(&self.v).unwrap(),
            attn: cx.zeros_bf16(nh * 128).unwrap(),
            proj: st.alloc_zeros(self.s.hidden).unwrap(),
        }
    }

    fn mrope(&self) -> Option<MropeAxes<'_>> {
        self.axes.as_ref().map(|axes| MropeAxes {
            axes,
            row_stride: 3,
        })
    }

    /// The four launches the block replaces.
    fn separate(
        &self,
        cx: &CudaContext,
        o: &mut Out,
        q: &mut CudaSlice<bf16>,
        ws: &mut CudaSlice<f32>,
    ) {
        let (h, nh, nkv) = (self.s.hidden, self.s.num_heads, self.s.num_kv_heads);
        let eps = self.s.eps;
        let input = match &self.init {
            Some(init) => GemvIn::SetNorm {
                init: init.slice(..),
                residual: &mut o.x,
                weight: &self.norm,
                eps,
            },
            None => GemvIn::Norm {
                residual: &mut o.x,
                weight: &self.norm,
                eps,
            },
        };
        cx.gemv_staged_norm_bf16(&self.wq, input, &mut o.qkv, (1, h, self.nq), None)
            .unwrap();
        let qkv_shape = QkvShape {
            tokens: 1,
            q_heads: nh,
            kv_heads: nkv,
            head_dim: 128,
            eps,
        };
        cx.qkv_rope_cache_bf16(
            qkv_shape,
            QkvBuffers {
                qkv: &o.qkv,
                q_out: q,
                k_cache: &mut o.kc,
                v_cache: &mut o.vc,
                positions: &self.positions,
                slot_mapping: &self.slot,
                inv_freq: &self.inv_freq,
                qk_norm: self.qk_norm.as_ref().map(|(a, b)| (a, b)),
                mrope: self.mrope(),
                prefetch: L2Prefetch::NONE,
            },
        )
        .unwrap();
        cx.paged_attention_bf16(
            &*q,
            &o.kc,
            &o.vc,
            &mut o.attn,
            &self.qsl,
            &self.seq_lens,
            &self.bt,
            ws,
            &self.attn_shape(),
        )
        .unwrap();
        cx.gemv_staged_f32(&o.attn, &self.wo, &mut o.proj, 1, nh * 128, h)
            .unwrap();
    }

    fn attn_shape(&self) -> AttnShape {
        AttnShape {
            num_seqs: 1,
            num_tokens: 1,
            num_heads: self.s.num_heads,
            num_kv_heads: self.s.num_kv_heads,
            head_dim: 128,
            block_size: BS,
            max_blocks_per_seq: self.s.max_blocks_per_seq,
            max_query_len: 1,
            max_seq_len: self.ctx,
            scale: self.s.scale,
        }
    }

    /// The one launch.
    fn block(
        &self,
        cx: &CudaContext,
        o: &mut Out,
        (ws, bar): (&mut CudaSlice<f32>, &mut CudaSlice<i32>),
        stamps: Option<&mut CudaSlice<u64>>,
    ) {
        let w = AttnBlock1Weights {
            input_norm: &self.norm,
            qkv: &self.wq,
            qk_norm: self.qk_norm.as_ref().map(|(a, b)| (a, b)),
            o: &self.wo,
        };
        let b = AttnBlock1Buffers {
            residual: &mut o.x,
            init: self.init.as_ref().map(|i| i.slice(..)),
            k_cache: &mut o.kc,
            v_cache: &mut o.vc,
            positions: &self.positions,
            slot_mapping: &self.slot,
            seq_lens: &self.seq_lens,
            block_table: &self.bt,
            inv_freq: &self.inv_freq,
            mrope: self.mrope(),
            qkv: &mut o.qkv,
            attn: &mut o.attn,
            proj: &mut o.proj,
            workspace: ws,
            barrier: bar,
        };
        match stamps {
            Some(s) => cx.attn_block1_stamped(self.s, w, b, s).unwrap(),
            None => cx.attn_block1(self.s, w, b).unwrap(),
        }
    }
}

/// Against the four launches on the same inputs, over Qwen3-30B-A3B's heads (32 / 4), a
/// group of 8 on 2 KV heads, groups of 2 and of 8 on one KV head with more CTAs than o_proj
/// rows, contexts from 1 to 40000 keys (partitions past one tile), with and without q/k
/// norms, M-RoPE and the embedding set: QKV, residual and both caches bit for bit (the new slot written, nothing else), the
/// attention within bf16 rounding, proj bit for bit the staged GEMV of the block's own
/// attention, three launches in a row equal and the barrier words back at zero.
#[test]
fn attn_block1_matches_the_separate_kernels() {
    let Some(cx) = ctx_or_skip("attn_block1_matches_the_separate_kernels") else {
        return;
    };
    let st = cx.stream().clone();
    let cases = [
        ((2048, 32, 4), 1088, (true, false, false)),
        ((2048, 32, 4), 1, (true, false, true)),
        ((2048, 32, 4), 4000, (true, false, false)),
        // Partitions of 1213 keys: three tiles with the online softmax.
        ((2048, 32, 4), 40000, (true, false, false)),
        ((1024, 16, 2), 33, (true, true, false)),
        ((512, 8, 4), 300, (false, false, true)),
        ((256, 8, 1), 77, (true, false, false)),
    ];
    for (n, &(dims, ctx, flags)) in cases.iter().enumerate() {
        let case = Case::new(&cx, dims, ctx, flags, 100 + n as u64);
        if !cx.attn_block1_fits(&case.s) {
            println!("SKIP attn_block1 {dims:?}: not taken on {:?}", cx.info());
            return;
        }
        let what = format!("{dims:?} ctx {ctx} (q/k norm, M-RoPE, set) {flags:?}");
        let mut r = case.fresh(&cx);
        let mut q = cx.zeros_bf16(dims.1 * 128).unwrap();
        let mut ws_ref = st
            .alloc_zeros::<f32>(paged_attention_workspace_len(&case.attn_shape()).max(1))
            .unwrap();
        case.separate(&cx, &mut r, &mut q, &mut ws_ref);
        let mut ws = st
            .alloc_zeros::<f32>(cx.attn_block1_workspace_len(&case.s))
            .unwrap();
        let mut bar = st.alloc_zeros::<i32>(1 + dims.2).unwrap();
        let mut first: Option<(Vec<u16>, Vec<u32>)> = None;
        for launch in 0..3 {
            let mut o = case.fresh(&cx);
            case.block(&cx, &mut o, (&mut ws, &mut bar), None);
            assert_eq!(bits16(&cx, &o.qkv), bits16(&cx, &r.qkv), "{what}: qkv");
            assert_eq!(bits32(&cx, &o.x), bits32(&cx, &r.x), "{what}: residual");
            assert_eq!(bits16(&cx, &o.vc), bits16(&cx, &r.vc), "{what}: v cache");
            // Keys: bit for bit off the new slot, within a bf16 rounding at it (the q/k norm's
            // sum of squares is added in another order than qkv_rope_cache_bf16's).
            let (kb, ka) = (
                cx.download_f32(&o.kc).unwrap(),
                cx.download_f32(&r.kc).unwrap(),
            );
            let row = dims.2 * 128;
            for (slot, (x, y)) in kb.chunks(row).zip(ka.chunks(row)).enumerate() {
                if slot == case.new_slot {
                    assert!(
                        x.iter().all(|v| v.is_finite()),
                        "{what}: new key not written"
                    );
                    let e = rel_err(x, y);
                    assert!(e < 8e-3, "{what}: new key rel. err {e:.2e}");
                } else {
                    let same = x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{what}: k cache slot {slot} changed");
                }
            }
            let got = cx.download_f32(&o.attn).unwrap();
            let want = cx.download_f32(&r.attn).unwrap();
            let err = rel_err(&got, &want);
            assert!(err < 8e-3, "{what}: attention rel. err {err:.2e}");
            let mut proj = st.alloc_zeros::<f32>(dims.0).unwrap();
            cx.gemv_staged_f32(&o.attn, &case.wo, &mut proj, 1, dims.1 * 128, dims.0)
                .unwrap();
            assert_eq!(bits32(&cx, &o.proj), bits32(&cx, &proj), "{what}: proj");
            let this = (bits16(&cx, &o.attn), bits32(&cx, &o.proj));
            match &first {
                None => first = Some(this),
                Some(f) => assert!(*f == this, "{what}: launch {launch} differs from the first"),
            }
            assert!(
                st.clone_dtoh(&bar).unwrap().iter().all(|&b| b == 0),
                "{what}: barrier words"
            );
            if launch == 0 {
                println!("attn_block1 {what}: attention rel. err {err:.2e}");
            }
        }
    }
}

/// Qwen3-30B-A3B's attention block of one token at 1088 keys in CUDA graphs (20 launches a
/// graph): the four launches against the one, then where a launch's time goes (each CTA's
/// timestamps).
#[test]
fn attn_block1_timing() {
    let Some(cx) = ctx_or_skip("attn_block1_timing") else {
        return;
    };
    let case = Case::new(&cx, (2048, 32, 4), 1088, (true, false, false), 7);
    if !cx.attn_block1_fits(&case.s) {
        println!("SKIP attn_block1_timing: not taken on {:?}", cx.info());
        return;
    }
    let st = cx.stream().clone();
    let mut r = case.fresh(&cx);
    let mut q = cx.zeros_bf16(32 * 128).unwrap();
    let mut ws_ref = st
        .alloc_zeros::<f32>(paged_attention_workspace_len(&case.attn_shape()).max(1))
        .unwrap();
    let four = graph_us(&cx, &mut || case.separate(&cx, &mut r, &mut q, &mut ws_ref));
    let mut o = case.fresh(&cx);
    let mut ws = st
        .alloc_zeros::<f32>(cx.attn_block1_workspace_len(&case.s))
        .unwrap();
    let mut bar = st.alloc_zeros::<i32>(5).unwrap();
    let one = graph_us(&cx, &mut || {
        case.block(&cx, &mut o, (&mut ws, &mut bar), None)
    });
    println!(
        "attn_block1 Qwen3-30B-A3B one token, 1088 keys, CUDA graphs: norm+QKV + q/k norm+RoPE \
         + attention + o_proj {four:.1} µs, one launch {one:.1} µs ({:.2}x)",
        four / one
    );
    assert!(st.clone_dtoh(&bar).unwrap().iter().all(|&b| b == 0));
    let sms = cx.info().sm_count;
    let mut stamps = st.alloc_zeros::<u64>(sms * STAMPS).unwrap();
    for _ in 0..3 {
        case.block(&cx, &mut o, (&mut ws, &mut bar), Some(&mut stamps));
    }
    let host = st.clone_dtoh(&stamps).unwrap();
    let names = [
        "entry",
        "waited",
        "qkv done",
        "barrier 1",
        "attention",
        "barrier 2",
        "attn read",
        "end",
    ];
    print_stamps("attn_block1", &names, &host);
}
