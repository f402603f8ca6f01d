#!/usr/bin/env bash
# Before/after on one GPU machine: `bench latency` (the `bench` step of gpu-check.sh: both
# shapes, decode at batch 1/8/32/64, a 2k prefill), CPU-backend decode at batch 1 and 16 on
# the host's cores, and `bench ipc --quick` with two staged
# binary sets, interleaved A B A B so drift of the machine hits both, then one table of
# tokens/s and their ratio B/A. Nothing is built here.
#
#   A: the binaries before a change, B: after (each a directory from scripts/gpu-build.sh;
#   stage the "before" set in .gpu-bin/base so the device tool carries both with .gpu-bin).
#
#   ROUNDS=2 bash scripts/gpu-ab.sh .gpu-bin/base .gpu-bin      (OUT: where results go)
set -uo pipefail
A=${1:-.gpu-bin/base}
B=${2:-.gpu-bin}
ROUNDS=${ROUNDS:-1}
STEPS=${STEPS:-bench cpu ipc}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    bin=$A; [ "$side" = B ] && bin=$B
    if [[ " $STEPS " == *" bench "* ]]; then
      GPU_BIN=$bin OUT="$OUT/$side-$r" bash scripts/gpu-check.sh bench > /dev/null 2>&1
      tar xzf "$OUT/$side-$r/logs.tgz" -C "$OUT/$side-$r"
    fi
    if [[ " $STEPS " == *" cpu "* ]]; then
      # The CPU backend (this host's cores): decode of a small Qwen3 (dummy weights) at batch 1
      # and 16, 128-token prompts, 64 new tokens, greedy.
      prompt=$(python3 -c "print(','.join(str((i*37)%31000+100) for i in range(128)))")
      for batch in 1 16; do
        "$bin/omni-engine" generate --model bench/models/qwen3-small-tp8 --load-format dummy \
          --device cpu --prompt-token-ids "$prompt" --repeat "$batch" --max-tokens 64 \
          --ignore-eos --temperature 0 2>&1 >/dev/null | grep -E 'prefill .* tok/s' | tail -1 \
          > "$OUT/cpu-$side-$r-b$batch.txt"
      done
    fi
    if [[ " $STEPS " == *" ipc "* ]]; then
      "$bin/omni-engine" bench ipc --quick --json "$OUT/ipc-$side-$r.json" > "$OUT/ipc-$side-$r.txt" 2>&1
    fi
  done
done
python3 - "$OUT" "$ROUNDS" <<'EOF'
import glob, json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def latency(side, r):
    rows = {}
    for f in glob.glob(f"{out}/{side}-{r}/logs/latency-*.json"):
        j = json.load(open(f))
        name = os.path.basename(f)[len("latency-"):-len(".json")]
        for d in j["decode"]:
            rows[(name, f"decode B={d['batch']}")] = d["decode_tok_per_s"]
        if j.get("prefill"):
            rows[(name, f"prefill {j['prefill']['tokens']}")] = j["prefill"]["tok_per_s"]
    return rows
def cpu(side, r):
    import re
    rows = {}
    for b in (1, 16):
        f = f"{out}/cpu-{side}-{r}-b{b}.txt"
        if os.path.exists(f):
            nums = re.findall(r"\(([\d.]+) tok/s\)", open(f).read())
            if len(nums) >= 2:
                rows[("cpu", f"prefill B={b}")] = float(nums[0])
                rows[("cpu", f"decode B={b}")] = float(nums[1])
    return rows
def ipc(side, r):
    f = f"{out}/ipc-{side}-{r}.json"
    if not os.path.exists(f):
        return {}
    j = json.load(open(f)); j = j["rows"] if isinstance(j, dict) else j
    rows = {}
    for x in j:
        key = ("ipc", f"{x['payload_bytes']} B {x['path']}")
        rows[key + ("p50 us",)] = x["p50_us"]
        rows[key + ("p99 us",)] = x["p99_us"]
        rows[key + ("GB/s",)] = x["gbps_per_reader"]
    return rows
print(f"{'what':<48} " + " ".join(f"{s}{r:<10}" for r in range(1, rounds + 1) for s in "AB") + "  B/A (mean)")
for fn in (latency, cpu, ipc):
    data = {(s, r): fn(s, r) for s in "AB" for r in range(1, rounds + 1)}
    keys = sorted(set().union(*[d.keys() for d in data.values()]))
    for k in keys:
        vals = [data[(s, r)].get(k) for r in range(1, rounds + 1) for s in "AB"]
        a = [data[("A", r)].get(k) for r in range(1, rounds + 1)]
        b = [data[("B", r)].get(k) for r in range(1, rounds + 1)]
        a = [v for v in a if v]; b = [v for v in b if v]
        ratio = f"{(sum(b)/len(b))/(sum(a)/len(a)):.3f}" if a and b else "n/a"
        print(f"{' '.join(str(x) for x in k):<48} " + " ".join(f"{v:<11.1f}" if v else f"{'-':<11}" for v in vals) + f"  {ratio}")
EOF
