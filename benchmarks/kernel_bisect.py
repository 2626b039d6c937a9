"""Which of the GPU's ``dspark`` kernels parts the default pair's rounds from its torch references
(issue #25's batch-1 lead)?

Session 45 (H100): the GPU's scheduled rounds equal its fixed rounds (no scheduler fault), but
request 0 accepts 0, 0, 1, 4 drafts in its first rounds on the GPU, in fp32 as in bf16, where the
CPU accepts 0, 4, 4, 1 (fp32) and 0, 4, 3, 1 (bf16); over 4 whole requests the GPU accepts ~20 %
fewer drafts. This runs requests greedily on one device, eagerly (no CUDA graphs, no decode
chain, no row kernels), with every op on its torch reference, with every op on its kernel, and
with each op alone on its kernel, and prints each run's accepted drafts and first tokens.

    python benchmarks/kernel_bisect.py [--dtype fp32] [--requests 0,2] [--rounds 4]
    TRITON_INTERPRET=1 python benchmarks/kernel_bisect.py --device cpu --only references,finite  # CPU, slow
"""
from __future__ import annotations

import os

os.environ.setdefault("DSPARK_DECODE_CHAIN", "0")   # only the dispatched ops switch
os.environ.setdefault("DSPARK_ROW_KERNELS", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dspark_trt import provenance  # noqa: E402
from kernel_switches import add_pair_arguments, first_rounds, load_pair, set_kernels, triton_switches  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(ap, str(REPO / "benchmarks" / "results"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default="", help="comma-separated run names (default: every run)")
    a = ap.parse_args(argv)
    requests = [int(i) for i in a.requests.split(",")]
    llm, prompts = load_pair(a.device, a.dtype, max(requests) + 1, cuda_graphs=False)
    modules = triton_switches()
    runs = {}
    plan = [("references", []), ("kernels", modules)] + [(m.__name__.rsplit(".", 1)[-1], [m]) for m in modules]
    plan = [p for p in plan if not a.only or p[0] in a.only.split(",")]
    for name, on in plan:
        print(f"[kernel-bisect] {name} ({a.dtype}, {a.device})", flush=True)
        set_kernels(llm, [m for m in modules if m not in on], False, False)
        set_kernels(llm, on, True, False)
        runs[name] = first_rounds(llm, prompts, requests, a.rounds, "kernel-bisect")
    set_kernels(llm, modules, None, False)
    ref = runs.get("references")
    parting = None if ref is None else [k for k, r in runs.items() if any(r[i] != ref[i] for i in requests)]
    print(f"[kernel-bisect] runs parting from the references: {parting}", flush=True)
    gpu = provenance.gpu_name() if a.device.startswith("cuda") else "cpu"
    report = {"git_sha": provenance.git_sha(), "gpu": gpu, "dtype": a.dtype, "device": a.device,
              "tf32": [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32],
              "command": "python benchmarks/kernel_bisect.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "runs": {k: {str(i): v for i, v in r.items()} for k, r in runs.items()}, "parting": parting}
    path = provenance.result_path(a.out_dir, "kernel-bisect", gpu, a.dtype)
    path.write_text(json.dumps(report, indent=1))
    print(f"[kernel-bisect] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
