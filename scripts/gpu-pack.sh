#!/usr/bin/env bash
# Packs binaries staged by scripts/gpu-build.sh into .gpu-bin-xz/ (xz, git-ignored) so that a
# device call can carry them: the working tree and the carried paths share one size limit, and
# the stripped binaries are several times their xz size. scripts/gpu-check.sh unpacks
# .gpu-bin-xz/ into .gpu-bin/ when it finds it (with python3's lzma: no xz needed there).
#
#   scripts/gpu-pack.sh [NAME...]     (default: every file in .gpu-bin/)
#   e.g. scripts/gpu-pack.sh omni-engine engine-tests && du -sh .gpu-bin-xz
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${GPU_BIN:-.gpu-bin}
DST=.gpu-bin-xz
rm -rf "$DST" && mkdir -p "$DST"
names=("$@")
[ ${#names[@]} -eq 0 ] && mapfile -t names < <(ls "$SRC")
for n in "${names[@]}"; do
  python3 - "$SRC/$n" "$DST/$n.xz" <<'PY'
import lzma, shutil, sys
with open(sys.argv[1], "rb") as src, lzma.open(sys.argv[2], "wb", preset=6) as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
done
du -sh "$DST"
