#!/usr/bin/env bash
# Multi-node launch on one GPU host: two torchrun agents ("nodes") that each see half of the GPUs
# (their own CUDA_VISIBLE_DEVICES, so both have a cuda:0), one c10d rendezvous, NCCL between them.
#   1. generate --tp-size GPUS (the built-in default pair, fp32, greedy) against one GPU, token for token
#   2. bench --tp-size GPUS (batch 1, short): the report's parallel.nodes is 2
# Writes $OUT/multinode.json (equal, first divergence, which agent printed) and the logs.
# Usage:  OUT=/path GPUS=2 bash benchmarks/multinode_gpu.sh      (GPUS: 2 or 4; the default pair
#         has 4 KV heads)   DEVICE=cpu runs the same launches on a CPU (gloo), to check the script.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the directory that receives the results}"
GPUS=${GPUS:-2}
HALF=$((GPUS / 2))
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
DEV=(${DEVICE:+--device "$DEVICE"})
GEN=(generate "${DEV[@]}" --dtype fp32 --max-batch-size 1 --max-seq-len 256 --max-new-tokens 64
     --json --prompt "def fibonacci(n):")
BENCH=(bench "${DEV[@]}" --batch-sizes 1 --prompt-len 32 --gen-len 16 --iters 3 --hf none
       --plot off --time-budget-s 120)
mkdir -p "$OUT"

two_nodes() {   # two_nodes NAME ARGS...: both agents at once, each with its half of the GPUs
  local name=$1 port id pids=() rc=0
  shift
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  id="dspark-mn-$name-$$"
  for n in 0 1; do
    CUDA_VISIBLE_DEVICES=$(seq -s, $((n * HALF)) $(((n + 1) * HALF - 1))) \
      timeout 600 python -m torch.distributed.run --nnodes 2 --node-rank $n --nproc-per-node $HALF \
      --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$port --rdzv-id "$id" --rdzv-conf join_timeout=120 \
      -m dspark_trt.cli "$@" --tp-size "$GPUS" > "$OUT/$name-node$n.out" 2> "$OUT/$name-node$n.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}

echo "== 1. generate: one GPU, then 2 nodes x $HALF"
CUDA_VISIBLE_DEVICES=0 python -m dspark_trt.cli "${GEN[@]}" > "$OUT/generate-one.out" 2> "$OUT/generate-one.err"
two_nodes generate "${GEN[@]}" || echo "generate on 2 nodes failed (see $OUT/generate-node*.err)"
echo "== 2. bench: 2 nodes x $HALF"
two_nodes bench "${BENCH[@]}" --out-dir "$OUT/bench" || echo "bench on 2 nodes failed (see $OUT/bench-node*.err)"

python - "$OUT" "$GPUS" <<'EOF'
import glob, json, os, sys
out, gpus = sys.argv[1], int(sys.argv[2])
def lines(path):
    return [json.loads(x) for x in open(path).read().splitlines() if x.startswith("{")] if os.path.exists(path) else []
one = lines(f"{out}/generate-one.out")
nodes = {n: lines(f"{out}/generate-node{n}.out") for n in (0, 1)}
printed = {n: len(v) for n, v in nodes.items()}
tp = [x for v in nodes.values() for x in v]
rep = {"tp_size": gpus, "printed_lines_per_agent": printed}
if one and len(tp) == 1:
    a, b = one[0]["output_ids"], tp[0]["output_ids"]
    rep.update(equal=a == b, tokens=len(a),
               first_divergence=next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None),
               tau_one=one[0]["stats"].get("tau"), tau_tp=tp[0]["stats"].get("tau"))
else:
    rep["error"] = "expected one JSON line from the single run and one from the 2-node run"
benches = glob.glob(f"{out}/bench/bench-*.json")
rep["bench_parallel"] = json.load(open(benches[0]))["parallel"] if benches else None
json.dump(rep, open(f"{out}/multinode.json", "w"), indent=1)
print(json.dumps(rep))
EOF
