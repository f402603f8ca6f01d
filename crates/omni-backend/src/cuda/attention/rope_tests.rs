//! GPU tests of [`CudaContext::paged_attention_rope_bf16`] (each SKIPs without a CUDA driver):
//! one launch against `qkv_rope_cache_bf16` then `paged_attention_bf16` on the same inputs.
//! The new tokens' cache slots start as NaN, so a CTA that read a new key or value from memory
//! instead of its registers would poison the output.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaSlice;

use super::emu::{ShuffledTables, shuffled_tables};
use super::rope::rope_plan_fits;
use super::tests::Lcg;
use super::*;
use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
use crate::cuda::{CudaContext, L2Prefetch, MropeAxes, QkvBuffers, QkvShape, bf16};

/// One decode step: sequences of context `lens` (0: a sequence with no query token and 5
/// tokens of context), one padding token past them (slot -1).
struct Step {
    nh: usize,
    nkv: usize,
    hd: usize,
    tokens: usize,
    qkv: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    new_slots: Vec<usize>,
    slots: Vec<i64>,
    positions: Vec<i32>,
    axes: Vec<u8>,
    inv_freq: Vec<f32>,
    norms: (Vec<f32>, Vec<f32>),
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    bt: Vec<i32>,
    shape: AttnShape,
}

impl Step {
    fn new(
        (nh, nkv, hd, bs): (usize, usize, usize, usize),
        lens: &[usize],
        mrope: bool,
        seed: u64,
    ) -> Self {
        let mut rng = Lcg(seed);
        let ctx: Vec<usize> = lens.iter().map(|&c| if c == 0 { 5 } else { c }).collect();
        let need: Vec<usize> = ctx.iter().map(|c| c.div_ceil(bs)).collect();
        let ShuffledTables {
            num_blocks,
            mbps,
            bt,
            tables,
        } = shuffled_tables(&need, &mut rng);
        let cache_len = num_blocks * bs * nkv * hd;
        let mut k: Vec<f32> = (0..cache_len).map(|_| rng.f32()).collect();
        let mut v: Vec<f32> = (0..cache_len).map(|_| rng.f32()).collect();
        let (mut qsl, mut slots, mut new_slots, mut positions) =
            (vec![0i32], vec![], vec![], vec![]);
        for (s, &c) in lens.iter().enumerate() {
            if c > 0 {
                let p = c - 1;
                let slot = tables[s][p / bs] as usize * bs + p % bs;
                slots.push(slot as i64);
                new_slots.push(slot);
                // Positions need not be the context index (M-RoPE, offsets): the kernels read them.
                positions.push((p + 3 * s) as i32);
            }
            qsl.push(qsl[s] + i32::from(c > 0));
        }
        // The padding token: no sequence, no slot.
        slots.push(-1);
        positions.push(0);
        let tokens = slots.len();
        for &slot in &new_slots {
            let row = slot * nkv * hd..(slot + 1) * nkv * hd;
            k[row.clone()].iter_mut().for_each(|x| *x = f32::NAN);
            v[row].iter_mut().for_each(|x| *x = f32::NAN);
        }
        if mrope {
            // Three rows of positions, `tokens + 2` apart.
            let stride = tokens + 2;
            let mut rows = vec![0i32; 2 * stride + tokens];
            for (t, &p) in positions.iter().enumerate() {
                for a in 0..3 {
                    rows[a * stride + t] = p + 5 * a as i32;
                }
            }
            positions = rows;
        }
        let half = hd / 2;
        let max_seq_len = ctx.iter().copied().max().unwrap_or(1);
        Self {
            nh,
            nkv,
            hd,
            tokens,
            qkv: rand_bf16_f32(tokens * (nh + 2 * nkv) * hd, seed + 1),
            k,
            v,
            new_slots,
            slots,
            positions,
            axes: (0..half).map(|i| (i % 3) as u8).collect(),
            inv_freq: (0..half)
                .map(|i| 1e6f32.powf(-((2 * i) as f32) / hd as f32))
                .collect(),
            norms: (
                rand_bf16_f32(hd, seed + 2)
                    .iter()
                    .map(|w| 1.0 + 0.5 * w)
                    .collect(),
                rand_bf16_f32(hd, seed + 3)
                    .iter()
                    .map(|w| 1.0 + 0.5 * w)
                    .collect(),
            ),
            qsl,
            seq_lens: ctx.iter().map(|&c| c as i32).collect(),
            bt,
            shape: AttnShape {
                num_seqs: lens.len(),
                num_tokens: tokens,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                block_size: bs,
                max_blocks_per_seq: mbps,
                max_query_len: 1,
                max_seq_len,
                scale: 1.0 / (hd as f32).sqrt(),
            },
        }
    }

    /// (out, k cache, v cache) after one step on the GPU: fused into the attention launch, or
    /// as `qkv_rope_cache_bf16` then `paged_attention_bf16`.
    fn run(&self, cx: &CudaContext, fused: bool, norm: bool, mrope: bool) -> [Vec<f32>; 3] {
        let s = cx.stream();
        let (nh, hd, t) = (self.nh, self.hd, self.tokens);
        let qkv = cx.upload_f32_as_bf16(&self.qkv).unwrap();
        let mut q = cx.upload_f32_as_bf16(&vec![0.0; t * nh * hd]).unwrap();
        let mut kc = cx.upload_f32_as_bf16(&self.k).unwrap();
        let mut vc = cx.upload_f32_as_bf16(&self.v).unwrap();
        let mut out = cx.upload_f32_as_bf16(&vec![0.25; t * nh * hd]).unwrap();
        let pos = s.clone_htod(&self.positions).unwrap();
        let slots = s.clone_htod(&self.slots).unwrap();
        let freq = s.clone_htod(&self.inv_freq).unwrap();
        let axes = s.clone_htod(&self.axes).unwrap();
        let (qn, kn) = (
            cx.upload_f32_as_bf16(&self.norms.0).unwrap(),
            cx.upload_f32_as_bf16(&self.norms.1).unwrap(),
        );
        let qsl = s.clone_htod(&self.qsl).unwrap();
        let seq_lens = s.clone_htod(&self.seq_lens).unwrap();
        let bt = s.clone_htod(&self.bt).unwrap();
        let mut ws = s
            .alloc_zeros::<f32>(paged_attention_workspace_len(&self.shape).max(1))
            .unwrap();
        let qkv_shape = QkvShape {
            tokens: t,
            q_heads: nh,
            kv_heads: self.nkv,
            head_dim: hd,
            eps: 1e-6,
        };
        let bufs = QkvBuffers {
            qkv: &qkv,
            q_out: &mut q,
            k_cache: &mut kc,
            v_cache: &mut vc,
            positions: &pos,
            slot_mapping: &slots,
            inv_freq: &freq,
            qk_norm: norm.then_some((&qn, &kn)),
            mrope: mrope.then_some(MropeAxes {
                axes: &axes,
                row_stride: t + 2,
            }),
            prefetch: L2Prefetch::NONE,
        };
        if fused {
            cx.paged_attention_rope_bf16(
                qkv_shape,
                bufs,
                &mut out,
                &qsl,
                &seq_lens,
                &bt,
                &mut ws,
                &self.shape,
            )
            .unwrap();
        } else {
            cx.qkv_rope_cache_bf16(qkv_shape, bufs).unwrap();
            cx.paged_attention_bf16(
                &q,
                &kc,
                &vc,
                &mut out,
                &qsl,
                &seq_lens,
                &bt,
                &mut ws,
                &self.shape,
            )
            .unwrap();
        }
        [&out, &kc, &vc].map(|b| cx.download_f32(b).unwrap())
    }
}

#[test]
fn decode_with_rope_matches_rope_then_attention() {
    let Some(cx) = ctx_or_skip("decode_with_rope_matches_rope_then_attention") else {
        return;
    };
    // ((q heads, KV heads, head_dim, block size), context lengths, q/k norm, M-RoPE, seed):
    // the 30B-A3B shape at batch 1 (4-head tiles, two per KV head, 32-token partitions and the
    // fused merge), a batch with a sequence of no query token and one whose only context is
    // the new token, no norm, MHA at head_dim 256 with M-RoPE, head_dim 16 (two lanes a row).
    type Case = (
        (usize, usize, usize, usize),
        &'static [usize],
        bool,
        bool,
        u64,
    );
    let cases: [Case; 5] = [
        ((32, 4, 128, 16), &[1088], true, false, 1),
        ((32, 8, 128, 16), &[300, 0, 17, 1], true, false, 2),
        ((16, 2, 64, 16), &[40, 513], false, false, 3),
        ((8, 8, 256, 32), &[70], true, true, 4),
        ((4, 1, 16, 16), &[33, 9], true, false, 5),
    ];
    for (geom, lens, norm, mrope, seed) in cases {
        let st = Step::new(geom, lens, mrope, seed);
        let what = format!("{geom:?} lens {lens:?} norm {norm} mrope {mrope}");
        assert!(rope_plan_fits(&st.shape), "{what}: a CUDA-core decode plan");
        let [out_a, k_a, v_a] = st.run(&cx, false, norm, mrope);
        let [out_b, k_b, v_b] = st.run(&cx, true, norm, mrope);
        // Rows of the padding token are untouched by both.
        let err = rel_err(&out_b, &out_a);
        println!("decode with rope {what}: out rel err vs unfused {err:.2e}");
        assert!(err < 2e-3, "{what}: {err}");
        // The values are copied: equal bit for bit everywhere. Keys: equal off the new slots
        // (untouched), within a bf16 rounding of the unfused ones at them (the norm's sum of
        // squares is added in another order).
        assert!(
            v_a.iter()
                .zip(&v_b)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: v cache"
        );
        let row = st.nkv * st.hd;
        for (slot, (ka, kb)) in k_a.chunks(row).zip(k_b.chunks(row)).enumerate() {
            if st.new_slots.contains(&slot) {
                assert!(
                    kb.iter().all(|x| x.is_finite()),
                    "{what}: slot {slot} not written"
                );
                let e = rel_err(kb, ka);
                assert!(e < 8e-3, "{what}: new key at slot {slot}: rel err {e}");
            } else {
                assert!(
                    ka.iter().zip(kb).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: slot {slot} changed"
                );
            }
        }
    }
}

#[test]
fn decode_with_rope_refuses_other_plans() {
    let Some(cx) = ctx_or_skip("decode_with_rope_refuses_other_plans") else {
        return;
    };
    let st = Step::new((32, 4, 128, 16), &[100], false, 9);
    // A prefill step, and a decode grid large enough for the tensor-core kernel.
    let mut prefill = st.shape;
    prefill.max_query_len = 2;
    let mut large = st.shape;
    (large.num_seqs, large.num_tokens, large.max_seq_len) = (64, 64, 1024);
    let mut refused = vec![(prefill, "prefill")];
    if tc_enabled() {
        refused.push((large, "tensor-core decode"));
    }
    for (sh, what) in refused {
        assert!(!cx.decode_fuses_rope(&sh), "{what}");
        let s = cx.stream();
        let t = sh.num_tokens;
        let qkv = cx.zeros_bf16(t * 40 * 128).unwrap();
        let mut q = cx.zeros_bf16(t * 32 * 128).unwrap();
        let mut kc = cx.zeros_bf16(st.k.len()).unwrap();
        let mut vc = cx.zeros_bf16(st.v.len()).unwrap();
        let mut out = cx.zeros_bf16(t * 32 * 128).unwrap();
        let pos = s.alloc_zeros::<i32>(t).unwrap();
        let slots = s.alloc_zeros::<i64>(t).unwrap();
        let freq = s.alloc_zeros::<f32>(64).unwrap();
        let meta = s
            .alloc_zeros::<i32>(64 * sh.max_blocks_per_seq + 65)
            .unwrap();
        let mut ws = s.alloc_zeros::<f32>(1 << 20).unwrap();
        let e = cx
            .paged_attention_rope_bf16(
                QkvShape {
                    tokens: t,
                    q_heads: 32,
                    kv_heads: 4,
                    head_dim: 128,
                    eps: 1e-6,
                },
                QkvBuffers::<_, _, _, _, _, _, _, CudaSlice<bf16>> {
                    qkv: &qkv,
                    q_out: &mut q,
                    k_cache: &mut kc,
                    v_cache: &mut vc,
                    positions: &pos,
                    slot_mapping: &slots,
                    inv_freq: &freq,
                    qk_norm: None,
                    mrope: None,
                    prefetch: L2Prefetch::NONE,
                },
                &mut out,
                &meta,
                &meta,
                &meta,
                &mut ws,
                &sh,
            )
            .err()
            .unwrap_or_else(|| panic!("{what}: accepted"))
            .to_string();
        assert!(e.contains("CUDA-core kernel"), "{what}: {e}");
    }
}
