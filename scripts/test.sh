#!/usr/bin/env bash
# The test command of the README: fetches the built-in default model (so the end-to-end
# "Paris" checks run) and the built-in voice (so the omni-tts golden checks run), validates the
# Kubernetes manifests (scripts/validate-k8s.sh), then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
scripts/fetch-default-model.sh >/dev/null || echo "warning: default model not fetched; tests that need it will skip" >&2
# The built-in voice (crates/omni-tts): the hibari model and ONNX Runtime's library from PyPI
# (~5 s), then the reference package's outputs for all 20 golden sentences into .cache/tts-golden
# (a small venv of its own, ~25 s the first time); without PyPI the voice tests skip.
if scripts/fetch-voice.sh >/dev/null; then
    scripts/make-tts-golden.sh --cache-only >/dev/null 2>&1 \
        || echo "warning: hibari reference outputs not made; omni-tts checks only the committed ones" >&2
else
    echo "warning: voice not fetched; omni-tts tests that need it will skip" >&2
fi
# NVRTC (no GPU needed) so every CUDA kernel source is compile-checked for sm_90 here too.
if NVRTC_DIR=$(scripts/fetch-nvrtc.sh); then
    export LD_LIBRARY_PATH="$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    echo "warning: NVRTC not fetched; CUDA kernel compile checks will skip" >&2
fi
# The Kubernetes manifests (deploy/k8s/), validated offline against Kubernetes' schemas and the
# vendored CRDs, and the validator's self-test (broken copies must be rejected). The validators
# come from PyPI once, into target/k8s-venv; without PyPI this step is skipped with a warning.
k8s_log="$(mktemp)"
k8s_rc=0
scripts/validate-k8s.sh --self-test >"$k8s_log" 2>&1 || k8s_rc=$?
case "$k8s_rc" in
    0) grep '^validate-k8s:' "$k8s_log" ;;
    3) echo "warning: kubernetes-validate not installed (PyPI unreachable?); manifest validation skipped" >&2 ;;
    *) cat "$k8s_log" >&2; rm -f "$k8s_log"; exit "$k8s_rc" ;;
esac
rm -f "$k8s_log"
# Model-check the ring's flag protocol with loom (its own target dir: a different cfg rebuilds
# the crate's dependencies). A swapped load order in `Flags::readable` fails this in 0.1 s.
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p omni-ipc --release --lib ring::tests
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast "$@"
    # nextest does not run doc tests.
    cargo test --workspace --doc
else
    cargo test --workspace --no-fail-fast "$@"
fi
