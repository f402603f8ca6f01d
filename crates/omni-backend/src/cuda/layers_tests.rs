//! `qkv_rope_cache_bf16` against an f32 CPU reference: Qwen3's per-head norm, RoPE (one row of
//! positions and M-RoPE rows), the cache writes and a padding token's skipped slot, on head
//! dims whose half is even (the kernel's bf16x2 path) and odd (its scalar path), one head a warp
//! and, from 256 tokens, groups of 8 heads a warp that mix queries and keys.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::tests::{ctx_or_skip, rand_bf16_f32, rel_err};
use super::*;

struct Case {
    tokens: usize,
    lq: usize,
    lkv: usize,
    hd: usize,
    norm: bool,
    mrope: bool,
}

/// The CPU reference: (q_out, k_cache, v_cache) as f32, caches `slots * lkv * hd` long with
/// untouched entries left at `fill`.
#[allow(clippy::too_many_arguments)]
fn cpu_qkv_rope(
    c: &Case,
    qkv: &[f32],
    pos: &[i32],
    axes: &[u8],
    slots: &[i64],
    inv_freq: &[f32],
    norms: (&[f32], &[f32]),
    cache_slots: usize,
    fill: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (lq, lkv, hd, half) = (c.lq, c.lkv, c.hd, c.hd / 2);
    let row = (lq + 2 * lkv) * hd;
    let mut q = vec![0f32; c.tokens * lq * hd];
    let mut kc = vec![fill; cache_slots * lkv * hd];
    let mut vc = kc.clone();
    for t in 0..c.tokens {
        for hh in 0..lq + lkv {
            let slot = slots[t];
            if hh >= lq && slot < 0 {
                continue;
            }
            let src = &qkv[t * row + hh * hd..][..hd];
            let mut x = src.to_vec();
            if c.norm {
                let w = if hh < lq { norms.0 } else { norms.1 };
                let ss: f32 = x.iter().map(|v| v * v).sum();
                let inv = 1.0 / (ss / hd as f32 + 1e-6).sqrt();
                for (v, w) in x.iter_mut().zip(w) {
                    *v = *v * inv * w;
                }
            }
            let dst: &mut [f32] = if hh < lq {
                &mut q[(t * lq + hh) * hd..][..hd]
            } else {
                &mut kc[(slot as usize * lkv + hh - lq) * hd..][..hd]
            };
            for i in 0..half {
                let axis = if c.mrope { axes[i] as usize } else { 0 };
                let p = pos[axis * c.tokens + t] as f32;
                let (s, co) = (p * inv_freq[i]).sin_cos();
                dst[i] = x[i] * co - x[i + half] * s;
                dst[i + half] = x[i + half] * co + x[i] * s;
            }
            if hh >= lq {
                let j = hh - lq;
                let v = &qkv[t * row + (lq + lkv + j) * hd..][..hd];
                vc[(slot as usize * lkv + j) * hd..][..hd].copy_from_slice(v);
            }
        }
    }
    (q, kc, vc)
}

#[test]
fn qkv_rope_cache_matches_cpu() {
    let Some(cx) = ctx_or_skip("qkv_rope_cache_matches_cpu") else {
        return;
    };
    // (tokens, q heads, kv heads, head dim, q/k norm, M-RoPE).
    let cases = [
        // Qwen3-30B-A3B's heads, one a warp (a decode step).
        (5, 32, 4, 128, true, false),
        // Queries and keys, M-RoPE rows, no norm.
        (3, 6, 3, 64, false, true),
        // hd / 2 odd: the scalar path.
        (4, 5, 2, 10, true, false),
        // Steps of 256+ tokens group 8 heads a warp: queries and keys in one group, M-RoPE.
        (300, 6, 3, 64, true, true),
        // ... and on the scalar path.
        (256, 5, 2, 10, true, false),
        // The largest head dim.
        (2, 4, 2, 256, true, true),
        // A Qwen3-30B-A3B prefill (the grouped kernel, or the wide one with
        // OMNI_CUDA_QKV_ROPE_WIDE=1), and 8/1 heads with M-RoPE (a wide round of k and v heads).
        (300, 32, 4, 128, true, false),
        (260, 8, 1, 128, true, true),
    ]
    .map(|(tokens, lq, lkv, hd, norm, mrope)| Case {
        tokens,
        lq,
        lkv,
        hd,
        norm,
        mrope,
    });
    for (n, c) in cases.iter().enumerate() {
        let (lq, lkv, hd, t) = (c.lq, c.lkv, c.hd, c.tokens);
        let half = hd / 2;
        let seed = 100 * n as u64;
        let qkv = rand_bf16_f32(t * (lq + 2 * lkv) * hd, seed + 1);
        let rows = if c.mrope { 3 } else { 1 };
        // Positions up to a few thousand: angles far past 2 pi.
        let pos: Vec<i32> = (0..rows * t)
            .map(|i| (i as i32 * 977 + 13) % 4000)
            .collect();
        let axes: Vec<u8> = (0..half).map(|i| (i % 3) as u8).collect();
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1e6f32.powf(-((2 * i) as f32) / hd as f32))
            .collect();
        let (qn, kn) = (rand_bf16_f32(hd, seed + 2), rand_bf16_f32(hd, seed + 3));
        // Token 1 is padding (slot -1): its keys and values are not written.
        let cache_slots = 2 * t + 1;
        let slots: Vec<i64> = (0..t)
            .map(|i| if i == 1 { -1 } else { (2 * i + 1) as i64 })
            .collect();
        let fill = 7.0f32;
        let (want_q, want_k, want_v) = cpu_qkv_rope(
            c,
            &qkv,
            &pos,
            &axes,
            &slots,
            &inv_freq,
            (&qn, &kn),
            cache_slots,
            fill,
        );

        let s = cx.stream();
        let d_qkv = cx.upload_f32_as_bf16(&qkv).unwrap();
        let mut d_q = cx.upload_f32_as_bf16(&vec![0.0; t * lq * hd]).unwrap();
        let mut d_k = cx
            .upload_f32_as_bf16(&vec![fill; cache_slots * lkv * hd])
            .unwrap();
        let mut d_v = cx
            .upload_f32_as_bf16(&vec![fill; cache_slots * lkv * hd])
            .unwrap();
        let d_pos = s.clone_htod(&pos).unwrap();
        let d_slots = s.clone_htod(&slots).unwrap();
        let d_freq = s.clone_htod(&inv_freq).unwrap();
        let d_axes = s.clone_htod(&axes).unwrap();
        let (d_qn, d_kn) = (
            cx.upload_f32_as_bf16(&qn).unwrap(),
            cx.upload_f32_as_bf16(&kn).unwrap(),
        );
        cx.qkv_rope_cache_bf16(
            QkvShape {
                tokens: t,
                q_heads: lq,
                kv_heads: lkv,
                head_dim: hd,
                eps: 1e-6,
            },
            QkvBuffers {
                qkv: &d_qkv,
                q_out: &mut d_q,
                k_cache: &mut d_k,
                v_cache: &mut d_v,
                positions: &d_pos,
                slot_mapping: &d_slots,
                inv_freq: &d_freq,
                qk_norm: c.norm.then_some((&d_qn, &d_kn)),
                mrope: c.mrope.then_some(MropeAxes {
                    axes: &d_axes,
                    row_stride: t,
                }),
                prefetch: L2Prefetch::NONE,
            },
        )
        .unwrap();
        let got_q = cx.download_f32(&d_q).unwrap();
        let got_k = cx.download_f32(&d_k).unwrap();
        let got_v = cx.download_f32(&d_v).unwrap();
        for (what, got, want) in [
            ("q", &got_q, &want_q),
            ("k", &got_k, &want_k),
            ("v", &got_v, &want_v),
        ] {
            let err = rel_err(got, want);
            println!("qkv_rope_cache case {n} (hd {hd}) {what}: rel err {err:.2e}");
            assert!(err < 1e-2, "case {n} {what}: rel err {err}");
        }
        // The padding token's slot and the unused ones keep their fill, bit for bit.
        for slot in (0..cache_slots).filter(|s| !slots.contains(&(*s as i64))) {
            for v in [&got_k, &got_v] {
                assert!(
                    v[slot * lkv * hd..][..lkv * hd].iter().all(|&x| x == fill),
                    "case {n}: slot {slot} written"
                );
            }
        }
        // Values are copied, not rounded twice.
        let exact = slots.iter().filter(|&&sl| sl >= 0).all(|&sl| {
            let r = sl as usize * lkv * hd..(sl as usize + 1) * lkv * hd;
            got_v[r.clone()] == want_v[r]
        });
        assert!(exact, "case {n}: values differ from the projection's");
    }
}
