#!/usr/bin/env bash
# Train the default pair in resumable stages (`dspark-trt train --stage ...`, train/stages.py)
# on one GPU, within a minute budget per call, and pack what this call produced into $OUT as at
# most 8 files of <= 15 MiB (the limit of what one GPU run brings back):
#   run.log   state.tar.part-aa, -ab, ...   (a tar of the files this call wrote, split)
# Reassemble:  mkdir -p runs/h200 && cat OUT/state.tar.part-* | tar -x -C runs/h200
#
# The run directory travels between calls as an ignored, carried path (RUN_DIR=runs/h200):
#   call 1:  STAGES="target"                    MINUTES=8.5  (corpus, tokenizer, target)
#   call 2:  STAGES="distill drafts eval"       MINUTES=8.5  (+ the acceptance table)
# Finished stages are skipped, so repeating a call resumes where the last one stopped; TRAIN_ARGS
# (e.g. "--draft-steps 1500") go to `dspark-trt train` (a stage already done with other values
# is refused; the draft step count may change until the drafts stage has run). cache/
# (token streams) is never packed, nor the run-dir folders named in PACK_SKIP (e.g. "distill
# dflash ar_draft", to keep what comes back under the 64 MiB a call returns); distill/ is packed but may be left behind: a missing output
# re-runs its stage.
# CPU smoke: OUT=/tmp/o RUN_DIR=/tmp/r PRESET=smoke DEVICE=cpu CORPUS="std=/path/to/dir" \
#            ACCEPTANCE=0 bash benchmarks/train_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the directory that receives the results}"
: "${RUN_DIR:?set RUN_DIR to the run directory (carried between calls)}"
MINUTES=${MINUTES:-8.5}
STAGES=${STAGES:-all}
PRESET=${PRESET:-h200}
DEVICE=${DEVICE:-cuda}
ACCEPTANCE=${ACCEPTANCE:-1}
TAG=${TAG:-$( [ "$DEVICE" = cpu ] && echo cpu || echo h200 )}
PART_BYTES=${PART_BYTES:-15M}
MAX_PARTS=7
LOG="$OUT/run.log"
mkdir -p "$OUT" "$RUN_DIR"
MARK=$(mktemp /tmp/train_gpu_mark.XXXXXX)       # files newer than this are this call's
start=$(date +%s)

pack() {
  local list
  list=$(mktemp)
  local skip=(! -path './cache/*')
  for d in ${PACK_SKIP:-}; do skip+=(! -path "./$d/*"); done
  (cd "$RUN_DIR" && find . -type f -newer "$MARK" "${skip[@]}" | sort) > "$list"
  if [ -s "$list" ]; then
    tar -cf - -C "$RUN_DIR" -T "$list" | split -b "$PART_BYTES" - "$OUT/state.tar.part-"
  fi
  local n
  n=$(find "$OUT" -name 'state.tar.part-*' | wc -l)
  echo "== packed $(wc -l < "$list") files into $n part(s) of <= $PART_BYTES" | tee -a "$LOG"
  if [ "$n" -gt "$MAX_PARTS" ]; then
    echo "!! $n parts > $MAX_PARTS: only the first $MAX_PARTS come back; largest files:" | tee -a "$LOG"
    (cd "$RUN_DIR" && xargs -a "$list" du -b | sort -n | tail -5) | tee -a "$LOG"
  fi
  ls -l "$OUT" | tee -a "$LOG"
}
trap pack EXIT

{
  echo "== $(date -u +%FT%TZ) git $(git rev-parse --short HEAD 2>/dev/null || echo '?') python $(python -V 2>&1)"
  echo "== stages: $STAGES, preset $PRESET, device $DEVICE, budget $MINUTES min, run dir $RUN_DIR"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  python -c "import matplotlib" 2>/dev/null || echo "matplotlib missing: no loss curves (redraw later: python -m dspark_trt.train.plots RUN_DIR)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null || true
} 2>&1 | tee "$LOG"

corpus_args=()
for c in ${CORPUS:-}; do corpus_args+=(--corpus-root "$c"); done
# shellcheck disable=SC2086
python -m dspark_trt.cli train --output "$RUN_DIR" --preset "$PRESET" --device "$DEVICE" \
  --minutes "$MINUTES" --stage $STAGES "${corpus_args[@]}" ${TRAIN_ARGS:-} 2>&1 | tee -a "$LOG"
echo "== training took $(( $(date +%s) - start )) s" | tee -a "$LOG"

left=$(python -c "print(int($MINUTES * 60 - ($(date +%s) - $start)))")
if [ "$ACCEPTANCE" = 1 ] && [ -f "$RUN_DIR/eval.json" ] && [ "$left" -gt 90 ]; then
  t=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$left" python benchmarks/acceptance.py --run-dir "$RUN_DIR" --device "$DEVICE" \
    --tag "$TAG" --results-dir "$RUN_DIR/results" ${ACCEPTANCE_ARGS:-} 2>&1 | tee -a "$LOG" || \
    echo "== acceptance table stopped (time budget)" | tee -a "$LOG"
  echo "== acceptance took $(( $(date +%s) - t )) s" | tee -a "$LOG"
fi
