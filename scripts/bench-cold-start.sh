#!/usr/bin/env bash
# Cold start and first requests of `omni-engine serve`: the seconds from launch to a healthy
# /health, then requests 1 to N sent one at a time (each a new random prompt of token ids, so no
# prefix-cache hits; streamed, so TTFT and the whole latency are both timed). A warm engine
# answers request 1 as fast as request 10; the summary prints request 1 / median(2..N).
#
#   usage: scripts/bench-cold-start.sh MODEL [serve flags...]
#   env:   OMNI_BIN (default target/release/omni-engine), PORT (8123), REQUESTS (10),
#          INPUT_LEN (512), OUTPUT_LEN (16), JSON (write the timings there), HEALTH_TIMEOUT (300 s)
#
# e.g. on a GPU: scripts/bench-cold-start.sh DIR --load-format dummy --device cuda
#      (DIR holds the real shape's config.json and a tokenizer; scripts/gpu-check.sh cold)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,12p "$0" >&2; exit 2; }
model=$1; shift
bin=${OMNI_BIN:-target/release/omni-engine}
port=${PORT:-8123}
log=$(mktemp)
t0=$(date +%s.%N)
"$bin" serve "$model" --host 127.0.0.1 --port "$port" "$@" > "$log" 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
python3 - "$port" "$t0" "$pid" "${REQUESTS:-10}" "${INPUT_LEN:-512}" "${OUTPUT_LEN:-16}" \
    "${JSON:-}" "${HEALTH_TIMEOUT:-300}" "$log" <<'PY'
import json, os, random, statistics, sys, time, urllib.request

port, t0, pid, n, inp, out, json_path, health_timeout, log = sys.argv[1:]
t0, n, inp, out, health_timeout = float(t0), int(n), int(inp), int(out), float(health_timeout)
base = f"http://127.0.0.1:{port}"

def alive():
    try:
        os.kill(int(pid), 0)
        return True
    except OSError:
        return False

deadline = time.time() + health_timeout
while True:
    try:
        if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
            break
    except Exception:
        pass
    if not alive() or time.time() > deadline:
        sys.stderr.write(open(log).read()[-4000:])
        sys.exit("bench-cold-start: the server did not become healthy")
    time.sleep(0.1)
healthy = time.time() - t0
models = json.load(urllib.request.urlopen(base + "/v1/models"))
name = models["data"][0]["id"]
vocab_hint = 1000  # ids below every real vocabulary and clear of special tokens at the top
rng = random.Random(0)
rows = []
for i in range(n):
    prompt = [rng.randrange(10, vocab_hint) for _ in range(inp)]
    body = {"model": name, "prompt": prompt, "max_tokens": out, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    start = time.time()
    ttft = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.time() - start
            chunks += 1
    total = time.time() - start
    rows.append({"request": i + 1, "ttft_s": ttft, "latency_s": total, "chunks": chunks})
print(f"healthy after {healthy:.2f} s")
print("request  ttft_ms  latency_ms")
for r in rows:
    print(f"{r['request']:7d}  {1e3 * (r['ttft_s'] or 0):7.1f}  {1e3 * r['latency_s']:10.1f}")
rest = rows[1:]
if rest:
    mt = statistics.median(r["ttft_s"] or 0 for r in rest)
    ml = statistics.median(r["latency_s"] for r in rest)
    print(f"request 1 / median(2..{n}): ttft {rows[0]['ttft_s'] / mt:.2f}x, "
          f"latency {rows[0]['latency_s'] / ml:.2f}x")
if json_path:
    json.dump({"healthy_s": healthy, "input_len": inp, "output_len": out, "requests": rows},
              open(json_path, "w"), indent=1)
PY
grep -E 'warmed up|captured CUDA graphs|engine ready' "$log" | head -5 || true
