#!/usr/bin/env bash
# The test command of the README: fetches the built-in default model (so the end-to-end
# "Paris" checks run), validates the Kubernetes manifests (scripts/validate-k8s.sh), then runs
# every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
scripts/fetch-default-model.sh >/dev/null || echo "warning: default model not fetched; tests that need it will skip" >&2
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
