#!/usr/bin/env bash
# Set up a fresh machine for fused-mlp and build every variant it can:
#   1. install the pinned Python packages (tools/requirements.txt; fast no-op when already installed),
#   2. build build/<variant>/ with tools/build.py (CPU always; CUDA when torch is a CUDA build and nvcc exists).
# FUSED_MLP_CUDA_CAPABILITIES=9.0 narrows the CUDA build to one capability (much faster).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -m pip install -q --disable-pip-version-check -r tools/requirements.txt; then
  echo "fused-mlp setup: installing the pinned packages failed (see above)" >&2
  exit 1
fi
"$PY" tools/build.py --abi-check
