#!/usr/bin/env bash
# Fetch the built-in voice of `serve --omni`: the hibari text-to-speech model (Apache-2.0) and the
# ONNX Runtime shared library that runs it.
#
# Both come from PyPI as wheels: hibari-tts==0.2.1 (14 MB, pure Python: the int8 acoustic model
# hibari/assets/hibari.onnx, the grapheme-to-phoneme data and the out-of-vocabulary net) and
# onnxruntime==1.31.1 (manylinux x86_64; only its onnxruntime/capi/libonnxruntime.so.* is kept).
# The wheels are downloaded with `pip download --no-deps` and unpacked into the cache directory:
#
#   cache dir: ${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/voices/
#     hibari-0.2.1/         the package's assets/ (what crates/omni-tts's Voice::load reads)
#     libonnxruntime.so     the runtime (ort's load-dynamic opens it; ORT_DYLIB_PATH may name another)
#   usage:     scripts/fetch-voice.sh      # prints the voice folder, then the library's path
#
# Idempotent: when both are there it only prints the paths (everything else goes to stderr).
set -euo pipefail

HIBARI="hibari-tts==0.2.1"
VOICE_NAME="hibari-0.2.1"
ORT_VERSION="1.31.1"
ORT="onnxruntime==$ORT_VERSION"

CACHE_DIR="${OMNI_CACHE_DIR:-$HOME/.cache/omni-engine}/voices"
VOICE_DIR="$CACHE_DIR/$VOICE_NAME"
LIB="$CACHE_DIR/libonnxruntime.so"

if [[ -s "$VOICE_DIR/hibari.onnx" && -s "$LIB" ]]; then
    echo "$VOICE_DIR"
    echo "$LIB"
    exit 0
fi

mkdir -p "$CACHE_DIR"
PYTHON="${PYTHON:-$(command -v python3 || command -v python || true)}"
if [[ -z "$PYTHON" ]]; then
    echo "fetch-voice: python3 is needed (for pip)" >&2
    exit 1
fi

WORK="$(mktemp -d "$CACHE_DIR/.fetch.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

if [[ ! -s "$VOICE_DIR/hibari.onnx" ]]; then
    echo "fetch-voice: downloading $HIBARI with pip into $WORK" >&2
    "$PYTHON" -m pip download --quiet --no-deps --disable-pip-version-check \
        --dest "$WORK/hibari" "$HIBARI" >&2
    # Unpack hibari/assets/* (flat) into a temporary folder, then rename it into place.
    "$PYTHON" - "$WORK/hibari" "$WORK/$VOICE_NAME" <<'PY'
import glob, os, shutil, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
out = sys.argv[2]
os.makedirs(out)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("hibari/assets/") and not name.endswith("/"):
            with z.open(name) as src, open(os.path.join(out, os.path.basename(name)), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        elif name.endswith("/LICENSE") or name.endswith("/NOTICE"):
            with z.open(name) as src, open(os.path.join(out, os.path.basename(name)), "wb") as dst:
                shutil.copyfileobj(src, dst)
PY
    rm -rf "$VOICE_DIR"
    mv "$WORK/$VOICE_NAME" "$VOICE_DIR"
    echo "fetch-voice: saved $VOICE_DIR" >&2
fi

if [[ ! -s "$LIB" ]]; then
    echo "fetch-voice: downloading $ORT (manylinux x86_64) with pip into $WORK" >&2
    "$PYTHON" -m pip download --quiet --no-deps --disable-pip-version-check \
        --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
        --implementation cp --abi cp311 --dest "$WORK/ort" "$ORT" >&2
    "$PYTHON" - "$WORK/ort" "$WORK/libonnxruntime.so" <<'PY'
import glob, os, shutil, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    libs = [n for n in z.namelist() if os.path.basename(n).startswith("libonnxruntime.so")]
    if not libs:
        sys.exit(f"fetch-voice: no libonnxruntime.so in {wheel}")
    with z.open(libs[0]) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
    mv "$WORK/libonnxruntime.so" "$LIB"
    echo "fetch-voice: saved $LIB" >&2
fi

echo "$VOICE_DIR"
echo "$LIB"
