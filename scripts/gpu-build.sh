#!/usr/bin/env bash
# Build, on this (CPU) machine, everything scripts/gpu-check.sh runs on a GPU machine, and stage
# it, stripped, in .gpu-bin/ (git-ignored; the device tool carries it: `carry: [".gpu-bin"]`).
# cudarc loads CUDA at run time, so nothing here needs a CUDA toolkit.
#
#   scripts/gpu-build.sh && du -sh .gpu-bin
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
STAGE=${GPU_BIN:-.gpu-bin}  # as gpu-check.sh reads it
TARGET=${CARGO_TARGET_DIR:-target}
rm -rf "$STAGE" && mkdir -p "$STAGE"

exe_of() { # the test executable cargo reports for a --no-run build
    grep -oE '\([^)]*release/deps/[^)]+\)' | tr -d '()' | tail -1
}
cargo build --release -p omni-engine
cp "$TARGET/release/omni-engine" "$STAGE/omni-engine"
t=$(cargo test --release -p omni-backend --features cuda --lib --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/backend-tests"
t=$(cargo test --release -p omni-models --features cuda --test cuda_reference --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/model-tests"
t=$(cargo test --release -p omni-models --features cuda --test cuda_moe_small_batch --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/moe-small-tests"
t=$(cargo test --release -p omni-models --features cuda --test cuda_talker --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/talker-tests"
t=$(cargo test --release -p omni-models --features cuda --test cuda_thinker --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/thinker-tests"
t=$(cargo test --release -p omni-models --features cuda --test cuda_code2wav --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/code2wav-tests"
t=$(cargo test --release -p omni-models --features cuda --test cuda_encoders --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/encoder-tests"
t=$(cargo test --release -p omni-engine --test engine_gpu --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/engine-tests"
t=$(cargo test --release -p omni-models --features cuda --test cuda_thinker_mm --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/thinker-mm-tests"
t=$(cargo test --release -p omni-engine --test engine_mm --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/engine-mm-tests"
t=$(cargo test --release -p omni-engine --test omni_pipeline --no-run 2>&1 | exe_of)
cp "$t" "$STAGE/omni-pipeline-tests"
strip --strip-debug "$STAGE"/*
ls -la "$STAGE"
du -sh "$STAGE"
