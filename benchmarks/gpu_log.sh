# Shared head of the GPU check scripts (fp8_gpu.sh, mxfp4_gpu.sh), sourced with the log's name:
#   source "$(dirname "$0")/gpu_log.sh" NAME
# -> cwd = the repo root, $O = $OUT (else benchmarks/results), $LOG = $O/NAME-<sha>.log, and
# `step TITLE` writes a timed header line to the terminal and the log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1
O=${OUT:-benchmarks/results}
mkdir -p "$O"
SHA=$(git rev-parse --short HEAD 2>/dev/null || echo "${DSPARK_GIT_SHA:-unknown}")
LOG=$O/$1-$SHA.log
step() { echo "===== $1 ($(date +%T))" | tee -a "$LOG"; }
