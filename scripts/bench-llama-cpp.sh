#!/usr/bin/env bash
# CPU speed of omni-engine against llama.cpp on the same GGUF file (default: the built-in
# SmolLM2-135M-Instruct Q4_1), measured in one run: batch-1 decode (llama-bench tg128) and a
# 512-token prefill (llama-bench pp512), both on the same thread count, in interleaved rounds
# (theirs, ours, theirs, ours, ...) because the machine is shared and noisy; prints each round,
# the medians and the ratios ours / llama.cpp.
#
# llama-bench is built from the llama.cpp sources that PyPI's llama-cpp-python sdist vendors
# (pip download --no-binary; CMake with -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF and the CPU's SIMD
# extensions but AMX, about 4.5 minutes on 2 cores), cached under target/llama-cpp/
# (git-ignored). When cmake is not on PATH it is installed from PyPI into target/llama-cpp/venv.
#
#   usage: scripts/bench-llama-cpp.sh [--rounds N] [--threads T] [--model FILE.gguf]
#                                     [--out results.md] [--build-only]
#   env:   LLAMA_CPP_PYTHON_VERSION (default 0.3.36), OMNI_BIN (default: release build of
#          omni-engine under $CARGO_TARGET_DIR or target/)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

rounds=3
threads=2
model=""
out=""
build_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --model) model=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --build-only) build_only=1; shift ;;
        *) echo "bench-llama-cpp: unknown argument $1" >&2; exit 2 ;;
    esac
done

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache="$root/target/llama-cpp"
src="$cache/llama-cpp-python-$version"
build="$cache/build-$version-noamx"
bench_bin="$build/bin/llama-bench"

# ggml's CPU features: every SIMD extension this CPU reports, except AMX. A VM may report AMX
# tiles that the kernel does not let a process use (llama-bench's pp512 then dies of SIGILL, as
# on the 2-core machine of 2026-12-02), so the build names its extensions instead of
# -march=native (GGML_NATIVE).
cpu_flags() {
    local have; have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    local out="-DGGML_NATIVE=OFF" f
    for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
             avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        case "$have" in
            *" ${f%%:*} "*) out="$out -DGGML_${f#*:}=ON" ;;
            *) out="$out -DGGML_${f#*:}=OFF" ;;
        esac
    done
    echo "$out"
}

build_llama_bench() {
    mkdir -p "$cache"
    if [ ! -d "$src/vendor/llama.cpp" ]; then
        echo "bench-llama-cpp: downloading the llama-cpp-python $version sdist" >&2
        rm -rf "$cache/sdist"
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            --disable-pip-version-check --dest "$cache/sdist" "llama-cpp-python==$version" >&2
        tar -xzf "$cache"/sdist/llama_cpp_python-"$version".tar.gz -C "$cache"
        mv "$cache/llama_cpp_python-$version" "$src"
    fi
    local cmake=cmake
    if ! command -v cmake >/dev/null; then
        if [ ! -x "$cache/venv/bin/cmake" ]; then
            echo "bench-llama-cpp: cmake not on PATH; installing it from PyPI into $cache/venv" >&2
            python3 -m venv "$cache/venv"
            "$cache/venv/bin/pip" install --quiet --disable-pip-version-check cmake >&2
        fi
        cmake="$cache/venv/bin/cmake"
    fi
    echo "bench-llama-cpp: building llama-bench in $build (takes minutes)" >&2
    "$cmake" -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $(cpu_flags) -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >&2
    "$cmake" --build "$build" --target llama-bench -j "$(nproc)" >&2
}

[ -x "$bench_bin" ] || build_llama_bench
if [ "$build_only" = 1 ]; then
    echo "$bench_bin"
    exit 0
fi

target_dir="${CARGO_TARGET_DIR:-$root/target}"
omni="${OMNI_BIN:-$target_dir/release/omni-engine}"
if [ -z "${OMNI_BIN:-}" ]; then
    cargo build --release -p omni-engine -j "$(nproc)" >&2
fi
[ -n "$model" ] || model=$(scripts/fetch-default-model.sh)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# llama-bench: 3 repetitions per round (it reports their mean), tg128 and pp512 as two runs.
llama_round() {
    local r=$1
    "$bench_bin" -m "$model" -t "$threads" -p 0 -n 128 -r 3 -o json > "$tmp/llama-tg-$r.json"
    "$bench_bin" -m "$model" -t "$threads" -p 512 -n 0 -r 3 -o json > "$tmp/llama-pp-$r.json"
}

# omni-engine: the same file, one sequence; decode 128 tokens after a 1-token prompt (tg128
# starts from an empty context), then a 512-token prefill (best of 3, one output token).
omni_round() {
    local r=$1
    RAYON_NUM_THREADS="$threads" "$omni" bench latency --model "$model" --device cpu \
        --batch-sizes 1 --input-len 1 --output-len 129 --prefill-len 512 \
        --max-num-batched-tokens 2048 --copy-bw-gbs 1 --json "$tmp/omni-$r.json" \
        > "$tmp/omni-$r.txt" 2> "$tmp/omni-$r.err" || { cat "$tmp/omni-$r.err" >&2; exit 1; }
}

for r in $(seq 1 "$rounds"); do
    echo "bench-llama-cpp: round $r of $rounds" >&2
    # The 1-minute load average before the round: other processes on a shared machine.
    cut -d' ' -f1 /proc/loadavg > "$tmp/load-$r"
    if [ $((r % 2)) = 1 ]; then llama_round "$r"; omni_round "$r"; else omni_round "$r"; llama_round "$r"; fi
done

python3 - "$tmp" "$rounds" "$threads" "$model" "$version" "$out" <<'PY'
import json, statistics, sys, datetime, platform, os
tmp, rounds, threads, model, version, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
rows = []
for r in range(1, rounds + 1):
    tg = json.load(open(f"{tmp}/llama-tg-{r}.json"))[0]
    pp = json.load(open(f"{tmp}/llama-pp-{r}.json"))[0]
    o = json.load(open(f"{tmp}/omni-{r}.json"))
    dec = o["decode"][0]["decode_tok_per_s"]
    # The mean of the tries' tokens/s, as llama-bench's avg_ts is.
    pp_ts = statistics.mean(512 / t for t in o["prefill"]["ttft_s"])
    load = open(f"{tmp}/load-{r}").read().strip()
    rows.append({"round": r, "load": load, "llama_tg": tg["avg_ts"], "omni_tg": dec,
                 "llama_pp": pp["avg_ts"], "omni_pp": pp_ts})
    build = tg.get("build_commit", "?")
    cpu = tg.get("cpu_info", "?")
med = {k: statistics.median(x[k] for x in rows) for k in ("llama_tg", "omni_tg", "llama_pp", "omni_pp")}
lines = []
lines.append(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
             f"machine: {os.cpu_count()} vCPU {cpu}; threads {threads}")
lines.append(f"model: {model}")
lines.append(f"llama.cpp: llama-bench from llama-cpp-python {version} (llama.cpp {build}), "
             f"-t {threads}, tg128 and pp512, 3 repetitions per round")
lines.append("omni-engine: bench latency --batch-sizes 1 --input-len 1 --output-len 129 "
             "--prefill-len 512 (decode tok/s of 128 tokens; prefill = mean of 512 / TTFT over 3 tries)")
lines.append("")
lines.append("| round (load avg before) | llama.cpp tg128 tok/s | omni decode tok/s | ratio | llama.cpp pp512 tok/s | omni prefill tok/s | ratio |")
lines.append("|---|---|---|---|---|---|---|")
for x in rows:
    lines.append(f"| {x['round']} ({x['load']}) | {x['llama_tg']:.1f} | {x['omni_tg']:.1f} | {x['omni_tg'] / x['llama_tg']:.2f} "
                 f"| {x['llama_pp']:.1f} | {x['omni_pp']:.1f} | {x['omni_pp'] / x['llama_pp']:.2f} |")
lines.append(f"| median | {med['llama_tg']:.1f} | {med['omni_tg']:.1f} | {med['omni_tg'] / med['llama_tg']:.2f} "
             f"| {med['llama_pp']:.1f} | {med['omni_pp']:.1f} | {med['omni_pp'] / med['llama_pp']:.2f} |")
text = "\n".join(lines) + "\n"
print(text, end="")
if out:
    with open(out, "a") as f:
        f.write(text)
PY
