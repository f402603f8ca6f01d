#!/usr/bin/env bash
# Issue 15: step time of `-tp 2 -pp 2` with the pipeline stages on two "nodes" (two network
# namespaces joined only by a veth pair; the follower with a private /dev/shm and PID namespace,
# as tests/multinode.rs does), uncapped and at 10 Gbit/s (`tc tbf`), against the same four
# ranks on one node. `omni-engine bench latency` on dummy weights of bench/models/qwen3-small-tp8
# (hidden 512, 8 layers), CPU workers. Needs root (ip netns, unshare, tc).
#
#   ROUNDS=2 bash scripts/bench-multinode.sh          # writes bench/results/multinode-cpu-<date>.json
#
# Rounds interleave the three setups (one node, two nodes, two nodes at 10 Gbit/s) so the
# shared machine's noise falls on all three alike.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-${CARGO_TARGET_DIR:-target}/release/omni-engine}
[ -x "$B" ] || cargo build --release -p omni-engine -j2
B=$(realpath "$B")
MODEL=${MODEL:-bench/models/qwen3-small-tp8}
ROUNDS=${ROUNDS:-2}
RATE=${RATE:-10gbit}
TAG=$$
A=omni_ba$TAG; F=omni_bb$TAG; VA=ba$TAG; VB=bb$TAG
IP_A=10.213.9.1; IP_B=10.213.9.2
OUT=$(mktemp -d /tmp/omni-bench-multinode.XXXXXX)
cleanup() {
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$F" 2>/dev/null || true
    rm -rf "$OUT"
}
trap cleanup EXIT
ip netns add "$A"; ip netns add "$F"
ip link add "$VA" type veth peer name "$VB"
ip link set "$VA" netns "$A"; ip link set "$VB" netns "$F"
ip -n "$A" addr add $IP_A/30 dev "$VA"; ip -n "$F" addr add $IP_B/30 dev "$VB"
for n in "$A" "$F"; do ip -n "$n" link set lo up; done
ip -n "$A" link set "$VA" up; ip -n "$F" link set "$VB" up

LAT=(bench latency --model "$MODEL" --load-format dummy --device cpu -tp 2 -pp 2
     --batch-sizes 1,8 --input-len 256 --output-len 32 --prefill-len 512
     --kv-cache-memory 256MiB --max-model-len 1024 --warmup-iters 1)
NODES=(--nnodes 2 --master-port 29555)

one_node() { # json
    RUST_LOG=warn "$B" "${LAT[@]}" --json "$1" > "$OUT/one.log" 2>&1
}
two_nodes() { # json
    ip netns exec "$F" unshare --mount --pid --fork --kill-child --mount-proc sh -c \
        'mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$@"' sh \
        "$B" serve --headless --device cpu -tp 2 -pp 2 "${NODES[@]}" --node-rank 1 \
        --master-addr $IP_A > "$OUT/follower.log" 2>&1 &
    local f=$!
    RUST_LOG=warn ip netns exec "$A" "$B" "${LAT[@]}" "${NODES[@]}" --node-rank 0 \
        --master-addr $IP_A --json "$1" > "$OUT/leader.log" 2>&1 \
        || { cat "$OUT/leader.log" "$OUT/follower.log"; exit 1; }
    wait "$f" || true
}
set_rate() { # rate | off
    for pair in "$A:$VA" "$F:$VB"; do
        ns=${pair%%:*}; dev=${pair#*:}
        ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
        [ "$1" = off ] || ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$1" \
            burst 1mb latency 50ms
    done
}
start=$(date -u +"%Y-%m-%d %H:%M UTC")
for r in $(seq 1 "$ROUNDS"); do
    one_node "$OUT/one-$r.json"; echo "round $r: one node done" >&2
    set_rate off; two_nodes "$OUT/two-$r.json"; echo "round $r: two nodes done" >&2
    set_rate "$RATE"; two_nodes "$OUT/capped-$r.json"; echo "round $r: two nodes at $RATE done" >&2
    set_rate off
done
RES=bench/results/multinode-cpu-$(date -u +%F).json
python3 - "$OUT" "$RES" "$start" "$RATE" "$(git rev-parse --short HEAD)" <<'PY'
import glob, json, os, statistics, sys
out, res, start, rate, commit = sys.argv[1:]
runs = {}
for p in sorted(glob.glob(f"{out}/*-*.json")):
    setup = os.path.basename(p).rsplit("-", 1)[0]
    runs.setdefault(setup, []).append(json.load(open(p)))
def pick(d):
    dec = {str(x["batch"]): x["ms_per_step"] for x in d.get("decode", [])}
    pre = d.get("prefill") or {}
    return dec, (pre["best_ttft_s"] * 1e3 if "best_ttft_s" in pre else None)
summary = {}
for setup, ds in runs.items():
    decs = [pick(d)[0] for d in ds]
    pres = [pick(d)[1] for d in ds if pick(d)[1] is not None]
    summary[setup] = {
        "decode_step_ms": {b: statistics.median([x[b] for x in decs if b in x]) for b in decs[0]},
        "prefill_ms": statistics.median(pres) if pres else None,
        "rounds": len(ds),
    }
json.dump({"date": start, "commit": commit, "rate": rate, "summary": summary, "runs": runs},
          open(res, "w"), indent=1)
base = summary.get("one", {})
for setup in ("one", "two", "capped"):
    s = summary.get(setup)
    if not s:
        continue
    rel = lambda v, b: f"{v:.3f} ms ({v / b:.2f}x)" if b else f"{v:.3f} ms"
    dec = ", ".join(f"batch {b}: {rel(v, base['decode_step_ms'].get(b))}" for b, v in s["decode_step_ms"].items())
    pre = rel(s["prefill_ms"], base.get("prefill_ms")) if s["prefill_ms"] else "-"
    print(f"{setup:>6}: decode step {dec}; prefill 512 (best TTFT): {pre}")
print(f"wrote {res}")
PY
