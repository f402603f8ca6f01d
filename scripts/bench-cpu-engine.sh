#!/usr/bin/env bash
# CPU prefill/decode throughput of the built-in model (SmolLM2-135M-Instruct) at batch 1 and 16,
# for each tensor-parallel size given (default "1 3": the model's 9 heads do not split over 2),
# as a fraction of this machine's memory bandwidth. Writes a markdown table to $1.
#   usage: scripts/bench-cpu-engine.sh bench/results/engine-cpu-smollm2-$(date -u +%F).md [tp ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?output file}"; shift || true
tps=("${@:-1 3}"); read -r -a tps <<< "${tps[*]}"
bin=target/release/omni-engine
[ -x "$bin" ] || cargo build --release -p omni-engine
model=$(scripts/fetch-default-model.sh)
mem=$("$bin" bench mem)
read_gbps=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['read_gbps'])" "$mem")
prompt=$(python3 -c "print(','.join(str((i*37)%49000+100) for i in range(128)))")
# Bytes streamed per decode step: every weight once, in f32 (the CPU backend upcasts at load):
# 30 layers x 3,540,096 params + the tied 49152 x 576 embedding used as lm_head.
step_bytes=$(( (30 * 3540096 + 49152 * 576) * 4 ))
{
  echo "# CPU engine throughput, SmolLM2-135M-Instruct (built-in model)"
  echo
  echo "* date: $(date -u '+%F %H:%M UTC'); machine: $(nproc)-vCPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) VM, no GPU"
  echo "* command: scripts/bench-cpu-engine.sh $out ${tps[*]} (release build; prompt 128 tokens, 64 generated, greedy, --ignore-eos, multi-process executor)"
  echo "* memory bandwidth (\`omni-engine bench mem\`): $mem"
  echo "* bytes per decode step: $step_bytes (all weights in f32, read once per step whatever the batch)"
  echo
  echo "| tp | batch | prefill tok/s | decode tok/s | decode steps/s | weight bytes/s | fraction of read bandwidth |"
  echo "|---|---|---|---|---|---|---|"
} > "$out"
for tp in "${tps[@]}"; do
  for batch in 1 16; do
    line=$("$bin" generate --model "$model" -tp "$tp" --prompt-token-ids "$prompt" --repeat "$batch" \
             --max-tokens 64 --ignore-eos --temperature 0 --json 2>&1 >/dev/null | grep -E 'prefill .* tok/s' | tail -1)
    python3 - "$tp" "$batch" "$line" "$step_bytes" "$read_gbps" >> "$out" <<'PY'
import re, sys
tp, batch, line, step_bytes, read = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
nums = re.findall(r"\(([\d.]+) tok/s\)", line)
prefill, decode = float(nums[0]), float(nums[1])
steps = decode / batch
bw = steps * step_bytes / 1e9
print(f"| {tp} | {batch} | {prefill:.0f} | {decode:.1f} | {steps:.1f} | {bw:.1f} GB/s | {bw / read:.2f} |")
PY
  done
done
echo >> "$out"
echo "Raw engine lines are printed by \`omni-engine generate\` on stderr." >> "$out"
cat "$out"
