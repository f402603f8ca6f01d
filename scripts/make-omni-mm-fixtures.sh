#!/usr/bin/env bash
# Create scripts/.venv with CPU-capable torch + transformers and regenerate the tiny random Qwen3-Omni multimodal Thinker fixture
# (crates/omni-models/tests/fixtures/qwen3-omni-mm/).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/venv.sh
. "$here/venv.sh"
fixture_venv
exec "$venv/bin/python" "$here/make_omni_mm_fixtures.py" "$@"
