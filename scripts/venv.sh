# shellcheck shell=bash
# The Python environment the fixture scripts share (scripts/.venv), sourced by make-fixtures.sh,
# make-omni-fixtures.sh, make-omni-mm-fixtures.sh and make-mm-golden.sh.
#
# fixture_venv [PACKAGE...]
#   Creates scripts/.venv if it is missing; installs CPU-capable torch (from PyTorch's CPU-only
#   wheel index, which is smaller, or from PyPI when that cannot be reached) and transformers 5 with
#   safetensors and tokenizers unless they already import; then installs the PACKAGEs given, if any.
#   Sets $venv to the environment's folder.
fixture_venv() {
    venv="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/.venv"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
    fi
    if ! "$venv/bin/python" -c "import torch, transformers, safetensors, tokenizers" 2>/dev/null; then
        "$venv/bin/pip" install --quiet torch --index-url https://download.pytorch.org/whl/cpu \
            || "$venv/bin/pip" install --quiet torch
        "$venv/bin/pip" install --quiet "transformers>=5,<6" safetensors tokenizers
    fi
    if [ "$#" -gt 0 ]; then
        "$venv/bin/pip" install --quiet "$@"
    fi
}
