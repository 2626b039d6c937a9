"""Run a cases module under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before
Triton is imported, so the kernel cases cannot run in the test process) and return its ``RESULT
{json}`` line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def interpreter_results(module: str, *args: str, timeout: float = 600) -> dict:
    """``python -m <module> <args>`` under the Triton interpreter -> its last ``RESULT`` line, parsed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])
