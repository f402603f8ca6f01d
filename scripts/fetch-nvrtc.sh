#!/usr/bin/env bash
# Fetch NVIDIA's runtime compiler (NVRTC 13.0, the version that matches the lent machines'
# driver 580 / CUDA 13.0) from PyPI so the CUDA kernels can be compiled to sm_90 CUBINs on a
# machine without a GPU: `scripts/test.sh` uses it to check that every kernel source compiles.
# NVRTC needs no driver and no GPU. Prints the directory to put on LD_LIBRARY_PATH (it holds a
# `libnvrtc.so` link, the name cudarc dlopens). Idempotent.
#
#   cache dir: ${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/nvrtc-13.0.88/
set -euo pipefail

PACKAGE="nvidia-cuda-nvrtc==13.0.88"
DIR="${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/nvrtc-13.0.88"
if [[ -e "$DIR/libnvrtc.so" ]]; then
    echo "$DIR"
    exit 0
fi
PYTHON="${PYTHON:-$(command -v python3 || command -v python || true)}"
if [[ -z "$PYTHON" ]]; then
    echo "fetch-nvrtc: python3 is needed (for pip)" >&2
    exit 1
fi
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_12_x86_64 \
    --python-version 3.11 -d "$TMP" "$PACKAGE" >&2
mkdir -p "$TMP/x" "$DIR"
"$PYTHON" -m zipfile -e "$TMP"/*.whl "$TMP/x" >&2
cp "$TMP"/x/nvidia/cu13/lib/libnvrtc.so.13 "$TMP"/x/nvidia/cu13/lib/libnvrtc-builtins.so.13.0 "$DIR/"
ln -sf libnvrtc.so.13 "$DIR/libnvrtc.so"
echo "$DIR"
