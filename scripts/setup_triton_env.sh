#!/usr/bin/env bash
# Create (idempotently) the serving venv: a real tritonserver 2.51 from the nvidia-pytriton wheel,
# CPU torch, numpy<2 (the python-backend stub needs it) and the project's pure-python runtime deps.
# The project itself is NOT installed: model.py puts the repo on sys.path (config parameter).
# Usage: scripts/setup_triton_env.sh [VENV_DIR]   (default: <repo>/.venv-triton)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
V="${1:-$ROOT/.venv-triton}"
PY="${PYTHON:-python3}"
STAMP="$V/.dspark-serving-ready"
if [ -f "$STAMP" ]; then echo "$V"; exit 0; fi
rm -rf "$V"
"$PY" -m venv "$V"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$V/bin/python" -m pip install -q "torch==2.13.0" "nvidia-pytriton==0.7.0" "numpy<2" \
    "safetensors>=0.4" "tokenizers>=0.19" tqdm
# The wheel does not put the python-backend stub where the backend looks for it (recipe gotcha 1).
TS="$("$V/bin/python" -c 'import os, pytriton; print(os.path.join(os.path.dirname(pytriton.__file__), "tritonserver"))')"
VER="$("$V/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
cp "$TS/python_backend_stubs/$VER/triton_python_backend_stub" "$TS/backends/python/"
"$V/bin/python" -c 'import numpy, torch, tritonclient.grpc, tritonclient.http; assert int(numpy.__version__.split(".")[0]) < 2'
touch "$STAMP"
echo "$V"
