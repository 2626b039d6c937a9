#!/usr/bin/env bash
# Issue #23 GPU checks in one device call (about 3 minutes on an H200; run from the repo root):
#   1. the fp8 GPU tests (kernel at Qwen3-8B shapes, tiny fp8 checkpoint on CUDA)      ~30 s
#   2. benchmarks/fp8_gemm_bench.py: fp8 block-scaled GEMM vs bf16 cuBLAS, JSON         ~1-2 min
# Optional (FP8_AR=1, +~2 min): LLM AR / speculative steps at Qwen3-8B dims, fp8 vs bf16 preset.
source "$(dirname "$0")/gpu_log.sh" fp8-gpu
step "fp8 GPU tests"
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_fp8_linear.py tests/checkpoints/test_fp8_checkpoint.py \
  -p no:cacheprovider -rfE 2>&1 | tail -20 | tee -a "$LOG"
step "fp8 GEMM bench"
timeout 240 python3 benchmarks/fp8_gemm_bench.py --out "$O" 2>&1 | tail -45 | tee -a "$LOG"
if [ "${FP8_AR:-0}" = 1 ]; then
  for m in qwen3-8b-dspark-block7 qwen3-8b-fp8-dspark-block7; do
    step "Qwen3-8B dims, random weights, $m (LLM eager modules + CUDA graphs)"
    timeout 120 python3 -m dspark_trt.cli bench --model $m --random-weights --dtype bf16 --batch-sizes 1,16 \
      --hf none --gen-len 32 --iters 30 --time-budget-s 60 --out-dir "$O/ar-$m" 2>&1 | grep "^\[bench\]" | tee -a "$LOG"
  done
fi
step "done"
