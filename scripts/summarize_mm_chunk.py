#!/usr/bin/env python3
"""Summarises scripts/bench-mm-chunk.sh's JSON: per image and chunk size, the median over rounds
(and the min..max spread) of throughput, TTFT mean and P99, ITL P99, overflow messages and bytes
per engine step; then the throughput loss at 10 MiB chunks against 100 MiB, per round and median.

    scripts/summarize_mm_chunk.py bench/results/mm-chunk-cpu-<date>.json
"""
import json
import statistics
import sys


def main(path: str) -> None:
    data = json.load(open(path))
    runs = data["runs"]
    images = sorted({r["image"] for r in runs})
    chunks = sorted({r["chunk_mb"] for r in runs})
    cols = [
        ("req/s", lambda r: r["request_throughput"], "{:.3f}"),
        ("TTFT mean ms", lambda r: r["ttft"]["mean_ms"], "{:.0f}"),
        ("TTFT P99 ms", lambda r: r["ttft"]["p99_ms"], "{:.0f}"),
        ("ITL P99 ms", lambda r: r["itl"]["p99_ms"], "{:.1f}"),
        ("overflow msg/step", lambda r: r.get("mq_overflow_messages_per_step", float("nan")), "{:.4f}"),
        ("overflow B/step", lambda r: r.get("mq_overflow_bytes_per_step", float("nan")), "{:.0f}"),
        ("ring B/step", lambda r: r.get("mq_ring_bytes_per_step", float("nan")), "{:.0f}"),
    ]
    print(f"{data['rounds']} rounds x {data['num_prompts']} prompts, {data['wall_s']} s, "
          f"commit {data['commit']}; median (min..max) over rounds\n")
    print("| image | chunk MiB | ok/failed | " + " | ".join(c[0] for c in cols) + " |")
    print("|---" * (3 + len(cols)) + "|")
    for img in images:
        for c in chunks:
            rs = [r for r in runs if r["image"] == img and r["chunk_mb"] == c]
            if not rs:
                continue
            ok = sum(r["completed"] for r in rs)
            bad = sum(r["failed"] for r in rs)
            cells = []
            for _, f, fmt in cols:
                v = [f(r) for r in rs]
                cells.append(f"{fmt.format(statistics.median(v))} "
                             f"({fmt.format(min(v))}..{fmt.format(max(v))})")
            print(f"| {img} | {c} | {ok}/{bad} | " + " | ".join(cells) + " |")
    print()
    lo, hi = min(chunks), max(chunks)
    for img in images:
        per_round = []
        for rnd in sorted({r["round"] for r in runs}):
            t = {r["chunk_mb"]: r["request_throughput"] for r in runs
                 if r["image"] == img and r["round"] == rnd}
            if lo in t and hi in t:
                per_round.append(1 - t[lo] / t[hi])
        med = {c: statistics.median([r["request_throughput"] for r in runs
                                     if r["image"] == img and r["chunk_mb"] == c])
               for c in (lo, hi)}
        print(f"{img}: loss at {lo} MiB vs {hi} MiB, of medians {100 * (1 - med[lo] / med[hi]):+.2f}%; "
              f"per round " + ", ".join(f"{100 * x:+.2f}%" for x in per_round))


if __name__ == "__main__":
    main(sys.argv[1])
