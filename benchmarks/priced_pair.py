"""The shipped default pair as ``dspark-trt bench`` loads it, its scheduler deciding with a given
cost curve: the setup of the AR-fallback studies (``fallback_trace.py``, ``fallback_profile.py``,
``mode_divergence.py``; issue #25), e.g. a GPU run's prices replayed on the CPU."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import verify_concurrency as vc  # noqa: E402
from dspark_trt.commands import bench  # noqa: E402
from dspark_trt.runtime.cost_curve import CostCurve  # noqa: E402
from dspark_trt.runtime.verify_scheduler import VerifyScheduler  # noqa: E402

PROMPT_LEN = 128
# a flat verify: every window but N loses, AR never wins (a round of 0.6 ms beats AR at tau 0)
DRAFTING_PAYS = CostCurve([1, 64], [0.5, 0.5], "flat verify: drafting always pays, at window N", rows=[1, 64],
                          draft_ms=[0.1, 0.1], ar_ms=[1.0, 1.0])


def priced_pair(curve, batch: int, gen_len: int, max_batch_size: int | None = None, dtype: str | None = None,
                graph_backend: str | None = None):
    """-> LLM of the default pair for a steady load of ``batch`` requests of ``gen_len`` new tokens
    (``verify_concurrency.steady_range``) after ``PROMPT_LEN``-token held-out prompts, its
    scheduler pricing with ``curve`` (a ``CostCurve``); its graphs (speculative and AR, the prompts'
    prefill) captured, few: only buckets up to ``max_batch_size`` (default ``batch``).
    ``graph_backend``: e.g. ``cuda_graphs.EAGER_REPLAY`` on the CPU."""
    args = vc.parse_args(["--prompts", "heldout", "--gen-len", str(gen_len), "--prompt-len", str(PROMPT_LEN),
                          "--batch-sizes", str(batch), "--load", "steady"] + (["--dtype", dtype] if dtype else []))
    args.max_batch_size, args.max_seq_len = max_batch_size or batch, PROMPT_LEN + vc.steady_range(gen_len)[1]
    llm = bench.load_llm(args, **bench.step_path_kwargs(args))
    if graph_backend is not None:
        llm.graphs_skipped, llm.graph_backend, llm._steps = None, graph_backend, None
    n = llm.networks.num_spec_tokens
    llm.steps.eager.scheduler = VerifyScheduler(n, llm.max_batch_size * (n + 1), llm.device, llm.calibration,
                                                curve, cost_model=llm.cost_model)
    llm.verify_cost = curve
    for spec in (True, False):
        llm.capture_graphs(spec, prefill_lengths=[PROMPT_LEN])
    return llm


def prompts(llm, n: int):
    """[n, PROMPT_LEN] held-out prompt ids (``bench.make_prompts``, seed 0)."""
    return bench.make_prompts(llm, "heldout", n, PROMPT_LEN, 0)
