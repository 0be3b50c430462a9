#!/usr/bin/env bash
# guidellm in a virtual environment of its own, made once: it pins click~=8.4 while the
# project's schema checker needs click>=8.5, so the two cannot share .venv. torch==2.13.0
# goes in first (the local CPU wheel): guidellm asks for any torch, which would otherwise
# fetch a CUDA build of several GB. Prints the guidellm executable's path.
#
# Usage: scripts/guidellm.sh PYTHON     (PYTHON: an interpreter with venv)
set -euo pipefail

PY="${1:?usage: $0 PYTHON}"
VERSION="${GUIDELLM_VERSION:-0.8.1}"
DATA_DIR="${IB_DATA_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/inference-backend}"
VENV="$DATA_DIR/venvs/guidellm-$VERSION"

if [ ! -f "$VENV/.complete" ]; then
    mkdir -p "$DATA_DIR/venvs"
    exec 9>"$DATA_DIR/venvs/.lock"
    flock 9
    if [ ! -f "$VENV/.complete" ]; then  # a venv left half-made by an interrupted run is made again
        echo "guidellm $VERSION: a venv of its own, once ($VENV)" >&2
        rm -rf "$VENV"
        "$PY" -m venv "$VENV"
        "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
        "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" >&2
        "$VENV/bin/python" -m pip install --quiet "guidellm==$VERSION" >&2
        touch "$VENV/.complete"
    fi
fi
echo "$VENV/bin/guidellm"
