#!/usr/bin/env bash
# `omni-engine bench serve` against `omni-engine serve` with the built-in model on this machine.
# Writes bench/results/serve-cpu-smollm2-<date>.{txt,json}: the vLLM result block with date,
# machine, build and the exact commands on top.
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/release/omni-engine
[ -x "$B" ] || cargo build --release -p omni-engine
TOK=$(scripts/fetch-default-model.sh)
PORT=${PORT:-8000}
OUT=bench/results/serve-cpu-smollm2-$(date -u +%F)
ARGS=(--base-url "http://127.0.0.1:$PORT" --dataset random --num-prompts 32 --max-concurrency 8
      --random-input-len 128 --random-output-len 64 --ignore-eos --tokenizer "$TOK" --disable-tqdm
      --save-result "$OUT.json")
log=$(mktemp)
"$B" serve --host 127.0.0.1 --port "$PORT" 2> "$log" &
P=$!
trap 'kill -TERM $P 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 240); do grep -q "listening on" "$log" && break; sleep 0.5; done
start=$(date -u +"%Y-%m-%d %H:%M UTC")
load=$(cut -d' ' -f1-3 /proc/loadavg)
"$B" bench serve "${ARGS[@]}" > "$OUT.block"
kill -TERM $P; wait $P || true
blocks=$(grep -o '[0-9]* KV blocks' "$log" | head -1 || true)
{
  echo "# omni-engine bench serve against omni-engine serve, CPU"
  echo "# date:    $start"
  echo "# machine: $(nproc)-vCPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) VM, $(free -g | awk '/Mem:/{print $2}') GiB RAM, no GPU; server and client share the cores"
  echo "# load average before the run: $load"
  echo "# build:   cargo build --release -p omni-engine (commit $(git rev-parse --short HEAD))"
  echo "# model:   built-in SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32), -tp 1, $blocks, prefix caching on"
  echo "# server:  omni-engine serve --host 127.0.0.1 --port $PORT"
  echo "# command: omni-engine bench serve ${ARGS[*]}"
  echo
  cat "$OUT.block"
} > "$OUT.txt"
rm -f "$OUT.block"
cat "$OUT.txt"
