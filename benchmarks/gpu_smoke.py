"""GPU smoke run for every change to kernels, export or the runtime: one device call, < 10 minutes.

    CXX=/usr/bin/g++ OUT=<dir> python3 benchmarks/gpu_smoke.py       (or: bash benchmarks/gpu_smoke.sh)

Steps (each a subprocess with its own time limit; the builds compile on the CPUs while the GPU
tests run, each build in its own process):
1. ``pytest -m gpu tests/``: every GPU test (plugin kernels against their references, MoE, CUDA
   graphs, L2 window);
2. AOTI builds with every dspark kernel compiled in (no reference fallback: a kernel that fails
   to build fails the step) of Qwen3-8B dimensions cut to 6 layers and of the tiny DeepSeek-V4
   pair (sparse MLA, SWA indices, MoE), each checked against the eager modules of the same seed
   (``benchmarks/build_gpu.py``: logits, drafts, verify argmax);
3. ``dspark-trt bench`` of the Qwen3 engine at batch 1 and 16 (and its confidence rounds:
   ``--verify-modes fixed,threshold``, the preset's draft has a head);
4. ``dspark-trt generate`` of the built-in default pair on the GPU (CUDA graphs, warm-up apart).
``--extra FILE`` adds benchmarks of the change at hand: one shell command a line (``#`` comments),
each run with a 240 s limit after the GPU tests, while the builds still compile on the CPUs.
Writes ``gpu-smoke-<sha>.json`` (per step: exit code, seconds, key numbers) and ``.log`` to $OUT
(default benchmarks/results/), beside the build and bench JSON files.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspark_trt import provenance  # noqa: E402

OUT = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
ENGINES = Path(os.environ.get("ENGINE_ROOT", "/tmp/dspark-engines"))
SHA = provenance.git_sha()
LOG = OUT / f"gpu-smoke-{SHA}.log"


def log(text: str) -> None:
    print(text, flush=True)
    with LOG.open("a") as f:
        f.write(text + "\n")


def start(name: str, cmd: list[str]) -> tuple[subprocess.Popen, Path, float]:
    path = OUT / f".smoke-{name}.out"
    log(f"[smoke] start {name}: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=path.open("w"), stderr=subprocess.STDOUT)
    return proc, path, time.perf_counter()


def finish(name: str, job, limit_s: float, steps: dict) -> str:
    proc, path, t0 = job
    try:
        rc = proc.wait(timeout=max(1.0, limit_s - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    text = path.read_text(errors="replace")
    path.unlink()
    log(f"----- {name} (exit {rc}, {time.perf_counter() - t0:.0f} s) -----\n{text.rstrip()}")
    steps[name] = {"exit": rc, "seconds": round(time.perf_counter() - t0, 1)}
    return text


def run(name: str, cmd: list[str], limit_s: float, steps: dict) -> str:
    return finish(name, start(name, cmd), limit_s, steps)


# builds of benchmarks/build_gpu.py (DSPARK_SMOKE_BUILDS: a comma list of its SMOKE / SMOKE_FP8 names)
BUILDS = tuple(os.environ.get("DSPARK_SMOKE_BUILDS", "qwen3-8b-6layers,v4-tiny").split(","))
BENCH_ENGINES = ("qwen3-8b-6layers", "qwen3-8b-6layers-fp8", "qwen3-8b-6layers-w8a8")     # benched where built
BUILD_LIMIT_S = 430            # from the start of the run; the builds compile beside the GPU tests


def main() -> int:
    """``--only gpu_tests,generate`` runs a subset (the default: every step)."""
    only = set(sys.argv[sys.argv.index("--only") + 1].split(",")) if "--only" in sys.argv else None
    wanted = lambda name: only is None or name in only  # noqa: E731
    OUT.mkdir(parents=True, exist_ok=True)
    LOG.write_text("")
    log(f"[smoke] git {SHA} on {provenance.gpu_name()}, CXX={os.environ.get('CXX')}, engines in {ENGINES}")
    steps: dict = {}
    py = sys.executable
    os.environ.setdefault("DSPARK_CHECK_TOOLCHAIN", "0")      # the build's load stage checks the packages
    os.environ["OUT"] = str(OUT)
    # the two builds in parallel (each ~150-210 s of compiling; one after the other they took ~400 s)
    builds = {name: start(f"build-{name}", [py, "benchmarks/build_gpu.py", name, "--keep", "--git-sha", SHA])
              for name in BUILDS} if wanted("builds") else {}
    if wanted("gpu_tests"):
        # Triton JIT compilation dominates the GPU tests: 4 workers where pytest-xdist is installed
        xdist = ["-n", "4", "--dist", "loadgroup"] if importlib.util.find_spec("xdist") else []
        tests = run("gpu_tests", [py, "-m", "pytest", "-q", "-m", "gpu", "tests/", "-p", "no:cacheprovider",
                                  *xdist], 330, steps)
        steps["gpu_tests"]["summary"] = next((ln for ln in reversed(tests.splitlines()) if " passed" in ln
                                              or " failed" in ln), None)
    if "--extra" in sys.argv:
        lines = Path(sys.argv[sys.argv.index("--extra") + 1]).read_text().splitlines()
        for i, cmd in enumerate(c for c in (ln.strip() for ln in lines) if c and not c.startswith("#")):
            run(f"extra{i}", ["bash", "-c", cmd], 240, steps)

    def finish_build(name: str) -> None:
        if name not in builds:
            return
        finish(f"build-{name}", builds.pop(name), BUILD_LIMIT_S, steps)
        f = OUT / f"build-{name}.json"
        if f.exists():
            rec = json.loads(f.read_text())
            steps[f"build-{name}"].update(wall_seconds=rec["build"]["wall_seconds"],
                                          ops=rec["build"].get("ops"), parity=rec.get("parity"))

    for name in BENCH_ENGINES:                          # the bench's engines; V4 may still compile
        finish_build(name)
        engine = ENGINES / name
        if not (engine.exists() and wanted("bench")):
            continue
        step = "bench" if name == BENCH_ENGINES[0] else f"bench-{name}"
        out_dir = OUT if step == "bench" else OUT / name       # bench names its JSON by GPU and sha only
        modes = ["--verify-modes", "fixed,threshold"] if step == "bench" else []  # its draft has a head
        bench = run(step, [py, "-m", "dspark_trt.cli", "bench", "--engine", str(engine), "--batch-sizes",
                           "1,16", "--hf", "none", "--gen-len", "64", "--time-budget-s", "120",
                           "--out-dir", str(out_dir), *modes], 120, steps)
        steps[step]["lines"] = [ln for ln in bench.splitlines() if ln.startswith("[bench] B=")]
    for name in list(builds):
        finish_build(name)
    if wanted("generate"):
        gen = run("generate", [py, "-m", "dspark_trt.cli", "generate", "--max-new-tokens", "128", "--json"], 60, steps)
        try:
            g = json.loads(gen.strip().splitlines()[-1])
            steps["generate"]["result"] = {**{k: g.get(k) for k in ("seconds", "prefill_seconds", "decode_seconds",
                                                                     "warmup_seconds", "stats", "finish_reason")},
                                           "tokens": len(g["output_ids"])}
        except (json.JSONDecodeError, IndexError, KeyError):
            pass
    ok = all(s["exit"] == 0 for s in steps.values())
    report = {"git_sha": SHA, "ok": ok, "gpu": provenance.gpu_name(), "command": " ".join(sys.argv),
              "versions": provenance.versions(), "steps": steps}
    (OUT / f"gpu-smoke-{SHA}.json").write_text(json.dumps(report, indent=1, default=str))
    log(f"[smoke] {'PASSED' if ok else 'FAILED'}: " + ", ".join(f"{k} {v['exit']}" for k, v in steps.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
