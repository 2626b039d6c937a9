#!/usr/bin/env bash
# The GPU smoke run (benchmarks/gpu_smoke.py) on a device machine: results to $OUT or benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
# The H200 image presets CXX to a wrapper g++ whose AOTI packages segfault at load (platform notes,
# section 11): the smoke run always builds with the system compiler unless DSPARK_SMOKE_CXX names one.
export CXX=${DSPARK_SMOKE_CXX:-/usr/bin/g++} PYTHONUNBUFFERED=1
export DSPARK_GIT_SHA=${DSPARK_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)}
exec python3 benchmarks/gpu_smoke.py "$@"
