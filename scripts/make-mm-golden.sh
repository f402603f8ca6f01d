#!/usr/bin/env bash
# Regenerate crates/omni-mm/tests/fixtures/ (synthetic media + transformers reference outputs) with the
# scripts/.venv of scripts/venv.sh, adding the media packages the references need.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/venv.sh
. "$here/venv.sh"
# pillow: the slow image processor; scipy: resample_poly; soxr: librosa's default resampler (vLLM's);
# soundfile (libsndfile 1.2, with LAME/mpg123): WAV/FLAC/MP3 writing and reading; blake3: output hashes.
fixture_venv pillow numpy scipy soxr soundfile blake3
# torchvision (the fast image processor and the video processor) is optional: without deps so it
# cannot replace torch; the fast-vs-slow report is skipped if it does not import.
"$venv/bin/python" -c "import torchvision" 2>/dev/null \
    || "$venv/bin/pip" install --quiet --no-deps torchvision || true
exec "$venv/bin/python" "$here/make_mm_golden.py" "$@"
