#!/usr/bin/env bash
# Issue 14's end-to-end check of the seed PR (vLLM's VLLM_MQ_MAX_CHUNK_BYTES_MB): `bench serve
# --dataset-name random-mm` with one synthetic image per request against `omni-engine serve -tp 2`
# (two CPU workers) on the tiny qwen3-omni-mm Thinker fixture, the chunk size and the payload
# interleaved in one run:
#
#   for r in 1..ROUNDS; for chunk in $CHUNKS (MiB); for image in $IMAGES (HxW):
#       VLLM_MQ_MAX_CHUNK_BYTES_MB=chunk omni-engine serve DIR -tp 2; bench serve; stop
#
# Images: 720x1280 resizes to 704x1280 = 3520 patches = 10,813,440 bytes of bf16 pixels
# (Qwen3-Omni at 1280x720); 768x1248 = 3744 patches = 11,501,568 bytes, the nearest Qwen image
# to the seed's Llama-4 17-tile 11,515,392 bytes. Both are above 10 MiB and below 16 MiB: at 10
# every image message overflows, at 16 and 100 none does.
#
#   ROUNDS=3 NUM_PROMPTS=200 bash scripts/bench-mm-chunk.sh
#
# On a GPU (`-tp 1`, the real Qwen3-Omni Thinker and towers, random weights made on the device):
#
#   DEVICE=cuda TP=1 MODEL_CONFIG=bench/models/qwen3-omni-30b-a3b/config.json \
#     SERVE_EXTRA="--max-model-len 4096 --max-num-seqs 64" IMAGES=720x1280 \
#     B=.gpu-bin/omni-engine bash scripts/bench-mm-chunk.sh
#
# MODEL_CONFIG replaces the fixture's config.json (and its weights: `--load-format dummy`).
#
# Writes bench/results/mm-chunk-<device>-<date>.json (every run's --save-result JSON) and prints the
# summary (medians over rounds; scripts/summarize_mm_chunk.py).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
NUM_PROMPTS=${NUM_PROMPTS:-200}
CHUNKS=${CHUNKS:-"10 16 100"}
IMAGES=${IMAGES:-"720x1280 768x1248"}
PORT=${PORT:-8021}
DEVICE=${DEVICE:-cpu}
TP=${TP:-2}
MODEL_CONFIG=${MODEL_CONFIG:-}
SERVE_EXTRA=${SERVE_EXTRA:---max-model-len 1536 --kv-cache-memory 256MiB}
B=${B:-${CARGO_TARGET_DIR:-target}/release/omni-engine}
[ -x "$B" ] || cargo build --release -p omni-engine -j2
M=$(mktemp -d /tmp/omni-mm-chunk-model.XXXXXX)
# RUNS_DIR keeps every run's server log, bench output and JSON (e.g. under a device run's $OUT,
# so a sweep cut short still brings back what it did); else a temporary directory.
RUNS=${RUNS_DIR:-$(mktemp -d /tmp/omni-mm-chunk-runs.XXXXXX)}
mkdir -p "$RUNS"
P=
cleanup() {
    [ -n "$P" ] && kill -TERM "$P" 2>/dev/null && wait "$P" 2>/dev/null || true
    rm -rf "$M"
    [ -n "${RUNS_DIR:-}" ] || rm -rf "$RUNS"
}
trap cleanup EXIT
python3 scripts/make_mm_model_dir.py "$M"
LOAD=()
if [ -n "$MODEL_CONFIG" ]; then
    rm -f "$M/config.json" "$M/model.safetensors"
    cp "$MODEL_CONFIG" "$M/config.json"
    LOAD=(--load-format dummy)
fi
# shellcheck disable=SC2206 # SERVE_EXTRA is a flag list
SERVE=(serve "$M" --served-model-name mm --device "$DEVICE" -tp "$TP" --host 127.0.0.1
       --port "$PORT" "${LOAD[@]}" $SERVE_EXTRA)
bench_args() { # $1 = HxW, $2 = output JSON
    local h=${1%x*} w=${1#*x}
    echo --base-url "http://127.0.0.1:$PORT" --model mm --backend openai-chat \
        --endpoint /v1/chat/completions --dataset-name random-mm \
        --random-mm-base-items-per-request 1 --random-mm-bucket-config "{($h,$w,1):1.0}" \
        --num-prompts "$NUM_PROMPTS" --max-concurrency 32 --random-input-len 87 \
        --random-output-len 128 --ignore-eos --tokenizer "$M" --seed 0 --disable-tqdm \
        --save-result "$2"
}
start=$(date -u +"%Y-%m-%d %H:%M UTC")
t0=$(date +%s)
for r in $(seq 1 "$ROUNDS"); do
    for c in $CHUNKS; do
        for img in $IMAGES; do
            log=$RUNS/serve-$r-$c-$img.log
            VLLM_MQ_MAX_CHUNK_BYTES_MB=$c RUST_LOG=warn "$B" "${SERVE[@]}" > "$log" 2>&1 &
            P=$!
            up=$(date +%s)
            for _ in $(seq 1 600); do
                curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
                kill -0 "$P" 2>/dev/null || break
                sleep 0.2
            done
            echo "round $r chunk $c MiB image $img: server up after $(( $(date +%s) - up )) s" >&2
            json=$RUNS/run-$r-$c-$img.json
            # shellcheck disable=SC2046 # the bucket config has no spaces
            "$B" bench serve $(bench_args "$img" "$json") > "$RUNS/bench-$r-$c-$img.txt" 2>&1 \
                || { cat "$RUNS/bench-$r-$c-$img.txt" "$log"; exit 1; }
            kill -TERM "$P"; wait "$P" || true; P=
            python3 - "$json" "$r" "$c" "$img" <<'PY'
import json, sys
p, r, c, img = sys.argv[1:]
d = json.load(open(p))
d.update(round=int(r), chunk_mb=int(c), image=img)
json.dump(d, open(p, "w"))
print(f"round {r} chunk {c:>3} MiB image {img}: {d['completed']} ok {d['failed']} failed, "
      f"{d['request_throughput']:.3f} req/s, TTFT mean {d['ttft']['mean_ms']:.0f} ms "
      f"P99 {d['ttft']['p99_ms']:.0f} ms, ITL P99 {d['itl']['p99_ms']:.1f} ms, "
      f"overflow {d.get('mq_overflow_messages_per_step', float('nan')):.4f} msg/step "
      f"{d.get('mq_overflow_bytes_per_step', float('nan')):.0f} B/step", flush=True)
PY
        done
    done
done
OUT=${OUT_PREFIX:-bench/results/mm-chunk-$DEVICE}-$(date -u +%F)
python3 - "$RUNS" "$OUT.json" "$start" "$(( $(date +%s) - t0 ))" "$(git rev-parse --short HEAD 2>/dev/null || echo "${COMMIT:-unknown}")" \
    "$ROUNDS" "$NUM_PROMPTS" "$(bench_args HxW run.json | sed "s|$M|MODEL_DIR|g")" <<'PY'
import glob, json, sys
runs_dir, out, start, secs, commit, rounds, n, args = sys.argv[1:]
runs = [json.load(open(p)) for p in sorted(glob.glob(f"{runs_dir}/run-*.json"))]
for r in runs:  # the per-request error strings are not worth keeping
    r["errors"] = r["errors"][:3]
json.dump({"date": start, "wall_s": int(secs), "commit": commit, "rounds": int(rounds),
           "num_prompts": int(n), "bench_args": args, "runs": runs}, open(out, "w"), indent=1)
PY
python3 scripts/summarize_mm_chunk.py "$OUT.json"
