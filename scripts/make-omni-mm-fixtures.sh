#!/usr/bin/env bash
# Create scripts/.venv with CPU-capable torch + transformers and regenerate the tiny random Qwen3-Omni multimodal Thinker fixture
# (crates/omni-models/tests/fixtures/qwen3-omni-mm/).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, transformers, safetensors, tokenizers" 2>/dev/null; then
    # The CPU-only wheel index is smaller; fall back to PyPI when it cannot be reached.
    "$venv/bin/pip" install --quiet torch --index-url https://download.pytorch.org/whl/cpu \
        || "$venv/bin/pip" install --quiet torch
    "$venv/bin/pip" install --quiet "transformers>=5,<6" safetensors tokenizers
fi
exec "$venv/bin/python" "$here/make_omni_mm_fixtures.py" "$@"
