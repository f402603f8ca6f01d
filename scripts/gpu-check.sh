#!/usr/bin/env bash
# GPU checks for the CUDA backend (issue 5). Builds NOTHING: run it on the device machine, from the
# repo root, with a test binary built on the CPU box:
#
#   cargo test -p omni-backend --features cuda --no-run --release   # prints the binary's path
#   bash scripts/gpu-check.sh target/release/deps/omni_backend-<hash>
#
# (with the device tool: carry that path). Runs the `cuda::` tests single-threaded with output,
# prints the environment, and writes logs to $OUT (a temp dir when OUT is unset).
# Exit code: the test binary's.
set -uo pipefail
BIN=${1:?usage: scripts/gpu-check.sh <omni-backend test binary built with --features cuda>}
shift
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# never use NVLink multicast on the lent machines (shared/gpu.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{
  echo "== date: $(date -u +%FT%TZ)"
  echo "== host: $(uname -srm), $(nproc) cores, $(ldd --version | head -1)"
  echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "nvidia-smi not available"
  echo "== CUDA libraries on the loader path"
  ldconfig -p | grep -E 'libcuda\.so|libnvrtc\.so|libcublas(Lt)?\.so' || echo "none found by ldconfig"
} 2>&1 | tee "$OUT/env.log"

# cudarc dlopens libnvrtc / libcublas / libcublasLt: add the toolkit's lib dirs if present
# (the lent image resolves them through ldconfig already).
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
echo "== LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" | tee -a "$OUT/env.log"

echo "== $BIN cuda:: --test-threads=1 --nocapture $*" | tee "$OUT/gpu-tests.log"
timeout 240 "$BIN" cuda:: --test-threads=1 --nocapture "$@" 2>&1 | tee -a "$OUT/gpu-tests.log"
rc=${PIPESTATUS[0]}
echo "== test binary exit code: $rc" | tee -a "$OUT/gpu-tests.log"
grep -oE '(SKIP|GEMM|gemm bf16|rmsnorm bf16|rope bf16|silu_and_mul bf16|embedding bf16|add_residual bf16|argmax f32|CUDA device).*' "$OUT/gpu-tests.log" > "$OUT/summary.log" || true
exit "$rc"
