#!/usr/bin/env bash
# The CUDA backend's checks and benchmarks on a GPU machine, from binaries staged by
# scripts/gpu-build.sh in .gpu-bin/ (nothing is built here). Run from the repository root:
#
#   bash scripts/gpu-check.sh [tests|bench|serve|all]...      (default: all)
#
#   tests   kernel tests vs the CPU backend, model logits/greedy vs the transformers references,
#           batched == alone, graphs == eager, engine greedy on 1 GPU, -pp 2 == -tp 1 (both
#           stages on one GPU when there is one), -tp 2 (when 2 GPUs)
#   bench   `omni-engine bench latency` (decode at batch 1/8/32/64 with 1k context, prefill of
#           2k tokens, roofline fractions) for Qwen3-8B and Qwen3-30B-A3B shapes (dummy
#           weights), -tp 1 and -tp 2 when there are 2 GPUs
#   nccl    `omni-engine bench nccl` over every GPU (also part of bench)
#   profile per-kernel GPU time of eager decode steps (batch 1 and 64) and of a 2k prefill
#           (OMNI_CUDA_PROFILE), both shapes, one GPU
#   talker  Qwen3-Omni's Talker + code predictor: CUDA vs CPU on the tiny fixture (prefill logits,
#           greedy frames, graphs == eager, top-k/top-p draws), then `omni-engine bench talker`
#           (frames/s at batch 1/16/32/64, graphs and eager, dummy weights of the real shapes)
#           and a per-kernel profile of eager steps at batch 1 and 64
#   omni    the omni pipeline's stage processes on the tiny fixture with the CUDA Thinker
#           (its text = transformers') and the CUDA Code2Wav (SNR vs the CPU's audio)
#   thinker Qwen3-Omni's Thinker: its hidden-state export on CUDA vs the CPU Thinker on the tiny
#           fixture (prefill eager, decode from graphs), then `omni-engine bench thinker`
#           (decode tok/s at batch 1 and 64 with the export off and on; dummy weights, real shapes)
#   code2wav Qwen3-Omni's Code2Wav: its kernels vs the CPU ops, CUDA vs CPU waveforms on the tiny
#           fixture (one-shot, streaming windows, graphs == eager, batched == alone), then
#           `omni-engine bench code2wav` (16 x 50-frame windows, 1 x 4, 1 x 50; dummy weights of
#           the real shapes) with a per-op profile
#   mm      Qwen3-Omni's Thinker with images and audio on CUDA: the device decoder's multimodal
#           path (placeholder rows, M-RoPE, deepstack) vs transformers on the tiny fixture, alone
#           and batched, then the multi-process engine on the CUDA worker (whole and chunked)
#   encoders Qwen3-Omni's vision and audio towers: the encoder kernels vs the host ops (and their
#           CPU emulators), CUDA vs host towers on the tiny fixture (images alone and in one
#           call, audio clips), then real-shape timings with dummy weights (a 1280x720 image,
#           a 30 s clip)
#   serve   `omni-engine serve` + `omni-engine bench serve` at concurrency 1/16/32/64
#           (random 1000 in / 256 out, ignore-eos) for both shapes on one GPU
#   ab-l2   decode with and without L2 prefetch hints (OMNI_CUDA_L2_PREFETCH_TOKENS 0 / 64,
#           64e: the next layer's QKV from the MoE down kernel, OMNI_CUDA_L2_PREFETCH_QKV_EARLY;
#           a `w` in a mode: the experts' w2 from the gate_up kernel, OMNI_CUDA_MOE_W2_PREFETCH):
#           the small-batch MoE kernel and model tests, bench latency at batch 1/16/64
#           (L2_MODELS, L2_MODES, L2_ROUNDS), eager profiles
#   ab-gemv the GEMV and MoE kernel tests and timings, ncu on two one-row GEMVs (NO_NCU=1: none),
#           the fused-path and reference model tests, then bench latency (batch 1/2/4/8,
#           GEMV_BATCHES) of both shapes (GEMV_MODELS) with OMNI_CUDA_SMALL_BATCH_GEMV=0 and 1
#   ab-attn decode attention before/after: backend-tests cuda::attention (checks and timing
#           lines), eager per-kernel profiles and bench latency at batch 1 and 64 of both shapes,
#           for this tree's binaries and, when staged, base-omni-engine / base-backend-tests
#           (built from the tree before the change, same names with a `base-` prefix)
#   ab-tc   decode attention on tensor cores against the CUDA-core kernel in one build: the
#           attention kernel tests and timings, then bench latency (batch 1/16/64) and an eager
#           per-kernel profile (batch 64) of both shapes with OMNI_CUDA_DECODE_TC=0 and 1
#   ab-bal  balanced decode partitions against `part` tokens and a tail in one build: the
#           attention kernel tests and timings, then bench latency (batch 1/16/64) of both
#           shapes with OMNI_CUDA_DECODE_BALANCED=0 and 1
#   ab-moe  MoE prefill on cuBLAS's grouped GEMM against the in-house kernels in one build:
#           backend-tests cuda::moe::tests and ::timing_tests (checks on every path, timings), then bench latency
#           and an eager per-kernel profile of the Qwen3-30B-A3B shape with
#           OMNI_CUDA_MOE_CUBLAS=0 and 1
#   ab-small-moe the small-batch MoE experts on the unfused decode path (OMNI_CUDA_MOE_SMALL_TOKENS
#           0 and 1): their kernel tests and timings, the model tests, bench latency of the
#           Qwen3-30B-A3B shape twice each way
#   ab-async async scheduling (--async-scheduling false / true, one binary): the engine's GPU
#           tests (greedy tokens equal with and without it), then bench latency of both
#           shapes twice each way, interleaved, with OMNI_STEP_TIMING; an eager per-kernel
#           profile of the Qwen3-30B-A3B shape at batch 1 and 64
#   ab-prefill the prefill kernels: attention checks and tiling timings, the grouped expert
#           GEMM tilings against cuBLAS (PREFILL_KERNELS_ONLY=1 stops here), the model tests,
#           cold vs L2-resident GEMV weights, torch's own kernels on the same shapes
#           (scripts/bench-torch-kernels.py), then bench latency of the Qwen3-30B-A3B shape
#           (prefills of PREFILL_LENS tokens) for this tree and, when staged, base-omni-engine
#           (twice each, interleaved)
#   ab-wgmma the warpgroup-MMA expert GEMMs: MoE checks and timings, ncu on the prefill tiles
#           (NCU_TILES, default large wg) and attention, model tests, bench latency prefills
#           (PREFILL_LENS, default 512 2048) with OMNI_CUDA_MOE_WGMMA in WG_MODES (default 0 1;
#           64 / 128 one tile), interleaved
#   ab-tma  the TMA expert GEMM tile (OMNI_CUDA_MOE_WGMMA=tma): MoE timings (TMA_TOKENS) and
#           checks, bench latency prefills (PREFILL_LENS, default 2048 4000) with WG_MODES
#           (default 1 tma), interleaved
#   ab-attn-wg the warpgroup-MMA prefill attention: its checks, every attention check with
#           OMNI_CUDA_ATTN_WGMMA=1, prefill tiling timings, ncu on the default tiling, model
#           tests with it on, bench latency prefills (PREFILL_LENS, default 512 2048 4000) with it 0 and ATTN_WG_TILES
#   peer    the peer: scripts/bench-hf-peer.py (Hugging Face transformers + torch.compile,
#           random weights of the same shapes) for decode at batch 1 and 8 and a 2k prefill
#           (PEER_MODELS / PEER_BATCHES / PEER_PYTHON override)
#   cold    cold start to /health and requests 1..10 one at a time (scripts/bench-cold-start.sh)
#           for the Qwen3-30B-A3B shape (dummy weights): request 1 must be as fast as the rest
#   ab-base this tree's omni-engine against base-omni-engine (staged from the tree before a
#           change; AB_ENGINES names other staged binaries to compare, default "omni-engine
#           base-omni-engine"): the kernel tests QKR_TESTS (default qkv_rope_cache_matches_cpu)
#           and the model tests, eager per-op profiles (a 2048-token prefill, decode at batch 1)
#           and bench latency (batch 1/16/64, prefill 2048) of the Qwen3-30B-A3B shape,
#           interleaved twice
#   ab-staged the staged GEMV of decode steps (weights copied into shared memory under the
#           latency-bound kernels before the projections): its checks, the model tests with it
#           on, bench latency with it off / on (STAGED_MODES, STAGED_MODELS, STAGED_BATCHES)
#   ab-optin the default kernels against their switches (OPTINS, default "attn1 route topk0
#           norm0 count wide0 first": the one-launch attention block of one-token steps
#           OMNI_CUDA_ATTN_ONE_LAUNCH=1 (attn1kN: with partitions of at least N keys,
#           OMNI_CUDA_ATTN_ONE_LAUNCH_KEYS) and the one-launch router + top-k OMNI_CUDA_MOE_ROUTE_MMA=1
#           (both off by default), and the first forms of the kernels made default on 2026-12-07: the
#           shared-memory top-k OMNI_CUDA_MOE_TOPK_REGS=0, the shared-memory RMSNorm
#           OMNI_CUDA_NORM_REGS=0, the count barrier OMNI_CUDA_MOE_BLOCK1_BARRIER=count, the
#           narrower q/k norm + RoPE OMNI_CUDA_QKV_ROPE_WIDE=0, and all four first forms; OPTIN_PARTS,
#           default "tests timing bench profile ncu", picks parts: all take ~10 minutes, past one
#           device call): their kernel checks (default, and with the router on and the first
#           forms), the model tests the same way, the routing and MoE kernels' timings at 2048
#           tokens, bench latency of the Qwen3-30B-A3B shape (batch 1, a 2048-token prefill) for
#           the default and each, interleaved OPTIN_ROUNDS (2) times, eager per-op profiles of
#           the default, the first forms, the router and OMNI_CUDA_QKV_ROPE_HEADS 1 / 2 / 4, then
#           Nsight Compute on the q/k norm + RoPE, norm, top-k and router kernels of a 2048-token
#           prefill
#   ncu-engine  Nsight Compute inside the engine's own 2048-token prefill of the Qwen3-30B-A3B
#           shape (eager; the routing the dummy weights give, not the timing test's random one):
#           NCU_KERNELS (default a layer's MoE alignment, 128-row expert GEMMs and reduction,
#           and the prefill attention), after NCU_SKIP matching launches (default 600: past the
#           warm-up), NCU_COUNT (6) of them
#   tp8     (8 GPUs) the same serve benchmark with -tp 8 for Qwen3-30B-A3B and Llama-3-70B,
#           plus `bench latency` -tp 8 (SERVE_TP / SERVE_MODELS override)
#
# Results go to $OUT (a temp dir when unset): the JSON of each benchmark, summary.log (what this
# prints), and logs.tgz with every step's full log. Exit code: non-zero if any step failed.
set -uo pipefail
BIN=${GPU_BIN:-.gpu-bin}
# Binaries packed by scripts/gpu-pack.sh: unpack them first.
if [ -d .gpu-bin-xz ]; then
  mkdir -p "$BIN"
  for f in .gpu-bin-xz/*.xz; do
    python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"), 1<<20)' \
      "$f" "$BIN/$(basename "$f" .xz)" && chmod +x "$BIN/$(basename "$f" .xz)"
  done
fi
OUT=${OUT:-$(mktemp -d)}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
exec > >(tee -a "$OUT/summary.log") 2>&1
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(all)
want() { for s in "${STEPS[@]}"; do [[ $s == "$1" || $s == all ]] && return 0; done; return 1; }
# Never NVLink multicast on the lent machines; NCCL logs only warnings.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} RUST_LOG=${RUST_LOG:-info} RUST_BACKTRACE=1
# cudarc dlopens libnccl.so (not .so.2): give it a link when only the versioned library exists.
if ! ldconfig -p | grep -q 'libnccl\.so '; then
  so=$(ldconfig -p | grep -oE '/[^ ]*libnccl\.so\.2$' | head -1)
  if [ -z "$so" ]; then
    so=$(ls /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -1)
  fi
  if [ -n "$so" ]; then
    shim=$(mktemp -d); ln -s "$so" "$shim/libnccl.so"
    export LD_LIBRARY_PATH="$shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
{
  echo "== date: $(date -u +%FT%TZ)"
  echo "== host: $(uname -srm), $(nproc) cores, $(ldd --version | head -1)"
  echo "== GPUs: $NGPU"; nvidia-smi 2>&1 | head -20
  echo "== CUDA libraries"; ldconfig -p | grep -E 'libcuda\.so|libnvrtc\.so|libcublas(Lt)?\.so|libnccl' || true
  echo "== LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} > "$LOGS/env.log" 2>&1
cat "$LOGS/env.log"
fail=0
# Nsight Compute, when installed, and the sections the kernel probes collect.
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section InstructionStats --section SourceCounters)

step() { # name, command...
  local name=$1; shift
  echo "== $name: $*" | tee "$LOGS/$name.log"
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-300}" "$@" >> "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOGS/$name.log"
  grep -E '^(SKIP|NCCL|built |\s+[0-9]+ |attention (decode|prefill)|moe (decode|prefill|route|topk T|paths|cublas|dense|large|wgmma|real shape)|torch |gemv |fused gemv |staged gemv |sampling [a-z]+ .*(us|µs)|nccl all-reduce|gpu |test result|.*panicked|bench |  (B=|prefill )|\|)|profile |GPU blocks|captured CUDA graphs|healthy after|request|warmed up' "$LOGS/$name.log" | grep -v 'attention check' | head -140
  [ $rc -ne 0 ] && fail=1
  return 0
}

# One prefill measurement of the Qwen3-30B-A3B shape (dummy weights): step name, prefill tokens,
# then the command's prefix (`env VAR=value ...` and the binary), JSON in $LOGS/<name>.json.
prefill_latency() {
  local name=$1 n=$2; shift 2
  step "$name" "$@" bench latency \
    --model bench/models/qwen3-30b-a3b --load-format dummy --device cuda \
    --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes 1 \
    --input-len 1024 --output-len 8 --prefill-len "$n" --json "$LOGS/$name.json"
}

if want tests; then
  step kernels "$BIN/backend-tests" cuda:: --test-threads=1 --nocapture
  step model "$BIN/model-tests" --test-threads=1 --nocapture
  step moe-small "$BIN/moe-small-tests" --test-threads=1 --nocapture
  # -pp 2 runs on one GPU too: its two stages then share the device.
  OMNI_CUDA_SHARE_DEVICES=1 OMNI_ENGINE_BIN=$BIN/omni-engine step engine "$BIN/engine-tests" --test-threads=1 --nocapture
fi

if want mm; then
  step thinker-mm "$BIN/thinker-mm-tests" --test-threads=1 --nocapture
  OMNI_ENGINE_BIN=$BIN/omni-engine step engine-mm "$BIN/engine-mm-tests" cuda --test-threads=1 --nocapture
fi

if want talker; then
  step talker-tests "$BIN/talker-tests" --test-threads=1 --nocapture
  step talker-bench "$BIN/omni-engine" bench talker --model bench/models/qwen3-omni-30b-a3b \
    --load-format dummy --batch-sizes 1,16,32,64 --frames 64 --json "$LOGS/talker.json"
  step talker-profile "$BIN/omni-engine" bench talker --model bench/models/qwen3-omni-30b-a3b \
    --load-format dummy --batch-sizes 1,64 --frames 16 --warmup 0 --cuda-profile-steps 16
fi

if want thinker; then
  step thinker-tests "$BIN/thinker-tests" --test-threads=1 --nocapture
  step thinker-bench "$BIN/omni-engine" bench thinker --model bench/models/qwen3-omni-30b-a3b \
    --batch-sizes 1,64
fi
if want code2wav; then
  step code2wav-kernels "$BIN/backend-tests" cuda::audio --test-threads=1 --nocapture
  step code2wav-tests "$BIN/code2wav-tests" --test-threads=1 --nocapture
  step code2wav-bench "$BIN/omni-engine" bench code2wav --model bench/models/qwen3-omni-30b-a3b \
    --load-format dummy --shapes 16x50,1x4,1x50 --profile --json "$LOGS/code2wav.json"
fi

if want encoders; then
  step encoder-kernels "$BIN/backend-tests" cuda::encoder --test-threads=1 --nocapture
  step encoder-tests "$BIN/encoder-tests" --test-threads=1 --nocapture
fi

if want omni; then
  # The pipeline's stage processes with the CUDA Thinker and CUDA Code2Wav (and the CPU tests
  # of the same binary).
  OMNI_ENGINE_BIN=$BIN/omni-engine step omni "$BIN/omni-pipeline-tests" --test-threads=1 --nocapture
fi

latency() { # model tp
  step "latency-$1-tp$2" "$BIN/omni-engine" bench latency --model "bench/models/$1" \
    --load-format dummy --device cuda -tp "$2" --max-model-len 4096 --max-num-seqs 64 \
    --max-num-batched-tokens 4096 --batch-sizes 1,8,32,64 --input-len 1024 --output-len 64 \
    --prefill-len 2048 --json "$LOGS/latency-$1-tp$2.json"
}
if want bench || want nccl; then
  [ "$NGPU" -ge 2 ] && step nccl "$BIN/omni-engine" bench nccl --json "$LOGS/nccl.json"
fi
if want bench; then
  for m in qwen3-8b qwen3-30b-a3b; do
    latency "$m" 1
    [ "$NGPU" -ge 2 ] && latency "$m" 2
  done
fi

# The small-batch GEMVs (fused dense and MoE decode layers) against cuBLAS, in one run: the
# kernels' checks and timings, the fused decoder path vs the unfused one, then bench latency.
if want ab-gemv; then
  step gemv-kernels "$BIN/backend-tests" cuda::gemv cuda::moe::small --test-threads=1 --nocapture
  step moe-kernels "$BIN/backend-tests" cuda::moe::tests --test-threads=1
  # Nsight Compute on one-row GEMVs of the timing test (launch 61 of gemv_r1: the 30B qkv with
  # its norm, 201: the 30B o_proj; each (shape, rows) launches it 141 times).
  if [ -n "$NCU" ] && [ -z "${NO_NCU:-}" ]; then
    for at in 60 200; do
      step "ncu-gemv-$at" "$NCU" --kernel-name gemv_r1 --launch-skip $at --launch-count 1 \
        "${NCU_SECTIONS[@]}" "$BIN/backend-tests" gemv_real_shape_timing --test-threads=1
    done
  fi
  [ -x "$BIN/moe-small-tests" ] && step moe-small "$BIN/moe-small-tests" --test-threads=1 --nocapture
  [ -x "$BIN/model-tests" ] && step model "$BIN/model-tests" --test-threads=1
  for m in ${GEMV_MODELS:-qwen3-30b-a3b qwen3-8b}; do
    for g in 0 1; do
      OMNI_CUDA_SMALL_BATCH_GEMV=$g step "gemv$g-$m" "$BIN/omni-engine" bench latency \
        --model "bench/models/$m" --load-format dummy --device cuda --max-model-len 4096 \
        --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes ${GEMV_BATCHES:-1,2,4,8} \
        --input-len 1024 --output-len 64 --prefill-len 2048 --json "$LOGS/gemv$g-$m.json"
    done
  done
fi

if want ab-attn; then
  # "" = this tree, base- = the tree before (when staged); interleaved so that a cut-short run
  # still has pairs.
  for p in "" base-; do
    v=${p:-new}; v=${v%-}
    [ -x "$BIN/${p}backend-tests" ] && step "attn-kernels-$v" "$BIN/${p}backend-tests" \
      cuda::attention --test-threads=1 --nocapture
  done
  for m in qwen3-30b-a3b qwen3-8b; do
    for p in "" base-; do
      v=${p:-new}; v=${v%-}
      [ -x "$BIN/${p}omni-engine" ] || continue
      OMNI_CUDA_PROFILE=16 step "attn-profile-$v-$m" "$BIN/${p}omni-engine" bench latency \
        --model "bench/models/$m" --load-format dummy --device cuda --enforce-eager \
        --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes 1,64 \
        --input-len 1024 --output-len 32 --prefill-len 2048
    done
    for p in "" base-; do
      v=${p:-new}; v=${v%-}
      [ -x "$BIN/${p}omni-engine" ] || continue
      step "attn-latency-$v-$m" "$BIN/${p}omni-engine" bench latency --model "bench/models/$m" \
        --load-format dummy --device cuda --max-model-len 4096 --max-num-seqs 64 \
        --max-num-batched-tokens 4096 --batch-sizes 1,64 --input-len 1024 --output-len 64 \
        --prefill-len 2048 --json "$LOGS/attn-latency-$v-$m.json"
    done
  done
fi

ab_latency() { # VAR prefix model: bench latency (batch 1/16/64) of one shape with VAR=0, then 1
  local v
  for v in 0 1; do
    declare -x "$1=$v"
    step "$2$v-latency-$3" "$BIN/omni-engine" bench latency --model "bench/models/$3" \
      --load-format dummy --device cuda --max-model-len 4096 --max-num-seqs 64 \
      --max-num-batched-tokens 4096 --batch-sizes 1,16,64 --input-len 1024 --output-len 64 \
      --prefill-len 2048 --json "$LOGS/$2$v-latency-$3.json"
    unset "$1"
  done
}

if want ab-tc; then
  step attn-kernels "$BIN/backend-tests" cuda::attention --test-threads=1 --nocapture
  for m in qwen3-30b-a3b qwen3-8b; do
    ab_latency OMNI_CUDA_DECODE_TC tc "$m"
    for t in 0 1; do
      OMNI_CUDA_DECODE_TC=$t OMNI_CUDA_PROFILE=16 step "tc$t-profile-$m" "$BIN/omni-engine" \
        bench latency --model "bench/models/$m" --load-format dummy --device cuda --enforce-eager \
        --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes 64 \
        --input-len 1024 --output-len 32 --prefill-len 2048
    done
  done
fi

if want ab-bal; then
  step attn-kernels "$BIN/backend-tests" cuda::attention --test-threads=1 --nocapture
  for m in qwen3-30b-a3b qwen3-8b; do
    ab_latency OMNI_CUDA_DECODE_BALANCED bal "$m"
  done
fi

if want ab-moe; then
  step moe-kernels "$BIN/backend-tests" cuda::moe::tests cuda::moe::timing_tests --test-threads=1 --nocapture
  for c in 0 1; do
    OMNI_STEP_TIMING=16 OMNI_CUDA_MOE_CUBLAS=$c step "moe-cublas$c-latency" "$BIN/omni-engine" bench latency \
      --model bench/models/qwen3-30b-a3b --load-format dummy --device cuda --max-model-len 4096 \
      --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes 1,64 --input-len 1024 \
      --output-len 32 --prefill-len 2048 --json "$LOGS/moe-cublas$c-latency.json"
  done
  for c in 0 1; do
    OMNI_CUDA_MOE_CUBLAS=$c OMNI_CUDA_PROFILE=4 step "moe-cublas$c-profile" "$BIN/omni-engine" \
      bench latency --model bench/models/qwen3-30b-a3b --load-format dummy --device cuda \
      --enforce-eager --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 4096 \
      --batch-sizes 1 --input-len 1024 --output-len 8 --prefill-len 2048
  done
fi

if want ab-small-moe; then
  # The small-batch MoE experts on the unfused path (OMNI_CUDA_MOE_SMALL_TOKENS, default 1)
  # against the grouped GEMM: kernel checks and timings, the model tests, then bench latency
  # twice each way, interleaved.
  step moe-small-kernels "$BIN/backend-tests" cuda::moe::small --test-threads=1 --nocapture
  [ -x "$BIN/model-tests" ] && step model "$BIN/model-tests" --test-threads=1
  [ -x "$BIN/moe-small-tests" ] && step moe-small "$BIN/moe-small-tests" --test-threads=1
  for r in 1 2; do ab_latency OMNI_CUDA_MOE_SMALL_TOKENS "smoe-r$r-" qwen3-30b-a3b; done
fi

if want ab-async; then
  OMNI_CUDA_SHARE_DEVICES=1 OMNI_ENGINE_BIN=$BIN/omni-engine step engine "$BIN/engine-tests" gpu_tp1 --test-threads=1 --nocapture
  for r in 1 2; do
    for m in qwen3-30b-a3b qwen3-8b; do
      for a in false true; do
        OMNI_STEP_TIMING=16 step "async-$a-r$r-latency-$m" "$BIN/omni-engine" bench latency \
          --model "bench/models/$m" --load-format dummy --device cuda --max-model-len 4096 \
          --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes 1,16,64 --input-len 1024 \
          --output-len 64 --prefill-len 0 --async-scheduling "$a" \
          --json "$LOGS/async-$a-r$r-latency-$m.json"
      done
    done
  done
  OMNI_CUDA_PROFILE=16 step async-profile-qwen3-30b-a3b "$BIN/omni-engine" bench latency \
    --model bench/models/qwen3-30b-a3b --load-format dummy --device cuda --enforce-eager \
    --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes 1,64 \
    --input-len 1024 --output-len 32 --prefill-len 0 --async-scheduling true
fi

if want ab-prefill; then
  step prefill-attn "$BIN/backend-tests" cuda::attention --test-threads=1 --nocapture
  step prefill-moe "$BIN/backend-tests" cuda::moe::timing_tests --test-threads=1 --nocapture
  # Nsight Compute on the prefill kernels, where the machine has it: throughput, occupancy, why
  # warps stall and where (the attention kernel at 2048 tokens; the expert GEMMs of the prefill
  # tile at 2048 tokens, after the two correctness launches of each).
  if [ -n "$NCU" ]; then
    step ncu-prefill-attn "$NCU" --kernel-name attn_prefill_hd128 --launch-count 1 "${NCU_SECTIONS[@]}" \
      "$BIN/backend-tests" attention_prefill_timing --test-threads=1
    step ncu-prefill-moe env OMNI_MOE_TIMING_TOKENS=2048 "$NCU" --kernel-name 'regex:^moe_(gate_up|down)_large$' \
      --launch-skip 4 --launch-count 2 "${NCU_SECTIONS[@]}" \
      "$BIN/backend-tests" fused_moe_real_shape_and_timing --test-threads=1
  else
    echo "== ncu: not on this machine"
  fi
  [ -n "${PREFILL_KERNELS_ONLY:-}" ] && exit $fail
  [ -x "$BIN/model-tests" ] && step model "$BIN/model-tests" --test-threads=1
  step gemv-warm "$BIN/backend-tests" gemv_real_shape_timing --test-threads=1 --nocapture
  PEER_PY=${PEER_PYTHON:-/opt/torch/.venv/bin/python}
  [ -x "$PEER_PY" ] && step torch-kernels "$PEER_PY" scripts/bench-torch-kernels.py
  for r in 1 2; do
    for n in ${PREFILL_LENS:-256 512 768 2048}; do
      for p in "" base-; do
        v=${p:-new}; v=${v%-}
        [ -x "$BIN/${p}omni-engine" ] || continue
        prefill_latency "prefill$n-$v-r$r-latency" "$n" "$BIN/${p}omni-engine"
      done
    done
  done
fi

if want ab-tma; then
  # The TMA expert GEMM tile against the default tiles: the timing test at TMA_TOKENS (its
  # correctness part first runs every tile at 4 and 512 tokens against the CPU), every MoE check
  # (each tile on every routing case), then bench latency prefills of PREFILL_LENS tokens
  # (Qwen3-30B-A3B shape) with OMNI_CUDA_MOE_WGMMA in WG_MODES (default: 1 = the default
  # tiles, tma), interleaved, WGMMA_ROUNDS times.
  step tma-timing env OMNI_MOE_TIMING_TOKENS=${TMA_TOKENS:-512,1024,2048,4096} \
    "$BIN/backend-tests" fused_moe_real_shape_and_timing --test-threads=1 --nocapture
  step tma-moe "$BIN/backend-tests" cuda::moe::tests --test-threads=1
  for r in $(seq 1 "${WGMMA_ROUNDS:-1}"); do
    for n in ${PREFILL_LENS:-2048 4000}; do
      for v in ${WG_MODES:-1 tma}; do
        prefill_latency "prefill$n-wg$v-r$r-latency" "$n" env OMNI_CUDA_MOE_WGMMA=$v "$BIN/omni-engine"
      done
    done
  done
fi
if want ab-l2; then
  # L2 prefetch hints of decode steps (OMNI_CUDA_L2_PREFETCH_TOKENS: 0 off, the default; 64 up to batch 64;
  # an `e` in a mode also sets OMNI_CUDA_L2_PREFETCH_QKV_EARLY=1, a `w`
  # OMNI_CUDA_MOE_W2_PREFETCH=1, e.g. 64e, 0w, 64ew):
  # bench latency at batch 1/16/64 of L2_MODELS (default the 30B-A3B shape) with each value of
  # L2_MODES, interleaved, L2_ROUNDS times; then an eager per-kernel profile at batch 1 with
  # each (NO_PROFILE=1: none). First the small-batch MoE kernel checks and timings and the
  # model tests, where staged (NO_TESTS=1: none).
  if [ -z "${NO_TESTS:-}" ]; then
    [ -x "$BIN/backend-tests" ] && step moe-small-kernels "$BIN/backend-tests" cuda::moe::small --test-threads=1 --nocapture
    [ -x "$BIN/model-tests" ] && step model "$BIN/model-tests" --test-threads=1
    [ -x "$BIN/moe-small-tests" ] && step moe-small "$BIN/moe-small-tests" --test-threads=1
  fi
  for r in $(seq 1 "${L2_ROUNDS:-2}"); do
    for m in ${L2_MODELS:-qwen3-30b-a3b}; do
      for v in ${L2_MODES:-0 64 64e}; do
        early=0; [[ $v == *e* ]] && early=1
        w2=0; [[ $v == *w* ]] && w2=1
        OMNI_CUDA_L2_PREFETCH_TOKENS=${v//[a-z]/} OMNI_CUDA_L2_PREFETCH_QKV_EARLY=$early \
          OMNI_CUDA_MOE_W2_PREFETCH=$w2 \
          step "l2pf$v-r$r-latency-$m" "$BIN/omni-engine" bench latency \
          --model "bench/models/$m" --load-format dummy --device cuda --max-model-len 4096 \
          --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes ${L2_BATCHES:-1,16,64} \
          --input-len 1024 --output-len 64 --prefill-len 2048 --json "$LOGS/l2pf$v-r$r-latency-$m.json"
      done
    done
  done
  if [ -z "${NO_PROFILE:-}" ]; then
    for v in ${L2_MODES:-0 64 64e}; do
      early=0; [[ $v == *e* ]] && early=1
      w2=0; [[ $v == *w* ]] && w2=1
      OMNI_CUDA_L2_PREFETCH_TOKENS=${v//[a-z]/} OMNI_CUDA_L2_PREFETCH_QKV_EARLY=$early \
        OMNI_CUDA_MOE_W2_PREFETCH=$w2 OMNI_CUDA_PROFILE=16 \
        step "l2pf$v-profile" "$BIN/omni-engine" \
        bench latency --model bench/models/qwen3-30b-a3b --load-format dummy --device cuda \
        --enforce-eager --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 4096 \
        --batch-sizes 1 --input-len 1024 --output-len 32 --prefill-len 2048
    done
  fi
fi
if want ab-staged; then
  # The staged GEMV of decode steps (OMNI_CUDA_STAGED_GEMV_TOKENS): its checks and timing
  # lines, the model and small-batch MoE tests with it on, then bench latency at STAGED_BATCHES
  # (default 1,4,8) of STAGED_MODELS (default the 30B-A3B shape and Qwen3-8B) with each of
  # STAGED_MODES (default "0 c 8 8u": off; off with every kernel asking for the largest
  # shared-memory carve-out; on for steps of up to 8 tokens; on with the input norm left to its
  # own kernel), interleaved STAGED_ROUNDS (2) times;
  # STAGED_KB sets its shared-memory budget (OMNI_CUDA_STAGED_GEMV_KB). NO_TESTS=1: no checks.
  if [ -z "${NO_TESTS:-}" ]; then
    step staged-kernels "$BIN/backend-tests" cuda::gemv --test-threads=1 --nocapture
    [ -x "$BIN/model-tests" ] && OMNI_CUDA_STAGED_GEMV_TOKENS=8 step staged-model "$BIN/model-tests" --test-threads=1
    [ -x "$BIN/moe-small-tests" ] && OMNI_CUDA_STAGED_GEMV_TOKENS=8 step staged-moe-small "$BIN/moe-small-tests" --test-threads=1
  fi
  for r in $(seq 1 "${STAGED_ROUNDS:-2}"); do
    for m in ${STAGED_MODELS:-qwen3-30b-a3b qwen3-8b}; do
      for v in ${STAGED_MODES:-0 c 8 8u}; do
        tok=${v%u} carve= fold=; [ "$v" == c ] && { tok=0; carve=100; }; [[ $v == *u ]] && fold=0
        OMNI_CUDA_STAGED_GEMV_TOKENS=$tok OMNI_CUDA_SMEM_CARVEOUT=$carve OMNI_CUDA_STAGED_GEMV_NORM=$fold \
          OMNI_CUDA_STAGED_GEMV_KB=${STAGED_KB:-} \
          step "staged$v-r$r-latency-$m" "$BIN/omni-engine" bench latency \
          --model "bench/models/$m" --load-format dummy --device cuda --max-model-len 4096 \
          --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes ${STAGED_BATCHES:-1,4,8} \
          --input-len 1024 --output-len 64 --prefill-len 512 --json "$LOGS/staged$v-r$r-latency-$m.json"
      done
    done
  done
fi
if want ab-wgmma; then
  # The warpgroup-MMA expert GEMMs: every MoE check and timing, Nsight Compute on the prefill
  # tiles NCU_TILES (default large wg) and the attention prefill at 2048 tokens, the model and
  # small-batch MoE tests on the default tiles, then bench latency prefills of PREFILL_LENS
  # tokens (Qwen3-30B-A3B shape) with OMNI_CUDA_MOE_WGMMA in WG_MODES (default 0 1: off / the
  # default tiles; 64 / 128 one tile), interleaved, WGMMA_ROUNDS times.
  step wg-moe "$BIN/backend-tests" cuda::moe --test-threads=1 --nocapture
  if [ -n "$NCU" ]; then
    for k in ${NCU_TILES:-large wg}; do
      step "ncu-moe-$k" env OMNI_MOE_TIMING_TOKENS=2048 "$NCU" --kernel-name "regex:^moe_(gate_up|down)_$k\$" \
        --launch-skip 4 --launch-count 2 "${NCU_SECTIONS[@]}" \
        "$BIN/backend-tests" fused_moe_real_shape_and_timing --test-threads=1
    done
    step ncu-attn "$NCU" --kernel-name attn_prefill_hd128 --launch-count 1 "${NCU_SECTIONS[@]}" \
      "$BIN/backend-tests" attention_prefill_timing --test-threads=1
  fi
  [ -x "$BIN/model-tests" ] && step wg-model "$BIN/model-tests" --test-threads=1
  [ -x "$BIN/moe-small-tests" ] && step wg-moe-small "$BIN/moe-small-tests" --test-threads=1
  for r in $(seq 1 "${WGMMA_ROUNDS:-1}"); do
    for n in ${PREFILL_LENS:-512 2048}; do
      for v in ${WG_MODES:-0 1}; do
        prefill_latency "prefill$n-wg$v-r$r-latency" "$n" env OMNI_CUDA_MOE_WGMMA=$v "$BIN/omni-engine"
      done
    done
  done
fi

if want ab-attn-wg; then
  # The warpgroup-MMA prefill attention (OMNI_CUDA_ATTN_WGMMA): its checks against the CPU and
  # every attention check through it, the prefill tiling timings, ncu on it at 2048 tokens,
  # the model tests with it on, then bench latency prefills (PREFILL_LENS) with it off and on
  # (ATTN_WG_TILES, default `1`: the picked tiling), interleaved, WGMMA_ROUNDS times.
  step attn-wg-check "$BIN/backend-tests" wgmma_prefill emu_wg paged_attention_mixed --test-threads=1 --nocapture
  step attn-wg-all env OMNI_CUDA_ATTN_WGMMA=1 "$BIN/backend-tests" cuda::attention --skip timing --test-threads=1
  step attn-wg-timing "$BIN/backend-tests" attention_prefill_timing --test-threads=1 --nocapture
  if [ -n "$NCU" ]; then
    step ncu-attn-wg "$NCU" --kernel-name regex:^attn_prefill_wg_hd128_w2_n128$ --launch-count 1 "${NCU_SECTIONS[@]}" \
      "$BIN/backend-tests" attention_prefill_timing --test-threads=1
  fi
  [ -x "$BIN/model-tests" ] && step attn-wg-model env OMNI_CUDA_ATTN_WGMMA=1 "$BIN/model-tests" --test-threads=1
  for r in $(seq 1 "${WGMMA_ROUNDS:-1}"); do
    for n in ${PREFILL_LENS:-512 2048 4000}; do
      for v in 0 ${ATTN_WG_TILES:-1}; do
        prefill_latency "prefill$n-attnwg$v-r$r-latency" "$n" env OMNI_CUDA_ATTN_WGMMA=$v "$BIN/omni-engine"
      done
    done
  done
fi

if want peer; then
  # The same shapes on Hugging Face transformers + torch.compile (random weights, static cache).
  PEER_PY=${PEER_PYTHON:-/opt/torch/.venv/bin/python}
  [ -x "$PEER_PY" ] || PEER_PY=python3
  for m in ${PEER_MODELS:-qwen3-30b-a3b qwen3-8b}; do
    step "peer-$m" "$PEER_PY" scripts/bench-hf-peer.py --model "bench/models/$m" \
      --batch-sizes "${PEER_BATCHES:-1,8}" --input-len 1024 --output-len 64 --prefill-len 2048 \
      --json "$LOGS/peer-$m.json"
  done
fi

if want ab-base; then
  step base-kernels "$BIN/backend-tests" ${QKR_TESTS:-qkv_rope_cache_matches_cpu} --test-threads=1 --nocapture
  [ -x "$BIN/model-tests" ] && step base-model "$BIN/model-tests" --test-threads=1
  # An AB_ENGINES entry is a staged binary's name, optionally with @VAR=value[,VAR=value...]
  # environment for its runs (e.g. omni-engine@OMNI_CUDA_STAGED_GEMV_TOKENS=8).
  read -ra AB <<<"${AB_ENGINES:-omni-engine base-omni-engine}"
  ab_run() { # step name prefix, entry, bench latency arguments...
    local pre=$1 spec=$2; shift 2
    local e=${spec%%@*} envs=()
    [[ $spec == *@* ]] && IFS=, read -ra envs <<<"${spec#*@}"
    [ -x "$BIN/$e" ] || return 0
    local name="$e"; [[ $spec == *@* ]] && name="$e-$(echo "${spec#*@}" | tr -c 'A-Za-z0-9\n' '-' | sed 's/OMNI-CUDA-//g')"
    step "$name-$pre" env "${envs[@]}" "$BIN/$e" bench latency "$@" --json "$LOGS/$name-$pre.json"
  }
  common=(--model bench/models/qwen3-30b-a3b --load-format dummy --device cuda --max-model-len 4096
    --max-num-seqs 64 --max-num-batched-tokens 4096)
  if [ -z "${AB_NO_PROFILE:-}" ]; then
    for e in "${AB[@]}"; do
      OMNI_CUDA_PROFILE=1 ab_run profile-prefill "$e" "${common[@]}" --enforce-eager \
        --batch-sizes 1 --input-len 1024 --output-len 2 --prefill-len 2048
      OMNI_CUDA_PROFILE=16 ab_run profile-decode "$e" "${common[@]}" --enforce-eager \
        --batch-sizes 1 --input-len 1024 --output-len 32 --prefill-len 2048
    done
  fi
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    for e in "${AB[@]}"; do
      ab_run "r$r-latency" "$e" "${common[@]}" --batch-sizes "${AB_BATCHES:-1,16,64}" \
        --input-len 1024 --output-len 64 --prefill-len 2048
    done
  done
fi

if want ab-optin; then
  FIRST=(OMNI_CUDA_MOE_TOPK_REGS=0 OMNI_CUDA_NORM_REGS=0 OMNI_CUDA_MOE_BLOCK1_BARRIER=count
    OMNI_CUDA_QKV_ROPE_WIDE=0)
  # The forms the default does not run: the router on, the first forms.
  ALL_ON=(OMNI_CUDA_ATTN_ONE_LAUNCH=1 OMNI_CUDA_MOE_ROUTE_MMA=1 "${FIRST[@]}")
  optin_env() { # mode -> VAR=value words
    case $1 in
      attn1) echo OMNI_CUDA_ATTN_ONE_LAUNCH=1 ;;
      attn1k*) echo OMNI_CUDA_ATTN_ONE_LAUNCH=1 "OMNI_CUDA_ATTN_ONE_LAUNCH_KEYS=${1#attn1k}" ;;
      route) echo OMNI_CUDA_MOE_ROUTE_MMA=1 ;; topk0) echo OMNI_CUDA_MOE_TOPK_REGS=0 ;;
      norm0) echo OMNI_CUDA_NORM_REGS=0 ;; count) echo OMNI_CUDA_MOE_BLOCK1_BARRIER=count ;;
      wide0) echo OMNI_CUDA_QKV_ROPE_WIDE=0 ;;
      first) echo "${FIRST[*]}" ;; all) echo "${ALL_ON[*]}" ;; *) echo OMNI_NONE=0 ;;
    esac
  }
  PARTS=" ${OPTIN_PARTS:-tests timing bench profile ncu} "
  OPT_TESTS=(cuda::moe::router_tests cuda::moe::tests::moe_topk cuda::moe::block1_tests
    cuda::moe::small_tests cuda::gemv cuda::layers_tests cuda::attention::rope_tests
    cuda::attention::block1_tests)
  if [[ $PARTS == *" tests "* ]]; then
    step optin-kernels "$BIN/backend-tests" "${OPT_TESTS[@]}" --skip timing --skip throughput \
      --test-threads=1 --nocapture
    step optin-kernels-on env "${ALL_ON[@]}" "$BIN/backend-tests" "${OPT_TESTS[@]}" --skip timing \
      --skip throughput --test-threads=1
    [ -x "$BIN/model-tests" ] && step optin-model env "${ALL_ON[@]}" "$BIN/model-tests" --test-threads=1
    # End to end on the paths the fixtures' small shapes never take (head_dim 128, 256+ token
    # steps): 16 greedy tokens after a 2048-token prompt of the 30B shape (dummy weights), the
    # default against the other forms; printed, not asserted (dummy routers have near-ties).
    ids=$(python3 -c "print(','.join(str((i*7919)%150000+1) for i in range(2048)))")
    for v in base all attn1; do
      # shellcheck disable=SC2046 # the mode's VAR=value words
      env $(optin_env "$v") "$BIN/omni-engine" generate --model bench/models/qwen3-30b-a3b \
        --load-format dummy --device cuda --max-model-len 4096 --max-num-batched-tokens 4096 \
        --prompt-token-ids "$ids" --max-tokens 16 --temperature 0 --ignore-eos --json \
        > "$LOGS/optin-generate-$v.json" 2> "$LOGS/optin-generate-$v.log"
      echo "== optin-generate-$v: $(python3 -c 'import json,sys; print([g.get("token_ids") for g in json.load(open(sys.argv[1]))])' "$LOGS/optin-generate-$v.json" 2>&1 | tail -1)"
    done
  fi
  if [[ $PARTS == *" timing "* ]]; then
    # The kernels alone: routing (split GEMMs + top-k against one launch), the MoE layer's
    # tiles and the top-k at 2048 tokens.
    step optin-attn1-timing "$BIN/backend-tests" attn_block1_timing --test-threads=1 --nocapture
    step optin-route-timing "$BIN/backend-tests" route_mma_timing --test-threads=1 --nocapture
    step optin-moe-timing env OMNI_MOE_TIMING_TOKENS=2048 "$BIN/backend-tests" \
      fused_moe_real_shape_and_timing --test-threads=1 --nocapture
  fi
  [[ $PARTS == *" bench "* ]] && for r in $(seq 1 "${OPTIN_ROUNDS:-2}"); do
    for v in base ${OPTINS:-attn1 route topk0 norm0 count wide0 first}; do
      # shellcheck disable=SC2046 # the mode's VAR=value words
      step "optin-$v-r$r" env $(optin_env "$v") "$BIN/omni-engine" bench latency \
        --model bench/models/qwen3-30b-a3b --load-format dummy --device cuda --max-model-len 4096 \
        --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes 1 --input-len 1024 \
        --output-len 64 --prefill-len 2048 --json "$LOGS/optin-$v-r$r.json"
    done
  done
  [[ $PARTS == *" profile "* ]] && for v in base attn1 first route heads1 heads2 heads4; do
    e=$(optin_env "$v"); [[ $v == heads* ]] && e=OMNI_CUDA_QKV_ROPE_HEADS=${v#heads}
    # shellcheck disable=SC2086 # the mode's VAR=value words
    OMNI_CUDA_PROFILE=4 step "optin-profile-$v" env $e "$BIN/omni-engine" bench latency \
      --model bench/models/qwen3-30b-a3b --load-format dummy --device cuda --enforce-eager \
      --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 4096 --batch-sizes 1 \
      --input-len 1024 --output-len 2 --prefill-len 2048
  done
  if [ -n "$NCU" ] && [[ $PARTS == *" ncu "* ]]; then
    # A 16-token decode request first (2 steps), then 2048-token prefills; no start-up warm-up,
    # so the skips below land in a 2048-token prefill: (kernel regex, skip, mode).
    for spec in "qkv_rope_cache_grouped_bf16 60 wide0" "qkv_rope_cache_wide_bf16 60 base" "fused_add_rmsnorm_f32res 500 base" \
      "fused_add_rmsnorm_f32res 500 norm0" "moe_topk_softmax 110 base" "moe_topk_softmax 110 topk0" \
      "moe_route_mma 110 route" "attn_prefill_wg_hd128_w2_n128 100 base"; do
      read -r k skip v <<< "$spec"
      # shellcheck disable=SC2046 # the mode's VAR=value words
      step "optin-ncu-$k-$v" env OMNI_CUDA_WARMUP=0 $(optin_env "$v") "$NCU" --target-processes all \
        --kernel-name "regex:^$k\$" --launch-skip "$skip" --launch-count 2 "${NCU_SECTIONS[@]}" \
        "$BIN/omni-engine" bench latency --model bench/models/qwen3-30b-a3b --load-format dummy \
        --device cuda --enforce-eager --max-model-len 4096 --max-num-seqs 64 \
        --max-num-batched-tokens 4096 --batch-sizes 1 --input-len 16 --output-len 2 --prefill-len 2048
      grep -E '^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Executed Ipc A|Issue Slots Busy' \
        "$LOGS/optin-ncu-$k-$v.log" | head -16
    done
  fi
fi

if want ncu-engine; then
  if [ -n "$NCU" ]; then
    step ncu-engine "$NCU" --target-processes all \
      --kernel-name "regex:${NCU_KERNELS:-^(moe_(align|reduce)|moe_(gate_up|down)_wg2|attn_prefill_wg_hd128_w2_n128)\$}" \
      --launch-skip "${NCU_SKIP:-600}" --launch-count "${NCU_COUNT:-6}" "${NCU_SECTIONS[@]}" \
      "$BIN/omni-engine" bench latency --model bench/models/qwen3-30b-a3b --load-format dummy \
      --device cuda --enforce-eager --max-model-len 4096 --max-num-seqs 64 \
      --max-num-batched-tokens 4096 --batch-sizes 1 --input-len 2048 --output-len 2 \
      --prefill-len 2048
  else
    echo "== ncu: not on this machine"
  fi
fi

if want profile; then
  for m in qwen3-8b qwen3-30b-a3b; do
    OMNI_CUDA_PROFILE=16 step "profile-$m" "$BIN/omni-engine" bench latency --model "bench/models/$m" \
      --load-format dummy --device cuda --enforce-eager --max-model-len 4096 --max-num-seqs 64 \
      --max-num-batched-tokens 4096 --batch-sizes 1,64 --input-len 1024 --output-len 32 \
      --prefill-len 2048
  done
fi

bench_model_dir() { # model -> a temp dir with its config.json and a tokenizer of its vocabulary
  local d; d=$(mktemp -d)/$1; mkdir -p "$d"; cp "bench/models/$1/config.json" "$d/"
  local vocab; vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$d/config.json")
  python3 scripts/make_bench_tokenizer.py "$vocab" > "$d/tokenizer.json"
  echo "$d"
}
if want cold; then
  # Without the workers' start-up warm-up (OMNI_CUDA_WARMUP=0), then with it.
  for m in ${COLD_MODELS:-qwen3-30b-a3b}; do
    d=$(bench_model_dir "$m")
    for w in 0 1; do
      OMNI_CUDA_WARMUP=$w OMNI_BIN=$BIN/omni-engine JSON="$LOGS/cold-$m-warmup$w.json" \
        step "cold-$m-warmup$w" bash scripts/bench-cold-start.sh \
        "$d" --load-format dummy --device cuda --max-model-len 4096 --max-num-seqs 64
    done
  done
fi

SERVE_TP=${SERVE_TP:-1}
if want tp8 && [ "$NGPU" -ge 8 ]; then
  step nccl-8 "$BIN/omni-engine" bench nccl --gpus 8 --json "$LOGS/nccl-8.json"
  for m in qwen3-30b-a3b llama-3-70b; do latency "$m" 8; done
fi
want tp8 && [ "$NGPU" -ge 8 ] && { SERVE_TP=8; SERVE_MODELS=${SERVE_MODELS:-qwen3-30b-a3b llama-3-70b}; STEPS+=(serve); }
if want serve; then
  for m in ${SERVE_MODELS:-qwen3-8b qwen3-30b-a3b}; do
    port=8100
    # config.json of the real shape + a tokenizer with exactly its vocabulary
    mdir=$(bench_model_dir "$m")
    "$BIN/omni-engine" serve "$mdir" --served-model-name "$m" --load-format dummy --device cuda --port $port -tp "$SERVE_TP" \
      --max-model-len 2048 --max-num-seqs 64 > "$LOGS/serve-$m.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do
      curl -sf "localhost:$port/health" >/dev/null 2>&1 && break
      kill -0 $pid 2>/dev/null || break
      sleep 0.5
    done
    for c in ${SERVE_CONCURRENCY:-1 16 32 64}; do
      n=$((c * 2)); [ $n -lt 8 ] && n=8
      step "serve-$m-tp$SERVE_TP-c$c" "$BIN/omni-engine" bench serve --base-url "http://localhost:$port" \
        --model "$m" --dataset-name random --random-input-len 1000 \
        --random-output-len 256 --ignore-eos --num-prompts $n --max-concurrency $c \
        --tokenizer "$mdir" --save-result "$LOGS/serve-$m-tp$SERVE_TP-c$c.json"
    done
    curl -s "localhost:$port/metrics" > "$LOGS/metrics-$m.txt" 2>&1
    kill -INT $pid; wait $pid
    grep -E 'GPU blocks|KV blocks|graphs|engine ready' "$LOGS/serve-$m.log" | head -5
  done
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $fail
