#!/usr/bin/env bash
# Regenerate crates/omni-mm/tests/fixtures/ (synthetic media + transformers reference outputs) with the
# scripts/.venv of make-omni-fixtures.sh, adding the media packages the references need.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
    "$venv/bin/pip" install --quiet torch --index-url https://download.pytorch.org/whl/cpu \
        || "$venv/bin/pip" install --quiet torch
    "$venv/bin/pip" install --quiet "transformers>=5,<6"
fi
# pillow: the slow image processor; scipy: resample_poly; soxr: librosa's default resampler (vLLM's);
# soundfile (libsndfile 1.2, with LAME/mpg123): WAV/FLAC/MP3 writing and reading; blake3: output hashes.
"$venv/bin/pip" install --quiet pillow numpy scipy soxr soundfile blake3
# torchvision (the fast image processor and the video processor) is optional: without deps so it
# cannot replace torch; the fast-vs-slow report is skipped if it does not import.
"$venv/bin/python" -c "import torchvision" 2>/dev/null \
    || "$venv/bin/pip" install --quiet --no-deps torchvision || true
exec "$venv/bin/python" "$here/make_mm_golden.py" "$@"
