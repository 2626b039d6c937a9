#!/usr/bin/env bash
# Wheels the H200 image lacks for the OpenAI server (benchmarks/gpu_openai.sh, tests/serving): FastAPI
# 0.165 and what it imports beyond the image (its image has anyio, click, h11, httpx and an older
# typing-extensions, no openai client: benchmarks/openai_load.py then uses httpx). Downloads them
# for CPython 3.12 / x86-64 into .whl/ (ignored by git: echo /.whl/ >> .git/info/exclude) and prints
# the size that travels to the device: tracked files + .whl must stay under its 64 MiB. The
# tracked tree is ~62 MiB (the shipped default pair is 59.5 MB), so a call that carries these
# ~3.2 MB must leave benchmarks/results behind, e.g.
#   tar cf /tmp/results.tar benchmarks/results && find benchmarks/results -type f \
#       ! -name confidence-calibration-h200-462ac15.json -delete      # before the call
#   tar xf /tmp/results.tar                                            # after it
# and start its command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site || exit;
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2
typing-extensions==4.16.0"
mkdir -p .whl
for w in $WHEELS; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$w" 2>&1 | grep -v "^WARNING: Location" || true
done
tracked=$(git ls-files -z | xargs -0 du -ck | tail -1 | cut -f1)
wheels=$(du -ck .whl/*.whl | tail -1 | cut -f1)
results=$(git ls-files -z benchmarks/results | xargs -0 du -ck | tail -1 | cut -f1)
echo "tracked ${tracked} KiB (benchmarks/results ${results} KiB) + wheels ${wheels} KiB = $((tracked + wheels)) KiB of 65536"
