#!/usr/bin/env bash
# Regenerate the omni-tts reference outputs (crates/omni-tts/tests/fixtures/ and the git-ignored
# .cache/tts-golden/) with the hibari-tts package itself. The environment is small and its own
# (hibari's dependencies are numpy and onnxruntime, plus onnx to give shared int8 weights one copy
# per node as crates/omni-tts does; scripts/venv.sh's torch + transformers are not needed): ${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/voices/venv, made on first use.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/voices/venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# The same onnxruntime as scripts/fetch-voice.sh's library, so both sides run one runtime.
if ! "$venv/bin/python" -c "import hibari, onnxruntime, numpy, onnx" 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        hibari-tts==0.2.1 onnxruntime==1.31.1 numpy==2.3.5 onnx==1.23.2
fi
exec "$venv/bin/python" "$here/make_tts_golden.py" "$@"
