#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs of one host (nvidia-h200-x2), ~5-7 minutes:
#   1. TP=2 equals TP=1 on Qwen3-8B real shapes (random weights, fp32): tp_equality.json
#   2. verify-step latency at TP=1 and TP=2 (bf16, eager steps on both so the split is the only
#      difference; plus TP=1 with CUDA graphs as the single-GPU reference): bench-*.json and
#      tp_scaling.json (verify / draft / AR step ms per batch size, TP=1 / TP=2 ratio)
# Usage:  OUT=/path bash benchmarks/tp_gpu.sh        (NVLink multicast stays off: NCCL_NVLS_ENABLE=0)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the directory that receives the results}"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
MODEL=${MODEL:-qwen3-8b-dspark-block7}
RUN=$(mktemp -d /tmp/dspark_tp.XXXXXX)
TORCHRUN="python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1"
BENCH=(bench --model "$MODEL" --random-weights --dtype bf16 --batch-sizes "${BATCH_SIZES:-1,8}"
       --prompt-len 128 --gen-len 32 --iters 10 --hf none --time-budget-s 150)
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  echo "== 1. TP=2 vs TP=1 equality ($MODEL, fp32)"
  $TORCHRUN --master-port 29511 benchmarks/tp_equality.py --model "$MODEL" --out "$OUT/tp_equality.json"
  echo "== 2a. bench TP=1, eager steps"
  python -m dspark_trt.cli "${BENCH[@]}" --cuda-graphs off --out-dir "$RUN/tp1-eager"
  echo "== 2b. bench TP=2, eager steps"
  $TORCHRUN --master-port 29512 -m dspark_trt.cli "${BENCH[@]}" --tp-size 2 --out-dir "$RUN/tp2-eager"
  echo "== 2c. bench TP=1, CUDA graphs (single-GPU reference)"
  python -m dspark_trt.cli "${BENCH[@]}" --out-dir "$RUN/tp1-graphs"
  echo "== 2d. bench TP=2 with CUDA graphs (attempt: capture of NCCL collectives)"
  timeout 150 $TORCHRUN --master-port 29513 -m dspark_trt.cli "${BENCH[@]}" --tp-size 2 --cuda-graphs on \
      --out-dir "$RUN/tp2-graphs" || echo "TP=2 with CUDA graphs failed (recorded as absent)"
  for tag in tp1-eager tp2-eager tp1-graphs tp2-graphs; do
    for f in "$RUN/$tag"/bench-*.json; do [ -f "$f" ] && cp "$f" "$OUT/$tag-$(basename "$f")"; done
  done
  python benchmarks/tp_scaling.py "$OUT"
  ls -l "$OUT"
} 2>&1 | tee "$OUT/run.log"
