#!/usr/bin/env bash
# Create scripts/.venv with CPU-capable torch + transformers and regenerate the omni-models fixtures.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/venv.sh
. "$here/venv.sh"
fixture_venv
exec "$venv/bin/python" "$here/make_fixtures.py" "$@"
