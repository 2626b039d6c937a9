"""What the sparse MLA kernel's launch configs compile to for sm_90, on a CPU-only machine.

Each config of ``tune_plugins.MLA_CONFIGS`` (the default first) is launched at V4 shapes (8 tokens
of one block, 128 heads, D = dv = 512, 256 index entries; on the CPU no config splits the lists,
as none does at batch 64 on a GPU, unless it asks to) with the launcher recorded
(``tests/plugins/test_plugins_compile.py``), compiled with ``triton.compile`` for sm_90 and read
back: registers and stack per thread (``cuobjdump -res-usage`` of the cubin: stack is spilled
registers), shared memory, and whether the MMAs are Hopper's ``wgmma`` or ``mma.sync``. A screen
before device time, not a timing. Writes ``mla-resources-sm90-<sha>.json``.

    python benchmarks/mla_resources.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.tune_plugins import MLA_CONFIGS  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.plugins.kernels import sparse_mla as ksm  # noqa: E402
from tests.plugins.test_plugins_compile import compile_launch, record  # noqa: E402
from tests.support.plugins_cases import sparse_mla_inputs  # noqa: E402


def resources(cubin: bytes) -> dict:
    """{registers, stack} per thread of a cubin (``cuobjdump -res-usage``)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return {"registers": int(re.search(r"REG:(\d+)", text)[1]), "stack": int(re.search(r"STACK:(\d+)", text)[1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--only", default=None, help='configs whose JSON contains this text, e.g. group')
    a = ap.parse_args(argv)
    q, kv, idx, sink, scale, dv = sparse_mla_inputs("cpu", torch.bfloat16, T=8, H=128, D=512, dv=512, S=300, W=256)
    idx = idx[:1].expand(8, -1)                                   # one block: every token the same list
    rows = []
    for cfg in [c for c in MLA_CONFIGS if a.only is None or a.only in json.dumps(c)]:
        patch = pytest.MonkeyPatch()               # what ``record`` patches, outside a test
        try:
            launches = record(patch, ksm, ksm.sparse_mla_attention_triton, q, kv, idx, sink, scale, dv, **cfg)
        finally:
            patch.undo()
        for kernel, args, kwargs in launches:
            if "BLOCK_H" not in kwargs:                           # the split lists' reduce: no MMA
                continue
            k = compile_launch(kernel, args, kwargs)
            row = dict(config=cfg, kernel=kernel.__name__, rows_per_mma=kwargs["BLOCK_H"] * kwargs.get("GROUP", 1),
                       shared_bytes=k.metadata.shared, mma="wgmma" if "wgmma" in k.asm["ptx"] else "mma.sync",
                       **resources(k.asm["cubin"]))
            rows.append(row)
            print(f"{json.dumps(cfg):70s} {row['kernel']:28s} M={row['rows_per_mma']:3d} {row['mma']:8s} "
                  f"regs {row['registers']:3d} stack {row['stack']:3d} B smem {row['shared_bytes']}", flush=True)
    sha = provenance.git_sha()
    path = Path(a.out) / f"mla-resources-sm90-{sha}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"git_sha": sha, "target": "sm_90 (triton.compile on the CPU)",
                                "triton": triton.__version__, "command": "python benchmarks/mla_resources.py",
                                "shape": "T=8 (one block) H=128 D=dv=512 W=256", "configs": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
