#!/usr/bin/env bash
# One device call (issue #25): the confidence GPU tests (CUDA-graph confidence rounds with the
# trimmed window), then throughput vs concurrency at Qwen3-8B dimensions (random bf16 weights,
# the default pair's measured acceptance replayed as synthetic confidence + acceptance) and on the
# trained default pair. ~2 min on an H200 (timeouts 60 + 120 + 60 s). Results: $OUT (default benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/.."
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1
O=${OUT:-benchmarks/results}
mkdir -p "$O"
echo "===== gpu tests ($(date +%T))"
timeout 60 python3 -m pytest -q -m gpu tests/runtime/test_confidence.py -p no:cacheprovider -rfE > "$O/gpu-tests-confidence.log" 2>&1
tail -4 "$O/gpu-tests-confidence.log"
echo "===== Qwen3-8B dims, synthetic acceptance ($(date +%T))"
timeout 120 python3 benchmarks/verify_concurrency.py --model qwen3-8b-dspark-block7 --random-weights --dtype bf16 \
  --synthetic benchmarks/results/confidence-calibration-h200-462ac15.json --gen-len 64 --prompt-len 128 --iters 10 \
  --tag h200-qwen3-8b-synthetic --out-dir "$O" 2>&1 | grep "verify-concurrency\|Error\|error"
echo "===== default pair, held-out prompts ($(date +%T))"
timeout 60 python3 benchmarks/verify_concurrency.py --prompts heldout --gen-len 32 --prompt-len 128 --iters 10 \
  --tag h200-default-pair --out-dir "$O" 2>&1 | grep "verify-concurrency\|Error\|error"
echo "===== done ($(date +%T))"
