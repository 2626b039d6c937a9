#!/usr/bin/env bash
# One device call (session 9): GPU tests, verify modes on the default pair, the skinny-GEMM A/B on
# LLM's eager modules at Qwen3-8B dims, and the sampling modifiers' cost through CUDA graphs.
set -uo pipefail
cd "$(dirname "$0")/.."
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1
SHA=${DSPARK_GIT_SHA:?}
O=${OUT:-benchmarks/results}
LOG=$O/gpu-session-$SHA.log
step() { echo "===== $1 ($(date +%T))" | tee -a "$LOG"; }
step "gpu tests"
timeout 240 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -rfE 2>&1 | grep -v "Warning\|warnings.warn" > "$O/gpu-tests-$SHA.log"
tail -25 "$O/gpu-tests-$SHA.log" | tee -a "$LOG"
step "verify modes, default pair"
timeout 100 python3 -m dspark_trt.cli bench --verify-modes fixed,scheduled,threshold --batch-sizes 1,4,16,64 \
  --prompts heldout --hf none --out-dir "$O/verify-modes" 2>&1 | grep "^\[bench\] B=\|target\|wrote" | tee -a "$LOG"
for e in 0 1; do
  step "Qwen3-8B dims (36 layers, random bf16), LLM eager modules + CUDA graphs, DSPARK_SKINNY_GEMM=$e"
  DSPARK_SKINNY_GEMM=$e timeout 100 python3 -m dspark_trt.cli bench --model qwen3-8b-dspark-block7 --random-weights \
    --dtype bf16 --batch-sizes 1,16 --hf none --gen-len 32 --iters 30 --time-budget-s 60 --out-dir "$O/skinny-$e" 2>&1 \
    | grep "^\[bench\]" | tee -a "$LOG"
done
for m in "" "--top-k 50" "--top-k 50 --min-p 0.05 --repetition-penalty 1.1 --presence-penalty 0.3 --frequency-penalty 0.2"; do
  step "generate, default pair, T 0.7, 256 tokens: ${m:-no modifiers}"
  timeout 60 python3 -m dspark_trt.cli generate --temperature 0.7 --max-new-tokens 256 --json $m 2>&1 | tail -1 \
    | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print({k: d.get(k) for k in ('decode_seconds','warmup_seconds','finish_reason')}, 'tokens', len(d['output_ids']), 'tau', round(d['stats']['tau'],2))" 2>&1 | tee -a "$LOG"
done
step "done"
