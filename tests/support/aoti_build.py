"""AOTI engine builds for the CPU tests, with one inductor knob that keeps the compile short."""
from __future__ import annotations

from pathlib import Path

from dspark_trt.builder.build import BuildOptions, build_engine

# Inductor stores a fused pointwise chain in a buffer of its own once the chain has more than this
# many ops (CPU default 50); below it the chain is inlined into every reader and re-generated per
# use. The counter-based RNG (plugins/rng.py: low32(x) = x - ((x >> 32) << 32), chained) reads each
# step several times, so inlining multiplies the code inductor generates: qwen3-tiny's draft_block
# compiled in 86 s at the default and in 28 s at 8 (2 CPU cores). Same ops, and in fp32 the same
# values: an fp32 intermediate stored to an fp32 buffer is exact.
TEST_INDUCTOR_CONFIG = {"realize_cpu_opcount_threshold": 8}


def build_cpu_engine(model: str, out: Path, **options) -> Path:
    """``dspark-trt build --backend aoti --device cpu --dtype fp32 --random-weights`` (no compiler
    probe: the build's last stage loads the three real packages anyway)."""
    from torch._inductor import config as inductor_config
    with inductor_config.patch(TEST_INDUCTOR_CONFIG):
        build_engine(BuildOptions(model=model, output=str(out), random_weights=True, dtype="fp32",
                                  backend="aoti", device="cpu", check_toolchain=False, **options),
                     report=lambda m: None)
    return out
