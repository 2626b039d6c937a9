#!/usr/bin/env bash
# The GPU smoke run (benchmarks/gpu_smoke.py) on a device machine: results to $OUT or benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
export CXX=${CXX:-/usr/bin/g++} PYTHONUNBUFFERED=1
export DSPARK_GIT_SHA=${DSPARK_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)}
exec python3 benchmarks/gpu_smoke.py "$@"
