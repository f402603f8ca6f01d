#!/usr/bin/env bash
# Build, on this (CPU) machine, everything scripts/gpu-check.sh runs on a GPU machine, and stage
# it, stripped, in .gpu-bin/ (git-ignored; the device tool carries it: `carry: [".gpu-bin"]`).
# cudarc loads CUDA at run time, so nothing here needs a CUDA toolkit.
#
#   scripts/gpu-build.sh && du -sh .gpu-bin
#   scripts/gpu-build.sh omni-engine backend-tests engine-tests   (only these staged names)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
STAGE=${GPU_BIN:-.gpu-bin}  # as gpu-check.sh reads it
TARGET=${CARGO_TARGET_DIR:-target}
rm -rf "$STAGE" && mkdir -p "$STAGE"

exe_of() { # the test executable cargo reports for a --no-run build
    grep -oE '\([^)]*release/deps/[^)]+\)' | tr -d '()' | tail -1
}
WANT=("$@")
want() { # a staged name is built when no names were given, or when it is one of them
    [ ${#WANT[@]} -eq 0 ] && return 0
    for n in "${WANT[@]}"; do [ "$n" == "$1" ] && return 0; done
    return 1
}
stage_test() { # name, cargo test arguments...
    local name=$1; shift
    want "$name" || return 0
    local t
    t=$(cargo test --release "$@" --no-run 2>&1 | exe_of)
    cp "$t" "$STAGE/$name"
}
if want omni-engine; then
    cargo build --release -p omni-engine
    cp "$TARGET/release/omni-engine" "$STAGE/omni-engine"
fi
stage_test backend-tests -p omni-backend --features cuda --lib
stage_test model-tests -p omni-models --features cuda --test cuda_reference
stage_test moe-small-tests -p omni-models --features cuda --test cuda_moe_small_batch
stage_test talker-tests -p omni-models --features cuda --test cuda_talker
stage_test thinker-tests -p omni-models --features cuda --test cuda_thinker
stage_test code2wav-tests -p omni-models --features cuda --test cuda_code2wav
stage_test encoder-tests -p omni-models --features cuda --test cuda_encoders
stage_test engine-tests -p omni-engine --test engine_gpu
stage_test thinker-mm-tests -p omni-models --features cuda --test cuda_thinker_mm
stage_test engine-mm-tests -p omni-engine --test engine_mm
stage_test omni-pipeline-tests -p omni-engine --test omni_pipeline
strip --strip-debug "$STAGE"/*
ls -la "$STAGE"
du -sh "$STAGE"
