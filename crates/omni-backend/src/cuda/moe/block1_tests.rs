//! GPU tests of the one-launch MoE block (`block1.rs`; each SKIPs without a CUDA driver or on
//! a device it does not run on): bit for bit against the three small-batch kernels it
//! replaces, repeated launches and a CUDA graph of them (the grid barrier's state), and the
//! timing line of both in CUDA graphs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaSlice;

use super::block1::STAMPS;
use super::small_emu::{rms_ref, shape, test_residual};
use super::small_tests::{DevLayer, DevOut, bits16, dev_layer};
use super::{MoeBlock1Buffers, MoeShape};
use crate::cuda::CudaContext;
use crate::cuda::tests::{bits32, ctx_or_skip, graph_us, print_stamps};

/// The one-launch block's outputs.
struct Block1Out {
    h: CudaSlice<crate::cuda::bf16>,
    logits: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    ws: CudaSlice<f32>,
    act: CudaSlice<crate::cuda::bf16>,
    barrier: CudaSlice<i32>,
}

impl Block1Out {
    fn new(cx: &CudaContext, s: MoeShape) -> Self {
        let st = cx.stream();
        Self {
            h: cx.zeros_bf16(s.hidden).unwrap(),
            logits: st.alloc_zeros(s.num_experts).unwrap(),
            ids: st.alloc_zeros(s.top_k).unwrap(),
            ws: st.alloc_zeros(s.top_k).unwrap(),
            act: cx.zeros_bf16(s.top_k * s.inter).unwrap(),
            barrier: st.alloc_zeros(2).unwrap(),
        }
    }

    fn bufs<'a>(
        &'a mut self,
        l: &'a DevLayer,
        residual: &'a mut CudaSlice<f32>,
        delta: Option<&'a CudaSlice<f32>>,
    ) -> MoeBlock1Buffers<'a> {
        MoeBlock1Buffers {
            residual,
            delta: delta.map(|d| d.slice(..)),
            norm_weight: &l.nw,
            router: &l.router,
            w13: &l.w13,
            w2: &l.w2,
            h: self.h.slice_mut(..),
            logits: self.logits.slice_mut(..),
            topk_ids: self.ids.slice_mut(..),
            topk_weights: self.ws.slice_mut(..),
            act: self.act.slice_mut(..),
            barrier: &mut self.barrier,
        }
    }

    fn run(
        &mut self,
        cx: &CudaContext,
        (l, evict_first): (&DevLayer, bool),
        s: MoeShape,
        (residual, delta): (&mut CudaSlice<f32>, Option<&CudaSlice<f32>>),
    ) {
        let b = self.bufs(l, residual, delta);
        cx.moe_block1(s, (true, 1e-6), b, evict_first).unwrap();
    }
}

/// `moe_route` (adding `delta`), `moe_small_gate_up` and `moe_small_down` into `residual`.
fn three_kernels(
    cx: &CudaContext,
    (o, l): (&mut DevOut, &DevLayer),
    s: MoeShape,
    (residual, delta): (&mut CudaSlice<f32>, Option<&CudaSlice<f32>>),
) {
    o.route(cx, l, s, residual, delta);
    cx.moe_small_gate_up(s, &o.h, &l.w13, &o.ids, &mut o.act)
        .unwrap();
    cx.moe_small_down(s, &o.act, &l.w2, &o.ids, &o.ws, residual)
        .unwrap();
}

/// The layer, the residual split into a base and the attention output (when `with_delta`).
fn case(
    cx: &CudaContext,
    s: MoeShape,
    with_delta: bool,
) -> (DevLayer, Vec<f32>, Option<CudaSlice<f32>>) {
    let h = s.hidden;
    let x = test_residual(1, h, 71);
    let base: Vec<f32> = if with_delta {
        x.iter().map(|v| (v * 0.375).round()).collect()
    } else {
        x.clone()
    };
    let rest: Vec<f32> = x.iter().zip(&base).map(|(v, b)| v - b).collect();
    let l0 = dev_layer(cx, s, 72, &[]);
    let nwf = cx.download_f32(&l0.nw).unwrap();
    let l = dev_layer(cx, s, 72, &rms_ref(&x, &nwf, 1e-6));
    let delta = with_delta.then(|| cx.stream().clone_htod(&rest).unwrap());
    (l, base, delta)
}

/// Against `moe_route` + `moe_small_gate_up` + `moe_small_down` on the same inputs, with and
/// without the attention output to add, over shapes from Qwen3-30B-A3B's down to 8-wide rows
/// (fewer output rows than CTAs): the residual, h, logits, act, experts and weights bit for
/// bit, three launches in a row from the same residual, the barrier count back at zero.
#[test]
fn moe_block1_matches_the_three_small_kernels() {
    let Some(cx) = ctx_or_skip("moe_block1_matches_the_three_small_kernels") else {
        return;
    };
    let st = cx.stream().clone();
    let cases = [
        (2048usize, 768usize, 128usize, 8usize),
        (1024, 200, 60, 6),
        (512, 96, 16, 4),
        (8, 8, 3, 3),
    ];
    for (&(h, i, e, k), with_delta) in cases.iter().flat_map(|c| [(c, true), (c, false)]) {
        let s = shape(1, h, i, e, k);
        if !cx.moe_block1_fits(&s) {
            println!("SKIP moe_block1 h={h} i={i}: not taken on {:?}", cx.info());
            return;
        }
        let (l, base, delta) = case(&cx, s, with_delta);
        // The three kernels.
        let mut o = DevOut::new(&cx, s);
        let mut x_ref = st.clone_htod(&base).unwrap();
        three_kernels(&cx, (&mut o, &l), s, (&mut x_ref, delta.as_ref()));
        // One launch, three times from the same residual: plain, with the experts' rows
        // evict-first, plain again.
        let mut b = Block1Out::new(&cx, s);
        let mut x = st.clone_htod(&base).unwrap();
        let what = format!("h={h} i={i} e={e} k={k} delta={with_delta}");
        for (n, ef) in [false, true, false].into_iter().enumerate() {
            st.memcpy_htod(&base, &mut x).unwrap();
            b.run(&cx, (&l, ef), s, (&mut x, delta.as_ref()));
            let r = bits32(&cx, &x);
            assert_eq!(
                r,
                bits32(&cx, &x_ref),
                "{what}: residual, launch {n} (evict-first {ef})"
            );
        }
        assert_ne!(bits32(&cx, &x), bits32(&cx, &st.clone_htod(&base).unwrap()));
        assert_eq!(
            bits16(&st.clone_dtoh(&b.h).unwrap()),
            bits16(&st.clone_dtoh(&o.h).unwrap()),
            "{what}: h"
        );
        assert_eq!(
            bits32(&cx, &b.logits),
            bits32(&cx, &o.logits),
            "{what}: logits"
        );
        assert_eq!(
            st.clone_dtoh(&b.ids).unwrap(),
            st.clone_dtoh(&o.ids).unwrap(),
            "{what}: experts"
        );
        assert_eq!(bits32(&cx, &b.ws), bits32(&cx, &o.ws), "{what}: weights");
        assert_eq!(
            bits16(&st.clone_dtoh(&b.act).unwrap()),
            bits16(&st.clone_dtoh(&o.act.slice(..k * i)).unwrap()),
            "{what}: act"
        );
        let bar = st.clone_dtoh(&b.barrier).unwrap();
        // Six barriers: the count back at zero; the default bumps the generation each time,
        // the flip barrier flips the count's top bit (an even number of times) and leaves it.
        assert_eq!(bar[0], 0, "{what}: barrier count");
        let generations = if super::block1::flip_barrier() { 0 } else { 6 };
        assert_eq!(bar[1], generations, "{what}: barrier generations");
    }
}

/// Qwen3-30B-A3B's MoE block of one token in CUDA graphs (20 launches a graph, every one
/// adding into the same residual): the three small kernels against the one launch, and after
/// the graphs the barrier count back at zero and the residual finite; then where a launch's
/// time goes (each CTA's timestamps).
#[test]
fn moe_block1_timing() {
    let Some(cx) = ctx_or_skip("moe_block1_timing") else {
        return;
    };
    let s = shape(1, 2048, 768, 128, 8);
    if !cx.moe_block1_fits(&s) {
        println!("SKIP moe_block1_timing: not taken on {:?}", cx.info());
        return;
    }
    let st = cx.stream().clone();
    let (l, base, delta) = case(&cx, s, true);
    let mut o = DevOut::new(&cx, s);
    let mut x3 = st.clone_htod(&base).unwrap();
    let three = graph_us(&cx, &mut || {
        three_kernels(&cx, (&mut o, &l), s, (&mut x3, delta.as_ref()))
    });
    let mut b = Block1Out::new(&cx, s);
    let mut x1 = st.clone_htod(&base).unwrap();
    let one = graph_us(&cx, &mut || {
        b.run(&cx, (&l, false), s, (&mut x1, delta.as_ref()))
    });
    let one_ef = graph_us(&cx, &mut || {
        b.run(&cx, (&l, true), s, (&mut x1, delta.as_ref()))
    });
    println!(
        "moe_block1 Qwen3-30B-A3B one token, CUDA graphs: route + gate_up + down {three:.1} µs, \
         one launch {one:.1} µs ({:.2}x), evict-first {one_ef:.1} µs",
        three / one
    );
    assert_eq!(st.clone_dtoh(&b.barrier).unwrap()[0], 0);
    assert!(st.clone_dtoh(&x1).unwrap().iter().all(|v| v.is_finite()));
    // Where a launch's time goes: each CTA's timestamps, after two warm launches.
    let sms = cx.info().sm_count;
    let mut stamps = st.alloc_zeros::<u64>(sms * STAMPS).unwrap();
    for _ in 0..3 {
        let bufs = b.bufs(&l, &mut x1, delta.as_ref());
        cx.moe_block1_stamped(s, bufs, &mut stamps).unwrap();
    }
    let host = st.clone_dtoh(&stamps).unwrap();
    let names = [
        "entry",
        "waited",
        "logits",
        "barrier 1",
        "routed",
        "gate_up",
        "w2 landed",
        "barrier 2",
        "end",
    ];
    print_stamps("moe_block1", &names, &host);
}
