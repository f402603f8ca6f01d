//! GPU tests of the small-batch MoE kernels (`small.rs`; each SKIPs without a CUDA driver):
//! each kernel against the unfused kernels it replaces at T = 1, 2, 8, a CUDA graph replay, the
//! shape errors, and the timing lines. The CPU emulators are in `small_emu.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaSlice;

use super::MoeShape;
use super::small::*;
use super::small_emu::{rms_ref, routing_is_clear, shape, test_residual, test_router};
use super::tests::{cpu_moe_rows, cpu_topk, rand_bf16_scaled};
use super::timing_tests::time_us;
use crate::cuda::tests::graph_us;
use crate::cuda::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
use crate::cuda::{CudaContext, CudaError, ResidualUpdate, bf16};

/// Device inputs of one small MoE layer.
pub(super) struct DevLayer {
    pub(super) nw: CudaSlice<bf16>,
    pub(super) router: CudaSlice<f32>,
    pub(super) w13: CudaSlice<bf16>,
    pub(super) w2: CudaSlice<bf16>,
}

/// Device outputs of the small path.
pub(super) struct DevOut {
    pub(super) h: CudaSlice<bf16>,
    pub(super) logits: CudaSlice<f32>,
    pub(super) ids: CudaSlice<i32>,
    pub(super) ws: CudaSlice<f32>,
    counters: CudaSlice<i32>,
    pub(super) act: CudaSlice<bf16>,
}

impl DevOut {
    pub(super) fn new(cx: &CudaContext, s: MoeShape) -> Self {
        let st = cx.stream();
        Self {
            h: cx
                .upload_bf16(&vec![bf16::NAN; s.tokens * s.hidden])
                .unwrap(),
            logits: st.alloc_zeros(s.tokens * s.num_experts).unwrap(),
            ids: st.alloc_zeros(s.tokens * s.top_k).unwrap(),
            ws: st.alloc_zeros(s.tokens * s.top_k).unwrap(),
            counters: st.alloc_zeros(s.tokens).unwrap(),
            act: st.alloc_zeros(moe_small_act_len(s)).unwrap(),
        }
    }

    /// The three small-path kernels: route, gate_up, down into `residual`.
    fn run(&mut self, cx: &CudaContext, l: &DevLayer, s: MoeShape, residual: &mut CudaSlice<f32>) {
        self.route(cx, l, s, residual, None);
        cx.moe_small_gate_up(s, &self.h, &l.w13, &self.ids, &mut self.act)
            .unwrap();
        cx.moe_small_down(s, &self.act, &l.w2, &self.ids, &self.ws, residual)
            .unwrap();
    }

    pub(super) fn route(
        &mut self,
        cx: &CudaContext,
        l: &DevLayer,
        s: MoeShape,
        residual: &mut CudaSlice<f32>,
        delta: Option<&CudaSlice<f32>>,
    ) {
        cx.moe_route(
            s,
            true,
            1e-6,
            MoeRouteBuffers {
                residual,
                delta: delta.map(|d| d.slice(..)),
                norm_weight: &l.nw,
                router: &l.router,
                h: self.h.slice_mut(..),
                logits: self.logits.slice_mut(..),
                topk_ids: self.ids.slice_mut(..),
                topk_weights: self.ws.slice_mut(..),
                counters: &mut self.counters,
            },
        )
        .unwrap();
    }
}

pub(super) fn dev_layer(cx: &CudaContext, s: MoeShape, seed: u64, normed0: &[f32]) -> DevLayer {
    let (h, i, e) = (s.hidden, s.inter, s.num_experts);
    let nw: Vec<f32> = rand_bf16_f32(h, seed)
        .iter()
        .map(|v| 1.0 + v / 4.0)
        .collect();
    DevLayer {
        nw: cx.upload_f32_as_bf16(&nw).unwrap(),
        router: cx
            .stream()
            .clone_htod(&test_router(e, h, seed + 1, normed0))
            .unwrap(),
        w13: cx
            .upload_bf16(&rand_bf16_scaled(e * 2 * i * h, seed + 2, 1.0 / 32.0))
            .unwrap(),
        w2: cx
            .upload_bf16(&rand_bf16_scaled(e * h * i, seed + 3, 1.0 / 32.0))
            .unwrap(),
    }
}

pub(super) fn bits16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|b| b.to_bits()).collect()
}

/// `moe_route` against the unfused kernels it replaces (fused_add_rms_norm_f32_out,
/// matmul_nt_f32, moe_topk_softmax) at T = 1, 2, 8, 64 (tiles of 4 tokens, a ragged last one at
/// 6), with the residual already summed and with the attention output as `delta`: h and the
/// summed residual bit for bit, logits to f32 rounding, the same experts (where no near-tie
/// makes the order depend on rounding) and weights; the counters stay zero over repeated calls.
#[test]
fn small_moe_route_matches_the_unfused_kernels() {
    let Some(cx) = ctx_or_skip("small_moe_route_matches_the_unfused_kernels") else {
        return;
    };
    let st = cx.stream().clone();
    let cases = [(2048usize, 128usize, 8usize), (256, 60, 4), (8, 3, 3)];
    for (&(h, e, k), with_delta) in cases.iter().flat_map(|c| [(c, false), (c, true)]) {
        for t in [1usize, 2, 6, 8, 64] {
            let s = shape(t, h, 8, e, k);
            let x = test_residual(t, h, 31 + t as u64);
            // With a delta the residual holds part of x and the delta the rest.
            let base: Vec<f32> = if with_delta {
                x.iter().map(|v| (v * 0.375).round()).collect()
            } else {
                x.clone()
            };
            let rest: Vec<f32> = x.iter().zip(&base).map(|(v, b)| v - b).collect();
            let l0 = dev_layer(&cx, s, 32, &[]);
            let nwf = cx.download_f32(&l0.nw).unwrap();
            let normed0 = rms_ref(&x[..h], &nwf, 1e-6);
            let l = dev_layer(&cx, s, 32, &normed0);
            let drest = st.clone_htod(&rest).unwrap();
            let mut o = DevOut::new(&cx, s);
            let mut dx = st.clone_htod(&base).unwrap();
            for _ in 0..3 {
                // Every call starts from the same residual (a delta is added into it).
                st.memcpy_htod(&base, &mut dx).unwrap();
                o.route(&cx, &l, s, &mut dx, with_delta.then_some(&drest));
            }
            // Unfused.
            let mut x2 = st.clone_htod(&base).unwrap();
            let zeros = st.alloc_zeros::<f32>(t * h).unwrap();
            let add = if with_delta { &drest } else { &zeros };
            let mut h_ref = cx.zeros_bf16(t * h).unwrap();
            let mut h32 = st.alloc_zeros::<f32>(t * h).unwrap();
            cx.fused_add_rms_norm_f32_out(
                &mut x2,
                ResidualUpdate::Add(add.slice(..)),
                &l.nw,
                &mut h_ref,
                Some(&mut h32.slice_mut(..)),
                t,
                h,
                1e-6,
            )
            .unwrap();
            let mut logits_ref = st.alloc_zeros::<f32>(t * e).unwrap();
            cx.matmul_nt_f32(&h32, &l.router, &mut logits_ref, t, h, e)
                .unwrap();
            let mut ids_ref = st.alloc_zeros::<i32>(t * k).unwrap();
            let mut ws_ref = st.alloc_zeros::<f32>(t * k).unwrap();
            cx.moe_topk_softmax(&logits_ref, &mut ids_ref, &mut ws_ref, t, e, k, true)
                .unwrap();
            let hb = bits16(&st.clone_dtoh(&o.h).unwrap());
            assert_eq!(
                hb,
                bits16(&st.clone_dtoh(&h_ref).unwrap()),
                "t={t} h={h}: h"
            );
            let bits32 = |v: &CudaSlice<f32>| -> Vec<u32> {
                st.clone_dtoh(v)
                    .unwrap()
                    .iter()
                    .map(|f| f.to_bits())
                    .collect()
            };
            assert_eq!(bits32(&dx), bits32(&x2), "t={t} h={h}: the summed residual");
            let (lg, lr) = (
                st.clone_dtoh(&o.logits).unwrap(),
                st.clone_dtoh(&logits_ref).unwrap(),
            );
            for (g, w) in lg.iter().zip(&lr) {
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "logit {g} vs {w}");
            }
            let (ig, ir) = (
                st.clone_dtoh(&o.ids).unwrap(),
                st.clone_dtoh(&ids_ref).unwrap(),
            );
            let (wg, wr) = (
                st.clone_dtoh(&o.ws).unwrap(),
                st.clone_dtoh(&ws_ref).unwrap(),
            );
            let mut same = 0;
            for tok in 0..t {
                let mut probs = lr[tok * e..(tok + 1) * e].to_vec();
                crate::ops::softmax_inplace(&mut probs);
                if !routing_is_clear(&probs, k) {
                    continue;
                }
                assert_eq!(ig[tok * k..(tok + 1) * k], ir[tok * k..(tok + 1) * k]);
                for j in tok * k..(tok + 1) * k {
                    assert!((wg[j] - wr[j]).abs() <= 1e-5, "{} vs {}", wg[j], wr[j]);
                }
                same += 1;
            }
            assert!(same > 0);
            assert!(st.clone_dtoh(&o.counters).unwrap().iter().all(|&c| c == 0));
            println!(
                "moe route t={t} h={h} e={e} delta {with_delta}: h and residual bitwise, {same}/{t} routings equal"
            );
        }
    }
}

/// The small path's expert kernels against `fused_moe_bf16` + widening + residual add on the
/// same routing (the router's, every token on the same experts), at T = 1, 2, 8 on the real
/// Qwen3-30B-A3B layer shape (fewer experts), and against the CPU block; the gate_up entry
/// that prefetches w2 writes the same bits as the plain one.
#[test]
fn small_moe_experts_match_the_grouped_gemm_path() {
    let Some(cx) = ctx_or_skip("small_moe_experts_match_the_grouped_gemm_path") else {
        return;
    };
    let st = cx.stream().clone();
    let (h, i, e, k) = (2048usize, 768usize, 32usize, 8usize);
    let l = dev_layer(&cx, shape(1, h, i, e, k), 41, &[]);
    let (w13, w2) = (
        st.clone_dtoh(&l.w13).unwrap(),
        st.clone_dtoh(&l.w2).unwrap(),
    );
    for t in [1usize, 2, 8] {
        let s = shape(t, h, i, e, k);
        let x = rand_bf16_f32(t * h, 42 + t as u64);
        let logits: Vec<f32> = rand_bf16_f32(t * e, 43).iter().map(|v| 4.0 * v).collect();
        for (name, logits) in [
            ("router", logits.clone()),
            ("shared", logits[..e].repeat(t)),
        ] {
            let (ids, ws) = cpu_topk(&logits, e, k, true);
            let dx = cx.upload_f32_as_bf16(&x).unwrap();
            let dids = st.clone_htod(&ids).unwrap();
            let dws = st.clone_htod(&ws).unwrap();
            let mut out = cx.zeros_bf16(t * h).unwrap();
            let mut wsp = st
                .alloc_zeros::<u8>(super::fused_moe_workspace_bytes(s))
                .unwrap();
            cx.fused_moe_bf16(&dx, &l.w13, &l.w2, &dids, &dws, &mut out, &mut wsp, s)
                .unwrap();
            let want = cx.download_f32(&out).unwrap();
            let base = rand_bf16_f32(t * h, 44);
            let mut res = st.clone_htod(&base).unwrap();
            let mut act = st.alloc_zeros::<bf16>(moe_small_act_len(s)).unwrap();
            cx.moe_small_gate_up(s, &dx, &l.w13, &dids, &mut act)
                .unwrap();
            // The w2-prefetching entry writes the same act bits.
            let mut act_pf = st.alloc_zeros::<bf16>(moe_small_act_len(s)).unwrap();
            cx.moe_small_gate_up_prefetch_w2(s, &dx, &l.w13, &l.w2, &dids, &mut act_pf)
                .unwrap();
            assert_eq!(
                bits16(&st.clone_dtoh(&act_pf).unwrap()),
                bits16(&st.clone_dtoh(&act).unwrap()),
                "t={t} {name}: gate_up with the w2 prefetch"
            );
            cx.moe_small_down(s, &act, &l.w2, &dids, &dws, &mut res)
                .unwrap();
            let got: Vec<f32> = st
                .clone_dtoh(&res)
                .unwrap()
                .iter()
                .zip(&base)
                .map(|(r, b)| r - b)
                .collect();
            let err = rel_err(&got, &want);
            let cpu = cpu_moe_rows(&x, &w13, &w2, &ids, &ws, s, &(0..t).collect::<Vec<_>>());
            let err_cpu = rel_err(&got, &cpu);
            println!(
                "moe small-batch experts t={t} {name}: rel err vs grouped GEMM {err:.2e}, vs CPU f32 {err_cpu:.2e}"
            );
            assert!(
                err <= 1e-2 && err_cpu <= 2e-2,
                "t={t} {name}: {err} {err_cpu}"
            );
        }
    }
}

/// The whole small path captured in a CUDA graph replays bit-identically to the eager run
/// (and the eager run is deterministic: twice the same bits).
#[test]
fn small_moe_layer_in_a_cuda_graph_is_bit_identical() {
    let Some(cx) = ctx_or_skip("small_moe_layer_in_a_cuda_graph_is_bit_identical") else {
        return;
    };
    let st = cx.stream().clone();
    let s = shape(2, 512, 64, 16, 4);
    let l = dev_layer(&cx, s, 51, &[]);
    let x = test_residual(2, 512, 52);
    let mut o = DevOut::new(&cx, s);
    let mut res = st.clone_htod(&x).unwrap();
    let mut eager = Vec::new();
    for _ in 0..2 {
        st.memcpy_htod(&x, &mut res).unwrap();
        o.run(&cx, &l, s, &mut res);
        eager.push(st.clone_dtoh(&res).unwrap());
    }
    let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(b(&eager[0]), b(&eager[1]), "eager runs differ");
    st.memcpy_htod(&x, &mut res).unwrap();
    cx.synchronize().unwrap();
    st.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    o.run(&cx, &l, s, &mut res);
    let graph = st
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    for _ in 0..2 {
        st.memcpy_htod(&x, &mut res).unwrap();
        graph.launch().unwrap();
        assert_eq!(b(&st.clone_dtoh(&res).unwrap()), b(&eager[0]), "replay");
    }
    println!("moe small layer: CUDA graph replay bit-identical");
}

#[test]
fn small_moe_rejects_bad_shapes() {
    let Some(cx) = ctx_or_skip("small_moe_rejects_bad_shapes") else {
        return;
    };
    let st = cx.stream().clone();
    let s = shape(2, 64, 16, 4, 2);
    let l = dev_layer(&cx, s, 61, &[]);
    let mut o = DevOut::new(&cx, s);
    let mut res = st.alloc_zeros::<f32>(2 * 64).unwrap();
    for bad in [
        shape(9, 64, 16, 4, 2),
        shape(2, 12, 16, 4, 2),
        shape(2, 64, 16, 4, 5),
        shape(2, 64, 16, 5, 2),
    ] {
        let r = cx.moe_small_gate_up(bad, &o.h, &l.w13, &o.ids, &mut o.act);
        assert!(matches!(r, Err(CudaError::Shape(_))), "{bad:?}: {r:?}");
        let r = cx.moe_small_down(bad, &o.act, &l.w2, &o.ids, &o.ws, &mut res);
        assert!(matches!(r, Err(CudaError::Shape(_))), "{bad:?}: {r:?}");
    }
    let mut short = st.alloc_zeros::<bf16>(8).unwrap();
    let r = cx.moe_small_gate_up(s, &o.h, &l.w13, &o.ids, &mut short);
    assert!(matches!(r, Err(CudaError::Shape(_))), "short act: {r:?}");
    let r = cx.moe_small_gate_up_prefetch_w2(s, &o.h, &l.w13, &l.w13, &o.ids, &mut o.act);
    assert!(
        matches!(r, Err(CudaError::Shape(_))),
        "w2 of another size: {r:?}"
    );
    let mut small_res = st.alloc_zeros::<f32>(64).unwrap();
    let r = cx.moe_small_down(s, &o.act, &l.w2, &o.ids, &o.ws, &mut small_res);
    assert!(
        matches!(r, Err(CudaError::Shape(_))),
        "short residual: {r:?}"
    );
    o.run(&cx, &l, s, &mut res);
}

/// Real Qwen3-30B-A3B layer (128 experts): the small path's time per kernel at T = 1, 2, 8
/// against the grouped-GEMM path (routing precomputed for the experts), TB/s of expert weights.
#[test]
fn small_moe_real_shape_timing() {
    let Some(cx) = ctx_or_skip("small_moe_real_shape_timing") else {
        return;
    };
    let st = cx.stream().clone();
    let (h, i, e, k) = (2048usize, 768usize, 128usize, 8usize);
    let l = dev_layer(&cx, shape(1, h, i, e, k), 71, &[]);
    let bytes_per_expert = (3 * i * h * 2) as f64;
    for t in [1usize, 2, 8] {
        let s = shape(t, h, i, e, k);
        let x = test_residual(t, h, 72 + t as u64);
        let mut res = st.clone_htod(&x).unwrap();
        let mut o = DevOut::new(&cx, s);
        o.route(&cx, &l, s, &mut res, None);
        let ids = st.clone_dtoh(&o.ids).unwrap();
        let mut seen = vec![false; e];
        ids.iter().for_each(|&id| seen[id as usize] = true);
        let touched = seen.iter().filter(|&&b| b).count();
        let us_route = time_us(&cx, || o.route(&cx, &l, s, &mut res, None));
        let us_experts = time_us(&cx, || {
            cx.moe_small_gate_up(s, &o.h, &l.w13, &o.ids, &mut o.act)
                .unwrap();
            cx.moe_small_down(s, &o.act, &l.w2, &o.ids, &o.ws, &mut res)
                .unwrap();
        });
        let us_layer = time_us(&cx, || o.run(&cx, &l, s, &mut res));
        let mut out = cx.zeros_bf16(t * h).unwrap();
        let mut wsp = st
            .alloc_zeros::<u8>(super::fused_moe_workspace_bytes(s))
            .unwrap();
        let us_grouped = time_us(&cx, || {
            cx.fused_moe_bf16(&o.h, &l.w13, &l.w2, &o.ids, &o.ws, &mut out, &mut wsp, s)
                .unwrap()
        });
        let mb = touched as f64 * bytes_per_expert / 1e6;
        println!(
            "moe decode small-batch T={t}: experts {us_experts:.1} µs ({:.2} TB/s of expert weights, {touched} experts, {mb:.1} MB), route {us_route:.1} µs, all three {us_layer:.1} µs; grouped-GEMM experts {us_grouped:.1} µs ({:.2} TB/s)",
            mb / us_experts,
            mb / us_grouped,
        );
    }
    // As a decode step replays a layer: in a CUDA graph, and each call on other experts than
    // the calls before it (16 routings of 8 distinct experts each cover all 128, so no call
    // finds its weights in the 60 MB L2, as no layer does in a model).
    let s = shape(1, h, i, e, k);
    let routes: Vec<(CudaSlice<i32>, CudaSlice<f32>)> = (0..e / k)
        .map(|r| {
            let ids: Vec<i32> = (0..k).map(|j| ((r * k + j * 5) % e) as i32).collect();
            let ws = vec![1.0 / k as f32; k];
            (st.clone_htod(&ids).unwrap(), st.clone_htod(&ws).unwrap())
        })
        .collect();
    let x = test_residual(1, h, 90);
    let mut res = st.clone_htod(&x).unwrap();
    let mut o = DevOut::new(&cx, s);
    o.route(&cx, &l, s, &mut res, None);
    let mut out = cx.zeros_bf16(h).unwrap();
    let mut wsp = st
        .alloc_zeros::<u8>(super::fused_moe_workspace_bytes(s))
        .unwrap();
    let mut n = 0usize;
    let us_small = graph_us(&cx, &mut || {
        let (ids, _) = &routes[n % routes.len()];
        n += 1;
        cx.moe_small_gate_up(s, &o.h, &l.w13, ids, &mut o.act)
            .unwrap();
        cx.moe_small_down(s, &o.act, &l.w2, ids, &o.ws, &mut res)
            .unwrap();
    });
    // The same with the gate_up kernel prefetching the routed experts' w2 into L2.
    let us_small_pf = graph_us(&cx, &mut || {
        let (ids, _) = &routes[n % routes.len()];
        n += 1;
        cx.moe_small_gate_up_prefetch_w2(s, &o.h, &l.w13, &l.w2, ids, &mut o.act)
            .unwrap();
        cx.moe_small_down(s, &o.act, &l.w2, ids, &o.ws, &mut res)
            .unwrap();
    });
    let us_grouped = graph_us(&cx, &mut || {
        let (ids, ws) = &routes[n % routes.len()];
        n += 1;
        cx.fused_moe_bf16(&o.h, &l.w13, &l.w2, ids, ws, &mut out, &mut wsp, s)
            .unwrap()
    });
    let us_route = graph_us(&cx, &mut || o.route(&cx, &l, s, &mut res, None));
    // Each kernel alone (the down kernel reads ids uploaded before the graph: nothing in it
    // writes them).
    let us_gate_up = graph_us(&cx, &mut || {
        let (ids, _) = &routes[n % routes.len()];
        n += 1;
        cx.moe_small_gate_up(s, &o.h, &l.w13, ids, &mut o.act)
            .unwrap();
    });
    let us_down = graph_us(&cx, &mut || {
        let (ids, _) = &routes[n % routes.len()];
        n += 1;
        cx.moe_small_down(s, &o.act, &l.w2, ids, &o.ws, &mut res)
            .unwrap();
    });
    // The router of larger steps, in a graph: the fused route (adding the attention output)
    // against the unfused norm + f32 router GEMM + top-k it replaces on the decode path.
    for t in [1usize, 4, 16, 64] {
        let s = shape(t, h, i, e, k);
        let mut o = DevOut::new(&cx, s);
        let mut x = st.clone_htod(&test_residual(t, h, 91)).unwrap();
        let d = st.alloc_zeros::<f32>(t * h).unwrap();
        let us_fused = graph_us(&cx, &mut || o.route(&cx, &l, s, &mut x, Some(&d)));
        let mut h32 = st.alloc_zeros::<f32>(t * h).unwrap();
        let us_unfused = graph_us(&cx, &mut || {
            cx.fused_add_rms_norm_f32_out(
                &mut x,
                ResidualUpdate::Add(d.slice(..)),
                &l.nw,
                &mut o.h,
                Some(&mut h32.slice_mut(..)),
                t,
                h,
                1e-6,
            )
            .unwrap();
            cx.matmul_nt_f32(&h32, &l.router, &mut o.logits, t, h, e)
                .unwrap();
            cx.moe_topk_softmax(&o.logits, &mut o.ids, &mut o.ws, t, e, k, true)
                .unwrap();
        });
        println!(
            "moe route T={t} in a CUDA graph: fused {us_fused:.1} µs, unfused norm + router GEMM + top-k {us_unfused:.1} µs"
        );
    }
    let mb = k as f64 * bytes_per_expert / 1e6;
    println!(
        "moe decode T=1 in a CUDA graph, experts cold in L2: small-batch experts {us_small:.1} µs ({:.2} TB/s; gate_up alone {us_gate_up:.1} µs {:.2} TB/s, down alone {us_down:.1} µs {:.2} TB/s), grouped-GEMM experts {us_grouped:.1} µs ({:.2} TB/s), route {us_route:.1} µs",
        mb / us_small,
        mb * 2.0 / 3.0 / us_gate_up,
        mb / 3.0 / us_down,
        mb / us_grouped
    );
    println!(
        "moe decode T=1 in a CUDA graph, experts cold in L2: small-batch experts with the w2 prefetch {us_small_pf:.1} µs ({:.2} TB/s)",
        mb / us_small_pf
    );
}
