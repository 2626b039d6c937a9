"""fp8 projections as an engine runs them (issue #23): Qwen3-8B layers' fused projections (q/k/v,
o, gate/up, down + SwiGLU) compiled by AOTInductor with a dynamic token count, three ways:

* ``bucketed``: the host picks the launch by token count (``fp8_linear_bucketed``: nested
  ``torch.cond``, one kernel body per branch), what engines build now;
* ``one_launch``: the op alone with a symbolic count (``by_m_config``: every body in one kernel,
  chosen by M inside it), what engines built before;
* ``bf16``: the same layers in bf16 (cuBLAS), the engine's bf16 baseline;
* ``w8a8``: ``bucketed`` with the activations quantised per (token, 128-column group) to fp8 in
  the kernel and fp8 x fp8 tensor-core dots (``Fp8Linear.act_quant``; its error is measured
  against the same W8A8 layers run eagerly);

and ``concrete``: the fp8 layers called eagerly, each token count in its own CUDA graph (the op
picks the measured config for that exact count: what a static-shape compile could reach).

Each package runs under CUDA-graph capture (``run_single_threaded=True``), token counts 1..128,
median of ``--iters`` replays. Roofline: weight + activation bytes at 4.8 TB/s. Writes
``fp8-engine-linear-<gpu>-<sha>.json`` into $OUT (else benchmarks/results/).

    python benchmarks/fp8_engine_linear_bench.py [--layers 2] [--ms 1,2,4,8,16,32,64,128] [--iters 50]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.skinny_gemm_bench import graph_us  # noqa: E402
from dspark_trt import provenance  # noqa: E402
from dspark_trt.builder.backends.aoti import inductor_configs, select_compiler  # noqa: E402
from dspark_trt.config import get_preset  # noqa: E402
from dspark_trt.models.fp8_linear import Fp8Linear  # noqa: E402
from dspark_trt.plugins.fp8_linear import fp8_linear_bucketed  # noqa: E402
from dspark_trt.devices import hbm_bytes_per_s  # noqa: E402

PEAK = hbm_bytes_per_s()     # the GPU's own peak HBM rate (devices.HBM_BYTES_PER_S; without a GPU the H200's 4.8e12)
MS = (1, 2, 4, 8, 16, 32, 64, 128)


class Layer(nn.Module):
    """One decoder layer's projections: x -> q/k/v -> o(q) -> gate/up -> SwiGLU -> down."""

    def __init__(self, d: int, qd: int, kvd: int, inter: int, fp8: bool, host_choice: bool | None,
                 act_quant: bool = False):
        super().__init__()
        self.qd, self.inter, self.fp8, self.host_choice, self.act_quant = qd, inter, fp8, host_choice, act_quant
        make = (lambda n, k: Fp8Linear.from_linear(nn.Linear(k, n, bias=False, device="cuda"))) if fp8 else \
            (lambda n, k: nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
        self.qkv, self.o, self.gate_up, self.down = make(qd + 2 * kvd, d), make(d, qd), make(2 * inter, d), \
            make(d, inter)

    def proj(self, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return lin(x)
        return fp8_linear_bucketed(x, lin.weight, lin.weight_scale_inv, host_choice=self.host_choice,
                                   act_quant=self.act_quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # x [T, d] bf16
        q = self.proj(self.qkv, x)[:, :self.qd]
        h = x + self.proj(self.o, q)
        g, u = self.proj(self.gate_up, h).split(self.inter, -1)
        return h + self.proj(self.down, F.silu(g) * u)


class Stack(nn.Module):
    def __init__(self, layers: list[Layer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def weight_bytes(stack: Stack) -> int:
    return sum(p.numel() * p.element_size() for p in stack.parameters())


def aoti(stack: Stack, d: int, max_m: int, path: Path):
    from torch._inductor import aoti_compile_and_package, aoti_load_package
    from torch.export import Dim
    with torch.no_grad():
        ep = torch.export.export(stack, (torch.randn(8, d, device="cuda", dtype=torch.bfloat16),),
                                 dynamic_shapes=({0: Dim("tokens", min=1, max=max_m)},), strict=False)
    cfg = {k: v for k, v in inductor_configs(select_compiler()).items() if k != "aot_inductor.package_constants_in_so"}
    pkg = aoti_compile_and_package(ep, package_path=str(path), inductor_configs=cfg)
    return aoti_load_package(pkg, run_single_threaded=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--variants", default="bucketed,one_launch,bf16,w8a8")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    c = get_preset("qwen3-8b-fp8-dspark-block7").target
    d, qd, kvd, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    t0 = time.time()
    torch.manual_seed(0)
    variants = {"bucketed": (True, None, False), "one_launch": (True, False, False), "bf16": (False, None, False),
                "w8a8": (True, None, True)}
    variants = {n: variants[n] for n in ["bucketed"] + [v for v in args.variants.split(",") if v != "bucketed"]}
    stacks = {}
    for name, (fp8, hc, aq) in variants.items():
        torch.manual_seed(0)                                  # the same weights in every variant
        stacks[name] = Stack([Layer(d, qd, kvd, inter, fp8, hc, aq) for _ in range(args.layers)]).eval()
    nets, build_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, stack in stacks.items():
            t = time.time()
            nets[name] = aoti(stack, d, max(ms), Path(tmp) / f"{name}.pt2")
            build_s[name] = time.time() - t
            print(f"[{time.time() - t0:6.1f}s] built {name} ({build_s[name]:.0f} s)", flush=True)
    nets["concrete"] = stacks["bucketed"]
    rows = []
    for M in ms:
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            refs = {n: stacks[n](x).float() for n in ("bucketed", "w8a8") if n in stacks}
        row = {"M": M}
        for name, net in nets.items():
            fp8 = name != "bf16"
            stack = stacks["bucketed" if name == "concrete" else name]
            ref = refs.get(name, refs["bucketed"])
            nbytes = weight_bytes(stack) + args.layers * 2 * M * (2 * d + qd + 2 * kvd + 3 * inter + d)
            with torch.no_grad():
                err = float((net(x).float() - ref).abs().max() / ref.abs().max()) if fp8 else None
                us = graph_us([lambda: net(x)], args.iters)
            row[name] = {"us": us, "bytes": nbytes, "pct_of_roofline": nbytes / (us * 1e-6) / PEAK * 100,
                         "rel_err_vs_concrete": err}
        for a, b in (("bucketed", "one_launch"), ("bucketed", "bf16"), ("w8a8", "bf16"), ("w8a8", "bucketed")):
            if a in row and b in row:
                row[f"{a}_vs_{b}"] = row[b]["us"] / row[a]["us"]
        rows.append(row)
        print(f"[{time.time() - t0:6.1f}s] M={M:4d}  " + "  ".join(
            f"{n} {row[n]['us']:8.1f} us ({row[n]['pct_of_roofline']:4.1f}%)" for n in nets)
            + "".join(f"  {k} x{v:.2f}" for k, v in row.items() if k.endswith(("_bf16", "_one_launch", "_vs_bucketed"))),
            flush=True)
    sha, gpu = provenance.git_sha(), provenance.gpu_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fp8-engine-linear-{gpu.replace(' ', '-')}-{sha}.json"
    path.write_text(json.dumps({
        "git_sha": sha, "gpu": gpu, "versions": provenance.versions(), "command": " ".join(sys.argv),
        "peak_bytes_per_s": PEAK, "layers": args.layers, "shapes": {"d": d, "q": qd, "kv": kvd, "inter": inter},
        "ms": ms, "iters": args.iters, "build_s": build_s, "rows": rows, "seconds": time.time() - t0}, indent=1))
    print(f"wrote {path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
