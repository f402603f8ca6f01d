//! Timing lines of the attention kernels on the GPU (`backend-tests cuda::attention`, printed for
//! `scripts/gpu-check.sh`): decode at batch 1 and 64 for the Qwen3-30B-A3B (32/4 heads) and
//! Qwen3-8B (32/8) shapes, with the plan in use and the unfused plan of 64-token partitions
//! and a reduce kernel (before the fused merge), eager and replayed from a CUDA graph; the
//! tensor-core prefill (`mma.sync` tilings and, on sm_90, the wgmma ones) at 32/8 and 32/4 heads.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaSlice;

use super::emu::{cuda_core_plan, tensor_core_plan, unfused_plan};
use super::tests::Lcg;
use super::*;
use crate::cuda::tests::{ctx_or_skip, eager_us, graph_us, rand_bf16_f32};
use crate::cuda::{CudaContext, bf16};

/// `seqs` decode rows of `ctx` tokens each on the device, blocks shuffled.
struct DecodeBatch {
    kc: CudaSlice<bf16>,
    vc: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    qsl: CudaSlice<i32>,
    sl: CudaSlice<i32>,
    bt: CudaSlice<i32>,
    shape: AttnShape,
}

impl DecodeBatch {
    fn new(cx: &CudaContext, seqs: usize, ctx: usize, nh: usize, nkv: usize) -> Self {
        let (hd, bs) = (128usize, 16usize);
        let bps = ctx.div_ceil(bs);
        let num_blocks = seqs * bps;
        let mut perm: Vec<i32> = (0..num_blocks as i32).collect();
        let mut rng = Lcg(5);
        for i in (1..num_blocks).rev() {
            perm.swap(i, rng.next(i + 1));
        }
        let cache = num_blocks * bs * nkv * hd;
        let s = cx.stream();
        Self {
            kc: cx.upload_f32_as_bf16(&rand_bf16_f32(cache, 1)).unwrap(),
            vc: cx.upload_f32_as_bf16(&rand_bf16_f32(cache, 2)).unwrap(),
            q: cx
                .upload_f32_as_bf16(&rand_bf16_f32(seqs * nh * hd, 3))
                .unwrap(),
            out: cx.zeros_bf16(seqs * nh * hd).unwrap(),
            qsl: s
                .clone_htod(&(0..=seqs as i32).collect::<Vec<_>>())
                .unwrap(),
            sl: s.clone_htod(&vec![ctx as i32; seqs]).unwrap(),
            bt: s.clone_htod(&perm).unwrap(),
            shape: AttnShape {
                num_seqs: seqs,
                num_tokens: seqs,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                block_size: bs,
                max_blocks_per_seq: bps,
                max_query_len: 1,
                max_seq_len: ctx,
                scale: 1.0 / (hd as f32).sqrt(),
            },
        }
    }

    /// Eager and graph µs per call with the grid sized for `bound` tokens and `plan_of`'s plan.
    fn time(
        &mut self,
        cx: &CudaContext,
        bound: usize,
        plan_of: fn(&AttnShape) -> DecodePlan,
    ) -> (DecodePlan, f64, f64) {
        let sh = AttnShape {
            max_seq_len: bound,
            ..self.shape
        };
        let plan = plan_of(&sh);
        let mut ws = cx
            .stream()
            .alloc_zeros::<f32>(decode_workspace_len(&sh, plan.parts).max(1))
            .unwrap();
        let mut f = || {
            cx.paged_attention_planned(
                &self.q,
                &self.kc,
                &self.vc,
                &mut self.out,
                &self.qsl,
                &self.sl,
                &self.bt,
                &mut ws,
                &sh,
                plan,
            )
            .unwrap()
        };
        let eager = eager_us(cx, &mut f);
        let graph = graph_us(cx, &mut f);
        (plan, eager, graph)
    }
}

/// A fused plan of `part`-token partitions for `shape`.
fn fused(shape: &AttnShape, part: usize) -> DecodePlan {
    DecodePlan {
        tile: group_tiling(shape).0,
        part,
        parts: shape.max_seq_len.div_ceil(part).max(1),
        fused: true,
        pdl: true,
        tc: false,
        balanced: false,
    }
}
fn now_balanced(shape: &AttnShape) -> DecodePlan {
    DecodePlan {
        balanced: true,
        ..decode_plan(shape)
    }
}
fn now_without_pdl(shape: &AttnShape) -> DecodePlan {
    DecodePlan {
        pdl: false,
        ..decode_plan(shape)
    }
}
fn tensor_cores(shape: &AttnShape, part: usize) -> DecodePlan {
    tensor_core_plan(fused(shape, part))
}
fn tc32(shape: &AttnShape) -> DecodePlan {
    tensor_cores(shape, 32)
}
fn tc128(shape: &AttnShape) -> DecodePlan {
    tensor_cores(shape, 128)
}
fn tc256(shape: &AttnShape) -> DecodePlan {
    tensor_cores(shape, 256)
}
fn tc512(shape: &AttnShape) -> DecodePlan {
    tensor_cores(shape, 512)
}
fn fused32(shape: &AttnShape) -> DecodePlan {
    fused(shape, 32)
}
fn fused64(shape: &AttnShape) -> DecodePlan {
    fused(shape, 64)
}
fn fused128(shape: &AttnShape) -> DecodePlan {
    fused(shape, 128)
}

#[test]
fn attention_decode_timing() {
    let Some(cx) = ctx_or_skip("attention_decode_timing") else {
        return;
    };
    type PlanOf = fn(&AttnShape) -> DecodePlan;
    /// (batch, context, grid bound, plans).
    type Case<'a> = (usize, usize, usize, &'a [(&'a str, PlanOf)]);
    let now: (&str, PlanOf) = ("now", decode_plan);
    let unfused: (&str, PlanOf) = ("unfused-64", unfused_plan);
    let sweep: [(&str, PlanOf); 8] = [
        now,
        unfused,
        ("now-no-pdl", now_without_pdl),
        ("now-whole-groups", cuda_core_plan),
        ("fused-32", fused32),
        ("fused-64", fused64),
        ("fused-128", fused128),
        ("tc-32", tc32),
    ];
    let balance: [(&str, PlanOf); 2] = [now, ("now-balanced", now_balanced)];
    let large: [(&str, PlanOf); 7] = [
        now,
        ("now-balanced", now_balanced),
        ("cuda-cores", cuda_core_plan),
        ("tc-128", tc128),
        ("tc-256", tc256),
        ("tc-512", tc512),
        unfused,
    ];
    for (model, nkv) in [("qwen3-30b-a3b", 4usize), ("qwen3-8b", 8)] {
        // (batch, context, grid bound, plans): batch 1 with the engine's graph bound
        // (max_model_len 4096) gets the sweep; context 1 gives the fixed cost.
        let cases: [Case; 9] = [
            (16, 1056, 4096, &balance),
            (64, 1056, 4096, &balance),
            (1, 1056, 4096, &sweep),
            (1, 1056, 1056, &[now, unfused]),
            (1, 1, 4096, &[now, unfused]),
            (1, 4096, 4096, &[now, unfused]),
            (16, 1024, 4096, &large),
            (64, 1024, 1024, &large),
            (64, 1024, 4096, &large),
        ];
        for (seqs, ctx, bound, plans) in cases {
            let mut b = DecodeBatch::new(&cx, seqs, ctx, 32, nkv);
            let bytes = (seqs * ctx * nkv * 128 * 2 * 2) as f64;
            for &(name, plan_of) in plans {
                let (plan, eager, graph) = b.time(&cx, bound, plan_of);
                println!(
                    "attention decode {model} 32/{nkv} heads B={seqs} ctx {ctx} bound {bound} plan {name} (tile {} part {} x {}{}{}{}): eager {eager:.1} us/call, graph {graph:.1} us/call, KV read {:.0} GB/s",
                    plan.tile,
                    plan.part,
                    plan.parts,
                    if plan.fused { " fused" } else { "" },
                    if plan.tc { " tc" } else { "" },
                    if plan.balanced { " balanced" } else { "" },
                    bytes / (graph * 1e3)
                );
            }
        }
    }
}

#[test]
fn attention_prefill_timing() {
    let Some(cx) = ctx_or_skip("attention_prefill_timing") else {
        return;
    };
    // The Qwen3-8B (32/8) and Qwen3-30B-A3B (32/4) heads.
    for nkv in [8usize, 4] {
        prefill_timing(&cx, 32, nkv);
    }
}

/// One causal prefill of 2048 tokens at `nh` / `nkv` heads, head_dim 128: the default kernel,
/// the `mma.sync` candidates and, on sm_90, every wgmma tiling, each checked against the
/// default's output.
fn prefill_timing(cx: &CudaContext, nh: usize, nkv: usize) {
    let (hd, bs) = (128usize, 16usize);
    let time_us = |f: &mut dyn FnMut()| eager_us(cx, f);
    // Prefill: one sequence of 2048 tokens.
    let t = 2048usize;
    let bps = t / bs;
    let kc = cx
        .upload_f32_as_bf16(&rand_bf16_f32(bps * bs * nkv * hd, 4))
        .unwrap();
    let vc = cx
        .upload_f32_as_bf16(&rand_bf16_f32(bps * bs * nkv * hd, 5))
        .unwrap();
    let q = cx
        .upload_f32_as_bf16(&rand_bf16_f32(t * nh * hd, 6))
        .unwrap();
    let mut out = cx.zeros_bf16(t * nh * hd).unwrap();
    let qsl = cx.stream().clone_htod(&[0i32, t as i32]).unwrap();
    let sl = cx.stream().clone_htod(&[t as i32]).unwrap();
    let bt = cx
        .stream()
        .clone_htod(&(0..bps as i32).rev().collect::<Vec<_>>())
        .unwrap();
    let shape = AttnShape {
        num_seqs: 1,
        num_tokens: t,
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        block_size: bs,
        max_blocks_per_seq: bps,
        max_query_len: t,
        max_seq_len: t,
        scale: 1.0 / (hd as f32).sqrt(),
    };
    let mut ws = cx.stream().alloc_zeros::<f32>(1).unwrap();
    let default = (
        prefill_cfg(hd),
        super::source::hd_kernels(hd).unwrap().prefill,
    );
    let run = |out: &mut CudaSlice<bf16>, ws: &mut CudaSlice<f32>, tiling| {
        cx.paged_attention_tiled(
            &q,
            &kc,
            &vc,
            out,
            &qsl,
            &sl,
            &bt,
            ws,
            &shape,
            decode_plan(&shape),
            tiling,
            None,
        )
        .unwrap()
    };
    run(&mut out, &mut ws, default);
    let us = time_us(&mut || run(&mut out, &mut ws, default));
    let flops = 4.0 * (t * t) as f64 / 2.0 * (nh * hd) as f64;
    println!(
        "attention prefill {t} tokens, {nh}/{nkv} heads, hd {hd}, block {bs}: {us:.1} us/call, {:.1} TFLOP/s (x36 layers: {:.2} ms)",
        flops / (us * 1e6),
        36.0 * us / 1e3
    );
    // Other tilings: the same answer (up to the order of the online softmax's tiles), timed.
    let want = cx.download_f32(&out).unwrap();
    let hopper = cx.info().compute_capability == (9, 0);
    let wgmma = WGMMA_PREFILL.iter().filter(|_| hopper);
    let mut table = Vec::new();
    for &(tile, name) in PREFILL_CANDIDATES.iter().chain(wgmma) {
        cx.stream().memset_zeros(&mut out).unwrap();
        run(&mut out, &mut ws, (tile, name));
        let err = crate::cuda::tests::rel_err(&cx.download_f32(&out).unwrap(), &want);
        let us_c = time_us(&mut || run(&mut out, &mut ws, (tile, name)));
        let tflops = flops / (us_c * 1e6);
        println!(
            "attention prefill {nh}/{nkv} heads tile {name} (warps {}, keys {}, q in registers {}, min CTAs {}, wgmma {}): {us_c:.1} us/call, {tflops:.1} TFLOP/s, {:.2}x the default, rel err vs it {err:.1e}",
            tile.warps,
            tile.bn,
            tile.qreg,
            tile.min_ctas,
            tile.wgmma,
            us_c / us
        );
        table.push((name, us_c, tflops, err));
        assert!(err < 1e-2, "{name}: {err}");
    }
    if !hopper {
        println!("attention prefill: no wgmma tilings (not an sm_90 device)");
    }
    println!("attention prefill {t} tokens {nh}/{nkv} heads: tile | us | TFLOP/s | rel err");
    println!(
        "  attn_prefill_hd128 (default) | {us:.1} | {:.1} | -",
        flops / (us * 1e6)
    );
    for (name, us_c, tflops, err) in table {
        println!("  {name} | {us_c:.1} | {tflops:.1} | {err:.1e}");
    }
}
