"""The default pair's first rounds on the CPU through the GPU's Triton kernels (Triton's
interpreter), against the same rounds through the torch references (issue #25's batch-1 lead).

Session 43's GPU traces parted from the CPU's rounds at the second round of requests 0 and 2.
This runs those requests greedily, one after another, twice in one process: with the torch
references (what the CPU runs) and with every ``dspark`` op on its Triton kernel (the attention,
the KV write, the Markov and rejection samplers, the token sampler, the finiteness check; the
CPU's ``use_triton`` answers True) and, with ``--row-kernels`` (bf16), the layers' row kernels
(``add_rmsnorm``, ``silu_mul``, ``qk_rope_cache``, the draft context's write among them), and
prints each run's drafts accepted per round. Not under test: the decode chain, CUDA graphs.

The interpreter computes ``tl.dot`` of bf16 operands wrongly (the attention kernel's output is
off by ~8e8 in bf16 and within 3e-7 in fp32 on the same inputs), so in bf16 ``--torch-attention``
keeps the attention on its reference. Session 44: in fp32 with every op, requests 0 and 2 ran the
references' rounds exactly; in bf16 with the row kernels and the torch attention their second
rounds were the references' (request 0's third parted by bf16 rounding: 0, 4, 4, 1 against 0, 4,
3, 1). Slow: minutes per request.

    python benchmarks/interpreted_pair.py [--dtype fp32] [--requests 0,2] [--rounds 4]
    python benchmarks/interpreted_pair.py --dtype bf16 --row-kernels --torch-attention
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"            # before triton is imported

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dspark_trt import provenance  # noqa: E402
from kernel_switches import add_pair_arguments, first_rounds, load_pair, set_kernels, triton_switches  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(ap, str(REPO / "benchmarks" / "results"))
    ap.add_argument("--row-kernels", action="store_true", help="the layers' row kernels too (bf16)")
    ap.add_argument("--torch-attention", action="store_true", help="the attention on its reference")
    a = ap.parse_args(argv)
    if a.row_kernels and a.dtype != "bf16":
        raise SystemExit("error: --row-kernels needs --dtype bf16 (the row kernels round as the bf16 modules)")
    requests = [int(i) for i in a.requests.split(",")]
    llm, prompts = load_pair("cpu", a.dtype, max(requests) + 1)
    modules = triton_switches(("block_attention",) if a.torch_attention else ())
    runs = {}
    for name, on in (("references", False), ("triton", True)):
        print(f"[interpreted-pair] {name} ({a.dtype})", flush=True)
        set_kernels(llm, modules, on, a.row_kernels)
        runs[name] = first_rounds(llm, prompts, requests, a.rounds)
    set_kernels(llm, modules, None, False)
    same = all(runs["references"][i] == runs["triton"][i] for i in requests)
    print(f"[interpreted-pair] the Triton kernels' rounds equal the references': {same}", flush=True)
    report = {"git_sha": provenance.git_sha(), "dtype": a.dtype, "row_kernels": a.row_kernels,
              "torch_attention": a.torch_attention, "triton_modules": [m.__name__ for m in modules],
              "command": "python benchmarks/interpreted_pair.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "runs": {k: {str(i): v for i, v in r.items()} for k, r in runs.items()}, "equal": same}
    tag = a.dtype + ("-rowk" if a.row_kernels else "") + ("-torch-attn" if a.torch_attention else "")
    path = provenance.result_path(a.out_dir, "interpreted-pair", "cpu", tag)
    path.write_text(json.dumps(report, indent=1))
    print(f"[interpreted-pair] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
