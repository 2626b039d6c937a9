#!/usr/bin/env bash
# This session's GPU checks in two device calls (each < 10 minutes), results packed so that they
# fit the device tool's 8 returned files:
#   part 1: benchmarks/gpu_smoke.sh (every GPU test, AOTI builds with kernels vs eager, engine bench,
#           generate) with, after the GPU tests, the fp8 block-scaled GEMM bench (#23) and the verify
#           modes vs concurrency at Qwen3-8B dims with the replayed acceptance curve (#25);
#   part 2: the decode paths at Qwen3-8B dims (#21: LLM eager unfused / fused / compiled, the compiled
#           HF peer) and the OpenAI server under load at Qwen3-8B dims (#22).
#   DSPARK_GIT_SHA=<sha> OUT=<dir> bash benchmarks/gpu_session10.sh 1|2
set -uo pipefail
cd "$(dirname "$0")/.."
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1 DSPARK_GIT_SHA=${DSPARK_GIT_SHA:?}
O=${OUT:?}
R=$O/results
mkdir -p "$R"
if [ "$1" = 1 ]; then
  cat > /tmp/extras.txt <<EOT
timeout 200 python3 benchmarks/fp8_gemm_bench.py --out $R 2>&1 | tail -40
timeout 150 python3 benchmarks/verify_concurrency.py --model qwen3-8b-dspark-block7 --random-weights --dtype bf16 --synthetic benchmarks/results/confidence-calibration-h200-462ac15.json --gen-len 64 --prompt-len 128 --iters 10 --tag h200-qwen3-8b-synthetic --out-dir $R 2>&1 | tail -25
EOT
  OUT=$R bash benchmarks/gpu_smoke.sh --extra /tmp/extras.txt 2>&1 | grep -v "Warning\|warnings.warn" \
    | grep "smoke\|passed\|failed\|FAIL\|Error\|rror:\|bench\] B=\|verify-concurrency\|goal\|GB/s\|TB/s\|%" | cut -c1-300 | tail -120
else
  timeout 200 python3 benchmarks/decode_paths.py --out-dir "$R" 2>&1 | tail -30 | tee "$R/decode-paths.log"
  timeout 220 python3 benchmarks/openai_load.py --model qwen3-8b-dspark-block7 --device cuda --dtype bf16 \
    --max-batch-size 32 --clients 32 --requests 4 --max-tokens 64 --output-dir "$R" 2>&1 | tail -8 | tee "$R/openai-load.log"
fi
(cd "$O" && tar czf "results-part$1.tgz" results && rm -rf results)
ls -la "$O"
