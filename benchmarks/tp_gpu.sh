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
  python - "$RUN" "$OUT/tp_scaling.json" <<'EOF'
import glob, json, sys
run, out = sys.argv[1], sys.argv[2]
res, keys = {}, ("verify_step_ms", "draft_step_ms", "ar_step_ms", "target_forward_1_ms")
for tag in ("tp1-eager", "tp2-eager", "tp1-graphs", "tp2-graphs"):
    files = glob.glob(f"{run}/{tag}/bench-*.json")
    if files:
        r = json.load(open(files[0]))
        res[tag] = {"parallel": r.get("parallel"), "graphs_skipped": r.get("graphs_skipped"),
                    "batch": {b: {k: row.get(k) for k in keys} | {
                        "spec_tokens_per_s": row["speculative"]["decode_tokens_per_s"]}
                        for b, row in r["batch"].items()}}
scaling = {}
for b in res.get("tp1-eager", {}).get("batch", {}):
    one, two = res["tp1-eager"]["batch"][b], res.get("tp2-eager", {}).get("batch", {}).get(b)
    if two:
        scaling[b] = {f"{k}_tp1_over_tp2": one[k] / two[k] for k in keys if one[k] and two[k]}
json.dump({"runs": res, "eager_scaling_tp1_over_tp2": scaling}, open(out, "w"), indent=1)
print(json.dumps(scaling, indent=1))
EOF
  for tag in tp1-eager tp2-eager tp1-graphs tp2-graphs; do
    for f in "$RUN/$tag"/bench-*.json; do [ -f "$f" ] && cp "$f" "$OUT/$tag-$(basename "$f")"; done
  done
  ls -l "$OUT"
} 2>&1 | tee "$OUT/run.log"
