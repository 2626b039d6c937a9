#!/usr/bin/env bash
# This session's GPU checks, results packed into one tarball per call (the device tool returns at
# most 8 files):
#   part 1: benchmarks/gpu_smoke.sh (every GPU test, AOTI builds with kernels vs eager, engine bench,
#           generate of the default pair);
#   part 2: benchmarks/gpu_confidence.sh (#25: confidence GPU tests, verify modes vs concurrency at
#           Qwen3-8B dims with the replayed acceptance curve and on the trained default pair) and
#           benchmarks/gpu_openai.sh (#22: logprob GPU tests, the OpenAI server under load on the
#           default pair and at Qwen3-8B dims; needs the FastAPI / uvicorn wheels carried in .whl).
#   part 3: the AOTI builds of the smoke (Qwen3-8B dims 6 layers, V4-tiny; on CPUs 8-15) beside the
#           OpenAI load (default pair, Qwen3-8B dims) and the verify modes under a steady load at
#           Qwen3-8B dims (#25), on CPUs 0-7.
#   DSPARK_GIT_SHA=<sha> OUT=<dir> bash benchmarks/gpu_session11.sh 1|2|3
set -uo pipefail
cd "$(dirname "$0")/.."
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1 DSPARK_GIT_SHA=${DSPARK_GIT_SHA:?}
O=${OUT:?}
R=$O/results
mkdir -p "$R"
if [ "$1" = 1 ]; then
  OUT=$R bash benchmarks/gpu_smoke.sh 2>&1 | grep -v "Warning\|warnings.warn" \
    | grep "smoke\|passed\|failed\|FAIL\|Error\|rror:\|bench\] B=\|goal\|GB/s\|TB/s\|%" | cut -c1-300 | tail -80
elif [ "$1" = 3 ]; then
  OUT=$R taskset -c 8-15 python3 benchmarks/gpu_smoke.py --only builds > "$R/builds.out" 2>&1 &
  B=$!
  step() { echo "===== $1 ($(date +%T))" | tee -a "$R/gpu-openai.log"; }
  step "load: default pair, fp32, batch 32, 32 clients x 4 requests x 32 tokens"
  timeout 120 taskset -c 0-7 python3 benchmarks/openai_load.py --device cuda --dtype fp32 --max-batch-size 32 \
    --clients 32 --requests 4 --max-tokens 32 --output-dir "$R" 2>&1 | tail -6 | tee -a "$R/gpu-openai.log"
  step "load: Qwen3-8B dims, random bf16, batch 32, 32 clients x 4 requests x 64 tokens"
  timeout 200 taskset -c 0-7 python3 benchmarks/openai_load.py --model qwen3-8b-dspark-block7 --device cuda \
    --dtype bf16 --max-batch-size 32 --clients 32 --requests 4 --max-tokens 64 --output-dir "$R" 2>&1 \
    | tail -6 | tee -a "$R/gpu-openai.log"
  step "verify modes, steady load, Qwen3-8B dims, synthetic acceptance"
  timeout 170 taskset -c 0-7 python3 benchmarks/verify_concurrency.py --model qwen3-8b-dspark-block7 --random-weights \
    --dtype bf16 --synthetic benchmarks/results/confidence-calibration-h200-462ac15.json --gen-len 64 \
    --prompt-len 128 --iters 10 --load steady --waves 3 --tag h200-qwen3-8b-synthetic --out-dir "$R" 2>&1 \
    | grep "verify-concurrency\|rror" | tee -a "$R/gpu-openai.log"
  step "waiting for the builds"
  wait $B
  grep "\[smoke\]\|-----\|parity\|equal" "$R/builds.out" | cut -c1-200 | tail -20
else
  OUT=$R bash benchmarks/gpu_confidence.sh 2>&1 | tee "$R/gpu-confidence.log" | tail -20
  OUT=$R bash benchmarks/gpu_openai.sh 2>&1 | tail -20
fi
(cd "$O" && tar czf "results-part$1.tgz" results && rm -rf results)
ls -la "$O"
