#!/usr/bin/env bash
# Set up a fresh machine for fused-mlp and build the kernel:
#   1. create the virtual environment .venv/ in the repository root when it is missing (`python3 -m venv`, no
#      system site-packages: everything the example and the tests import is installed here, by this script),
#   2. install the pinned packages into it (tools/requirements.txt; a fast no-op when already installed),
#   3. install the tools the checks use when they are missing, with apt-get as root (Debian/Ubuntu): the aarch64 cross
#      compiler (g++-aarch64-linux-gnu, for tools/cross_compile_check.py) and jq (the workflow's scripts, which
#      tests/packaging/test_release.py runs); elsewhere this step only says what is missing,
#   4. build build/<variant>/ with tools/build.py: the variants kernel-builder builds (CPU always; CUDA when torch
#      is a CUDA build and nvcc exists), each binary checked with kernel-abi-check.
# Then run everything with .venv/bin/python (or `source .venv/bin/activate` first).
# Environment: PYTHON (the interpreter that creates .venv, default python3); FUSED_MLP_CUDA_CAPABILITIES=9.0 narrows
# the CUDA build to one capability (much faster); FUSED_MLP_ABI=all also builds the per-torch variants (tools/build.py
# --abi; CI does, for the tests that compare the two builds).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
say() { echo "fused-mlp setup: $*"; }

if [ ! -e "$VENV" ]; then
  say "creating the virtual environment $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
elif [ ! -x "$VENV/bin/python" ]; then
  say "$VENV exists but has no bin/python: remove it and run this again" >&2
  exit 1
fi
if ! grep -Eq '^include-system-site-packages *= *false' "$VENV/pyvenv.cfg"; then
  say "$VENV sees the system site-packages (created with --system-site-packages?): remove it and run this again" >&2
  exit 1
fi
PY="$VENV/bin/python"

if ! "$PY" -m pip install -q --disable-pip-version-check -r tools/requirements.txt; then
  say "installing the pinned packages into $VENV failed (see above)" >&2
  exit 1
fi

# command:Debian package
missing=()
for tool in aarch64-linux-gnu-g++:g++-aarch64-linux-gnu jq:jq; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${missing[@]}" >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; } \
      || { say "installing ${missing[*]} failed (see above)" >&2; exit 1; }
  else
    say "not installed: ${missing[*]} (Debian/Ubuntu packages; the aarch64 compile check and the workflow tests need" \
        "them): apt-get install ${missing[*]}"
  fi
fi

"$PY" tools/build.py --abi-check ${FUSED_MLP_ABI:+--abi "$FUSED_MLP_ABI"}
