#!/usr/bin/env python3
"""Peer timings of the two prefill kernels that dominate a Qwen3-30B-A3B prefill, on torch's
own kernels and the same GPU: causal attention through `scaled_dot_product_attention` (its
flash backend) and the expert block's GEMMs through `torch._grouped_mm` (when this torch has
it), for the shapes `backend-tests` times (`attention_prefill_timing`,
`fused_moe_real_shape_and_timing`). Random bf16 data; prints one line per measurement.

    /opt/torch/.venv/bin/python scripts/bench-torch-kernels.py [--tokens 2048]
"""
import argparse

import torch
import torch.nn.functional as F


def time_us(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    times.sort()
    return times[len(times) // 2]


def attention(t, heads, kv_heads, hd):
    q = torch.randn(1, heads, t, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, t, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, kv_heads, t, hd, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * t * t / 2 * heads * hd
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            print(f"torch attention prefill {t} tokens, {heads}/{kv_heads} heads, hd {hd}, {name}: {us:.1f} us ({flops / us / 1e6:.1f} TFLOP/s)")
        except Exception as e:  # a backend this build or GPU lacks
            print(f"torch attention {name}: unavailable ({type(e).__name__}: {str(e)[:120]})")


def grouped_moe(t, hidden=2048, inter=768, experts=128, top_k=8):
    if not hasattr(torch, "_grouped_mm"):
        print("torch grouped mm: unavailable (no torch._grouped_mm)")
        return
    pairs = t * top_k
    ids = torch.randint(0, experts, (pairs,), device="cuda")
    counts = torch.bincount(ids, minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(pairs, hidden, device="cuda", dtype=torch.bfloat16)
    # Weights as stored ([E, out, in]), seen as [E, in, out] (column-major, as grouped mm wants).
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / 32).transpose(1, 2)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / 32).transpose(1, 2)

    def run():
        gu = torch._grouped_mm(x, w13, offs=offs)
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        return torch._grouped_mm(act, w2, offs=offs)

    try:
        us = time_us(run)
    except Exception as e:
        print(f"torch grouped mm: failed ({type(e).__name__}: {str(e)[:120]})")
        return
    flops = 2.0 * pairs * 3 * hidden * inter
    print(f"torch grouped mm moe T={t}: {us:.1f} us ({flops / us / 1e6:.0f} TFLOP/s; gate_up, silu-mul, down; rows pre-sorted)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    attention(a.tokens, 32, 8, 128)
    attention(a.tokens, 32, 4, 128)
    for t in (512, 2048, 4096):
        grouped_moe(t)


if __name__ == "__main__":
    main()
