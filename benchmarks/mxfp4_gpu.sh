#!/usr/bin/env bash
# Issue #23 MXFP4 routed experts: GPU checks in one device call (under 6 minutes on an H200; run
# from the repo root, logs and JSON into $OUT, else benchmarks/results):
#   1. the MoE GPU tests: moe_experts and moe_experts_mxfp4 (kernel vs reference at V4-Flash shapes,
#      the tl.dot_scaled variant (the op's default with bf16 x), CUDA-graph capture, AOTInductor with dynamic tokens) and
#      the tiny V4 checkpoint with --quantization fp8 on CUDA (MXFP4 kernel, spec == AR)     ~2-3 min
#   2. benchmarks/moe_mxfp4_bench.py: MXFP4 vs bf16 grouped experts at V4-Flash / V4-Pro shapes,
#      M = 1, 16, 64, cold L2, JSON (written after every row, so a timeout keeps what ran)    ~2-3 min
source "$(dirname "$0")/gpu_log.sh" mxfp4-gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
step "MoE GPU tests (bf16 and MXFP4 experts)"
timeout 200 python3 -m pytest -q -m gpu tests/plugins/test_moe_gpu.py \
  tests/checkpoints/test_v4_loader.py::test_mxfp4_experts_on_gpu_run_the_kernel \
  -p no:cacheprovider -rfE --durations=10 2>&1 | tail -40 | tee -a "$LOG"
step "MXFP4 MoE bench"
timeout 150 python3 benchmarks/moe_mxfp4_bench.py --out "$O" 2>&1 | tail -30 | tee -a "$LOG"
step "done"
