#!/usr/bin/env bash
# Install hookmech into the active Python environment (a venv is recommended).
#   ./install.sh        the package
#   ./install.sh dev    the package and the development extras: tests, release build, the
#                       tutorial notebook's kernel, and the documentation site's tools
#   ./install.sh docs   the package and the documentation site's tools only
#   ./install.sh hf     the package and the Hugging Face extra (pretrained model folders, hub names)
# torch is installed first, as the CPU build, only where none is present: a plain
# `pip install torch` would pull a multi-GB CUDA build. HOOKMECH_TORCH overrides the spec.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q --upgrade pip >/dev/null
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "${HOOKMECH_TORCH:-torch==2.13.0}"
fi
extras="${1:-}"
python -m pip install -q -e ".${extras:+[$extras]}"
