#!/usr/bin/env bash
# A session's GPU checks, one device call each, results packed into one tarball per call (the
# device tool returns at most 8 files), packed again after every step of part N > 1:
#   part 1: the smoke's AOTI builds (Qwen3-8B dims 6 layers, V4-tiny) on CPUs 8-15, beside every GPU
#           test (4 xdist workers) and the verify modes under a steady load (#25: Qwen3-8B dims with
#           the replayed acceptance curve, fixed / scheduled / packed verify, one round of each kind
#           timed per batch; and the
#           trained default pair) on CPUs 0-7; then the smoke's engine bench and the default pair's
#           generate.
#   With EXTRA set, part 1 runs its commands in place of the verify-mode steps.
#   part N > 1: EXTRA=<file of commands> run one after the other (the change's own benchmarks;
#           e.g. benchmarks/gpu_session14_part2.txt).
#   GPU_TESTS: the test paths of part 1 (default tests/); DSPARK_SMOKE_BUILDS: its builds (gpu_smoke.py).
#   DSPARK_GIT_SHA=<sha> OUT=<dir> [EXTRA=<file>] bash benchmarks/gpu_session.sh 1|N
set -uo pipefail
cd "$(dirname "$0")/.."
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1 DSPARK_GIT_SHA=${DSPARK_GIT_SHA:?}
DEST=${OUT:?}           # what the device tool brings back: one tarball, packed again after every step,
export OUT=$(mktemp -d) # so a call cut short still returns what it measured; the steps write $OUT/results
O=$OUT
R=$O/results
mkdir -p "$R"
step() { echo "===== $1 ($(date +%T))" | tee -a "$R/session.log"; }
pack() {
  (cd "$O" && tar czf pack.tgz results && cp pack.tgz "$DEST/.results-part$PART.tgz" \
    && mv "$DEST/.results-part$PART.tgz" "$DEST/results-part$PART.tgz")
}
run_extra() {   # each non-comment line of $EXTRA, one after the other
  grep -v '^\s*#' "${EXTRA:?}" | grep . | while read -r cmd; do
    step "$cmd"
    bash -c "$cmd" 2>&1 | tail -60 | tee -a "$R/session.log"
    # a step cut by its timeout can leave pytest-xdist workers on the GPU, beside the next step's
    # timings (session 47: a batch-1 repeat at 0.78): none outlives its step
    pkill -9 -f -- "-m pytest" 2>/dev/null || true
    pack
  done
}
PART=$1
if [ "$1" = 1 ]; then
  OUT=$R taskset -c 8-15 python3 benchmarks/gpu_smoke.py --only builds > "$R/builds.out" 2>&1 &
  B=$!
  step "GPU tests"
  timeout 200 taskset -c 0-7 python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/} -n 4 --dist loadgroup \
    -p no:cacheprovider -rfE \
    > "$R/gpu-tests-$DSPARK_GIT_SHA.log" 2>&1
  grep -E "passed|failed|FAILED|ERROR" "$R/gpu-tests-$DSPARK_GIT_SHA.log" | tail -15 | tee -a "$R/session.log"
  if [ -n "${EXTRA:-}" ]; then
    run_extra
  else
  step "verify modes, steady load, Qwen3-8B dims, synthetic acceptance"
  timeout 240 taskset -c 0-7 python3 benchmarks/verify_concurrency.py --model qwen3-8b-dspark-block7 --random-weights \
    --dtype bf16 --synthetic benchmarks/results/confidence-calibration-h200-462ac15.json --gen-len 64 \
    --prompt-len 128 --iters 10 --load steady --waves 3 --min-requests 16 --round-kinds --modes fixed,scheduled,packed \
    --tag h200-qwen3-8b-synthetic --out-dir "$R" 2>&1 \
    | grep "verify-concurrency\|rror" | tee -a "$R/session.log"
  step "verify modes, steady load, default pair"
  timeout 80 taskset -c 0-7 python3 benchmarks/verify_concurrency.py --prompts heldout --gen-len 32 --prompt-len 128 \
    --iters 10 --load steady --waves 3 --min-requests 16 --round-kinds --modes fixed,scheduled,packed --tag h200-default-pair --out-dir "$R" 2>&1 \
    | grep "verify-concurrency\|rror" | tee -a "$R/session.log"
  fi
  step "waiting for the builds"
  wait $B
  grep "\[smoke\]\|-----\|parity\|equal" "$R/builds.out" | cut -c1-200 | tail -40 | tee -a "$R/session.log"
  mv "$R/gpu-smoke-$DSPARK_GIT_SHA.json" "$R/gpu-smoke-builds-$DSPARK_GIT_SHA.json" 2>/dev/null
  mv "$R/gpu-smoke-$DSPARK_GIT_SHA.log" "$R/gpu-smoke-builds-$DSPARK_GIT_SHA.log" 2>/dev/null
  step "engine bench, generate"
  OUT=$R python3 benchmarks/gpu_smoke.py --only bench,generate 2>&1 | grep "\[smoke\]\|bench\] B=" | tail -8 \
    | tee -a "$R/session.log"
else
  run_extra
fi
pack
ls -la "$DEST"
