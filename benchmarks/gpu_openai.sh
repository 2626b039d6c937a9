#!/usr/bin/env bash
# One device call (issue #22): the logprob / graph GPU tests, the OpenAI load benchmark on the
# default pair (fp32: every response must equal LLM.generate) and at Qwen3-8B dimensions (random
# bf16 weights, token-id prompts; mismatches only reported). JSON and logs to $OUT. < 3 min on an H200.
# The H200 image lacks FastAPI / uvicorn: carry the wheels of benchmarks/device_wheels.sh (it says how).
set -uo pipefail
cd "$(dirname "$0")/.."
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1
O=${OUT:-benchmarks/results}
mkdir -p "$O"
step() { echo "===== $1 ($(date +%T))" | tee -a "$O/gpu-openai.log"; }
step "GPU test: logprob rounds beside CUDA-graph rounds"
timeout 90 python3 -m pytest -q -m gpu tests/runtime/test_logprobs.py \
  -p no:cacheprovider -rfE 2>&1 | tail -15 | tee -a "$O/gpu-openai.log"
step "load: default pair, fp32, batch 32, 32 clients x 4 requests x 32 tokens"
timeout 120 python3 benchmarks/openai_load.py --device cuda --dtype fp32 --max-batch-size 32 \
  --clients 32 --requests 4 --max-tokens 32 --output-dir "$O" 2>&1 | tail -4 | tee -a "$O/gpu-openai.log"
step "load: Qwen3-8B dims, random bf16, batch 32, 32 clients x 4 requests x 64 tokens"
timeout 200 python3 benchmarks/openai_load.py --model qwen3-8b-dspark-block7 --device cuda --dtype bf16 \
  --max-batch-size 32 --clients 32 --requests 4 --max-tokens 64 --output-dir "$O" 2>&1 | tail -4 | tee -a "$O/gpu-openai.log"
step "done"
