#!/usr/bin/env bash
# This session's GPU checks, results packed into one tarball per call (the device tool returns at
# most 8 files):
#   part 1: benchmarks/gpu_smoke.sh (every GPU test, AOTI builds with kernels vs eager, engine bench,
#           generate of the default pair);
#   part 2: benchmarks/gpu_confidence.sh (#25: confidence GPU tests, verify modes vs concurrency at
#           Qwen3-8B dims with the replayed acceptance curve and on the trained default pair) and
#           benchmarks/gpu_openai.sh (#22: logprob GPU tests, the OpenAI server under load on the
#           default pair and at Qwen3-8B dims; needs the FastAPI / uvicorn wheels carried in .whl).
#   DSPARK_GIT_SHA=<sha> OUT=<dir> bash benchmarks/gpu_session11.sh 1|2
set -uo pipefail
cd "$(dirname "$0")/.."
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1 DSPARK_GIT_SHA=${DSPARK_GIT_SHA:?}
O=${OUT:?}
R=$O/results
mkdir -p "$R"
if [ "$1" = 1 ]; then
  OUT=$R bash benchmarks/gpu_smoke.sh 2>&1 | grep -v "Warning\|warnings.warn" \
    | grep "smoke\|passed\|failed\|FAIL\|Error\|rror:\|bench\] B=\|goal\|GB/s\|TB/s\|%" | cut -c1-300 | tail -80
else
  OUT=$R bash benchmarks/gpu_confidence.sh 2>&1 | tee "$R/gpu-confidence.log" | tail -20
  OUT=$R bash benchmarks/gpu_openai.sh 2>&1 | tail -20
fi
(cd "$O" && tar czf "results-part$1.tgz" results && rm -rf results)
ls -la "$O"
