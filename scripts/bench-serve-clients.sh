#!/usr/bin/env bash
# Our `bench serve` and vLLM's `vllm bench serve` as clients of the same `omni-engine serve`,
# alternated (ours, vLLM's, ours, ...), same workload: do the two clients report the same
# throughput, TPOT and ITL percentiles? Needs vLLM's client in a virtual environment
# (VLLM_VENV, default scripts/.vllm-venv; made with `pip install vllm` when absent).
#
#   ROUNDS=3 bash scripts/bench-serve-clients.sh
#
# Serves bench/models/qwen3-small-tp8 (dummy weights, CPU) with a word-level tokenizer of its
# vocabulary (scripts/make_bench_tokenizer.py), so random prompts have exact lengths for both
# clients. Writes bench/results/serve-clients-cpu-<date>.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-8011}
VENV=${VLLM_VENV:-scripts/.vllm-venv}
B=target/release/omni-engine
[ -x "$B" ] || cargo build --release -p omni-engine
if [ ! -x "$VENV/bin/vllm" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet vllm
fi
M=$(mktemp -d)
cp bench/models/qwen3-small-tp8/config.json "$M/"
vocab=$(python3 -c "import json,sys; print(json.load(open('$M/config.json'))['vocab_size'])")
python3 scripts/make_bench_tokenizer.py "$vocab" > "$M/tokenizer.json"
echo '{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}' > "$M/tokenizer_config.json"
log=$(mktemp)
"$B" serve "$M" --load-format dummy --device cpu --host 127.0.0.1 --port "$PORT" \
    --served-model-name small --max-model-len 1024 2> "$log" &
P=$!
trap 'kill -TERM $P 2>/dev/null || true; rm -rf "$log" "$M"' EXIT
for _ in $(seq 1 240); do grep -q "listening on" "$log" && break; sleep 0.5; done
grep -q "listening on" "$log" || { cat "$log"; exit 1; }
COMMON=(--base-url "http://127.0.0.1:$PORT" --model small --dataset-name random --num-prompts 32
        --max-concurrency 8 --random-input-len 128 --random-output-len 64 --ignore-eos
        --tokenizer "$M" --seed 0)
OURS=("$B" bench serve "${COMMON[@]}" --disable-tqdm)
THEIRS=("$VENV/bin/vllm" bench serve "${COMMON[@]}" --disable-tqdm --backend openai --endpoint /v1/completions)
pick() { grep -E "^$2" "$1" | head -1 | awk '{print $NF}'; }
OUT=bench/results/serve-clients-cpu-$(date -u +%F).md
rows=()
for r in $(seq 1 "$ROUNDS"); do
    for who in ours vllm; do
        f=$(mktemp)
        if [ "$who" = ours ]; then "${OURS[@]}" > "$f" 2>&1; else "${THEIRS[@]}" > "$f" 2>&1; fi
        rows+=("| $r | $who | $(pick "$f" 'Successful requests') | $(pick "$f" 'Output token throughput') | $(pick "$f" 'Median TPOT') | $(pick "$f" 'Median ITL') | $(pick "$f" 'P99 ITL') | $(pick "$f" 'P99 TTFT') |")
        echo "${rows[-1]}"
        rm -f "$f"
    done
done
{
    echo "# Our bench serve vs vLLM's client, same server ($(date -u +'%Y-%m-%d %H:%M UTC'))"
    echo
    echo "* machine: $(nproc)-vCPU VM, no GPU, server and clients share the cores (other builds running: load $(cut -d' ' -f1-3 /proc/loadavg) at the end)"
    echo "* server: \`omni-engine serve <bench/models/qwen3-small-tp8 + word tokenizer> --load-format dummy --device cpu\` (commit $(git rev-parse --short HEAD))"
    echo "* clients, alternated: \`omni-engine bench serve\` and \`vllm bench serve\` (vLLM $("$VENV/bin/pip" show vllm 2>/dev/null | awk '/^Version/{print $2}')), both: \`${COMMON[*]}\`"
    echo "* command: \`ROUNDS=$ROUNDS bash scripts/bench-serve-clients.sh\`"
    echo
    echo "| round | client | ok | out tok/s | median TPOT ms | median ITL ms | P99 ITL ms | P99 TTFT ms |"
    echo "|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
} > "$OUT"
cat "$OUT"
