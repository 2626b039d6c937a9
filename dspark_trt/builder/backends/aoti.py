"""AOTInductor backend: one .pt2 package per network, weights kept outside the compiled code.

Packages are compiled with ``aot_inductor.package_constants_in_so = False``; the engine's single
safetensors file is given back at load with ``load_constants(..., check_full_update=True,
user_managed=True)``, so tensors shared by several networks (embeddings, lm_head) exist once on
disk and once in memory. The C++ compiler is chosen explicitly (``$CXX``, else /usr/bin/g++):
a wrapper ``g++`` on PATH has produced packages that segfault at load (platform-notes §11), so a
tiny probe package is built and loaded in a subprocess before the real networks.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ...engine.networks import load_aoti_network as load_network  # noqa: F401  (build checks packages load)
from . import BuildError

SYSTEM_CXX = "/usr/bin/g++"


def select_compiler() -> str:
    """$CXX if set, else the system g++, else whatever g++ is on PATH."""
    cxx = os.environ.get("CXX") or (SYSTEM_CXX if Path(SYSTEM_CXX).exists() else shutil.which("g++"))
    if not cxx or not (Path(cxx).exists() or shutil.which(cxx)):
        raise BuildError(f"no C++ compiler found (CXX={os.environ.get('CXX')!r}); set CXX=/path/to/g++")
    return cxx


def inductor_configs(cxx: str) -> dict:
    return {"aot_inductor.package_constants_in_so": False, "cpp.cxx": (cxx,)}


def compile_network(ep: torch.export.ExportedProgram, path: Path, cxx: str) -> Path:
    """Compile one exported network into ``path`` (.pt2)."""
    from torch._inductor import aoti_compile_and_package
    return Path(aoti_compile_and_package(ep, package_path=str(path), inductor_configs=inductor_configs(cxx)))


class _Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x):
        return x * 2 + self.w


_PROBE_RUN = """
import sys, torch
from torch._inductor import aoti_load_package
m = aoti_load_package(sys.argv[1], run_single_threaded=sys.argv[2] == "cuda")
m.load_constants({n: torch.full((4,), 0.5, device=sys.argv[2]) for n in m.get_constant_fqns()},
                 check_full_update=True)
y = m(torch.ones(3, 4, device=sys.argv[2]))
sys.exit(0 if bool((y == 2.5).all()) else 3)
"""


def _toolchain_stamp(cxx: str, device: torch.device) -> Path | None:
    """Cache file that marks (compiler binary and what it runs, torch, Triton, device) as checked;
    under ``$DSPARK_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dspark_trt`` or ``~/.cache/dspark_trt``).
    None when the compiler cannot even be asked its version (the probe then says what is wrong)."""
    exe = Path(shutil.which(cxx) or cxx).resolve()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    try:
        st = exe.stat()
        tools = [subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=30).stdout.strip()
                 for args in (["--version"], ["-print-prog-name=cc1plus"], ["-print-prog-name=ld"])]
    except (OSError, subprocess.SubprocessError):
        return None
    key = "|".join([str(exe), str(st.st_size), str(st.st_mtime_ns), *tools, torch.__version__, device.type, gpu,
                    str(triton), sys.version])
    root = Path(os.environ.get("DSPARK_CACHE_DIR") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspark_trt")
    return root / "toolchain" / hashlib.sha256(key.encode()).hexdigest()[:24]


def check_toolchain(cxx: str, device: torch.device) -> bool:
    """Build a tiny package with ``cxx`` and load + run it in a subprocess (a crash stays there).
    Returns True if the same compiler, torch, Triton and device passed before (cached; no build)."""
    stamp = _toolchain_stamp(cxx, device)
    if stamp is not None and stamp.exists():
        return True
    _probe_toolchain(cxx, device)
    if stamp is not None:
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(f"{cxx} passed the AOTI probe\n")
        except OSError:                   # a read-only home: check again next time
            pass
    return False


def _probe_toolchain(cxx: str, device: torch.device) -> None:
    with tempfile.TemporaryDirectory(prefix="dspark-aoti-probe-") as d:
        probe = _Probe().to(device)
        ep = torch.export.export(probe, (torch.ones(3, 4, device=device),))
        try:
            path = compile_network(ep, Path(d) / "probe.pt2", cxx)
        except Exception as e:
            raise BuildError(f"AOTInductor cannot compile a probe network with CXX={cxx} ({e}); "
                             "set CXX to a working g++ (e.g. CXX=/usr/bin/g++)") from e
        r = subprocess.run([sys.executable, "-c", _PROBE_RUN, str(path), device.type],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise BuildError(f"a probe package compiled with CXX={cxx} does not load and run "
                             f"(exit code {r.returncode}: {r.stderr.strip()[-300:]}); a wrapper g++ "
                             "produces crashing packages, build with CXX=/usr/bin/g++")
