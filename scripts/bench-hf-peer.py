#!/usr/bin/env python3
"""The peer for `omni-engine bench latency` on a GPU: Hugging Face transformers with random bf16
weights of the same shape (a config from bench/models/), a static KV cache and
`torch.compile(mode="reduce-overhead")` of the decode steps (generate's own), greedy. Prints decode tok/s at each batch size and
prefill tok/s, in the same terms as bench latency (decode: batch x (output_len - 1) tokens over
the decode time, which is the time of a full generate minus a generate of one token; prefill:
one forward of prefill_len tokens), and writes them as JSON with --json.

    python3 scripts/bench-hf-peer.py --model bench/models/qwen3-30b-a3b --batch-sizes 1,8 \
        --input-len 1024 --output-len 64 --prefill-len 2048 --json peer.json

Needs torch and transformers (the lent GPU machines have them in /opt/torch/.venv; nothing is
downloaded: the model is built from its config). Compiling takes about a minute per batch size.
"""

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a directory with config.json")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(a.model)
    t0 = time.time()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    print(f"built {cfg.model_type} with random weights in {time.time() - t0:.1f} s", flush=True)
    vocab = cfg.vocab_size
    gen = model.generation_config
    gen.cache_implementation = "static"
    gen.do_sample = False
    gen.pad_token_id = 0
    gen.eos_token_id = None
    eager_forward = model.forward
    if a.no_compile:
        gen.disable_compile = True
    else:
        # generate() compiles its decode steps itself when the cache is static (wrapping
        # model.forward as well compiled the prefill too and crashed torch 2.11 on Qwen3-MoE).
        from transformers import CompileConfig

        gen.compile_config = CompileConfig(fullgraph=False, mode="reduce-overhead")

    def generate(ids: "torch.Tensor", new: int) -> float:
        torch.cuda.synchronize()
        t = time.time()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new)
        torch.cuda.synchronize()
        return time.time() - t

    rows = []
    for b in [int(x) for x in a.batch_sizes.split(",") if x]:
        ids = torch.randint(0, vocab, (b, a.input_len), device="cuda")
        t_c = time.time()
        generate(ids, a.output_len)  # compiles
        generate(ids, 1)
        print(f"  B={b}: compiled and warmed up in {time.time() - t_c:.1f} s", flush=True)
        full = min(generate(ids, a.output_len) for _ in range(2))
        first = min(generate(ids, 1) for _ in range(2))
        decode_s = max(full - first, 1e-9)
        tok_s = b * (a.output_len - 1) / decode_s
        rows.append({"batch_size": b, "decode_tok_per_s": tok_s,
                     "ms_per_step": 1e3 * decode_s / (a.output_len - 1)})
        print(f"  B={b}: {tok_s:.1f} decode tok/s, {1e3 * decode_s / (a.output_len - 1):.3f} ms/step",
              flush=True)

    # Prefill: eager forwards of one prompt (a compiled static-cache forward of this length
    # would compile once more).
    ids = torch.randint(0, vocab, (1, a.prefill_len), device="cuda")
    times = []
    with torch.inference_mode():
        for _ in range(4):
            torch.cuda.synchronize()
            t = time.time()
            eager_forward(input_ids=ids, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
            times.append(time.time() - t)
    pre_s = min(times[1:])
    print(f"  prefill {a.prefill_len}: {a.prefill_len / pre_s:.1f} tok/s, {1e3 * pre_s:.2f} ms",
          flush=True)
    out = {
        "peer": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                + ("eager" if a.no_compile else "torch.compile reduce-overhead, static cache"),
        "gpu": torch.cuda.get_device_name(0),
        "model": a.model,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "decode": rows,
        "prefill": {"tokens": a.prefill_len, "tok_per_s": a.prefill_len / pre_s,
                    "ms": 1e3 * pre_s},
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
