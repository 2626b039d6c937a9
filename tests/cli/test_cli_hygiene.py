"""What a user sees on the command line: no stray warnings on a CPU machine without Triton, the
AOTI compiler check cached, progress shown for long work."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Runs the CLI as on a machine without Triton: `import triton` fails and find_spec finds nothing.
_NO_TRITON = """
import importlib.util, sys
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "triton" else _find(name, *a, **k)
sys.modules["triton"] = None
from dspark_trt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_cpu_machine_without_triton_prints_no_triton_warnings():
    r = subprocess.run([sys.executable, "-c", _NO_TRITON, "generate", "--model", "qwen3-tiny-dspark",
                        "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "output ids" in r.stdout                       # the ops ran (PyTorch references)
    assert "Triton not available" not in r.stderr and "Triton not available" not in r.stdout


def test_toolchain_check_is_cached_per_compiler(tmp_path, monkeypatch):
    from dspark_trt.builder.backends import aoti
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    probes = []
    monkeypatch.setattr(aoti, "_probe_toolchain", lambda cxx, device: probes.append(cxx))
    cxx = aoti.select_compiler()
    cpu = torch.device("cpu")
    assert aoti.check_toolchain(cxx, cpu) is False and probes == [cxx]        # probed, then stamped
    assert aoti.check_toolchain(cxx, cpu) is True and probes == [cxx]         # cached: no probe
    other = tmp_path / "g++-other"                                             # another compiler: probed
    other.write_text("#!/bin/sh\necho other-g++ 1.0\n")
    other.chmod(0o755)
    assert aoti.check_toolchain(str(other), cpu) is False and len(probes) == 2


def test_failed_probe_is_not_cached(tmp_path, monkeypatch):
    from dspark_trt.builder.backends import BuildError, aoti
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))

    def crash(cxx, device):
        raise BuildError("probe package does not load")
    monkeypatch.setattr(aoti, "_probe_toolchain", crash)
    cxx = aoti.select_compiler()
    for _ in range(2):                                   # the second call probes again
        with pytest.raises(BuildError, match="does not load"):
            aoti.check_toolchain(cxx, torch.device("cpu"))


def test_weight_loading_shows_progress_when_asked(tmp_path, monkeypatch, capsys):
    from dspark_trt.checkpoints.files import read_tensors, write_checkpoint
    write_checkpoint(tmp_path / "ckpt", {"model_type": "qwen3"},
                     {f"w{i}": torch.full((4,), float(i)) for i in range(5)})
    monkeypatch.setenv("DSPARK_PROGRESS", "1")
    got = read_tensors(tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert "loading ckpt" in err and "/5 " in err and "tensor" in err      # a bar over the 5 tensors
    assert sorted(got) == [f"w{i}" for i in range(5)]
    monkeypatch.setenv("DSPARK_PROGRESS", "0")
    read_tensors(tmp_path / "ckpt")
    assert "loading" not in capsys.readouterr().err


def test_a_compiler_that_cannot_run_goes_to_the_probe_not_a_traceback(tmp_path, monkeypatch):
    """No cache key for a compiler that cannot be asked its version: the probe runs (and its
    BuildError names the problem) rather than an OSError from computing the key."""
    from dspark_trt.builder.backends import BuildError, aoti
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "g++-not-executable"
    broken.write_text("not a program")

    def probe(cxx, device):
        raise BuildError(f"AOTInductor cannot compile a probe network with CXX={cxx}")
    monkeypatch.setattr(aoti, "_probe_toolchain", probe)
    with pytest.raises(BuildError, match="g\\+\\+-not-executable"):
        aoti.check_toolchain(str(broken), torch.device("cpu"))
