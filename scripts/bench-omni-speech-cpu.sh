#!/usr/bin/env bash
# `bench serve --omni` against `serve --omni` with no model on this machine: the built-in
# SmolLM2 as the text stage and the built-in voice as the TTS stage (deploy/text_speech.yaml),
# all on the CPU. Prints each run's result block and writes them, with date, machine, build and
# the exact commands, to bench/results/omni-speech-cpu-<date>.txt (JSON beside it per run).
# Then the same requests as text only against plain `serve` (the same model, no pipeline), for
# the text's TTFT / TPOT with and without the speech stage beside it on the same cores.
#
#   scripts/bench-omni-speech-cpu.sh
#
# Env: CONCURRENCY ("1 4"), PROMPT_LENS ("10 160"), OUTPUT_LEN (text tokens, 64),
# NUM_PROMPTS (per run, 16), PORT (8300), BASELINE (1: also the text-only runs; 0: skip).
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/release/omni-engine
[ -x "$B" ] || cargo build --release -p omni-engine
scripts/fetch-voice.sh > /dev/null
PORT=${PORT:-8300}
OUT=bench/results/omni-speech-cpu-$(date -u +%F)
log=$(mktemp)
P=
trap '[ -n "$P" ] && kill -TERM $P 2>/dev/null; rm -f "$log"' EXIT
start_server() { # serve flags...
  "$B" serve "$@" --host 127.0.0.1 --port "$PORT" 2> "$log" &
  P=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && return 0
    kill -0 $P 2>/dev/null || { tail -30 "$log"; exit 1; }
    sleep 0.5
  done
  echo "server not healthy after 120 s" >&2; exit 1
}
stop_server() { kill -TERM $P; wait $P || true; P=; }
runs() { # tag, bench flags...
  local tag=$1; shift
  for c in ${CONCURRENCY:-1 4}; do
    for len in ${PROMPT_LENS:-10 160}; do
      ARGS=("$@" --base-url "http://127.0.0.1:$PORT" --dataset-name seed-tts
            --seed-tts-prompt-len "$len" --seed-tts-output-len "${OUTPUT_LEN:-64}" --ignore-eos
            --num-prompts "${NUM_PROMPTS:-16}" --max-concurrency "$c" --num-warmups 1 --disable-tqdm
            --save-result "$OUT-$tag-c$c-p$len.json")
      { echo; echo "## $tag: concurrency $c, prompt $len tokens"; echo "# command: omni-engine bench serve ${ARGS[*]}"; } >> "$OUT.txt"
      "$B" bench serve "${ARGS[@]}" | tee -a "$OUT.txt"
    done
  done
}
{
  echo "# omni-engine bench serve --omni against omni-engine serve --omni (no model), CPU"
  echo "# date:    $(date -u +"%Y-%m-%d %H:%M UTC")"
  echo "# machine: $(nproc)-vCPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) VM, $(free -g | awk '/Mem:/{print $2}') GiB RAM, no GPU; server and client share the cores"
  echo "# load average before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# build:   cargo build --release -p omni-engine (commit $(git rev-parse --short HEAD))"
  echo "# server:  omni-engine serve --omni --host 127.0.0.1 --port $PORT (deploy/text_speech.yaml)"
} > "$OUT.txt"
start_server --omni
runs speech --omni --backend openai-chat-omni \
  --percentile-metrics ttft,tpot,e2el,audio_ttfp,audio_rtf,audio_duration
stop_server
if [ "${BASELINE:-1}" = 1 ]; then
  echo "# server:  omni-engine serve --host 127.0.0.1 --port $PORT (the same model, text only)" >> "$OUT.txt"
  start_server
  runs text --backend openai-chat --percentile-metrics ttft,tpot,e2el
  stop_server
fi
echo "wrote $OUT.txt"
