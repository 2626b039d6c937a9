"""Window rounds (issue #25): an estimated window w < N runs as the fixed round of the block's
first w drafts (the draft's head and Markov sampler over w rows, the verify of w), without the
confidence head, the admission or a read-back; one round in ``CONFIDENCE_PROBE_EVERY`` runs the
confidence steps to keep the survival estimate's prior current."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_trt.models import build_models
from dspark_trt.runtime.cost_curve import CostCurve
from dspark_trt.runtime.verify_scheduler import CONFIDENCE_PROBE_EVERY, ESTIMATED_WINDOW_MIN_ROWS, VerifyScheduler
from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY, GraphedSteps
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams
from dspark_trt.runtime.steps import DeviceInputs

from tests.runtime.test_confidence import _llm, _pair, _scheduler, _spread_head_
from tests.support.models import scale_weights_

STEEP = CostCurve([1, 64], [1.0, 40.0], "test: steep, AR dear", rows=[1, 8], draft_ms=[0.1, 0.1],
                  ar_ms=[30.0, 30.0])


def _inputs(llm, params):
    gen = llm.scheduler()
    seqs = [gen.add_request(p, sp) for p, sp in params]
    gen.step()                                                     # prefill: a context
    return DeviceInputs.from_host(gen.round_inputs(seqs), "cpu")


@pytest.mark.parametrize("width", [1, 3])
def test_window_draft_is_the_blocks_first_drafts(width):
    """The window's drafts, proposal logits and confidences are the full block's first ``width``
    (same block pass; the sampler's randomness is keyed by seed and position), greedy and sampled."""
    llm = _llm(block=4)
    nets = llm.networks
    x = _inputs(llm, [([1, 2, 3], SamplingParams(max_new_tokens=8)),
                      ([5, 6], SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))])
    drafts, z = nets.draft_block(x.anchor, x.start, x.table, x.temperature, x.seed)
    dw, zw = nets.draft_block(x.anchor, x.start, x.table, x.temperature, x.seed, width=width)
    assert dw.shape == (2, width) and zw.shape == (2, width, z.shape[-1])
    assert torch.equal(dw, drafts[:, :width])
    torch.testing.assert_close(zw, z[:, :width], rtol=1e-12, atol=1e-12)
    _, _, conf = nets.draft_block_confidence(x.anchor, x.start, x.table, x.temperature, x.seed)
    _, _, conf_w = nets.draft_module(x.anchor, x.start, x.table, x.temperature, x.seed, nets.draft_cache,
                                     with_confidence=True, width=width)
    torch.testing.assert_close(conf_w, conf[:, :width], rtol=1e-12, atol=1e-12)


def test_v4_window_draft_is_the_blocks_first_drafts():
    llm = LLM.from_preset("deepseek-v4-tiny-dspark", dtype=torch.float64, device="cpu",
                          max_batch_size=2, max_seq_len=64)
    nets = llm.networks
    x = _inputs(llm, [([1, 2, 3, 4], SamplingParams(max_new_tokens=4, temperature=1.0, seed=7))])
    drafts, z = nets.draft_block(x.anchor, x.start, x.table, x.temperature, x.seed)
    dw, zw = nets.draft_block(x.anchor, x.start, x.table, x.temperature, x.seed, width=2)
    assert torch.equal(dw, drafts[:, :2])
    torch.testing.assert_close(zw, z[:, :2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("graphs", [False, True])
def test_large_scheduled_batches_run_window_rounds_losslessly(graphs):
    """From ``ESTIMATED_WINDOW_MIN_ROWS`` rows under a steep verify cost, the rounds after the
    first confidence round are window rounds of the estimate's width, one in
    ``CONFIDENCE_PROBE_EVERY`` a confidence round over that window; greedy output equals the
    target's token for token (eager steps and graph replay). Every round that decides from the
    estimate hands the steps the next round's decisions as host work (``Scheduler._next_decisions``),
    which runs once, before the round's read-back."""
    rows = ESTIMATED_WINDOW_MIN_ROWS
    llm = _llm(block=4, seed=6, batch=rows, verify_cost=STEEP, cost_model="trimmed", graphs=graphs)
    prompts = [[1 + i, 2, 3 + i] for i in range(rows)]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=40), speculative=False)
    kinds = []
    spec_round, admitted = llm.steps.spec_round, llm.steps.spec_round_admitted

    host_work = []                                     # [calls] per round handed host work

    def record(kind, fn):
        def run(r, *a, **kw):
            if r.batch_size == rows:                             # the full batch's rounds
                kinds.append(kind if kind != "fixed" or kw.get("width") is None else "window")
            if kw.get("host_work") is not None:
                work, calls = kw["host_work"], host_work.append(0) or len(host_work) - 1

                def counted():
                    host_work[calls] += 1
                    work()
                kw["host_work"] = counted
            return fn(r, *a, **kw)
        return run
    llm.steps.spec_round, llm.steps.spec_round_admitted = record("fixed", spec_round), record("confidence", admitted)
    try:
        out = llm.generate(prompts, SamplingParams(max_new_tokens=40, verify_mode="scheduled"))
    finally:
        llm.steps.spec_round, llm.steps.spec_round_admitted = spec_round, admitted
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    assert kinds[0] == "confidence" and "fixed" not in kinds, kinds
    assert len(host_work) >= len(kinds) - 1 and set(host_work) == {1}, (host_work, kinds)
    window = kinds[1:]
    assert window.count("window") >= CONFIDENCE_PROBE_EVERY, kinds
    for i in range(0, len(window) - CONFIDENCE_PROBE_EVERY + 1):          # a probe in every stretch
        assert "confidence" in window[i:i + CONFIDENCE_PROBE_EVERY], kinds
        assert window[i:i + CONFIDENCE_PROBE_EVERY].count("confidence") == 1, kinds
    assert sum(llm.steps.window_rounds.values()) == window.count("window") and max(llm.steps.window_rounds) < 4
    assert all(p < 4 for p in out[0].stats.proposed[1:-1]), out[0].stats.proposed


@pytest.mark.parametrize("graphs", [False, True])
def test_fixed_rounds_take_in_the_survival_outcome_as_host_work(graphs):
    """A fixed-N batch under a scheduler that may fall back still feeds the survival estimate; its
    rounds decide nothing, so their host work is the estimate's bookkeeping: each round's outcome
    (deferred by ``add``) is applied during the next round's device work, none between rounds;
    greedy output equals the target's."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    rows = 2
    llm = _llm(block=4, seed=6, batch=rows, verify_cost=STEEP, cost_model="trimmed", graphs=graphs)
    prompts = [[1 + i, 2, 3 + i] for i in range(rows)]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=24), speculative=False)
    applied, in_work = [], [False]
    add = SurvivalEstimate._add
    spec_round = llm.steps.spec_round

    def record_add(self, *a, **kw):
        applied.append(in_work[0])
        return add(self, *a, **kw)

    def run(r, *a, **kw):
        work = kw.get("host_work")
        if work is not None:
            def flagged():
                in_work[0] = True
                try:
                    work()
                finally:
                    in_work[0] = False
            kw["host_work"] = flagged
        return spec_round(r, *a, **kw)
    llm.steps.spec_round = run
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(SurvivalEstimate, "_add", record_add)
            out = llm.generate(prompts, SamplingParams(max_new_tokens=24))          # fixed N
    finally:
        llm.steps.spec_round = spec_round
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    assert len(applied) >= 3 and all(applied), applied


def test_window_rounds_pay_the_admission_only_in_their_probes():
    """The trimmed model prices a window below N with the admission's cost under
    ``ESTIMATED_WINDOW_MIN_ROWS`` rows (each round admits) and with 1 / ``CONFIDENCE_PROBE_EVERY``
    of it from there (window rounds; only the probes run the head); the fixed round never."""
    curve = CostCurve([1, 512], [1.0, 1.0], "test: flat", rows=[1, 64], draft_ms=[1.0, 1.0],
                      ar_ms=[5.0, 5.0], admission_ms=[0.8, 0.8])
    sched = VerifyScheduler(4, 512, "cpu", cost=curve)
    base = sched.cost.step_ms("draft", 1) + sched.round_overhead_ms + 1.0            # flat verify
    adm = sched.admission_ms(1)
    np.testing.assert_allclose(sched.option_ms(ESTIMATED_WINDOW_MIN_ROWS - 1), [base + adm] * 3 + [base])
    np.testing.assert_allclose(sched.option_ms(ESTIMATED_WINDOW_MIN_ROWS),
                               [base + adm / CONFIDENCE_PROBE_EVERY] * 3 + [base])


def test_window_options_price_the_window_draft(tmp_path):
    """From ``ESTIMATED_WINDOW_MIN_ROWS`` rows a window option's draft is the measured window
    draft of its width (``draft_window_ms``, saved and loaded; checked on load), but for its probes
    (the whole block's draft), below that and for the fixed round the full draft step; a faster
    window draft can turn the best window from N to a narrower one."""
    from dspark_trt.runtime.confidence import ConfidenceFileError
    rows = [1, ESTIMATED_WINDOW_MIN_ROWS]
    steps = dict(rows=rows, draft_ms=[4.0, 4.0], ar_ms=[50.0, 50.0], verify_ms=[[1.0] * 4, [3.0, 3.5, 4.0, 4.5]])
    windows = [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    measured = CostCurve([1, 64], [1.0, 40.0], "t", **steps, draft_window_ms=windows)
    measured.save(tmp_path)
    assert CostCurve.find(tmp_path).draft_window_ms == windows
    with pytest.raises(ConfidenceFileError, match="draft_window_ms"):
        CostCurve([1, 64], [1.0, 40.0], "bad", **steps, draft_window_ms=[[1.0, 2.0, 3.0]])
    full = VerifyScheduler(4, 64, "cpu", cost=CostCurve([1, 64], [1.0, 40.0], "t", **steps))
    priced = VerifyScheduler(4, 64, "cpu", cost=measured)
    r = ESTIMATED_WINDOW_MIN_ROWS
    # a window round saves the draft of the rows past w, its probe (1 in CONFIDENCE_PROBE_EVERY) does not
    np.testing.assert_allclose(priced.option_ms(r) - full.option_ms(r),
                               np.array([-3.0, -2.0, -1.0, 0.0]) * (1 - 1 / CONFIDENCE_PROBE_EVERY))
    np.testing.assert_allclose(priced.option_ms(r - 1), full.option_ms(r - 1))
    survival = [0.5, 0.3, 0.2, 0.15]
    assert full.best_window(r, survival) == 4 and priced.best_window(r, survival) < 4


def test_engines_draft_the_whole_block_and_keep_the_window():
    """An engine's N is compiled in: a window round's draft runs the whole block and keeps its
    first w drafts and z rows (contiguous); a width outside 1..N is refused. (The tokens equal an
    eager width-w pass: tests/builder/test_engine.py.)"""
    from dspark_trt.runtime.engine import EngineNetworks
    nets = EngineNetworks.__new__(EngineNetworks)
    nets.num_spec_tokens, nets.max_batch_size, nets.draft_cache = 4, 2, []
    drafts, z = torch.arange(8).view(2, 4), torch.randn(2, 4, 5)
    nets.nets = {"draft_block": lambda *args: (drafts, z)}
    t = torch.zeros(2, dtype=torch.int64)
    d2, z2 = nets.draft_block(t, t, t[:, None], t.float(), t, width=2)
    assert torch.equal(d2, drafts[:, :2]) and torch.equal(z2, z[:, :2]) and z2.is_contiguous()
    assert nets.draft_block(t, t, t[:, None], t.float(), t)[0] is drafts
    with pytest.raises(ValueError, match="width 5 outside 1..4"):
        nets.draft_block(t, t, t[:, None], t.float(), t, width=5)


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.gpu),
                                     pytest.param("cuda-python", marks=pytest.mark.gpu), EAGER_REPLAY])
def test_window_round_graphs_are_captured_ahead_and_lossless(backend):
    """``capture_graphs`` captures the window rounds' "draft" / "verify" graphs of every width < N
    for the buckets from ``ESTIMATED_WINDOW_MIN_ROWS`` rows (none below, none on first use); the
    scheduled batch then replays them with the target's greedy output. GPU: captured graphs; CPU:
    the eager-replay backend."""
    device = "cpu" if backend == EAGER_REPLAY else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    if backend == "cuda-python":
        pytest.importorskip("cuda.bindings", reason="needs cuda-python")
    rows, n = ESTIMATED_WINDOW_MIN_ROWS, 5
    pair = _pair(block=n, hidden=64)              # head dim 16: the Triton attention kernel's least
    target, draft = build_models(pair, torch.float32, device, seed=4)
    scale_weights_(target, 4.0)
    _spread_head_(draft)
    llm = LLM(pair, target, draft, max_batch_size=rows, max_seq_len=96, page_size=8,
              cuda_graphs=device == "cuda", graph_backend=backend, verify_cost=STEEP)
    if device == "cpu":
        llm._steps = GraphedSteps(llm.steps, rows, llm.max_pages_per_seq, EAGER_REPLAY)
    _scheduler(llm).cost_model = "trimmed"
    llm.capture_graphs(True)
    llm.capture_graphs(False)
    captured = set(llm.steps._graphs)
    window = {(k[0], k[1], k[3]) for k in captured if k[0] in ("draft", "verify") and len(k) == 4}
    assert window == {(kind, rows, w) for kind in ("draft", "verify") for w in range(1, n)}, window
    prompts = [[1 + i, 2, 3 + i] for i in range(rows)]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=24), speculative=False)
    out = llm.generate(prompts, SamplingParams(max_new_tokens=24, verify_mode="scheduled"))
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    assert llm.steps.window_rounds and max(llm.steps.window_rounds) < n, llm.steps.window_rounds
    assert set(llm.steps._graphs) == captured                     # nothing captured on first use


def test_measured_host_time_replaces_the_round_overhead_constant(tmp_path):
    """With the cost curve's ``host_ms`` (saved, loaded, checked on load) every option pays the
    measured host time plus ``SCHEDULER_ROW_MS`` per row instead of ``ROUND_OVERHEAD_MS``; a round
    overhead over-stated by the constant hides a window that pays (the H200's 32-row case at
    3599eb9: the constant 1.3 ms against ~0.5 measured), the measured one finds it."""
    from dspark_trt.runtime.confidence import ConfidenceFileError
    from dspark_trt.runtime.verify_scheduler import ROUND_OVERHEAD_MS, SCHEDULER_ROW_MS
    r = ESTIMATED_WINDOW_MIN_ROWS
    steps = dict(rows=[1, r], draft_ms=[1.0, 1.0], ar_ms=[50.0, 50.0],
                 verify_ms=[[1.0] * 4, [2.0, 3.9, 3.95, 4.0]], draft_window_ms=[[0.5] * 3, [0.5] * 3])
    measured = CostCurve([1, 64], [1.0, 40.0], "t", **steps, host_ms=[0.05, 0.1])
    measured.save(tmp_path)
    assert CostCurve.find(tmp_path).host_ms == [0.05, 0.1]
    with pytest.raises(ConfidenceFileError, match="host_ms"):
        CostCurve([1, 64], [1.0, 40.0], "bad", **steps, host_ms=[0.1, -0.1])
    const = VerifyScheduler(4, 64, "cpu", cost=CostCurve([1, 64], [1.0, 40.0], "t", **steps))
    priced = VerifyScheduler(4, 64, "cpu", cost=measured)
    assert const.overhead_ms(r) == ROUND_OVERHEAD_MS
    assert priced.overhead_ms(r) == pytest.approx(0.1 + SCHEDULER_ROW_MS * r)
    np.testing.assert_allclose(const.option_ms(r) - priced.option_ms(r),
                               [ROUND_OVERHEAD_MS - priced.overhead_ms(r)] * 4)
    survival = [0.7, 0.5, 0.4, 0.3]      # w = 1: 1.7 tokens, the fixed round 2.9
    assert const.best_window(r, survival) == 4        # 1.7 / 3.83 < 2.9 / 6.3 (w = 3: 2.6 / 5.78)
    assert priced.best_window(r, survival) == 1       # 1.7 / 2.71 > 1.05 x 2.9 / 5.18


def test_ar_round_priced_with_its_own_host_time(tmp_path):
    """``ar_host_ms`` (saved, loaded, checked on load) prices the fallback's AR round with its own
    host time: the H100's default pair at batch 1 (session 40: AR step 0.21 ms, fixed round's steps
    0.55, host 0.06 against 0.12 as the steady load ran them, tau 2.0) prefers AR by 1.2x, which
    the speculative round's host time charged to both sides hid inside the 5 % margin."""
    from dspark_trt.runtime.confidence import ConfidenceFileError
    from dspark_trt.runtime.verify_scheduler import SCHEDULER_ROW_MS
    steps = dict(rows=[1, 8], draft_ms=[0.14, 0.16], ar_ms=[0.21, 0.28], verify_ms=[[0.41] * 4, [0.42] * 4],
                 host_ms=[0.12, 0.12])
    shared = CostCurve([1, 64], [0.4, 0.5], "t", **steps)
    own = CostCurve([1, 64], [0.4, 0.5], "t", **steps, ar_host_ms=[0.06, 0.06])
    own.save(tmp_path)
    assert CostCurve.find(tmp_path).ar_host_ms == [0.06, 0.06]
    with pytest.raises(ConfidenceFileError, match="ar_host_ms"):
        CostCurve([1, 64], [0.4, 0.5], "bad", **steps, ar_host_ms=[0.06])
    with pytest.raises(ConfidenceFileError, match="needs 'host_ms'"):          # it would be ignored
        CostCurve([1, 64], [0.4, 0.5], "bad", **{**steps, "host_ms": None}, ar_host_ms=[0.06, 0.06])
    a, b = (VerifyScheduler(4, 64, "cpu", cost=c) for c in (shared, own))
    assert a.priced_ms("ar", 1) == pytest.approx(0.21 + 0.12 + SCHEDULER_ROW_MS)
    assert b.priced_ms("ar", 1) == pytest.approx(0.21 + 0.06 + SCHEDULER_ROW_MS)
    assert b.overhead_ms(1) == a.overhead_ms(1)                  # the speculative rounds' price is unchanged
    survival = [0.55, 0.25, 0.12, 0.06]                         # 1.98 tokens per fixed round
    assert not a.prefers_ar(1, survival)                        # 1 / 0.34 < 1.05 x 1.98 / 0.68
    assert b.prefers_ar(1, survival)                            # 1 / 0.28 > 1.05 x 1.98 / 0.68


def test_round_log_names_the_kind_each_round_ran():
    """``Scheduler.round_log`` (benchmarks' round wall time): a scheduled batch whose rounds admit
    every draft (the padded model) logs them as fixed rounds, the trimmed model's confidence
    rounds as confidence rounds; every decode round once, with its rows."""
    logs = {}
    for model in ("padded", "trimmed"):
        llm = _llm(block=4, seed=6, batch=2, verify_cost=STEEP, cost_model=model)
        gen = llm.scheduler()
        gen.round_log = []
        for p in ([1, 2, 3], [4, 5, 6]):
            gen.add_request(p, SamplingParams(max_new_tokens=12, verify_mode="scheduled"))
        rounds = 0
        while gen.has_work():
            rounds += bool([s for s in gen.running if s.finish_reason is None])
            gen.step()
        logs[model] = {k for k, _, _ in gen.round_log}
        assert len(gen.round_log) == rounds and all(0 < b <= 2 and ms > 0 for _, b, ms in gen.round_log)
    assert logs["padded"] == {"fixed"} and "confidence" in logs["trimmed"], logs
