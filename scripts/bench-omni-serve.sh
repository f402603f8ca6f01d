#!/usr/bin/env bash
# `serve --omni` on one GPU with dummy weights of Qwen3-Omni-30B-A3B's real shapes (all three
# stages on the device, the built-in deploy profile), then `bench serve --omni` over
# vLLM-Omni's prompt lengths and concurrencies (issue 13's table). Run from the repository root
# on a GPU machine with binaries staged by scripts/gpu-build.sh:
#
#   BIN=.gpu-bin bash scripts/bench-omni-serve.sh [OUT_DIR]
#
# Env: CONCURRENCY ("1 16 32 64"), PROMPT_LENS ("10 160 320 640"), LENGTHS (Thinker tokens,
# Talker frames: "64,144"), ROUNDS (requests per concurrency slot, 2), SERVE_ARGS (extra flags,
# e.g. "--no-async-chunk" or "--stage-overrides {...}" or "--enforce-eager" or
# "--cuda-profile-steps 50" for per-kernel tables in serve.log), PORT (8200). After each run
# it prints the stages' `stage profile` lines (every 5 s: --stage-profile-interval-s).
set -euo pipefail
BIN=${BIN:-.gpu-bin}
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
PORT=${PORT:-8200}
dir=$(mktemp -d)/qwen3-omni-30b-a3b
mkdir -p "$dir"
cp bench/models/qwen3-omni-30b-a3b/config.json "$dir/"
python3 scripts/make_omni_bench_tokenizer.py "$dir"
# shellcheck disable=SC2086
"$BIN/omni-engine" serve "$dir" --omni --load-format dummy --device cuda --served-model-name omni \
  --host 127.0.0.1 --port "$PORT" --max-model-len 4096 --stage-profile-interval-s 5 ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { tail -50 "$OUT/serve.log"; exit 1; }
  sleep 1
done
grep -E "ready|on cuda|stage serving|omni pipeline" "$OUT/serve.log" | head -20
for c in ${CONCURRENCY:-1 16 32 64}; do
  for len in ${PROMPT_LENS:-10 160 320 640}; do
    n=$(( c * ${ROUNDS:-2} )); [ "$n" -lt 4 ] && n=4
    echo "== concurrency $c, prompt $len tokens, $n requests"
    mark=$(wc -l < "$OUT/serve.log")
    "$BIN/omni-engine" bench serve --omni --backend openai-chat-omni \
      --base-url "http://127.0.0.1:$PORT" --model omni --dataset-name seed-tts \
      --seed-tts-prompt-len "$len" --omni-fixed-lengths "${LENGTHS:-64,144}" \
      --num-prompts "$n" --max-concurrency "$c" --num-warmups 2 \
      --percentile-metrics ttft,tpot,itl,e2el,audio_ttfp,audio_rtf,audio_duration \
      --save-result "$OUT/c${c}-p${len}.json" 2>&1 | tee "$OUT/c${c}-p${len}.txt" \
      | grep -E "Successful|Failed|Request throughput|Mean AUDIO_TTFP|Mean AUDIO_RTF|Mean TTFT|Mean E2EL"
    # The stages' `stage profile` lines of the run (phases per step, busy and idle shares).
    tail -n +"$((mark + 1))" "$OUT/serve.log" | grep "stage profile" \
      | sed -E 's/.*stage profile ([^:]+): /\1: /' || true
  done
done
grep -iE "warn|error" "$OUT/serve.log" | head -20 || true
