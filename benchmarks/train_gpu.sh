#!/usr/bin/env bash
# Train the default pair (target + DSpark draft) and the DFlash / AR baselines on one GPU, run the
# acceptance table, and pack everything into $OUT (8 files, each well under 16 MB):
#   run.log  train_summary.json  loss_curves.png  target.tar.gz  draft.tar.gz  baselines.tar.gz
#   acceptance-<tag>.json  acceptance-<tag>.md
# Usage on the H200:  bash benchmarks/train_gpu.sh          (MINUTES=6 training + ~1-2 min table)
# CPU smoke:          OUT=/tmp/o PRESET=smoke DEVICE=cpu ACCEPTANCE_ARGS="--num-prompts 4 \
#                     --max-new-tokens 16 --min-len 16 --max-len 32" bash benchmarks/train_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the directory that receives the results}"
MINUTES=${MINUTES:-6}
PRESET=${PRESET:-h200}
DEVICE=${DEVICE:-cuda}
TAG=${TAG:-$( [ "$DEVICE" = cpu ] && echo cpu || echo h200 )}
RUN=${RUN_DIR:-$(mktemp -d /tmp/dspark_train.XXXXXX)}
LOG="$OUT/run.log"
mkdir -p "$OUT" "$RUN"

pack() {
  [ -d "$RUN/target" ] && tar -czf "$OUT/target.tar.gz" -C "$RUN" target
  [ -d "$RUN/draft" ] && tar -czf "$OUT/draft.tar.gz" -C "$RUN" draft
  [ -d "$RUN/ar_draft" ] && tar -czf "$OUT/baselines.tar.gz" -C "$RUN" dflash ar_draft
  for f in train_summary.json loss_curves.png; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"; done
  for f in benchmarks/results/acceptance-"$TAG".{json,md}; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  ls -l "$OUT" | tee -a "$LOG"
}
trap pack EXIT

{
  echo "== $(date -u +%FT%TZ) git $(git rev-parse --short HEAD 2>/dev/null || echo '?') python $(python -V 2>&1)"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  python -c "import matplotlib" 2>/dev/null || echo "matplotlib missing: no loss_curves.png (redraw later: python -m dspark_trt.train.plots RUN_DIR)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null || true
} 2>&1 | tee "$LOG"

start=$(date +%s)
python -m dspark_trt.cli train --output "$RUN" --preset "$PRESET" --device "$DEVICE" \
  --minutes-budget "$MINUTES" 2>&1 | tee -a "$LOG"
echo "== training took $(( $(date +%s) - start )) s" | tee -a "$LOG"

start=$(date +%s)
# shellcheck disable=SC2086
python benchmarks/acceptance.py --run-dir "$RUN" --device "$DEVICE" --tag "$TAG" \
  ${ACCEPTANCE_ARGS:-} 2>&1 | tee -a "$LOG"
echo "== acceptance took $(( $(date +%s) - start )) s" | tee -a "$LOG"
