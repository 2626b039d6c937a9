"""Confidence head, verify modes (fixed / threshold / scheduled), STS calibration (issue 25)."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dspark_trt.checkpoints.files import CheckpointError, write_checkpoint
from dspark_trt.checkpoints.qwen3 import load_qwen3_pair, qwen3_draft_tensors, qwen3_target_tensors
from dspark_trt.cli import main
from dspark_trt.config import ConfigError
from dspark_trt.models import build_models
from dspark_trt.runtime import calibration as cal
from dspark_trt.runtime.confidence import MODE_IDS, Calibration, admitted_lengths
from dspark_trt.runtime.cost_curve import CostCurve
from dspark_trt.runtime.verify_scheduler import ESTIMATED_WINDOW_MIN_ROWS, VerifyScheduler
from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY, GraphedSteps
from dspark_trt.runtime.context_rows import ROW_BUCKETS
from dspark_trt.runtime.steps import DecodeSteps
from dspark_trt.runtime.scheduler import Scheduler
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import RequestError, SamplingParams

from tests.support.models import scale_weights_, tiny_pair

MODES = ("fixed", "threshold", "scheduled")


def _pair(block=4, rank=8, **kw):
    pair = tiny_pair(block=block, rank=rank, **kw)
    pair.draft.enable_confidence_head = True
    return pair


def _spread_head_(draft, scale: float = 3.0, bias: float = 0.5) -> None:
    """Random heads give confidences near 0.5 for every row: spread them so that admitted
    lengths vary from 0 to N."""
    with torch.no_grad():
        draft.confidence_head.proj.weight.mul_(scale)
        draft.confidence_head.proj.bias.fill_(bias)


def _llm(block=4, seed=1, batch=4, dtype=torch.float64, cost_model="padded", graphs=False,
         max_seq_len=96, **kw) -> LLM:
    """``graphs``: run the rounds through ``GraphedSteps`` with the CPU "eager-replay" backend
    (the static buffers and graph-to-graph outputs of the CUDA graph path, without capture)."""
    pair = _pair(block=block)
    target, draft = build_models(pair, dtype, "cpu", seed=seed)
    scale_weights_(target, 4.0)
    _spread_head_(draft)
    llm = LLM(pair, target, draft, max_batch_size=batch, max_seq_len=max_seq_len, page_size=8, **kw)
    if graphs:
        llm.graphs_skipped, llm.graph_backend = None, EAGER_REPLAY
    _scheduler(llm).cost_model = cost_model
    return llm


def _scheduler(llm):
    steps = llm.steps
    return (steps.steps if isinstance(steps, GraphedSteps) else steps).scheduler


# ---- the head in the draft step --------------------------------------------------------------------

def test_confidence_logits_come_from_the_draft_step_and_match_eq7():
    """c_k = sigmoid(proj([h_k ; W1[x_{k-1}]])), x_{-1} = anchor, h = post-norm hidden; the drafts and
    z of the confidence draft step equal the plain draft step's; inert rows get c = 0."""
    llm = _llm()
    nets, d = llm.networks, llm.draft
    gen = llm.scheduler()
    seqs = [gen.add_request([1, 2, 3], SamplingParams(max_new_tokens=8)),
            gen.add_request([5, 6], SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))]
    gen.step()                                                     # prefill: a context
    r = gen.round_inputs(seqs)
    r.anchor[1], r.start[1] = -1, -1                                # row 1 inert
    from dspark_trt.runtime.steps import DeviceInputs
    x = DeviceInputs.from_host(r, "cpu")
    drafts, z, conf = nets.draft_block_confidence(x.anchor, x.start, x.table, x.temperature, x.seed)
    d2, z2 = nets.draft_block(x.anchor, x.start, x.table, x.temperature, x.seed)
    assert torch.equal(drafts, d2) and torch.equal(z, z2)
    h = d.block_hidden(x.anchor, x.start, x.table, nets.draft_cache)
    prev = torch.cat([x.anchor[:1, None], drafts[:1, :-1]], 1)
    w = d.confidence_head.proj
    want = (torch.cat([h[:1], d.markov_head.markov_w1(prev)], -1) @ w.weight.T + w.bias)[..., 0]
    torch.testing.assert_close(conf[:1], want.float())
    assert torch.isinf(conf[1]).all() and (conf[1] < 0).all()


# ---- loading the published names -------------------------------------------------------------------

def _write(tmp_path, head: dict | None, side: dict | None = None):
    pair = tiny_pair(rank=4)
    target, draft = build_models(pair, torch.float32, "cpu", seed=3)
    tdir, ddir = tmp_path / "target", tmp_path / "draft"
    write_checkpoint(tdir, pair.target.to_hf(), qwen3_target_tensors(target))
    dt = qwen3_draft_tensors(draft, include_shared=False)
    dt.update(head or {})
    write_checkpoint(ddir, pair.draft.to_hf(), dt)
    if side is not None:
        save_file(side, str(ddir / "confidence_head.safetensors"))
    return pair, tdir, ddir


def test_published_qwen3_names_load_into_the_head(tmp_path):
    d = tiny_pair().target.hidden_size
    w, b = torch.randn(1, d + 4), torch.tensor([0.25])
    _, tdir, ddir = _write(tmp_path, {"confidence_head.proj.weight": w, "confidence_head.proj.bias": b})
    _, _, draft = load_qwen3_pair(tdir, ddir)
    assert torch.equal(draft.confidence_head.proj.weight, w)
    assert torch.equal(draft.confidence_head.proj.bias, b)
    assert LLM.from_checkpoints(tdir, ddir, device="cpu").networks.has_confidence


def test_qwen3_head_of_the_wrong_shape_is_refused(tmp_path):
    d = tiny_pair().target.hidden_size
    _, tdir, ddir = _write(tmp_path, {"confidence_head.proj.weight": torch.randn(1, d + 5),
                                      "confidence_head.proj.bias": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"confidence_head.proj.weight.*shape \(1, 37\)"):
        load_qwen3_pair(tdir, ddir)


@pytest.mark.parametrize("legacy", [False, True])
def test_trained_side_file_loads_under_the_published_name(tmp_path, legacy):
    """``dspark-trt train`` saves the head beside the draft (train/confidence.py); the runtime
    loader finds it there (new keys and the older ``confidence_head.{weight,bias}``)."""
    from dspark_trt.train.confidence import ConfidenceHead
    d = tiny_pair().target.hidden_size
    _, tdir, ddir = _write(tmp_path, None)
    head = ConfidenceHead(d, 4)
    torch.nn.init.normal_(head.proj.weight)
    torch.nn.init.normal_(head.proj.bias)
    head.save(ddir)
    if legacy:
        from safetensors.torch import load_file
        t = load_file(str(ddir / "confidence_head.safetensors"))
        save_file({k.replace(".proj", ""): v for k, v in t.items()}, str(ddir / "confidence_head.safetensors"))
    _, _, draft = load_qwen3_pair(tdir, ddir)
    torch.testing.assert_close(draft.confidence_head.proj.weight,
                               head.proj.weight.detach().to(torch.bfloat16).float())
    torch.testing.assert_close(draft.confidence_head.proj.bias,
                               head.proj.bias.detach().to(torch.bfloat16).float())


def test_draft_without_a_head_refuses_the_confidence_modes(tmp_path):
    _, tdir, ddir = _write(tmp_path, None)
    llm = LLM.from_checkpoints(tdir, ddir, device="cpu")
    assert llm.draft.confidence_head is None and not llm.networks.has_confidence
    with pytest.raises(RequestError, match="needs a draft with a confidence head"):
        llm.generate([[1, 2]], SamplingParams(verify_mode="scheduled"))
    assert llm.generate([[1, 2]], SamplingParams(max_new_tokens=4))[0].finish_reason == "length"


@pytest.mark.parametrize("stage", [0, 2])
def test_v4_confidence_head_loads_from_any_stage(tmp_path, stage):
    from dspark_trt.checkpoints.loaders import load_pair
    from dspark_trt.checkpoints.v4 import v4_checkpoint_tensors
    from dspark_trt.config import get_preset
    pair = get_preset("deepseek-v4-tiny-dspark")
    target, draft = build_models(pair, seed=0)
    tensors = v4_checkpoint_tensors(target, draft, quantize=False)
    dr = pair.draft.backbone.hidden_size + pair.draft.markov_rank
    w = torch.randn(1, dr)
    tensors[f"mtp.{stage}.confidence_head.proj.weight"] = w
    write_checkpoint(tmp_path, pair.draft.to_hf(), tensors)
    _, _, d2 = load_pair(tmp_path, tmp_path)
    assert d2.confidence_head.proj.bias is None
    assert torch.equal(d2.confidence_head.proj.weight, w)
    tensors[f"mtp.{stage}.confidence_head.proj.weight"] = torch.randn(1, dr + 1)
    write_checkpoint(tmp_path / "bad", pair.draft.to_hf(), tensors)
    with pytest.raises(CheckpointError, match="confidence_head.proj.weight"):
        load_pair(tmp_path / "bad", tmp_path / "bad")


def test_v4_draft_step_returns_confidence():
    """V4: the head reads the pre-norm hc_head output (h) and W1[x_{k-1}]."""
    llm = LLM.from_preset("deepseek-v4-tiny-dspark", dtype=torch.float64, device="cpu",
                          max_batch_size=2, max_seq_len=64)
    llm.draft.add_confidence_head().double()
    nets = type(llm.networks)(llm.target, llm.draft, llm.networks.num_pages, llm.networks.page_size,
                              "cpu", torch.float64)
    assert nets.has_confidence
    gen = Scheduler(nets, 2, 64, llm.pair.target.vocab_size)
    seqs = [gen.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=4))]
    gen.step()
    from dspark_trt.runtime.steps import DeviceInputs
    x = DeviceInputs.from_host(gen.round_inputs(seqs), "cpu")
    drafts, _, conf = nets.draft_block_confidence(x.anchor, x.start, x.table, x.temperature, x.seed)
    h = llm.draft.block_hidden(x.anchor, x.start, x.table, nets.draft_cache)
    prev = torch.cat([x.anchor[:, None], drafts[:, :-1]], 1)
    want = llm.draft.confidence_head(h, llm.draft.markov_head.markov_w1(prev))
    torch.testing.assert_close(conf, want)


# ---- lossless in every mode ---------------------------------------------------------------------------

CURVES = {"default": CostCurve.default(),
          "linear": CostCurve([1, 64], [1.0, 40.0], "test: verify cost grows fast")}


@pytest.mark.parametrize("block,curve,graphs", [(3, "default", False), (5, "linear", False),
                                                (7, "linear", False), (5, "linear", True)])
def test_greedy_output_equals_the_target_in_every_mode(block, curve, graphs):
    """Lossless in every mode; the scheduler with the "packed" cost model (variable admissions), and
    with the default "padded" one (the verify runs all N drafts: every draft is admitted)."""
    llm = _llm(block=block, seed=block, verify_cost=CURVES[curve], cost_model="packed", graphs=graphs)
    rng = random.Random(block)
    prompts = [[rng.randrange(63) for _ in range(rng.randint(1, 10))] for _ in range(5)]   # 5 > batch
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=24), speculative=False)
    proposed = {}
    for mode in MODES:
        sp = SamplingParams(max_new_tokens=24, verify_mode=mode, confidence_threshold=0.6)
        out = llm.generate(prompts, sp)
        for o, a in zip(out, ar):
            assert o.output_ids == a.output_ids, mode
            assert all(0 <= x <= p for x, p in zip(o.stats.accepted, o.stats.proposed))
        proposed[mode] = [p for o in out for p in o.stats.proposed]
    assert set(proposed["fixed"]) <= {block} | set(range(1, block))      # cut only at the end
    for mode in ("threshold", "scheduled"):                              # variable lengths happened
        if mode == "scheduled" and curve == "default":
            continue                                                     # flat curve: admits all
        assert len(set(proposed[mode])) >= 2 and min(proposed[mode]) < block, (mode, proposed[mode])
    _scheduler(llm).cost_model = "padded"
    out = llm.generate(prompts, SamplingParams(max_new_tokens=24, verify_mode="scheduled"))
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    assert [p for o in out for p in o.stats.proposed] == proposed["fixed"]     # padded: admits all


@pytest.mark.parametrize("graphs", [False, True])
def test_mixed_modes_in_one_batch_stay_lossless(graphs):
    llm = _llm(block=5, seed=11, verify_cost=CURVES["linear"], cost_model="packed", graphs=graphs)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=20), speculative=False)
    plist = [SamplingParams(max_new_tokens=20, verify_mode=m, confidence_threshold=0.7)
             for m in ("fixed", "threshold", "scheduled", "scheduled")]
    out = llm.generate(prompts, plist)
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    assert set(out[0].stats.proposed[:-1]) == {5}


# ---- the scheduler ----------------------------------------------------------------------------------------

def _admit(c: np.ndarray, curve: CostCurve, mode="scheduled", threshold=0.5, live=None, temps=None,
           padded=None):
    B, N = c.shape
    logits = torch.logit(torch.tensor(c, dtype=torch.float64)).float()
    live = torch.ones(B, dtype=torch.bool) if live is None else torch.tensor(live)
    modes = torch.full((B,), MODE_IDS[mode]) if isinstance(mode, str) else torch.tensor(
        [MODE_IDS[m] for m in mode])
    inv = torch.ones(N) if temps is None else 1 / torch.tensor(temps)
    return admitted_lengths(logits, live, modes, torch.full((B,), threshold), inv,
                            curve.sps_table(B * (N + 1), "cpu"), padded).tolist()


def _algorithm1(c: np.ndarray, curve: CostCurve, padded: int | None = None) -> list[int]:
    """The paper's Algorithm 1, literally (all rows scheduled); ``padded``: the verify runs every
    row at that width, so the cost of the batch is R * (1 + padded) tokens whatever is admitted."""
    R, N = c.shape
    a = np.cumprod(c, 1)
    E = sorted(((a[r, j], r, j) for r in range(R) for j in range(N) if a[r, j] > 0),
               key=lambda e: -e[0])                               # sorted() is stable
    sps = lambda b: 1 / curve.latency(b if padded is None else R * (1 + padded))  # noqa: E731
    ell, B, tau = [0] * R, R, float(R)
    best, out = R * sps(R), [0] * R
    for v, r, j in E:
        ell[r], B, tau = j + 1, B + 1, tau + v
        theta = tau * sps(B)
        if theta > best:
            best, out = theta, list(ell)
        else:
            break
    return out


def test_scheduler_equals_algorithm1_on_random_batches():
    rng = np.random.default_rng(0)
    curve = CostCurve([1, 8, 16, 64], [1.0, 1.2, 2.0, 9.0], "test")
    for _ in range(200):
        B, N = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        c = rng.uniform(0.05, 0.999, size=(B, N))
        assert _admit(c, curve) == _algorithm1(c, curve)


def test_padded_cost_model_equals_algorithm1_and_admits_every_candidate():
    """The default cost model (the verify runs N drafts per row): Algorithm 1 with a constant
    SPS, i.e. every candidate with a > 0, even one too small to change tau in float32."""
    rng = np.random.default_rng(2)
    curve = CostCurve([1, 8, 16, 64], [1.0, 1.2, 2.0, 9.0], "test")
    for _ in range(200):
        B, N = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        c = rng.uniform(0.02, 0.999, size=(B, N))
        assert _admit(c, curve, padded=N) == _algorithm1(c, curve, padded=N) == [N] * B
    c = np.array([[0.999] * 7, [1e-6, 1e-6, 1e-6, 0.5, 0.5, 0.5, 0.5]])      # a down to 1e-18
    assert _admit(c, curve, padded=7) == [7, 7]
    assert _admit(c, curve) == _algorithm1(c, curve)                        # packed: stops


def test_admission_runs_without_host_synchronisation():
    """Every op of the admission has a meta kernel and none reads a value back (``.item()``,
    a 0-dim tensor used as an index, ``.cpu()`` raise on meta tensors): capturable, no sync."""
    B, N = 6, 5
    m = dict(device="meta")
    M = B * (N + 1) + 1
    for padded, trimmed, grid in ((None, False, False), (N, False, False), (None, True, False),
                                  (None, True, True), (None, False, True)):
        out = admitted_lengths(torch.randn(B, N, **m), torch.ones(B, dtype=torch.bool, **m),
                               torch.full((B,), MODE_IDS["scheduled"], **m), torch.zeros(B, **m),
                               torch.ones(N, **m), torch.ones(M, **m), padded, trimmed=trimmed,
                               round_ms=torch.ones(M, **m) if grid else None,
                               window_sps=torch.ones(M, N, **m) if grid else None)
        assert out.shape == (B,) and out.dtype == torch.int64


def _old_eager_round(steps: DecodeSteps, r, use_top_p: bool):
    """The eager confidence round before the fix: one host sync for w = max admitted, the verify on
    the first w drafts only."""
    from dspark_trt.runtime.steps import DeviceInputs
    x = DeviceInputs.from_host(r, steps.device, confidence=True)
    drafts, z, conf = steps.draft_step_confidence(x)
    limit = steps.admit(x, conf, x.verify_mode, x.threshold)
    w = max(1, int(limit.max()))
    return steps.verify_step(x, drafts[:, :w], z[:, :w], use_top_p, limit).numpy(), limit.numpy()


@pytest.mark.parametrize("cost_model", ["packed", "padded"])
def test_full_width_verify_equals_the_admitted_width_verify(cost_model):
    """Sampling (T = 1, top-p), mixed modes, 3 rows in a bucket of 4: the round that verifies all N
    drafts with the admitted lengths on the device (eager, and the graph path's eager-replay) gives
    the old width-w round's accepted counts, next tokens and lengths, round after round."""
    llm = _llm(block=5, seed=3, verify_cost=CURVES["linear"], cost_model=cost_model)
    steps = llm.steps
    replay = GraphedSteps(steps, llm.max_batch_size, llm.max_pages_per_seq, EAGER_REPLAY)
    gen = llm.scheduler()
    modes = ("scheduled", "threshold", "scheduled")
    seqs = [gen.add_request([1 + i, 2, 3], SamplingParams(max_new_tokens=40, temperature=1.0,
                                                          top_p=0.9, seed=7 + i, verify_mode=m,
                                                          confidence_threshold=0.6))
            for i, m in enumerate(modes)]
    gen.step()                                                                  # prefill
    lengths = set()
    for _ in range(6):
        if len(gen.running) < len(seqs):
            break
        r = gen.round_inputs(gen.running)
        old, old_lim = _old_eager_round(steps, r, True)
        for impl in (steps, replay):
            out, lim, conf = impl.spec_round_admitted(r, True, want_confidence=True)
            assert (lim == old_lim).all()
            assert (out[:, :2] == old[:, :2]).all(), (out[:, :2], old[:, :2])
            assert out.shape[1] == 2 + 5 and conf.shape == (r.batch_size, 5)
        lengths |= set(old_lim.tolist())
        gen.step()
    if cost_model == "packed":
        assert len(lengths) >= 2, lengths
    assert any(s.stats.proposed for s in seqs)


def test_scheduled_rows_verify_the_whole_trimmed_window():
    """A trimmed round computes every row's w+1 target rows, so its scheduled rows verify all w
    drafts whatever they were admitted, and its threshold rows their own admitted prefix: the
    round's limits, and the same accepted / next tokens as a verify with those limits."""
    from dspark_trt.runtime.steps import DeviceInputs
    llm = _llm(block=5, seed=3, verify_cost=CURVES["linear"], cost_model="trimmed")
    steps = llm.steps
    gen = llm.scheduler()
    for i, m in enumerate(("scheduled", "threshold", "scheduled")):
        gen.add_request([1 + i, 2, 3], SamplingParams(max_new_tokens=40, verify_mode=m,
                                                      confidence_threshold=0.5))
    gen.step()                                                                  # prefill
    x = DeviceInputs.from_host(gen.round_inputs(gen.running), llm.device, confidence=True)
    drafts, z, _, _ = steps.draft_admit_step(x)
    admitted = torch.tensor([1, 2, 0])                    # as an admission could have given
    out = steps.verify_admit_step(x, drafts, z, admitted, False, width=4)
    assert out[:, -1].tolist() == [4, 2, 4]
    want = steps.verify_step(x, drafts[:, :4].contiguous(), z[:, :4].contiguous(), False,
                             torch.tensor([4, 2, 4]))
    assert torch.equal(out[:, :-1], want)


def test_admission_is_greedy_by_prefix_survival():
    """Two rows: row 0's survival products [0.9, 0.45], row 1's [0.8, 0.72]; with room for exactly
    three extra tokens the admitted are 0.9, 0.8, 0.72 -> lengths [1, 2], even though row 0's c_2 is
    not the smallest confidence."""
    c = np.array([[0.9, 0.5], [0.8, 0.9]])
    curve = CostCurve([1, 5, 6], [1.0, 1.0, 100.0], "test: 5 tokens free, the 6th costs 100x")
    assert _admit(c, curve) == [1, 2]
    assert _admit(c, CostCurve([1, 6], [1.0, 1.0], "flat")) == [2, 2]          # flat: admit all


def test_early_stop_against_the_cost_curve():
    """The paper's appendix A case: SPS(1) = 1, SPS(2) = 0.5, SPS(3) = 0.45, a_1 = 0.8, c_2 = 0.9:
    Theta = 1.0, 0.9 (stop), 1.134 -- a global search would admit 2, Algorithm 1 admits 0."""
    curve = CostCurve([1, 2, 3], [1.0, 2.0, 1 / 0.45], "appendix A")
    assert _admit(np.array([[0.8, 0.9]]), curve) == [0]
    # a cheaper second token: Theta = 1.0, 1.8 * 0.9 = 1.62, 2.52 * 0.85 -> admits both
    curve = CostCurve([1, 2, 3], [1.0, 1 / 0.9, 1 / 0.85], "cheap")
    assert _admit(np.array([[0.8, 0.9]]), curve) == [2]


def test_budget_shrinks_as_the_batch_grows():
    curve = CostCurve([1, 32, 64, 512], [1.0, 1.0, 1.6, 14.0], "flat then linear")
    rng = np.random.default_rng(1)
    row = rng.uniform(0.6, 0.95, size=7)
    means = []
    for B in (1, 4, 16, 64):
        lens = _admit(np.tile(row, (B, 1)), curve)
        means.append(sum(lens) / B)
    assert means[0] == 7 and means[-1] < 2.5, means
    assert all(b <= a for a, b in zip(means, means[1:])), means


def test_fixed_threshold_and_inert_rows():
    c = np.array([[0.9, 0.4, 0.9], [0.3, 0.9, 0.9], [0.9, 0.9, 0.9], [0.9, 0.9, 0.9]])
    lens = _admit(c, CostCurve.default(), mode=["threshold", "threshold", "fixed", "fixed"],
                  threshold=0.5, live=[True, True, True, False])
    assert lens == [1, 0, 3, 0]


def test_calibration_temperatures_change_the_schedule():
    """Flattening an overconfident head (T > 1) lowers the survival products: fewer admitted."""
    c = np.full((1, 5), 0.97)
    curve = CostCurve([1, 100], [1.2, 20.99], "test: 0.2 ms per verified token")
    assert _admit(c, curve) == [5] and _admit(c, curve, temps=[4.0] * 5) == [3]


# ---- STS ----------------------------------------------------------------------------------------------------

def _synthetic_rounds(n: int, N: int, seed: int, overconfidence: float = 3.0):
    """True conditional acceptance c_k; the head reports logit(c_k) * overconfidence + noise-free
    ranking; a round accepts while Bernoulli(c_k) draws pass."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(n):
        c = rng.uniform(0.3, 0.97, size=N)
        logits = np.log(c / (1 - c)) * overconfidence
        a = 0
        while a < N and rng.random() < c[a]:
            a += 1
        rounds.append((logits.tolist(), N, a))
    return rounds


def test_sts_reduces_ece_on_miscalibrated_data():
    N = 5
    fit = cal.arrays(_synthetic_rounds(4000, N, 0), N)
    held = cal.arrays(_synthetic_rounds(4000, N, 1), N)
    temps = cal.fit_sts(*fit)
    before, after = cal.metrics(*held, [1.0]), cal.metrics(*held, temps)
    assert before["ece"] > 0.05 and after["ece"] < 0.03, (before["ece"], after["ece"])
    assert after["ece"] < 0.5 * before["ece"]
    assert all(t > 1.5 for t in temps[:2]), temps                         # flattened, as expected
    assert after["per_position"][0]["auc"] == pytest.approx(before["per_position"][0]["auc"])
    assert 0.6 < after["auc"] <= 1


def test_ece_and_auc_definitions():
    assert cal.ece(np.array([0.8] * 10), np.array([1] * 8 + [0] * 2)) == pytest.approx(0.0)
    assert cal.ece(np.array([0.9] * 10), np.array([1] * 5 + [0] * 5)) == pytest.approx(0.4)
    assert cal.roc_auc(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0, 0, 1, 1])) == 1.0
    assert cal.roc_auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5


# ---- files and commands ----------------------------------------------------------------------------------------

def test_cost_curve_and_calibration_files(tmp_path):
    c = CostCurve([2, 8, 16], [1.0, 2.0, 4.0], "t")
    c.save(tmp_path)
    c2 = CostCurve.find(tmp_path)
    assert (c2.tokens, c2.latency_ms) == ([2, 8, 16], [1.0, 2.0, 4.0])
    assert c2.latency(1) == 1.0 and c2.latency(5) == 1.5 and c2.latency(32) == 8.0   # extrapolated
    assert CostCurve.find(tmp_path / "none").source == "default"
    Calibration([1.5, 2.0], {"ece_after": 0.01}).save(tmp_path)
    assert Calibration.find(tmp_path).inv_temperatures(3, "cpu").tolist() == pytest.approx([1 / 1.5, 0.5, 0.5])
    (tmp_path / "verify_cost.json").write_text('{"tokens": [4, 2], "latency_ms": [1, 2]}')
    with pytest.raises(ValueError, match="increasing"):
        CostCurve.find(tmp_path)
    (tmp_path / "verify_cost.json").write_text('{"tokens": [2], "latency_ms": [1], "context_tokens": [4, 64]}')
    with pytest.raises(ValueError, match="'context_tokens'.*'context_ms'"):
        CostCurve.find(tmp_path)
    CostCurve([2], [1.0], "t", context_tokens=[4, 64], context_ms=[0.5, 2.0]).save(tmp_path)
    c3 = CostCurve.find(tmp_path)
    assert c3.context(0) == 0.0 and c3.context(4) == 0.5 and c3.context(34) == pytest.approx(1.25)
    assert CostCurve([2], [1.0], "t").context(100) == 0.0                  # not measured: unpriced
    assert Calibration.find(tmp_path).survival(3) is None                      # an older file: none
    Calibration([1.5], {"survival": [0.5, 0.2, 0.1, 0.05]}).save(tmp_path)
    assert Calibration.find(tmp_path).survival(3).tolist() == [0.5, 0.2, 0.1]
    (tmp_path / "confidence_calibration.json").write_text('{"temperatures": [1.0], "survival": [0.5, 1.5]}')
    with pytest.raises(ValueError, match="'survival'"):
        Calibration.find(tmp_path)


def _head_checkpoints(tmp_path):
    pair = _pair(block=4, rank=8, vocab=64)
    target, draft = build_models(pair, torch.float32, "cpu", seed=2)
    scale_weights_(target, 4.0)
    _spread_head_(draft)
    tdir, ddir = tmp_path / "target", tmp_path / "draft"
    write_checkpoint(tdir, pair.target.to_hf(), qwen3_target_tensors(target))
    write_checkpoint(ddir, pair.draft.to_hf(), qwen3_draft_tensors(draft, include_shared=False))
    return tdir, ddir


def test_calibrate_command_writes_the_calibration_the_llm_loads(tmp_path, capsys):
    tdir, ddir = _head_checkpoints(tmp_path)
    rc = main(["calibrate", "--checkpoint", str(tdir), "--draft-checkpoint", str(ddir), "--device", "cpu",
               "--num-prompts", "8", "--max-new-tokens", "24", "--max-seq-len", "64", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["heldout_rounds"] > 0 and len(res["temperatures"]) == 4
    assert res["ece_after"] <= res["ece_before"] + 1e-9 or res["fit_rounds"] < 50
    saved = json.loads((ddir / "confidence_calibration.json").read_text())
    assert saved["temperatures"] == res["temperatures"] and "auc_before" in saved
    # the held-out prefix survival: the labels' mean per position (positions some round verified)
    labels = [p["label_mean"] for p in saved["after"]["per_position"] if p["count"]]
    assert saved["survival"] == labels and 1 <= len(labels) <= 4
    llm = LLM.from_checkpoints(tdir, ddir, device="cpu")
    assert llm.calibration.temperatures == res["temperatures"]
    assert llm.calibration.survival(4).tolist() == labels
    assert main(["calibrate", "--checkpoint", str(tdir), "--draft-checkpoint", str(ddir), "--device", "cpu",
                 "--num-prompts", "8", "--max-new-tokens", "24", "--max-seq-len", "64",
                 "--out", str(tmp_path / "again")]) == 0
    assert f"(tau {1 + sum(labels):.2f}:" in capsys.readouterr().out


def test_a_draft_vocabularys_calibration_has_its_own_file_and_neither_run_finds_the_others(tmp_path, capsys, caplog):
    """``calibrate --draft-vocab`` writes the set's own file beside the draft, the full-vocabulary
    file stays as it was, and each ``from_checkpoints`` run (with and without the set) loads its own;
    a run with a set that has no calibration of its own loads none and says why."""
    from dspark_trt.commands.draft_vocab import write_draft_vocab
    tdir, ddir = _head_checkpoints(tmp_path)
    full = {"temperatures": [1.5, 2.0]}
    (ddir / "confidence_calibration.json").write_text(json.dumps(full))
    vpath = tmp_path / "v.json"
    V = 64                                                      # _head_checkpoints' vocabulary
    write_draft_vocab(vpath, torch.arange(0, V, 2), V, {})
    rc = main(["calibrate", "--checkpoint", str(tdir), "--draft-checkpoint", str(ddir), "--device", "cpu",
               "--num-prompts", "4", "--max-new-tokens", "16", "--max-seq-len", "64", "--json",
               "--draft-vocab", str(vpath)])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    written = Path(res["path"])
    assert written.parent == ddir and written.name.startswith("confidence_calibration.vocab-32-")
    assert json.loads((ddir / "confidence_calibration.json").read_text()) == full
    with_set = LLM.from_checkpoints(tdir, ddir, device="cpu", draft_vocab=str(vpath))
    assert with_set.calibration.temperatures == res["temperatures"]
    assert LLM.from_checkpoints(tdir, ddir, device="cpu").calibration.temperatures == [1.5, 2.0]
    other = tmp_path / "w.json"
    write_draft_vocab(other, torch.arange(1, V, 2), V, {})                 # another set of 32
    with caplog.at_level("WARNING"):
        assert LLM.from_checkpoints(tdir, ddir, device="cpu", draft_vocab=str(other)).calibration is None
    assert "made without this draft vocabulary" in caplog.text
    # the cost curve likewise (its draft step is the set's): each run finds its own
    CostCurve([1, 2], [1.0, 2.0], "full").save(ddir)
    CostCurve([1, 2], [1.0, 1.5], "set").save(ddir, written.name.replace("confidence_calibration", "verify_cost"))
    assert LLM.from_checkpoints(tdir, ddir, device="cpu", draft_vocab=str(vpath)).verify_cost.latency_ms == [1.0, 1.5]
    assert LLM.from_checkpoints(tdir, ddir, device="cpu").verify_cost.latency_ms == [1.0, 2.0]
    assert LLM.from_checkpoints(tdir, ddir, device="cpu", draft_vocab=str(other)).verify_cost.to_json() == \
        CostCurve.default().to_json()


def test_step_costs_are_bounded_by_later_measurements():
    """A shared CPU's noise only stretches calls: a step cost is cut to the least measured for more
    rows (or more drafts), so the scheduler never reads a 1-row AR step dearer than a 4-row one (the
    53b30e8 curve: 20.0 against 18.5 ms); costs that already grow are kept."""
    from dspark_trt.commands.bench import least_from_above
    assert least_from_above([20.0, 18.5, 27.1, 61.6]) == [18.5, 18.5, 27.1, 61.6]
    assert least_from_above([19.6, 22.8, 17.5, 15.5, 15.5, 17.6, 16.6]) == [15.5] * 5 + [16.6, 16.6]
    assert least_from_above([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0] and least_from_above([]) == []


def test_host_times_made_monotone_without_their_clamped_zeros():
    """A host time of 0 (a round timed below its steps' events, clamped) is no measurement: it
    must not zero the smaller row counts' host times."""
    from dspark_trt.commands.bench import least_measured_from_above as f
    assert f([0.3, 0.1, 0.0]) == [0.1, 0.1, 0.1]
    assert f([0.1, 0.0, 0.2]) == [0.1, 0.2, 0.2] and f([0.0, 0.0]) == [0.0, 0.0]
    assert f([0.092, 0.187, 0.078, 0.135]) == [0.078, 0.078, 0.078, 0.135]


def test_bench_cost_curve_writes_verify_cost(tmp_path, capsys, monkeypatch):
    from dspark_trt.commands import bench as bench_cmd
    tdir, ddir = _head_checkpoints(tmp_path)
    out = tmp_path / "curve"
    samples, time_ms = [], bench_cmd.time_ms
    monkeypatch.setattr(bench_cmd, "time_ms", lambda fn, iters, cuda: samples.append(iters) or time_ms(fn, iters, cuda))
    host_times = iter([0.3, 0.2, 0.1, 0.05])    # per row count: the fixed round's, the AR round's
    monkeypatch.setattr(bench_cmd, "host_overhead_ms", lambda *a: next(host_times))
    rc = main(["bench", "--checkpoint", str(tdir), "--draft-checkpoint", str(ddir), "--device", "cpu",
               "--cost-curve", "--batch-sizes", "1,2", "--iters", "1", "--prompt-len", "8",
               "--gen-len", "8", "--cost-curve-out", str(out)])
    assert rc == 0
    # on the CPU the step latencies the scheduler compares (draft, AR, verify per width: 6 per row
    # count) take CPU_STEP_ITERS samples whatever --iters says (a median of one or two is not one)
    assert samples.count(bench_cmd.CPU_STEP_ITERS) == 2 * 6, samples
    curve = CostCurve.find(out)
    for costs in (curve.draft_ms, curve.ar_ms, *curve.verify_ms, *zip(*curve.verify_ms)):   # grow with rows, drafts
        assert all(b >= a for a, b in zip(costs, costs[1:])), costs
    assert curve.tokens == [2, 3, 4, 5, 6, 8, 10] and "bench --cost-curve" in curve.source
    assert all(b >= a for a, b in zip(curve.latency_ms, curve.latency_ms[1:]))
    n = len(curve.verify_ms[0])                                    # one latency per (rows, width)
    assert len(curve.verify_ms) == len(curve.rows) == 2 and n >= 1
    assert curve.window_ms(2, n) == curve.verify_ms[1][n - 1]
    # the draft has a head: the confidence round's device cost over the fixed round's, per rows,
    # and the window rounds' draft step per rows and width 1 .. N - 1
    assert len(curve.admission_ms) == 2 and all(v >= 0 for v in curve.admission_ms)
    assert [len(r) for r in curve.draft_window_ms] == [3, 3] and curve.draft_window(2, 2) == curve.draft_window_ms[1][1]
    # the host's share of a fixed round per rows, and of an AR round: measured
    # medians of a few dozen rounds, noisy: made non-decreasing in rows as the steps are
    assert curve.host_ms == [0.1, 0.1] and curve.ar_host_ms == [0.05, 0.05]
    # the draft's context write at 1 and 8 positions (the prompt's) per row, rows 1 and 2
    assert curve.context_tokens == [1, 2, 8, 16]
    assert all(b >= a >= 0 for a, b in zip(curve.context_ms, curve.context_ms[1:]))


def test_measured_admission_cost_prices_trimmed_windows(tmp_path):
    """``admission_ms`` per rows (saved, loaded, checked) adds to every trimmed option and to the
    trimmed admission's round cost: a window that pays against the 0.25 ms constant stops paying
    when a confidence round measurably costs 3 ms more at 4 rows, so the full (fixed) window wins
    and such a batch runs fixed rounds (no head, no admission), where at 1 row it still may not."""
    from dspark_trt.runtime.confidence import ConfidenceFileError
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    steps = dict(rows=[1, 4], draft_ms=[0.1, 0.1], ar_ms=[50.0, 50.0],
                 verify_ms=[[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    measured = CostCurve([1, 64], [1.0, 40.0], "t", **steps, admission_ms=[0.0, 3.0])
    measured.save(tmp_path)
    assert CostCurve.find(tmp_path).admission_ms == [0.0, 3.0]
    with pytest.raises(ConfidenceFileError, match="admission_ms"):
        CostCurve([1, 64], [1.0, 40.0], "bad", **steps, admission_ms=[0.1])
    with pytest.raises(ConfidenceFileError, match="admission_ms"):
        CostCurve([1, 64], [1.0, 40.0], "bad", **steps, admission_ms=[0.1, -1.0])
    constant = VerifyScheduler(4, 64, "cpu", cost=CostCurve([1, 64], [1.0, 40.0], "t", **steps))
    priced = VerifyScheduler(4, 64, "cpu", cost=measured)
    assert priced.admission_ms(4) == pytest.approx(priced.admission_overhead_ms + 3.0)
    assert priced.admission_ms(1) == pytest.approx(priced.admission_overhead_ms)
    survival = [0.5, 0.25, 0.125, 0.06]
    assert constant.best_window(4, survival) < 4 and priced.best_window(4, survival) == 4
    scheduled = np.full(4, MODE_IDS["scheduled"])
    assert priced.admits_every_draft(scheduled) and not constant.admits_every_draft(scheduled)
    assert priced.round_ms[4] - constant.round_ms[4] == pytest.approx(3.0)      # Algorithm 1's cost


def test_generate_cli_verify_mode(tmp_path, capsys):
    tdir, ddir = _head_checkpoints(tmp_path)
    rc = main(["generate", "--checkpoint", str(tdir), "--draft-checkpoint", str(ddir), "--device", "cpu",
               "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--verify-mode", "scheduled", "--json"])
    assert rc == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["rounds"] > 0 and 1 <= stats["verified_per_round"] <= 5
    rc = main(["generate", "--model", "qwen3-tiny-dspark", "--device", "cpu", "--prompt-ids", "1,2",
               "--max-new-tokens", "4", "--verify-mode", "threshold"])
    assert rc == 2 and "confidence head" in capsys.readouterr().err


def test_openai_request_extension():
    pytest.importorskip("fastapi", reason="needs the [openai] extra")
    from dspark_trt.openai_server.errors import APIError
    from dspark_trt.openai_server.protocol import parse_completion
    req = parse_completion({"model": "m", "prompt": [1, 2], "verify_mode": "threshold",
                           "confidence_threshold": 0.3}, "m")
    assert req.params.verify_mode == "threshold" and req.params.confidence_threshold == 0.3
    with pytest.raises(APIError, match="verify_mode"):
        parse_completion({"model": "m", "prompt": [1, 2], "verify_mode": "sometimes"}, "m")


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.gpu),
                                     pytest.param("cuda-python", marks=pytest.mark.gpu), EAGER_REPLAY])
@pytest.mark.parametrize("cost_model", ["packed", "padded", "trimmed"])
def test_scheduled_rounds_from_cuda_graphs_match_eager(backend, cost_model):
    """The graphed confidence path ("draft_admit" graph with the admission inside, the fixed-N
    "verify_admit" graph) gives the target's greedy output; every graph is captured by
    ``capture_graphs`` (none on first use); with the packed cost model admissions vary (0 .. N),
    with the default padded one every draft is admitted. GPU: captured graphs; CPU: the
    eager-replay backend (the static-buffer plumbing, not capturability)."""
    device = "cpu" if backend == EAGER_REPLAY else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    if backend == "cuda-python":
        pytest.importorskip("cuda.bindings", reason="needs cuda-python")
    pair = _pair(block=5, hidden=64)              # head dim 16: the Triton attention kernel's least
    target, draft = build_models(pair, torch.float32, device, seed=4)
    scale_weights_(target, 4.0)
    _spread_head_(draft)
    graphed = LLM(pair, target, draft, max_batch_size=4, max_seq_len=96, page_size=8,
                  cuda_graphs=device == "cuda", graph_backend=backend, verify_cost=CURVES["linear"])
    if device == "cpu":
        graphed._steps = GraphedSteps(graphed.steps, 4, graphed.max_pages_per_seq, EAGER_REPLAY)
    assert isinstance(graphed.steps, GraphedSteps)
    _scheduler(graphed).cost_model = cost_model
    graphed.capture_graphs(True)
    graphed.capture_graphs(False)
    captured = set(graphed.steps._graphs)
    assert {k[0] for k in captured} == {"draft", "verify", "draft_admit", "verify_admit", "ar"}
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ar = graphed.generate(prompts, SamplingParams(max_new_tokens=24), speculative=False)
    proposed = {}
    for mode in MODES:
        out = graphed.generate(prompts, SamplingParams(max_new_tokens=24, verify_mode=mode,
                                                       confidence_threshold=0.6))
        assert [o.output_ids for o in out] == [a.output_ids for a in ar], mode
        proposed[mode] = [p for o in out for p in o.stats.proposed]
    assert set(graphed.steps._graphs) == captured                 # nothing captured on first use
    if cost_model == "packed":
        assert len(set(proposed["scheduled"])) >= 2, proposed
    elif cost_model == "padded":
        assert proposed["scheduled"] == proposed["fixed"], proposed
    else:                                          # one verify_admit graph per window width
        assert {k[3] for k in captured if k[0] == "verify_admit"} == set(range(1, 6))
        assert min(graphed.steps.verify_widths) < 5, graphed.steps.verify_widths


def test_bench_reports_each_verify_mode(tmp_path):
    tdir, ddir = _head_checkpoints(tmp_path)
    rc = main(["bench", "--checkpoint", str(tdir), "--draft-checkpoint", str(ddir), "--device", "cpu",
               "--batch-sizes", "1,2", "--prompt-len", "8", "--gen-len", "8", "--iters", "1", "--hf", "none",
               "--verify-modes", "fixed,threshold,scheduled", "--out-dir", str(tmp_path / "out")])
    assert rc == 0
    report = json.loads(next((tmp_path / "out").glob("bench-*.json")).read_text())
    for B in ("1", "2"):
        row = report["batch"][B]
        for mode in ("threshold", "scheduled"):
            e2e = row[f"speculative_{mode}"]
            assert e2e["decode_tokens_per_s"] > 0 and 1 <= e2e["verified_per_round"] <= 5
            assert e2e["output_ids_row0"] == row["speculative"]["output_ids_row0"]   # greedy: lossless


# ---- the trimmed verify window (cost model "trimmed", the default) ----------------------------------

def _trimmed_reference(c: np.ndarray, curve: CostCurve, modes: list[str], threshold: float) -> list[int]:
    """Algorithm 1 over the window's widths, literally: width w costs rows x (1 + max(w, m0))
    tokens (m0: the longest non-scheduled row, at least 1) and adds sum_r a_{r,w-1} of the
    scheduled rows; admitted while tau * SPS strictly grows."""
    R, N = c.shape
    a = np.cumprod(c, 1)
    length = [N if m == "fixed" else int(np.cumprod(c[r] >= threshold).sum()) if m == "threshold"
              else 0 for r, m in enumerate(modes)]
    sched = [m == "scheduled" for m in modes]
    m0 = max([1] + [length[r] for r in range(R) if not sched[r]])
    tau = sum(1 + (a[r, :length[r]].sum() if not sched[r] else 0) for r in range(R))
    best, K = tau / curve.latency(R * (1 + m0)), 0
    for w in range(1, N + 1):
        gain = sum(a[r, w - 1] for r in range(R) if sched[r])
        theta = (tau + gain) / curve.latency(R * (1 + max(w, m0)))
        if gain <= 0 or theta <= best:
            break
        tau, best, K = tau + gain, theta, w
    return [K if sched[r] else length[r] for r in range(R)]


def test_trimmed_admission_equals_algorithm1_over_widths():
    rng = np.random.default_rng(5)
    curve = CostCurve([1, 8, 16, 64], [1.0, 1.2, 2.0, 9.0], "test")
    seen = set()
    for _ in range(200):
        B, N = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        c = rng.uniform(0.05, 0.999, size=(B, N))
        modes = [MODES[i] for i in rng.integers(0, 3, B)]
        logits = torch.logit(torch.tensor(c, dtype=torch.float64)).float()
        got = admitted_lengths(logits, torch.ones(B, dtype=torch.bool),
                               torch.tensor([MODE_IDS[m] for m in modes]), torch.full((B,), 0.5),
                               torch.ones(N), curve.sps_table(B * (N + 1), "cpu"), None,
                               trimmed=True).tolist()
        ref = _trimmed_reference(c.astype(np.float32).astype(np.float64), curve, modes, 0.5)
        assert got == ref, (c, modes, got, ref)
        seen |= {g for g, m in zip(got, modes) if m == "scheduled"}
    assert len(seen) >= 3, seen                                   # the width varies


def test_trimmed_window_falls_back_to_fixed_rounds_where_the_curve_is_flat():
    """Below ``admission_overhead_ms`` of saving (a flat curve) a scheduled round is a fixed round;
    a threshold row always needs the admission."""
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    flat = VerifyScheduler(7, 512, "cpu", cost=CostCurve([2, 512], [0.9, 1.05], "flat"))
    steep = VerifyScheduler(7, 512, "cpu", cost=CURVES["linear"])
    sched, thr = np.full(4, MODE_IDS["scheduled"]), np.array([2, 1, 0, 0])
    assert flat.admits_every_draft(sched) and not flat.admits_every_draft(thr)
    assert not steep.admits_every_draft(sched)
    assert VerifyScheduler(7, 512, "cpu").admits_every_draft(sched)      # no measured curve: fixed
    assert [steep.verify_width(m) for m in (0, 1, 3, 7)] == [1, 1, 3, 7]


@pytest.mark.parametrize("graphs", [False, True])
def test_trimmed_rounds_verify_narrower_windows_and_stay_lossless(graphs):
    """The default "trimmed" model under a steep cost curve: rounds verify windows narrower than
    N (the verify counter says so) and the greedy output is the target's, token for token; mixed
    modes too (threshold rows inside a wider window)."""
    llm = _llm(block=5, seed=11, verify_cost=CURVES["linear"], cost_model="trimmed", graphs=graphs)
    rng = random.Random(3)
    prompts = [[rng.randrange(63) for _ in range(rng.randint(1, 10))] for _ in range(6)]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=24), speculative=False)
    llm.steps.verify_widths.clear()
    for plist in (SamplingParams(max_new_tokens=24, verify_mode="scheduled"),
                  [SamplingParams(max_new_tokens=24, verify_mode=m, confidence_threshold=0.6)
                   for m in ("scheduled", "threshold") * 3]):
        out = llm.generate(prompts, plist)
        assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    widths = llm.steps.verify_widths
    assert min(widths) < 5 and len(widths) >= 2, widths


# ---- the AR fallback of all-scheduled batches -------------------------------------------------------

STEPS = dict(rows=[1, 4], draft_ms=[30.0, 30.0], ar_ms=[1.0, 1.2])      # drafting never pays


def probed_curve(draft_ms: float = 3.0) -> CostCurve:
    """Step costs under which drafting pays at 1-4 rows only if nearly every draft is accepted
    (``drafting_cannot_pay`` is False there: all 5 tokens of a round would beat AR by 1.6x, so an
    AR streak's probes could end it), while the tiny test pairs' acceptance (about 0.9, then
    under 0.05) keeps AR ahead by 1.6x: the curve of the tests of the probes themselves."""
    return CostCurve([1, 64], [1.0, 2.0], "test: drafting pays only near full acceptance", rows=[1, 4],
                     draft_ms=[draft_ms, draft_ms], ar_ms=[0.4, 0.5])
AR_PROBE_EVERY_T = 8              # scheduler.AR_PROBE_EVERY (checked in the fallback tests)


@pytest.fixture
def unbudgeted_probes(monkeypatch):
    """Probes every AR_PROBE_EVERY .. AR_PROBE_MAX AR rounds whatever they cost (no
    ``PROBE_BUDGET`` floor): the tests of the probes themselves use curves where drafting never
    pays, under which the budget would space them past the test's generation."""
    from dspark_trt.runtime import scheduler
    monkeypatch.setattr(scheduler, "PROBE_BUDGET", math.inf)


def test_prefers_ar_compares_the_expected_round_throughputs():
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    cheap = CostCurve([2, 64], [1.0, 1.0], "flat", rows=[1, 64], draft_ms=[0.5, 0.5], ar_ms=[1.0, 1.0])
    s = VerifyScheduler(4, 256, "cpu", cost=cheap, round_overhead_ms=0.0)
    # fixed round: 1.5 ms; 1 + 0.6 + 0.3 + 0.1 + 0 = 2 tokens > 1.05 x 1.5 tokens of AR
    assert s.falls_back and not s.prefers_ar(4, [0.6, 0.3, 0.1, 0.0])
    assert s.prefers_ar(4, [0.3, 0.05, 0.0, 0.0])                 # 1.35 / 1.5 ms < 1 / 1 ms
    assert not VerifyScheduler(4, 256, "cpu", cost=CURVES["linear"]).falls_back   # no step costs
    with pytest.raises(ValueError, match="rows"):
        CostCurve([2], [1.0], "bad", rows=[1, 2], draft_ms=[1.0], ar_ms=[1.0, 1.0])


def test_round_costs_average_the_observed_over_the_priced_wall():
    """An exponential average per (kind, rows), used after MIN_ROUNDS rounds (before: a prior
    kind's), each ratio clamped."""
    from dspark_trt.runtime import round_costs as rc
    c = rc.RoundCosts()
    for _ in range(rc.MIN_ROUNDS - 1):
        c.observe("spec", 4, 20.0, 10.0)
    assert c.scale("spec", 4) == 1.0 and c.rounds("spec", 4) == rc.MIN_ROUNDS - 1    # not yet
    c.observe("spec", 4, 20.0, 10.0)
    assert c.scale("spec", 4) == pytest.approx(2.0) and c.scale("spec", 8) == 1.0 and c.scale("ar", 4) == 1.0
    assert c.scale("window", 4, "spec") == pytest.approx(2.0) and c.scale("window", 8, "spec") == 1.0
    c.observe("spec", 4, 10.0, 10.0)                                  # 2 + ALPHA * (1 - 2)
    assert c.scale("spec", 4) == pytest.approx(2.0 - rc.ALPHA)
    for _ in range(50):
        c.observe("ar", 1, 1e6, 1.0)                                   # a stall: at most SCALE_RANGE[1]
        c.observe("ar", 1, float("nan"), 1.0)                          # ignored
    assert c.scale("ar", 1) == pytest.approx(rc.SCALE_RANGE[1]) and c.rounds("ar", 1) == 50


def test_prefers_ar_weighs_the_rounds_as_they_ran():
    """The curve says drafting pays (2 tokens in 1.5 ms against 1 in 1 ms); rounds that ran at 1.3x
    their price for "fixed" and 0.75x for "ar" say AR does: the fallback follows the observed walls,
    and not without ``learn_costs``."""
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    cheap = CostCurve([2, 64], [1.0, 1.0], "flat", rows=[1, 64], draft_ms=[0.5, 0.5], ar_ms=[1.0, 1.0])
    learn, fixed = (VerifyScheduler(4, 256, "cpu", cost=cheap, round_overhead_ms=0.0, learn_costs=flag)
                    for flag in (True, False))
    survival = [0.6, 0.3, 0.1, 0.0]
    assert learn.priced_ms("spec", 4) == pytest.approx(1.5) and learn.priced_ms("ar", 4) == pytest.approx(1.0)
    assert learn.option_kind(4, 4) == "fixed" and learn.option_kind(4, 2) == "confidence"
    assert learn.option_kind(8, 2) == "window"                       # ESTIMATED_WINDOW_MIN_ROWS
    assert learn.priced_ms("fixed", 4) == pytest.approx(1.5) and learn.priced_ms("ar", 4) == pytest.approx(1.0)
    assert learn.priced_ms("confidence", 4, 2) == pytest.approx(1.5 + learn.admission_ms(4))
    for _ in range(3):
        learn.round_costs.observe("fixed", 4, 1.3 * 1.5, learn.priced_ms("fixed", 4))
        learn.round_costs.observe("ar", 4, 0.75, learn.priced_ms("ar", 4))
    assert learn.prefers_ar(4, survival) and not fixed.prefers_ar(4, survival)
    assert fixed.round_costs is None and not learn.prefers_ar(1, survival)         # other row counts: the curve
    # narrower windows (confidence rounds below 8 rows) take the fixed rounds' scale until seen
    assert learn.round_costs.scale("confidence", 4, "fixed") == pytest.approx(1.3)


def test_best_window_weighs_the_rounds_as_they_ran():
    """A steep curve makes a narrow window (a confidence round below 8 rows) the best option; once
    such rounds ran at 3x their price, the fixed round is: the window is chosen on the same scaled
    prices the AR fallback compares."""
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    steep = CostCurve([1, 64], [1.0, 40.0], "steep", rows=[1, 4], draft_ms=[0.1, 0.1], ar_ms=[10.0, 10.0])
    s = VerifyScheduler(4, 64, "cpu", cost=steep, learn_costs=True)
    survival = [0.5, 0.1, 0.01, 0.001]
    w = s.best_window(4, survival)
    assert w < 4 and s.option_kind(4, w) == "confidence"
    for _ in range(3):
        s.round_costs.observe("confidence", 4, 3.0 * s.priced_ms("confidence", 4, w), s.priced_ms("confidence", 4, w))
    assert s.best_window(4, survival) == 4


def test_scheduler_observes_the_fallback_rounds_it_weighs(unbudgeted_probes):
    """Each AR fallback round and each speculative round gives the scheduler's round costs one
    observation at its row count (priced by ``priced_ms``), except a probe after an AR streak (it
    writes the streak's deferred context too); plain AR decoding none."""
    curve = CostCurve([1, 64], [1.0, 40.0], "test: steep, with step costs", **STEPS)
    llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="trimmed", learn_round_costs=True)
    costs = _scheduler(llm).round_costs
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    llm.generate(prompts, SamplingParams(max_new_tokens=12), speculative=False)
    assert not costs._ratio
    gen, kinds, probes = llm.scheduler(), [], 0
    for mode in ("scheduled", "fixed"):
        gen.round_log = []
        gen.run([(p, SamplingParams(max_new_tokens=30, verify_mode=mode)) for p in prompts])
        run = [k for k, _, _ in gen.round_log]
        kinds += run
        probes += sum(k in ("fixed", "window") and prev == "ar" for prev, k in zip(run, run[1:]))
    observed = lambda kind: sum(costs.rounds(kind, rows) for rows in (1, 2, 3))  # noqa: E731
    assert probes >= 1 and observed("ar") == kinds.count("ar") > 0
    spec = ("fixed", "window", "confidence")
    assert sum(map(observed, spec)) == sum(map(kinds.count, spec)) - probes > 0


# the H200 situation of issue #25 (verify-concurrency-h200-qwen3-8b-synthetic-a8f3096.json.gz): Qwen3-8B
# dims, N = 7, a verify curve flat at low load, the shipped pair's prefix-survival curve
H200_SURVIVAL = [0.64, 0.39, 0.25, 0.16, 0.11, 0.08, 0.06]
H200_CURVE = CostCurve(
    [2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512],
    [8.17, 8.25, 8.36, 8.44, 8.47, 8.51, 8.79, 9.14, 9.39, 10.72, 12.07, 14.97, 22.58], "h200 8b",
    rows=[1, 2, 4, 8, 16, 32, 64], draft_ms=[1.56, 1.79, 1.98, 1.93, 2.21, 2.73, 4.01],
    ar_ms=[7.37, 7.77, 8.76, 8.45, 9.65, 10.21, 11.24])


def _survival_logits(B: int, survival=H200_SURVIVAL) -> torch.Tensor:
    """[B, N] confidence logits whose prefix products are ``survival`` (calibrated: T = 1)."""
    s = np.asarray(survival)
    cond = s / np.concatenate([[1.0], s[:-1]])
    return torch.logit(torch.tensor(cond, dtype=torch.float64)).float()[None].expand(B, -1).clone()


def test_flat_h200_curve_admits_near_full_windows_and_never_falls_back_at_batch_1():
    """Issue #25: at batch 1 on the flat H200 curve Algorithm 1 (whole-round cost: draft + overhead
    + verify) admits a near-full window, and the expected tokens per ms of that window beat AR, so
    no AR fallback -- neither from the true curve nor from the estimate of a few unlucky rounds
    (first draft rejected twice: the prior keeps it from reading as zero survival)."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    s = VerifyScheduler(7, 64 * 8, "cpu", cost=H200_CURVE)
    sched = torch.full((1,), MODE_IDS["scheduled"])
    got = int(s.admit(_survival_logits(1), torch.ones(1, dtype=torch.bool), sched, torch.zeros(1))[0])
    assert got >= 6, got
    best_w, _ = max(s.spec_options(1, H200_SURVIVAL), key=lambda o: o[1])
    assert best_w >= 6 and not s.prefers_ar(1, H200_SURVIVAL)
    est = SurvivalEstimate(7)
    est.add([0], [2])
    est.add([0], [3])
    assert not s.prefers_ar(1, est.curve()), est.curve()
    cond = np.asarray(H200_SURVIVAL) / np.concatenate([[1.0], H200_SURVIVAL[:-1]])
    est = SurvivalEstimate(7)                  # the head's confidences as the prior: near the truth
    for _ in range(3):
        est.add([0], [1], cond[None])
    assert not s.prefers_ar(1, est.curve()), est.curve()
    np.testing.assert_allclose(est.prior(), cond)
    for B in (2, 4, 8):                                   # expected: spec beats AR at low load
        assert not s.prefers_ar(B, H200_SURVIVAL)


def test_ar_fallback_where_ar_is_cheaper_than_every_window():
    """A steep verify curve at batch 64 (every verified draft costs like an AR step): the best
    window's expected tokens per ms lose to AR, so the scheduler falls back; the admission trims."""
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    steep = CostCurve([64, 128, 512], [11.0, 22.0, 88.0], "steep", rows=[1, 64],
                      draft_ms=[1.5, 4.0], ar_ms=[7.4, 11.2])
    s = VerifyScheduler(7, 64 * 8, "cpu", cost=steep)
    assert s.prefers_ar(64, H200_SURVIVAL)
    assert not s.prefers_ar(64, [0.99] * 7)               # near-certain acceptance: drafting pays
    B = 64
    got = s.admit(_survival_logits(B), torch.ones(B, dtype=torch.bool),
                  torch.full((B,), MODE_IDS["scheduled"]), torch.zeros(B))
    assert int(got.max()) <= 2, got


def test_survival_estimate_is_kaplan_meier_over_the_verified_windows():
    from dspark_trt.runtime.survival import SurvivalEstimate
    est = SurvivalEstimate(3, window=2, refresh=1)
    est.PRIOR_WEIGHT = 0.0
    est.add([1, 3, 0], [1, 3, 2])      # row 0: window 1 all accepted (censored after 0)
    # pos 0: at risk 3, survived 2; pos 1: at risk 1 (row 1; row 0 not verified), survived 1
    # pos 2: at risk 1, survived 1
    np.testing.assert_allclose(est.curve(), [2 / 3, 2 / 3, 2 / 3])
    est.add([0], [3])
    est.add([0], [3])                  # the window drops the first round
    np.testing.assert_allclose(est.curve()[0], 0.0)


def test_survival_estimate_refreshes_a_full_window_every_few_rounds():
    """Until the window is full the curve follows every round; then it is estimated again every
    ``refresh`` rounds (``version`` moves with it: each move a new curve array, what the decision
    tables key on) and holds in between, whatever those rounds add."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    est = SurvivalEstimate(2, window=2, refresh=3)
    est.PRIOR_WEIGHT = 0.0
    est.add([2], [2])
    first = est.curve().copy()
    est.add([2], [2])                              # the window fills: still estimated each round
    np.testing.assert_allclose(est.curve(), [1.0, 1.0])
    v = est.version
    est.add([0], [2])
    est.add([0], [2])                              # two rounds of nothing accepted: held
    np.testing.assert_allclose(est.curve(), [1.0, 1.0])
    assert est.version == v
    est.add([0], [2])                              # the third: estimated again from the window
    np.testing.assert_allclose(est.curve(), [0.0, 0.0])
    assert est.version == v + 1 and first[0] == 1.0


def test_round_decisions_are_priced_once_and_read_per_row_count(monkeypatch):
    """A round's decisions (``prefers_ar``, ``best_window``) come from one table per survival curve
    over every row count (``row_choices``), so the next round reads them whatever its row count:
    the options' prices are computed once per row count for the cost curve, a new curve computes
    only its expected tokens, and each decision equals the per-row-count computation (a scheduler
    whose table covers one row, ``max_rows`` 1) on curves where AR, narrow and full windows win."""
    cost = CostCurve([1, 8, 64], [1.0, 1.2, 40.0], "test: steep", rows=[1, 4, 16], draft_ms=[0.1, 0.3, 0.5],
                     ar_ms=[0.9, 1.0, 2.6])
    sched = VerifyScheduler(4, 16 * 5, "cpu", cost=cost)
    assert sched.max_rows == 16
    tokens, priced = [], []
    option_tokens, option_ms = sched._option_tokens, sched.option_ms
    monkeypatch.setattr(sched, "_option_tokens", lambda s: tokens.append(1) or option_tokens(s))
    monkeypatch.setattr(sched, "option_ms", lambda rows: priced.append(rows) or option_ms(rows))
    curve = np.array([0.9, 0.8, 0.6, 0.3])
    first = [sched.best_window(2, curve), sched.prefers_ar(2, curve), sched.best_window(3, curve),
             sched.prefers_ar(3, curve, -0.05)]
    assert [sched.best_window(2, curve), sched.prefers_ar(2, curve), sched.best_window(3, curve),
            sched.prefers_ar(3, curve, -0.05)] == first
    assert len(tokens) == 1 and priced == list(range(1, 17))
    sched.best_window(2, curve.copy())
    assert len(tokens) == 2 and priced == list(range(1, 17))
    per_row = VerifyScheduler(4, 5, "cpu", cost=cost)
    assert per_row.max_rows == 1 and per_row.row_choices(curve, 2) is None
    seen_ar, seen_windows = set(), set()
    for c in (curve, np.array([0.99, 0.98, 0.97, 0.96]), np.array([0.3, 0.05, 0.01, 0.0]),
              np.array([0.95, 0.9, 0.2, 0.1]), np.array([0.6, 0.4, 0.2, 0.1])):
        for rows in range(2, 17):
            ar, w = sched.prefers_ar(rows, c), sched.best_window(rows, c)
            assert (ar, w) == (per_row.prefers_ar(rows, c), per_row.best_window(rows, c)), (c, rows)
            for margin in (-0.05, 0.0, 0.2):
                assert sched.prefers_ar(rows, c, margin) == per_row.prefers_ar(rows, c, margin), (c, rows, margin)
            seen_ar.add(ar)
            seen_windows.add(w)
    assert seen_ar == {True, False} and len(seen_windows) >= 2


def test_survival_estimate_prepared_during_a_round_lags_it_by_one():
    """``prepare`` (host work while a round runs on the device) estimates from the rounds before
    that round; its ``add`` keeps the estimate (and ``version``), the next ``prepare`` takes it in;
    an ``add`` with no ``prepare`` before it drops the estimate as before."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    est = SurvivalEstimate(2, window=4, refresh=1)
    est.PRIOR_WEIGHT = 0.0
    est.add([2], [2])
    est.prepare()
    np.testing.assert_allclose(est.curve(), [1.0, 1.0])
    v = est.version
    est.add([0], [2])                  # the round that ran while prepare did: kept
    np.testing.assert_allclose(est.curve(), [1.0, 1.0])
    assert est.version == v
    est.prepare()                      # now with it: position 0 at risk 2, survived 1
    np.testing.assert_allclose(est.curve(), [0.5, 0.5])
    assert est.version == v + 1
    est.add([0], [2])                  # held once more
    np.testing.assert_allclose(est.curve(), [0.5, 0.5])
    est.add([0], [2])                  # no prepare before it: the estimate follows (1 of 4)
    np.testing.assert_allclose(est.curve(), [0.25, 0.25])
    assert est.version == v + 2
    held = SurvivalEstimate(2, window=2, refresh=8)
    held.PRIOR_WEIGHT = 0.0
    held.add([0], [2])
    held.add([0], [2])                 # the window is full: held for 8 rounds, and prepared
    held.prepare()
    held.add([2], [2], now=True)       # a probe: taken in at once all the same
    np.testing.assert_allclose(held.curve(), [0.5, 0.5])


def test_a_deferred_add_reads_as_an_immediate_one():
    """``add(defer=True)`` (the scheduler's, so that the next round's host work takes the outcome
    in) is invisible to every read: random runs of adds (with and without the head's confidences,
    probes with ``now``), ``prepare``, curve / version / length / last-confidence reads give the
    same values, bit for bit, as with every add applied at once; the deferred add runs at
    ``prepare``, at a read that needs it, or at the next add, never twice."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    rng = np.random.default_rng(3)
    for run in range(40):
        window, refresh = int(rng.integers(2, 6)), int(rng.integers(1, 5))
        now_est, deferred = SurvivalEstimate(4, window, refresh=refresh), SurvivalEstimate(4, window, refresh=refresh)
        applied = []
        add_now = deferred._add
        deferred._add = lambda *a, **k: applied.append(1) or add_now(*a, **k)
        adds = 0
        for step in range(60):
            op = rng.integers(0, 7)
            if op <= 2:                                    # a round's outcome
                rows = int(rng.integers(1, 4))
                ver = rng.integers(0, 5, rows)
                acc = np.minimum(rng.integers(0, 5, rows), ver)
                conf = rng.uniform(0.05, 1.0, (rows, 4)) if op == 2 else None
                probe = bool(rng.integers(0, 6) == 0)
                now_est.add(acc, ver, conf, now=probe)
                deferred.add(acc, ver, conf, now=probe, defer=True)
                adds += 1
            elif op == 3:
                now_est.prepare()
                deferred.prepare()
            elif op == 4:
                np.testing.assert_array_equal(deferred.curve(), now_est.curve())
            elif op == 5:
                assert deferred.version == now_est.version and len(deferred) == len(now_est), (run, step)
                assert deferred.informed == now_est.informed
            else:
                a, b = deferred.last_confidence, now_est.last_confidence
                assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), (run, step)
            assert len(applied) in (adds - 1, adds)       # at most one round waits
        np.testing.assert_array_equal(deferred.prior(), now_est.prior())
        assert len(applied) == adds                        # prior() took the last one in
    est = SurvivalEstimate(2, window=4)
    est.add([1], [2], [[0.9, 0.5]], defer=True)
    conf = est.last_confidence
    est.prepare()
    assert est.last_confidence is conf                     # one array: cached decisions key on it


def test_survival_estimate_starts_from_the_measured_curve():
    """A measured (held-out) survival curve is the estimate before any round (``informed``); verified
    rounds then weigh against it as the prior; a confidence round's head products replace it as the
    prior; a curve shorter than N carries its last conditional acceptance."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    blind, est = SurvivalEstimate(3), SurvivalEstimate(3, measured=np.array([0.4, 0.2]))
    assert not blind.informed and est.informed and not len(est)
    np.testing.assert_allclose(est.curve(), [0.4, 0.2, 0.1])
    np.testing.assert_allclose(blind.curve(), [0.5, 0.25, 0.125])
    est.add([3, 3], [3, 3])                       # 2 rows accept all: (2 + 4 x 0.4) / (2 + 4) at pos 0
    assert est.curve()[0] == pytest.approx(3.6 / 6)
    est.add([0], [3], confidence=np.array([[0.9, 0.9, 0.9]]))
    np.testing.assert_allclose(est.prior(), [0.9, 0.9, 0.9])


def test_ar_round_with_context_writes_the_drafts_context_like_a_verify_that_accepts_nothing():
    """The fallback's AR round writes the draft KV at the anchor's position P exactly as a
    speculative round whose verifier accepted no draft does (from the target's taps of the anchor)."""
    llm = _llm(block=4, seed=2)
    nets, steps = llm.networks, llm.steps
    gen = llm.scheduler()
    for p in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        gen.add_request(p, SamplingParams(max_new_tokens=10))
    gen.step()
    r = gen.round_inputs(gen.running)
    caches = [nets.target_cache, nets.draft_cache]
    snap = [{k: [t.clone() for t in v] for k, v in c.items()} for c in caches]

    def restore():
        for c, s in zip(caches, snap):
            for k in c:
                for t, t0 in zip(c[k], s[k]):
                    t.copy_(t0)

    def at_anchor(cache):                              # [rows, layers, Hkv, D] K at position P
        ps = nets.page_size
        return torch.stack([torch.stack([k[r.table[i, P // ps], P % ps] for k in cache["k"]])
                            for i, P in enumerate(r.start.tolist())])

    ar = steps.ar_round(r, True, context=True)
    written = at_anchor(nets.draft_cache)
    restore()
    verify = nets.verify
    nets.verify = lambda logits, *a: (torch.zeros(logits.shape[0], dtype=torch.int64),
                                      logits[:, 0].argmax(-1))          # accept nothing
    try:
        out = steps.spec_round(r, True)
    finally:
        nets.verify = verify
    assert (out[:, 0] == 0).all() and (out[:, 1] == ar[:, 0]).all()
    assert written.abs().sum() > 0
    torch.testing.assert_close(written, at_anchor(nets.draft_cache))
    restore()


@pytest.mark.parametrize("graphs", [False, True])
def test_ar_round_stores_its_taps_at_the_rows_it_is_given(graphs):
    """The fallback's AR round stores each row's taps (those ``ar_step(taps_out=True)`` returns) in
    the steps' ``tap_store`` at its ``tap_row``, inside the step (the graph path: the bucket's
    static inputs); inert rows (-1, and the bucket's padding) go to the spare last row, no other
    row is touched; the next tokens equal a plain AR round's."""
    from dspark_trt.runtime.steps import DeviceInputs
    llm = _llm(block=4, seed=2, graphs=graphs)
    steps = llm.steps
    gen = llm.scheduler()
    for p in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        gen.add_request(p, SamplingParams(max_new_tokens=10))
    gen.step()
    r = gen.round_inputs(gen.running)
    plain, taps = steps.eager.ar_step(DeviceInputs.from_host(r, "cpu"), False, taps_out=True)  # [B, m*d]
    store = steps.eager.tap_store
    assert store is None or store.shape[0] == steps.eager.tap_rows + 1
    r.tap_row = np.array([5, -1, 2])
    steps.ar_round_keep_taps(r, False)                 # allocates the store (the graph: at capture)
    store = steps.eager.tap_store
    assert store.shape == (steps.eager.tap_rows + 1, taps.shape[-1]) and steps.eager.tap_rows >= 4 * 64
    with torch.inference_mode():                       # the steps write it in inference mode
        store.fill_(7.0)
    out = steps.ar_round_keep_taps(r, False)
    assert store is steps.eager.tap_store
    np.testing.assert_array_equal(out, plain.numpy())
    torch.testing.assert_close(store[5], taps[0])
    torch.testing.assert_close(store[2], taps[2])
    if not graphs:                                     # the graph's bucket pads with inert rows too
        torch.testing.assert_close(store[-1], taps[1])
    others = torch.ones(store.shape[0], dtype=torch.bool)
    others[[2, 5, -1]] = False
    assert (store[others] == 7.0).all()


@pytest.mark.parametrize("graphs", [False, True])
def test_scheduled_batches_fall_back_to_ar_rounds_losslessly(graphs, unbudgeted_probes):
    """With step costs where drafting never pays, an all-scheduled batch runs AR rounds (0 drafts
    verified, the draft's context kept) with a scheduled probe every AR_PROBE_EVERY rounds; greedy
    output equals the target's; a batch with a fixed row never falls back."""
    from dspark_trt.runtime.scheduler import AR_PROBE_EVERY
    curve = probed_curve()
    llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="trimmed", graphs=graphs)
    if graphs:
        llm.capture_graphs(True)
        assert any(k[0] == "ar_taps" for k in llm.steps._graphs)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=30), speculative=False)
    out = llm.generate(prompts, SamplingParams(max_new_tokens=30, verify_mode="scheduled"))
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    proposed = out[0].stats.proposed
    assert proposed.count(0) >= AR_PROBE_EVERY and sum(p > 0 for p in proposed) >= 2, proposed
    mixed = llm.generate(prompts, [SamplingParams(max_new_tokens=30, verify_mode=m)
                                   for m in ("fixed", "scheduled", "scheduled")])
    assert [o.output_ids for o in mixed] == [a.output_ids for a in ar]
    assert 0 not in mixed[0].stats.proposed


def _cuda_llm(**kw) -> LLM:
    """``_llm``'s pair on the GPU in fp32 (head dim 16: the Triton attention kernel's least), its
    rounds from captured CUDA graphs (cuda-python)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    pytest.importorskip("cuda.bindings", reason="needs cuda-python")
    pair = _pair(block=4, hidden=64)
    target, draft = build_models(pair, torch.float32, "cuda", seed=6)
    scale_weights_(target, 4.0)
    _spread_head_(draft)
    llm = LLM(pair, target, draft, max_batch_size=4, max_seq_len=96, page_size=8, cuda_graphs=True,
              graph_backend="cuda-python", **kw)
    _scheduler(llm).cost_model = "trimmed"
    return llm


@pytest.mark.parametrize("graphs", [False, True, pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fallback_context_written_late_equals_written_each_round(graphs, unbudgeted_probes):
    """The fallback's AR rounds keep their taps and the next scheduled round writes them in one
    draft_context call: the same drafts, acceptance and output as writing them in every AR round
    (fp64), and the draft cache holds the same context; a finished sequence leaves nothing pending.
    "cuda": captured graphs (the taps stored inside the "ar_taps" graph), fp32: the same output,
    the cache within fp32 rounding of a wider matmul."""
    curve = probed_curve()
    if graphs == "cuda":
        llm = _cuda_llm(verify_cost=curve)
        llm.capture_graphs(True)
        assert any(k[0] == "ar_taps" for k in llm.steps._graphs)
    else:
        llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="trimmed", graphs=graphs)
    reqs = [([1, 2, 3], SamplingParams(max_new_tokens=40, verify_mode="scheduled")),
            ([4, 5], SamplingParams(max_new_tokens=25, verify_mode="scheduled"))]
    runs = {}
    for defer in (True, False):
        gen = llm.scheduler()
        gen.defer_context = defer
        seqs = [gen.add_request(p, sp) for p, sp in reqs]
        while seqs[0].stats.proposed.count(0) < 2 * AR_PROBE_EVERY_T and gen.has_work():   # stop inside an AR streak
            gen.step()
        assert seqs[0].stats.proposed.count(0) >= 2 * AR_PROBE_EVERY_T, seqs[0].stats.proposed
        assert gen.deferred.empty != defer                 # an AR streak's rows wait (deferring)
        gen._write_deferred(gen.running)
        assert gen.deferred.empty
        ps = llm.networks.page_size                 # the draft K of every committed position
        cache = [torch.stack([k[s.table_row[p // ps], p % ps] for p in range(s.position)])
                 for s in gen.running for k in llm.networks.draft_cache["k"]]
        while gen.has_work():
            gen.step()
        runs[defer] = ([(s.output_ids, s.stats.proposed, s.stats.accepted) for s in seqs], cache, gen)
    if graphs == "cuda":                           # fp32: the output; the cache to its rounding
        assert [o for o, _, _ in runs[True][0]] == [o for o, _, _ in runs[False][0]]
    else:
        assert runs[True][0] == runs[False][0]
    tol = 1e-4 if graphs == "cuda" else 1e-12
    for a, b in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    late = runs[True][2].deferred
    ar_rounds = sum(p == 0 for _, proposed, _ in runs[True][0] for p in proposed)
    assert late.flushes >= 2 and 0 < late.flushed_rows <= ar_rounds
    assert not late.positions and late.empty and runs[False][2].deferred.flushes == 0
    writer = late.writer                 # graphs: every write replayed a row bucket's graph
    assert (writer.graph_writes, writer.eager_writes) == ((late.flushes, 0) if graphs else (0, late.flushes))


@pytest.mark.gpu
def test_fallback_context_written_late_on_the_default_pair_on_gpu(unbudgeted_probes):
    """The trained default pair in bf16 on the GPU (decode chain, row kernels, CUDA graphs, as
    ``dspark-trt generate`` runs it): an AR streak whose draft context ``ContextRows``' graphs write
    late, a request admitted inside it (its prompt deferred too), leaves the draft cache of every
    committed position as AR rounds that write it each round do (bf16 GEMMs of other shapes: within
    3 % of the values' scale; a wrong row is off by its whole scale). Session 43: on an H100 the
    scheduler's speculative rounds after AR streaks accepted ~0.5 drafts where fixed rounds accepted
    1.29, which no CPU replay of the same prices showed."""
    from dspark_trt.config.source import default_pair_dirs
    if not torch.cuda.is_available() or default_pair_dirs() is None:
        pytest.skip("needs a CUDA GPU and the shipped default pair")
    llm = LLM.from_checkpoints(*default_pair_dirs(), device="cuda", dtype=torch.bfloat16, max_batch_size=4,
                               max_seq_len=256, cuda_graphs=True, verify_cost=probed_curve())
    _scheduler(llm).cost_model = "trimmed"
    llm.capture_graphs(True, prefill_lengths=[16])
    rng = np.random.default_rng(0)
    first = (rng.integers(10, 8000, 16).tolist(), SamplingParams(max_new_tokens=80, verify_mode="scheduled"))
    later = (rng.integers(10, 8000, 16).tolist(), SamplingParams(max_new_tokens=60, verify_mode="scheduled"))
    runs = {}
    for defer in (True, False):
        gen = llm.scheduler()
        gen.defer_context = defer
        seqs = [gen.add_request(*first)]
        while seqs[0].stats.proposed.count(0) < 3 and gen.has_work():          # inside an AR streak
            gen.step()
        seqs.append(gen.add_request(*later))
        while seqs[1].stats.proposed.count(0) < 3 and gen.has_work():
            gen.step()
        assert seqs[1].stats.proposed.count(0) >= 3, seqs[1].stats.proposed
        assert gen.deferred.empty != defer
        gen._write_deferred(gen.running)
        ps = llm.networks.page_size
        runs[defer] = [torch.stack([c[s.table_row[p // ps], p % ps] for p in range(s.position)]).float()
                       for s in gen.running for kind in ("k", "v") for c in llm.networks.draft_cache[kind]]
        for s in list(gen.running):
            gen.abort(s.request_id)
        gen.step()
    for late, each in zip(runs[True], runs[False]):
        assert late.shape == each.shape
        err = float((late - each).abs().max() / each.abs().max())
        assert err <= 0.03, err


DRAFTING_PAYS = CostCurve([1, 64], [0.5, 0.5], "test: a flat verify, drafting always pays", rows=[1, 64],
                          draft_ms=[0.1, 0.1], ar_ms=[1.0, 1.0])     # a round of 0.6 ms beats AR at tau 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_scheduled_rounds_of_the_default_pair_equal_its_fixed_rounds(device):
    """Where every window but N loses and AR never wins (``DRAFTING_PAYS``), an all-scheduled
    request runs plain fixed rounds that the survival estimate decided (its host work beside them):
    round for round the same verified and accepted drafts as the fixed mode, requests one after
    another on one scheduler (batch 1, as the steady load of ``verify_concurrency.py``). "cuda":
    the trained pair in bf16 as ``dspark-trt generate`` runs it (decode chain, row kernels, CUDA
    graphs). Session 43 (H100, batch 1) had read its traces as the scheduled run accepting fewer
    drafts than fixed rounds before any AR round; only the CPU's fixed rounds were measured."""
    from dspark_trt.commands.bench import make_prompts
    from dspark_trt.config.source import default_pair_dirs
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if default_pair_dirs() is None:
        pytest.skip("needs the shipped default pair")
    llm = LLM.from_checkpoints(*default_pair_dirs(), device=device, dtype=torch.bfloat16, max_batch_size=1,
                               max_seq_len=160, cuda_graphs=device == "cuda", verify_cost=DRAFTING_PAYS)
    _scheduler(llm).cost_model = "trimmed"
    if device == "cuda":
        llm.capture_graphs(True, prefill_lengths=[96])
    prompts = make_prompts(llm, "heldout", 3, 96, 0)
    runs = {}
    for mode in ("fixed", "scheduled"):
        gen = llm.scheduler()
        kinds, estimated, estimates = [], [], gen._estimates_rounds

        def estimates_rounds(seqs, constants=None):
            estimated.append(estimates(seqs, constants))
            return estimated[-1]
        gen._estimates_rounds = estimates_rounds
        runs[mode] = []
        for p in prompts:
            seq = gen.add_request(p.tolist(), SamplingParams(max_new_tokens=48, ignore_eos=True, verify_mode=mode))
            while gen.has_work():
                gen.step()
                kinds.append(gen._round_kind)             # ("" until a round ran: an admission)
            runs[mode].append((seq.output_ids, list(zip(seq.stats.proposed, seq.stats.accepted))))
        if mode == "scheduled":                           # the estimate decided every round: a fixed round
            assert set(kinds) - {""} == {"fixed"}, set(kinds)
            assert len(estimated) >= sum(len(r) for _, r in runs[mode]) and all(estimated), estimated
    for i, ((out_f, fixed), (out_s, sched)) in enumerate(zip(runs["fixed"], runs["scheduled"])):
        assert out_s == out_f, f"request {i}: the output differs"
        k = next((k for k, (a, b) in enumerate(zip(fixed, sched)) if a != b), min(len(fixed), len(sched)))
        assert sched == fixed, (f"request {i}: from round {k} (verified, accepted) {sched[k:k + 4]} where the "
                                f"fixed mode's were {fixed[k:k + 4]}")
    assert sum(a for _, r in runs["fixed"] for _, a in r) > 0           # the pair drafts something


@pytest.mark.parametrize("graphs", [False, True])
def test_fallback_context_respects_a_networks_batch_cap(graphs, unbudgeted_probes):
    """Networks with a batch cap (a compiled engine's ``max_batch_size``) never get more
    draft-context rows than the cap from the fallback's late writes (each sequence's rows in its own
    row, no graphs), and decode as the same networks without the cap do."""
    outs, reqs = {}, [[1, 2, 3], [4, 5]]
    for cap in (None, 2):
        llm = _llm(block=4, seed=6, verify_cost=probed_curve(), cost_model="trimmed", graphs=graphs)
        if cap:
            nets, write = llm.networks, llm.networks.draft_context
            rows = []

            def capped(taps, pos, table):
                rows.append(taps.shape[0])
                assert taps.shape[0] <= cap, f"{taps.shape[0]} rows past the cap of {cap}"
                return write(taps, pos, table)
            nets.max_batch_size, nets.draft_context = cap, capped
            llm._steps = None                     # the steps (and their ContextRows) see the cap
            _scheduler(llm).cost_model = "trimmed"
        gen = llm.scheduler()
        seqs = [gen.add_request(p, SamplingParams(max_new_tokens=40, verify_mode="scheduled")) for p in reqs]
        while gen.has_work():
            gen.step()
        outs[cap] = [(s.output_ids, s.stats.proposed) for s in seqs]
        if cap:
            w = gen.deferred.writer
            assert gen.deferred.flushes >= 2 and w.graph_writes == 0 and w.eager_writes == gen.deferred.flushes
    assert outs[None] == outs[2]


@pytest.mark.parametrize("graphs", [False, True])
def test_prompts_admitted_in_an_ar_streak_defer_their_draft_context(graphs, unbudgeted_probes):
    """Requests admitted while the batch falls back to AR keep their prompts' taps instead of
    writing the draft context at the prefill: the same outputs, acceptance and draft cache (fp64)
    as writing it there; a request that ends inside the streak never has it written."""
    curve = CostCurve([1, 64], [1.0, 40.0], "test: steep, with step costs", **STEPS)
    llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="trimmed", graphs=graphs)
    first = ([1, 2, 3], SamplingParams(max_new_tokens=40, verify_mode="scheduled"))
    later = [([4, 5, 6, 7, 8], SamplingParams(max_new_tokens=30, verify_mode="scheduled")),
             ([9, 10], SamplingParams(max_new_tokens=2, verify_mode="scheduled"))]
    runs = {}
    for defer in (True, False):
        gen = llm.scheduler()
        gen.defer_context = defer
        seqs = [gen.add_request(*first)]
        while seqs[0].stats.proposed.count(0) < 3:            # inside an AR streak
            gen.step()
        seqs += [gen.add_request(*r) for r in later]
        while seqs[1].stats.proposed.count(0) < 3:
            gen.step()
        gen._write_deferred(gen.running)
        ps, s = llm.networks.page_size, seqs[1]
        cache = [torch.stack([k[s.table_row[p // ps], p % ps] for p in range(s.position)])
                 for k in llm.networks.draft_cache["k"]]
        while gen.has_work():
            gen.step()
        runs[defer] = ([(s.output_ids, s.stats.proposed, s.stats.accepted) for s in seqs], cache, gen.deferred)
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    late, eager = runs[True][2], runs[False][2]
    assert late.prompts_deferred == 2 and late.prompt_rows_dropped == 2 and not late.prompts
    assert eager.prompts_deferred == 0


def test_prefers_full_window_where_trimming_does_not_pay():
    """Flat verify cost: the fixed round (w = N) is the best option; a steep one with a low survival
    curve: a narrower window."""
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    steps = dict(rows=[1, 4], draft_ms=[0.1, 0.1], ar_ms=[10.0, 10.0])
    flat = VerifyScheduler(4, 64, "cpu", cost=CostCurve([1, 64], [1.0, 1.0], "flat", **steps))
    steep = VerifyScheduler(4, 64, "cpu", cost=CostCurve([1, 64], [1.0, 40.0], "steep", **steps))
    assert flat.prefers_full_window(4, [0.9, 0.8, 0.7, 0.6])
    assert not steep.prefers_full_window(4, [0.5, 0.1, 0.01, 0.001])


@pytest.mark.parametrize("cost_model", ["trimmed", "packed"])
def test_scheduled_batches_run_fixed_rounds_where_the_full_window_is_best(cost_model):
    """A verify cost that grows slowly (trimming 3 rows from 5 to 2 tokens would save 0.38 ms, more
    than the admission's overhead), cheap drafts, AR expensive: after the first (confidence) round,
    which gives the survival estimate, an all-scheduled batch runs plain fixed rounds (no head, no
    admission: no trimmed window or packed verify counted) verifying all N drafts, under either cost
    model; greedy output equals the target's."""
    from dspark_trt.runtime import scheduler as sched_mod
    curve = CostCurve([1, 64], [1.0, 3.0], "test: trimming could pay", rows=[1, 4], draft_ms=[0.1, 0.1],
                      ar_ms=[10.0, 10.0])
    llm = _llm(block=4, seed=6, verify_cost=curve, cost_model=cost_model)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=30), speculative=False)
    counted = lambda: sum(llm.steps.verify_widths.values()) + sum(llm.steps.verify_slots.values())
    before = counted()
    out = llm.generate(prompts, SamplingParams(max_new_tokens=30, verify_mode="scheduled"))
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    rounds = len(out[0].stats.proposed)
    # the first round only; packed: and a probe every PACKED_PROBE_EVERY fixed rounds
    probes = 0 if cost_model == "trimmed" else (rounds - 1) // (sched_mod.PACKED_PROBE_EVERY + 1)
    assert counted() - before == 1 + probes and rounds > 3
    proposed = out[0].stats.proposed
    assert len(proposed) > 3 and all(p == 4 for p in proposed[1:-1]), proposed


def test_ar_fallback_probes_less_often_while_ar_wins(unbudgeted_probes, monkeypatch):
    """Scheduled probes at rounds 0 (no history), 9, 26, 59: 8, 16 then 32 AR rounds between; each
    probe's outcome enters the survival estimate at once (``add(now=True)``), whatever its refresh
    interval and the estimate prepared during the probe, so the decision after it reads it."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    curve = probed_curve()
    llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="trimmed")
    added, add = [], SurvivalEstimate.add

    def recorded(self, *a, now=False, **kw):
        added.append(now)
        return add(self, *a, now=now, **kw)
    monkeypatch.setattr(SurvivalEstimate, "add", recorded)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=80, verify_mode="scheduled"))[0]
    ar = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=80), speculative=False)[0]
    assert out.output_ids == ar.output_ids
    assert [i for i, p in enumerate(out.stats.proposed) if p > 0][:4] == [0, 9, 26, 59]
    assert added[:4] == [False, True, True, True]


def test_an_ar_streak_skips_its_decisions_only_where_they_cannot_change(unbudgeted_probes, monkeypatch):
    """``Scheduler._streak_goes_on``: the streak's rounds that fall back without deciding again
    (no probe due, the same batch and survival curve) leave every round kind, output and probe
    where deciding every round puts them, through admissions and finishes that change the batch."""
    from dspark_trt.runtime.scheduler import Scheduler
    llm = _llm(block=4, seed=6, verify_cost=probed_curve(), cost_model="trimmed")
    reqs = [([1, 2, 3], 60), ([4, 5], 25), ([6, 7, 8, 9], 40), ([3, 1], 10)]
    skipped, goes_on = [], Scheduler._streak_goes_on

    def run(fast: bool):
        monkeypatch.setattr(Scheduler, "_streak_goes_on",
                            (lambda self, b: skipped.append(goes_on(self, b)) or skipped[-1]) if fast
                            else (lambda self, b: False))
        gen = llm.scheduler()
        gen.round_log = []
        seqs = [gen.add_request(p, SamplingParams(max_new_tokens=n, verify_mode="scheduled")) for p, n in reqs[:2]]
        steps = 0
        while gen.has_work():
            gen.step()
            steps += 1
            if steps in (12, 30):          # admissions inside the streak
                seqs.append(gen.add_request(reqs[len(seqs)][0], SamplingParams(
                    max_new_tokens=reqs[len(seqs)][1], verify_mode="scheduled")))
        return [k for k, _, _ in gen.round_log], [(s.output_ids, s.stats.proposed) for s in seqs]
    fast, full = run(True), run(False)
    assert fast == full
    assert sum(skipped) >= 20 and fast[0].count("ar") > sum(skipped) and "fixed" in fast[0][5:]


@pytest.mark.parametrize("graphs", [False, True])
def test_a_fresh_batch_starts_from_the_calibrations_survival(graphs, unbudgeted_probes):
    """With the calibration's held-out survival, a fresh all-scheduled batch decides its first round
    from it: where drafting never pays, it starts with AR rounds (its prompts' draft context
    deferred, the first probe after AR_PROBE_EVERY of them) instead of a blind speculative round,
    and greedy output equals the target's; where drafting pays, it starts speculative; without a
    measured curve, speculative as before."""
    curve = probed_curve()
    pays = CostCurve([1, 64], [1.0, 1.0], "flat: cheap drafts, dear AR", rows=[1, 4], draft_ms=[0.1, 0.1],
                     ar_ms=[30.0, 30.0])
    prompts, runs = [[1, 2, 3], [4, 5]], {}
    for name, survival in (("low", [0.1, 0.01, 0.0, 0.0]), ("high", [0.99, 0.98, 0.97, 0.96]),
                           ("none", None)):
        llm = _llm(block=4, seed=6, verify_cost=pays if name == "high" else curve, cost_model="trimmed",
                   graphs=graphs, calibration=Calibration([1.0], {} if survival is None else {"survival": survival}))
        gen = llm.scheduler()
        seqs = [gen.add_request(p, SamplingParams(max_new_tokens=30, verify_mode="scheduled"))
                for p in prompts]
        while gen.has_work():
            gen.step()
        ar = llm.generate(prompts, SamplingParams(max_new_tokens=30), speculative=False)
        assert [s.output_ids for s in seqs] == [a.output_ids for a in ar]
        runs[name] = (seqs[0].stats.proposed, gen.deferred.prompts_deferred)
    proposed, deferred = runs["low"]
    assert proposed[:AR_PROBE_EVERY_T] == [0] * AR_PROBE_EVERY_T and proposed[AR_PROBE_EVERY_T] > 0
    assert deferred == len(prompts)
    assert runs["high"][0][0] > 0 and runs["high"][1] == 0
    assert runs["none"][0][0] > 0 and runs["none"][1] == 0


def test_probe_loss_counts_the_ar_rounds_a_speculative_round_gives_up():
    """The fixed round costs 1.5 ms and commits 1.35 tokens per row, AR 1 token in 1 ms: the round
    buys 1.5 AR tokens, so a probe loses 0.15 AR rounds; none where drafting wins."""
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    cheap = CostCurve([2, 64], [1.0, 1.0], "flat", rows=[1, 64], draft_ms=[0.5, 0.5], ar_ms=[1.0, 1.0])
    s = VerifyScheduler(4, 256, "cpu", cost=cheap, round_overhead_ms=0.0)
    assert s.probe_loss(4, [0.3, 0.05, 0.0, 0.0]) == pytest.approx(0.15)
    assert s.probe_loss(4, [0.9, 0.8, 0.7, 0.6]) == 0.0                 # 4 tokens in 1.5 ms


def test_probe_loss_prices_the_round_a_probe_runs_and_its_context_write():
    """At many rows the best option is a window round (priced with 1/8 of a confidence round); a
    probe before any confidence round runs the confidence round over that window: dearer. The
    deferred rows' context write adds ``context(pending) / ar price`` AR rounds."""
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    rows = ESTIMATED_WINDOW_MIN_ROWS
    curve = CostCurve([1, 1024], [1.0, 64.0], "steep", rows=[1, rows], draft_ms=[2.0, 2.0], ar_ms=[1.0, 1.0],
                      context_tokens=[1, 1000], context_ms=[0.01, 10.0])
    s = VerifyScheduler(4, 1024, "cpu", cost=curve, round_overhead_ms=0.0)
    survival = [0.3, 0.05, 0.0, 0.0]
    w = s.best_window(rows, survival)
    assert s.option_kind(rows, w) == "window"
    plain = s.probe_loss(rows, survival)
    confidence = s.probe_loss(rows, survival, confidence_round=True)
    conf_ms = s.cost.step_ms("draft", rows) + s.admission_ms(rows) + s.cost.window_ms(rows, w)
    assert s.priced_ms("confidence", rows, w) == pytest.approx(conf_ms)
    assert plain > 0 and confidence - plain == pytest.approx(conf_ms - s.priced_ms("window", rows, w))
    assert s.probe_loss(rows, survival, pending=500) - plain == pytest.approx(curve.context(500))


def test_probes_wait_while_their_context_write_exceeds_the_budget():
    """A probe that would lose ``L`` AR rounds comes after ``max(AR_PROBE_EVERY, L / PROBE_BUDGET)``
    of them; when the context write of the rows the streak deferred grows faster than the budget
    (here 0.5 ms per row against 1 % of a 1 ms AR round), it waits to ``AR_PROBE_LIMIT``. A fresh
    batch starts in AR from the calibration's survival; greedy output equals the target's."""
    from dspark_trt.runtime import scheduler
    n = scheduler.AR_PROBE_LIMIT + 8
    steps = dict(rows=[1, 4], draft_ms=[0.2, 0.2], ar_ms=[1.0, 1.0])
    probes = {}
    for name, ctx in (("unpriced", {}), ("priced", dict(context_tokens=[1, 512], context_ms=[0.5, 256.0]))):
        curve = CostCurve([1, 64], [1.0, 1.0], "flat, cheap drafts", **steps, **ctx)
        llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="trimmed", max_seq_len=n + 8,
                   calibration=Calibration([1.0], {"survival": [0.0, 0.0, 0.0, 0.0]}))   # AR even at its bound
        out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=n, verify_mode="scheduled"))[0]
        ar = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=n), speculative=False)[0]
        assert out.output_ids == ar.output_ids
        probes[name] = [i for i, p in enumerate(out.stats.proposed) if p > 0]
        sched = _scheduler(llm)
    loss = sched.probe_loss(1, [0.0, 0.0, 0.0, 0.0], confidence_round=True)
    first = max(AR_PROBE_EVERY_T, math.ceil(loss / scheduler.PROBE_BUDGET))
    assert first < scheduler.AR_PROBE_LIMIT and probes["unpriced"][0] == first, (loss, probes)
    assert probes["priced"][0] == scheduler.AR_PROBE_LIMIT, probes


def test_no_probes_where_drafting_cannot_pay():
    """Drafting never pays at this batch's row count, even if every draft were accepted
    (``drafting_cannot_pay``): after the first round the AR streak runs without probes (none
    could end it), so the scheduled batch runs exactly the target's AR rounds; where drafting
    could pay (``probed_curve``) the streak probes again after AR_PROBE_EVERY rounds."""
    from dspark_trt.runtime import scheduler
    for curve, probed in ((CostCurve([1, 64], [1.0, 40.0], "test: steep, with step costs", **STEPS), False),
                          (probed_curve(), True)):
        sched = VerifyScheduler(4, 64, "cpu", cost=curve)
        assert sched.drafting_cannot_pay(1) is not probed
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(scheduler, "PROBE_BUDGET", math.inf)
            llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="trimmed")
            out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=60, verify_mode="scheduled"))[0]
        ar = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=60), speculative=False)[0]
        assert out.output_ids == ar.output_ids
        rounds = [i for i, p in enumerate(out.stats.proposed) if p > 0]
        assert (rounds[:2] == [0, 1 + AR_PROBE_EVERY_T]) if probed else rounds == [0], rounds
    never = CostCurve([1, 64], [1.0, 40.0], "test: steep, with step costs", **STEPS)
    learned = VerifyScheduler(4, 64, "cpu", cost=never, learn_costs=True)
    assert not learned.drafting_cannot_pay(1)           # learned prices move: probes keep them honest


def test_ar_streaks_space_their_probes_by_the_budget():
    """Drafting pays only if every draft is accepted (by 1.08x), and a probe costs ~2.7 AR rounds
    at the pair's acceptance: after the first round the next scheduled probe comes only after
    AR_PROBE_LIMIT AR rounds (the budget asks for ~270), where without the budget it came after
    AR_PROBE_EVERY; greedy output equals the target's."""
    from dspark_trt.runtime import scheduler
    curve = probed_curve(draft_ms=5.5)
    n = scheduler.AR_PROBE_LIMIT + 8
    llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="trimmed", max_seq_len=n + 8)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=n, verify_mode="scheduled"))[0]
    ar = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=n), speculative=False)[0]
    assert out.output_ids == ar.output_ids
    probes = [i for i, p in enumerate(out.stats.proposed) if p > 0]
    assert probes[:2] == [0, 1 + scheduler.AR_PROBE_LIMIT], probes


@pytest.mark.parametrize("graphs", [False, True])
def test_large_scheduled_batches_take_the_window_from_the_estimate(graphs, monkeypatch):
    """From ``ESTIMATED_WINDOW_MIN_ROWS`` rows, a steep verify cost: after the first confidence
    round (which reads its admitted lengths back to pick the window and gives the survival
    estimate) the rounds of all its rows verify the estimate's window below N without that
    read-back (window rounds, and the confidence probes among them: ``test_window_rounds.py``;
    rounds after some rows finished read back again); greedy
    output equals the target's, and each row verifies the whole window."""
    curve = CostCurve([1, 64], [1.0, 40.0], "test: steep, AR dear", rows=[1, 8], draft_ms=[0.1, 0.1],
                      ar_ms=[30.0, 30.0])
    llm = _llm(block=4, seed=6, batch=8, verify_cost=curve, cost_model="trimmed", graphs=graphs)
    prompts = [[1 + i, 2, 3 + i] for i in range(ESTIMATED_WINDOW_MIN_ROWS)]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=24), speculative=False)
    eager = llm.steps.eager
    readbacks = []
    monkeypatch.setattr(eager, "shape", lambda x, limit, head=None: readbacks.append(len(limit)) or DecodeSteps.shape(eager, x, limit, head))
    before = sum(llm.steps.verify_widths.values())
    out = llm.generate(prompts, SamplingParams(max_new_tokens=24, verify_mode="scheduled"))
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    windowed = sum(llm.steps.verify_widths.values()) - before
    narrow = [w for w, n in llm.steps.verify_widths.items() if w < 4 and n]
    assert windowed > 3 and narrow, llm.steps.verify_widths
    if not graphs:
        rows = ESTIMATED_WINDOW_MIN_ROWS        # later read-backs: rounds after some finished
        assert readbacks[0] == rows and all(n < rows for n in readbacks[1:]), readbacks
    proposed = out[0].stats.proposed
    assert all(p in narrow for p in proposed[1:-1]), proposed


def test_packed_target_equals_the_window_on_admitted_rows():
    """``packed_target``: each row's first ``1 + l`` window tokens as rows of one token (fp64):
    logits and taps equal the rectangular target's on entries ``j <= l``, the target K/V of the
    admitted positions equal, and pad slots / rows past ``l`` / inert rows write no K/V."""
    from dspark_trt.runtime.packed_verify import packed_target, pack_slots
    llm = _llm(block=4, seed=3)
    nets = llm.networks
    B, N = 3, 4
    g = torch.Generator().manual_seed(0)
    table = torch.tensor([[0, 1], [2, 3], [-1, -1]])                   # row 2 inert
    start = torch.tensor([5, 9, -1])
    offs = torch.arange(N + 1)
    pos = torch.where((start >= 0)[:, None], start[:, None] + offs, -1)
    tokens = torch.randint(0, nets.vocab_size, (B, N + 1), generator=g)
    limit = torch.tensor([1, 4, 0])
    lengths = torch.where(start >= 0, 1 + limit, 0)
    for cache in nets.target_cache.values():
        for c in cache:
            c.zero_()
    ref_logits, ref_taps = nets.target(tokens, pos, table)
    ref_k = [c.clone() for c in nets.target_cache["k"]]
    for cache in nets.target_cache.values():
        for c in cache:
            c.zero_()
    logits, taps, finite = packed_target(nets.target, tokens, pos, table, lengths, 12)
    assert finite.dtype == torch.bool and finite[:2].all()
    for r in range(2):
        j = int(lengths[r])
        torch.testing.assert_close(logits[r, :j], ref_logits[r, :j], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(taps[r, :j], ref_taps[r, :j], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(logits[r, j:], logits[r, j - 1:j].expand(N + 1 - j, -1))
    ps = llm.page_size if hasattr(llm, "page_size") else nets.page_size
    for k_new, k_ref in zip(nets.target_cache["k"], ref_k):
        for r in range(2):
            for p in range(int(start[r]), int(start[r]) + N + 1):
                page, off = int(table[r, p // ps]), p % ps
                if p < int(start[r] + lengths[r]):
                    torch.testing.assert_close(k_new[page, off], k_ref[page, off], rtol=1e-12, atol=1e-12)
                else:                                              # past the row's prefix: untouched
                    assert not k_new[page, off].any()
    row, col, live = pack_slots(lengths, 12)
    assert live.sum() == 7 and row[:7].tolist() == [0, 0, 1, 1, 1, 1, 1] and col[:7].tolist() == [0, 1, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad_slot, bad_row", [(1, 0), (6, 1), (9, None)])
def test_packed_target_flags_the_row_of_a_non_finite_slot(bad_slot, bad_row):
    """``packed_target``'s finite flags are per row over the row's own slots: NaN in slot 1 (row
    0's last token) or slot 6 (row 1's last) flags that row alone; in a pad slot (9) no row."""
    from dspark_trt.runtime.packed_verify import packed_target
    nets = _llm(block=4, seed=3).networks

    def target(tok, pos, table, groups=None):
        logits, taps = nets.target(tok, pos, table, groups=groups)
        logits = logits.clone()
        logits[bad_slot, 0, 3] = float("nan")
        return logits, taps
    start = torch.tensor([5, 9, -1])
    pos = torch.where((start >= 0)[:, None], start[:, None] + torch.arange(5), -1)
    tokens = torch.randint(0, nets.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([2, 5, 0])
    _, _, finite = packed_target(target, tokens, pos, torch.tensor([[0, 1], [2, 3], [-1, -1]]), lengths, 12)
    assert finite[:2].tolist() == [r != bad_row for r in range(2)]


@pytest.mark.parametrize("graphs", [False, True])
def test_packed_rounds_verify_each_rows_own_prefix(graphs):
    """The packed cost model with a steep curve: rows admit different prefixes; where their
    packed tokens take fewer slots than the rectangular window, the verify runs packed (counted
    per slot bucket); each row's proposal is its own admission; greedy output equals the target's."""
    curve = CURVES["linear"]
    llm = _llm(block=4, seed=6, batch=8, verify_cost=curve, cost_model="packed", graphs=graphs)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3], [5, 1], [2, 2, 2], [7], [9, 8]]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=20), speculative=False)
    out = llm.generate(prompts, SamplingParams(max_new_tokens=20, verify_mode="scheduled"))
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    slots = llm.steps.verify_slots
    assert slots and max(slots) < 8 * 5, slots               # packed where it beats the window
    per_round = list(zip(*[o.stats.proposed[:5] for o in out]))
    assert any(len(set(r)) > 1 for r in per_round), per_round       # rows verify different prefixes


@pytest.mark.parametrize("graphs", [False, True])
def test_auto_cost_model_packs_large_rounds_and_trims_small_ones(monkeypatch, graphs):
    """"auto" (the default where the target packs): rounds of PACKED_MIN_ROWS rows or more run the
    packed model, smaller ones the trimmed model (here the threshold lowered to 5 rows of 8); as
    requests finish the batch moves from one to the other; greedy output equals the target's."""
    from dspark_trt.runtime import verify_scheduler
    monkeypatch.setattr(verify_scheduler, "PACKED_MIN_ROWS", 5)
    llm = _llm(block=4, seed=6, batch=8, verify_cost=CURVES["linear"], cost_model="auto", graphs=graphs)
    sched = _scheduler(llm)
    seen = []
    use_rows = sched.use_rows
    monkeypatch.setattr(sched, "use_rows", lambda rows: seen.append((rows, use_rows(rows))) or seen[-1][1])
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3], [5, 1], [2, 2, 2], [7], [9, 8]]
    params = [SamplingParams(max_new_tokens=n, verify_mode="scheduled") for n in (4, 6, 8, 10, 20, 20, 24, 24)]
    ar = llm.generate(prompts, [SamplingParams(max_new_tokens=p.max_new_tokens) for p in params], speculative=False)
    out = llm.generate(prompts, params)
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    assert {m for r, m in seen if r >= 5} == {"packed"} and {m for r, m in seen if r < 5} == {"trimmed"}, seen
    assert llm.steps.verify_slots and llm.steps.verify_widths          # packed rounds, then trimmed ones
    assert sched.configured == "auto"


def test_auto_cost_model_chooses_by_rows():
    from dspark_trt.runtime.verify_scheduler import PACKED_MIN_ROWS, VerifyScheduler
    s = VerifyScheduler(7, 64 * 8, "cpu", cost_model="auto")
    assert s.cost_model == "trimmed" and s.configured == "auto"          # until a round sets it
    assert s.model_for(PACKED_MIN_ROWS - 1) == "trimmed" and s.model_for(PACKED_MIN_ROWS) == "packed"
    assert s.use_rows(64) == "packed" and s.cost_model == "packed" and s.packs
    assert s.use_rows(1) == "trimmed" and not s.packs and s.trims
    assert s.bucket_models(64) == ["trimmed", "packed"] and s.bucket_models(32) == ["trimmed"]
    assert not s.estimates_windows(64) and s.estimates_windows(32)      # packed rounds estimate no window
    s.cost_model = "trimmed"
    assert s.use_rows(64) == "trimmed" and s.bucket_models(64) == ["trimmed"]
    with pytest.raises(ValueError, match="cost_model must be one of"):
        s.cost_model = "fast"


@pytest.mark.parametrize("preset", ["qwen3-tiny-dspark", "deepseek-v4-tiny-dspark"])
def test_llm_defaults_to_the_trimmed_cost_model(preset):
    assert _scheduler(LLM.from_preset(preset, device="cpu", max_seq_len=64)).configured == "trimmed"


def test_llm_cost_model_option_and_its_errors():
    """``LLM(cost_model=...)`` reaches the scheduler; a packing model on a target whose rows cannot
    pack (DeepSeek-V4) and an unknown name are refused, naming what is wrong."""
    llm = LLM.from_preset("qwen3-tiny-dspark", device="cpu", max_seq_len=64, cost_model="auto")
    assert _scheduler(llm).configured == "auto"
    with pytest.raises(ConfigError, match="'packed'.*this target cannot"):
        LLM.from_preset("deepseek-v4-tiny-dspark", device="cpu", max_seq_len=64, cost_model="packed")
    with pytest.raises(ConfigError, match="cost_model must be one of"):
        LLM.from_preset("qwen3-tiny-dspark", device="cpu", max_seq_len=64, cost_model="fastest")


def test_verify_cost_model_flag_reaches_the_scheduler():
    """``--verify-cost-model`` (generate / bench / serve / calibrate): parsed, carried by
    ``ModelSource`` and the Triton model's parameters, and given to ``LLM``; bad names refused."""
    import argparse
    from dspark_trt.commands.common import add_model_args
    from dspark_trt.config.source import ModelSource
    from dspark_trt.serving.source import ServedModel
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--model", "qwen3-tiny-dspark", "--device", "cpu", "--max-seq-len", "64",
                         "--verify-cost-model", "auto"])
    src = ModelSource.from_args(args)
    assert src.verify_cost_model == "auto"
    assert _scheduler(LLM.from_source(src)).configured == "auto"
    assert ModelSource.from_args(p.parse_args([])).verify_cost_model == "trimmed"
    served = ServedModel(model="qwen3-tiny-dspark", random_weights=True, verify_cost_model="packed")
    assert ServedModel.from_parameters(served.to_parameters()).verify_cost_model == "packed"
    with pytest.raises(SystemExit):
        p.parse_args(["--verify-cost-model", "fastest"])


# H100 at Qwen3-8B dimensions (session 37, faaf31b): the draft step at 1 / 64 rows by drafts sampled
H100_DRAFTS = CostCurve([1, 512], [6.0, 15.0], "test: H100-like", rows=[1, 64], draft_ms=[0.05, 3.185],
                        ar_ms=[5.7, 8.1], draft_window_ms=[[0.035, 0.037, 0.038, 0.04, 0.043, 0.046],
                                                           [2.243, 2.345, 2.449, 2.569, 2.746, 2.939]])
REPLAYED = [0.450, 0.179, 0.072, 0.027, 0.008, 0.004, 0.003]      # the replayed pair's prefix survival


def test_head_width_drafts_only_the_positions_that_pay():
    """A packed round drafts the head width of the most tokens per ms: at 64 rows with the replayed
    survival (0.015 tokens a row past the 4th draft) 4 of 7 (0.62 ms of the draft saved); with a
    survival that stays high, or without the draft's latencies, all 7; never below N / 2."""
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    s = VerifyScheduler(7, 64 * 8, "cpu", cost=H100_DRAFTS, cost_model="packed")
    assert s.head_widths == [4, 5, 6, 7]
    assert s.head_width(64, np.array(REPLAYED)) == 4
    assert s.head_width(64, 0.95 ** np.arange(1, 8)) == 7
    assert s.head_width(64, np.zeros(7)) == 4
    assert VerifyScheduler(7, 512, "cpu", cost_model="packed").head_width(64, np.array(REPLAYED)) == 7
    assert s.bucket_heads(64) == [4, 5, 6, 7] and s.bucket_heads(1) == [7]     # graphs: where narrowing can pay
    curve, calls, price = np.array(REPLAYED), [], s._head_width
    s._head_width = lambda rows, survival: calls.append(rows) or price(rows, survival)
    assert [s.head_width(64, curve) for _ in range(3)] == [4, 4, 4] and calls == [64]   # once per curve and rows
    assert s.head_width(64, curve.copy()) == 4 and calls == [64, 64]
    assert VerifyScheduler(7, 512, "cpu", cost_model="packed").bucket_heads(64) == [7]


@pytest.mark.parametrize("graphs", [False, True])
def test_packed_rounds_of_a_narrowed_head(monkeypatch, graphs):
    """Packed rounds drafting 2 of 4 (``head_width``): the first confidence round drafts all 4
    (nothing estimated yet), then 7 narrowed rounds to one of all 4 (HEAD_PROBE_EVERY); no row
    verifies past 2 drafts in a narrowed round; greedy output equals the target's, eager and
    graph-replay."""
    from dspark_trt.runtime.verify_scheduler import HEAD_PROBE_EVERY
    curve = CostCurve([1, 64], [1.0, 40.0], "test: steep, AR dear", rows=[1, 8], draft_ms=[0.1, 0.1],
                      ar_ms=[30.0, 30.0])
    llm = _llm(block=4, seed=6, batch=8, verify_cost=curve, cost_model="packed", graphs=graphs)
    monkeypatch.setattr(_scheduler(llm), "head_width", lambda rows, survival: 2)
    drafted, real = [], DecodeSteps.draft_step_confidence

    def draft(self, x, head=None, z_out=None):
        if bool((x.start >= 0).any()):          # not a capture's warm-up on inert rows
            drafted.append(head or 4)
        return real(self, x, head, z_out)
    monkeypatch.setattr(DecodeSteps, "draft_step_confidence", draft)
    prompts = [[1 + i, 2, 3 + i] for i in range(8)]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=40), speculative=False)
    out = llm.generate(prompts, SamplingParams(max_new_tokens=40, verify_mode="scheduled"))
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    assert len(drafted) > 2 * HEAD_PROBE_EVERY
    assert drafted == [4] + [4 if i % HEAD_PROBE_EVERY == HEAD_PROBE_EVERY - 1 else 2
                             for i in range(len(drafted) - 1)], drafted
    rounds = list(zip(*[o.stats.proposed for o in out]))               # the rounds every row ran
    assert all(max(r) <= 2 for r, h in zip(rounds, drafted) if h == 2), (rounds, drafted)
    if graphs:                                   # the heads' draft graphs write z to one store
        z2, z4 = (llm.steps.graph("draft_admit", 8, head=h).outputs[1] for h in (2, 4))
        assert z2.shape == (8, 2, z4.shape[-1]) and z4.shape[1] == 4 and z2.data_ptr() == z4.data_ptr()


def test_packed_cost_model_refuses_a_target_that_cannot_pack():
    from dspark_trt.runtime.packed_verify import check_packable
    llm = _llm()
    check_packable(llm.networks)
    llm.networks.packs_rows = False
    with pytest.raises(ValueError, match="cannot pack"):
        check_packable(llm.networks)


def test_verify_shape_packs_only_where_it_runs_fewer_tokens():
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    s = VerifyScheduler(7, 64 * 8, "cpu", cost_model="trimmed")
    assert s.verify_shape([0, 0, 0, 7], 4) == (7, None)
    s.cost_model = "packed"
    assert s.verify_shape([0, 0, 0, 7], 4) == (7, 16)           # 11 tokens: 16 slots < 4 x 8
    assert s.verify_shape([2, 2, 2, 2], 4) == (2, None)         # 12 tokens: the window's 12 <= 16
    assert s.verify_shape([1] * 60 + [7] * 4, 64) == (7, 160)   # 152 tokens -> 160 slots < 512
    assert s.slot_buckets[:9] == [8, 16, 24, 32, 40, 48, 56, 64, 80] and s.slot_buckets[-1] == 512


def test_survival_running_sums_equal_the_windows_sums():
    """``SurvivalEstimate`` keeps running sums of its last ``window`` rounds: after more rounds
    than the window (evictions) its curve equals the estimate recomputed from the kept rounds,
    with the prior leaning on the evicted rounds' decayed counts (``HISTORY_DECAY``)."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    rng = np.random.default_rng(3)
    est = SurvivalEstimate(5, window=4, refresh=1)
    kept, rounds = [], []                            # the window's confidence arrays; every round's counts
    for i in range(11):
        acc = rng.integers(0, 6, 7)
        conf = 0.2 + 0.8 * rng.random((7, 5)) if i % 3 else None
        ver = np.maximum(acc, rng.integers(0, 6, 7))
        est.add(acc, ver, conf)
        rounds.append(est.rounds[-1])                                       # (at risk, survived) [5] each
        kept = (kept + [conf])[-4:] if conf is not None else kept
        risk = sum(r[0] for r in est.rounds)
        surv = sum(r[1] for r in est.rounds)
        if kept:
            s = np.cumprod(np.concatenate(kept), axis=1).mean(0)           # S_k, mean prefix product
            prior = s / np.concatenate([[1.0], s[:-1]])
        else:
            prior = np.full(5, est.PRIOR)
        gone = rounds[:-4]                                                  # evicted, oldest first
        if gone:
            decay = [est.HISTORY_DECAY ** (len(gone) - 1 - j) for j in range(len(gone))]
            h_risk = sum(d * r[0] for d, r in zip(decay, gone))
            h_surv = sum(d * r[1] for d, r in zip(decay, gone))
            prior = (h_surv + est.PRIOR_WEIGHT * prior) / (h_risk + est.PRIOR_WEIGHT)
        h = (surv + est.PRIOR_WEIGHT * prior) / (risk + est.PRIOR_WEIGHT)
        np.testing.assert_allclose(est.curve(), np.cumprod(h), rtol=1e-12)


# the trained pair's sampled (T = 1) prefix survival, confidence-calibration-h200-462ac15.json
SAMPLED_SURVIVAL = [0.45, 0.179, 0.072, 0.027, 0.008, 0.004, 0.003]


def test_survival_estimate_leans_on_its_history_not_a_mismatched_calibration():
    """Batch-1 rounds whose drafts are accepted with probability 0.6 each (1.46 accepted drafts a
    round: greedy requests accept more than the temperature-1 calibration's 0.74): the window's
    estimate, between rounds 200 and 400 (median per seed, mean of six seeds), is within 6 % of the
    truth with the rounds past the window as the prior's counts; with the calibration's curve alone
    as the prior it reads below 0.92 of it (the bias that kept batch 1 in AR rounds, session 43)."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    truth = sum(0.6 ** k for k in range(1, 8))
    means = {}
    for history in (True, False):
        medians = []
        for seed in range(6):
            rng = np.random.default_rng(seed)
            est = SurvivalEstimate(7, measured=np.array(SAMPLED_SURVIVAL))
            if not history:
                est.prior = est._external_prior
            points = []
            for i in range(400):
                est.add(np.minimum(rng.geometric(0.4, 1) - 1, 7), np.full(1, 7))
                if i >= 200:
                    points.append(est.curve().sum())
            medians.append(np.median(points))
        means[history] = float(np.mean(medians)) / truth
    assert abs(means[True] - 1) < 0.06 and means[False] < 0.92, means


def _correlated_rounds(rng, rows: int, survival=SAMPLED_SURVIVAL):
    """Confidences and outcomes of one round whose rows are calibrated but correlated across
    positions (one logistic offset per row, as ``verify_concurrency.py --synthetic`` replays):
    ``q [rows, N]`` conditional acceptances, ``acc [rows]`` accepted drafts of the full block."""
    s = np.asarray(survival)
    cond = s / np.concatenate([[1.0], s[:-1]])
    u = rng.random((rows, 1))
    q = 1.0 / (1.0 + np.exp(-(np.log(cond / (1 - cond))[None] + np.log(u / (1 - u)))))
    acc = np.cumprod(rng.random(q.shape) < q, axis=1).sum(1)
    return q, acc


def test_survival_estimate_of_censored_windows_follows_the_heads_prefix_products():
    """Rows verifying 3 of 7 drafts say nothing about drafts 3..6: there the estimate is the
    head's prior, which must be the mean calibrated prefix product (the survival of correlated
    rows), not the product of mean conditionals (too low a tail: it kept windows trimmed that
    should be full, scheduled 0.92x fixed at batch 16 on the H200, e9d2e5a). With it the window
    decision equals the one on the true survival curve."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    rng = np.random.default_rng(0)
    q, acc = _correlated_rounds(rng, 200_000)
    true = np.array([(acc > k).mean() for k in range(7)])              # uncensored survival
    naive = np.cumprod(q.mean(0))
    assert naive[3:].sum() < 0.6 * true[3:].sum()                      # the bias this fixes
    est = SurvivalEstimate(7)
    for _ in range(32):
        q, acc = _correlated_rounds(rng, 64)
        est.add(np.minimum(acc, 3), np.full(64, 3), q)                 # window 3: censored at 3
    np.testing.assert_allclose(est.curve(), true, atol=0.02, rtol=0.15)
    s = VerifyScheduler(7, 64 * 8, "cpu", cost=H200_CURVE)
    for rows in (8, 16, 32, 64):
        assert s.best_window(rows, est.curve()) == s.best_window(rows, true), rows


@pytest.mark.parametrize("threshold", [0.3, 0.15])
def test_survival_estimate_of_packed_rows_weighs_their_unverified_drafts(monkeypatch, threshold):
    """Packed rounds verify each row's own admitted prefix (its calibrated prefix product above a
    threshold): the rows verified furthest are the confident ones, so Kaplan-Meier over those
    windows alone reads the tail's conditional acceptance near 1 (an H100 run at batch 64 estimated
    0.14 at draft 7 where the replay's truth was ~0.1, and no round narrowed its head). With the
    head's odds of each row's unverified drafts (``censored_odds``) the estimate is the mean survival
    within 15 % (relative) at every position; without them it is over by more than 40 % (1.3-2.7x
    at 0.3, 1.2-1.7x at 0.15).
    A narrowed head's confidences ([rows, h]) weigh its rows but leave the prior and
    ``last_confidence`` alone."""
    from dspark_trt.runtime import survival
    from dspark_trt.runtime.survival import SurvivalEstimate
    rng = np.random.default_rng(1)
    q, acc = _correlated_rounds(rng, 400_000)
    true = np.array([(acc > k).mean() for k in range(7)])

    def estimate():
        est, r = SurvivalEstimate(7), np.random.default_rng(2)
        for _ in range(32):
            q, acc = _correlated_rounds(r, 64)
            admitted = (np.cumprod(q, axis=1) > threshold).sum(1)             # [rows] each row's window
            est.add(np.minimum(acc, admitted), admitted, q)
        return est.curve()
    np.testing.assert_allclose(estimate(), true, rtol=0.15)
    monkeypatch.setattr(survival, "censored_odds", lambda *a: None)
    assert (estimate() / true > 1.4).any()
    monkeypatch.undo()

    est = SurvivalEstimate(3, window=4, refresh=1)
    full = np.array([[0.9, 0.5, 0.5]])
    est.add([1], [1], full)                          # accepted its 1 draft: draft 1 at 0.5, draft 2 at 0.25
    prior, last = est.prior().copy(), est.last_confidence
    est.add([2, 0], [2, 1], np.array([[0.8, 0.5], [0.9, 0.9]]))      # a head of 2: row 0 censored at 2
    assert est.last_confidence is last and np.array_equal(est.prior(), prior)
    np.testing.assert_allclose(est._risk, [1 + 2, 1 + 1, 0.5 + 0])      # round 1 + round 2
    np.testing.assert_allclose(est._surv, [1 + 1, 0.5 + 1, 0.25 + 0])


def test_best_window_takes_the_wider_of_equal_options():
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    flat = VerifyScheduler(4, 64, "cpu", cost=CostCurve([1, 64], [1.0, 1.0], "flat", rows=[1, 4],
                                                        draft_ms=[0.1, 0.1], ar_ms=[9.0, 9.0]),
                           admission_overhead_ms=0.0)
    assert flat.best_window(4, [0.0, 0.0, 0.0, 0.0]) == 4          # all equal: the widest
    opts = flat.spec_options(4, [0.5, 0.2, 0.1, 0.0])
    assert [w for w, _ in opts] == [1, 2, 3, 4] and opts[3][1] == opts[2][1] > opts[1][1]
    assert flat.best_window(4, [0.5, 0.2, 0.1, 0.0]) == 4


@pytest.mark.parametrize("full_ms, trims", [(1.33, False), (1.6, True)])
def test_trimmed_window_must_beat_the_fixed_round_by_the_margin(full_ms, trims):
    """Only draft 0 can survive: the 1-draft window (2.65 ms a round with the admission) against
    the full one (1.4 ms + ``full_ms``): about 3 % better at 1.33 ms, under ``TRIM_MARGIN``, so
    the fixed round (N); about 15 % better at 1.6 ms: the trimmed window."""
    from dspark_trt.runtime.verify_scheduler import TRIM_MARGIN, VerifyScheduler
    assert TRIM_MARGIN == 0.05
    grid = [[1.0] * 4, [1.0, 1.0, 1.0, full_ms]]
    s = VerifyScheduler(4, 64, "cpu", cost=CostCurve([1, 64], [1.0, 2.0], "t", rows=[1, 4], draft_ms=[0.1, 0.1],
                                                     ar_ms=[50.0, 50.0], verify_ms=grid))
    opts = dict(s.spec_options(4, [0.5, 0.0, 0.0, 0.0]))
    gain = opts[1] / opts[4] - 1
    assert (gain > TRIM_MARGIN) == trims and 0.01 < abs(gain - TRIM_MARGIN) < 0.12, gain
    assert (s.best_window(4, [0.5, 0.0, 0.0, 0.0]) < 4) == trims      # w = 1..3 tie: the widest, 3
    assert s.prefers_full_window(4, [0.5, 0.0, 0.0, 0.0]) != trims


def test_cost_grid_by_rows_and_width(tmp_path):
    """``verify_ms`` [rows][w-1]: saved and loaded, interpolated over the rows, checked; with it the
    trimmed admission and the options price a window by rows and width: a grid where the full
    window costs what a narrow one does admits N where the steep token curve trims."""
    from dspark_trt.runtime.confidence import ConfidenceFileError
    from dspark_trt.runtime.verify_scheduler import VerifyScheduler
    steps = dict(rows=[1, 4], draft_ms=[0.1, 0.1], ar_ms=[50.0, 50.0])
    grid = [[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]
    c = CostCurve([1, 64], [1.0, 40.0], "t", **steps, verify_ms=grid)
    c.save(tmp_path)
    c2 = CostCurve.find(tmp_path)
    assert c2.verify_ms == grid and c2.window_ms(2.5, 3) == 1.5 and c2.window_ms(4, 9) == 2.0
    with pytest.raises(ConfidenceFileError, match="verify_ms"):
        CostCurve([1, 64], [1.0, 40.0], "bad", **steps, verify_ms=[[1.0], [1.0, 2.0]])
    conf = torch.full((4, 4), 0.0)                                  # c = 0.5 everywhere
    live = torch.ones(4, dtype=torch.bool)
    mode = torch.full((4,), MODE_IDS["scheduled"])
    tokens_only = VerifyScheduler(4, 64, "cpu", cost=CostCurve([1, 64], [1.0, 40.0], "t", **steps),
                                  cost_model="trimmed")
    by_grid = VerifyScheduler(4, 64, "cpu", cost=c, cost_model="trimmed")
    assert tokens_only.admit(conf, live, mode, torch.zeros(4)).tolist() != [4] * 4
    assert by_grid.admit(conf, live, mode, torch.zeros(4)).tolist() == [4] * 4
    assert by_grid.best_window(4, [0.5, 0.25, 0.125, 0.06]) == 4
    assert tokens_only.best_window(4, [0.5, 0.25, 0.125, 0.06]) < 4


def test_packed_gain_prices_per_row_prefixes():
    """``packed_gain``: on the steep H200 token curve, 64 rows whose calibrated confidences are
    correlated per row (the replayed curve) gain from packing (Algorithm 1 gives the confident
    rows long prefixes, the others none) -- more than a common window could (``spec_options``:
    best window over the fixed round); on a flat curve packing only adds the admission's cost."""
    from dspark_trt.runtime.verify_scheduler import TRIM_MARGIN, VerifyScheduler
    rng = np.random.default_rng(5)
    s = VerifyScheduler(7, 64 * 8, "cpu", cost=H200_CURVE)
    rounds = [_correlated_rounds(rng, 64)[0] for _ in range(20)]
    gains = [s.packed_gain(q) for q in rounds]
    survival = np.cumprod(np.concatenate(rounds), axis=1).mean(0)          # these rows' batch survival
    opts = dict(s.spec_options(64, survival))
    assert np.mean(gains) > 1.0 + TRIM_MARGIN and np.mean(gains) > max(opts.values()) / opts[7]
    flat = VerifyScheduler(7, 64 * 8, "cpu", cost=CostCurve([1, 1024], [10.0, 10.0], "flat", rows=[1, 64],
                                                             draft_ms=[1.0, 1.0], ar_ms=[9.0, 9.0]))
    assert max(flat.packed_gain(_correlated_rounds(rng, 64)[0]) for _ in range(5)) < 1.0


@pytest.mark.parametrize("gain", [2.0, 1.0])
def test_packed_model_packs_where_the_rows_gain(gain, monkeypatch):
    """The packed cost model packs every round while ``packed_gain`` of the last confidence
    round's rows clears the margin, else runs fixed rounds with a packed probe every
    ``PACKED_PROBE_EVERY``; greedy output equals the target's either way. The gain is computed in
    the host work of the round after the confidences' (while the device runs), not on the path of
    the round that reads it: every call but the first inside a round's ``host_work``."""
    from dspark_trt.runtime import scheduler as sched_mod, steps as steps_mod
    curve = CostCurve([1, 64], [1.0, 3.0], "test", rows=[1, 4], draft_ms=[0.1, 0.1], ar_ms=[10.0, 10.0])
    llm = _llm(block=4, seed=6, verify_cost=curve, cost_model="packed")
    calls, in_host_work = [], [False]
    monkeypatch.setattr(llm.steps.eager.scheduler, "packed_gain",
                        lambda conf: calls.append(in_host_work[0]) or gain)
    run = steps_mod.run_host_work

    def host_work(work):
        in_host_work[0] = True
        run(work)
        in_host_work[0] = False
    monkeypatch.setattr(steps_mod, "run_host_work", host_work)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ar = llm.generate(prompts, SamplingParams(max_new_tokens=40), speculative=False)
    before = sum(llm.steps.verify_widths.values())
    out = llm.generate(prompts, SamplingParams(max_new_tokens=40, verify_mode="scheduled"))
    assert [o.output_ids for o in out] == [a.output_ids for a in ar]
    confidence_rounds = sum(llm.steps.verify_widths.values()) - before
    rounds = len(out[0].stats.proposed)
    assert len(calls) <= confidence_rounds                  # once per round that read confidences
    assert len(calls) > 1 and all(calls[1:]), calls
    if gain > 1.5:
        assert confidence_rounds >= rounds - 1 > 3
    else:
        assert confidence_rounds == 1 + (rounds - 1) // (sched_mod.PACKED_PROBE_EVERY + 1) and rounds > 9


def test_optimistic_survival_bounds_the_estimate_by_its_rows():
    """``SurvivalEstimate.optimistic``: the curve scaled to its expected accepted drafts' one-sided
    95 % upper bound over the rows behind it: 1 + 0.66 z / sqrt(36) (the variance of a geometric
    count: ~1.5 at acceptance 0.5, 4 drafts) over 32 batch-1 rounds, within 6 % over batch-64 rounds; nothing
    verified: the prior bounded as its PRIOR_WEIGHT rows (a calibration's curve, measured at another
    temperature, is no more certain than its weight in the estimate)."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    rng = np.random.default_rng(0)
    for rows, lo, hi in ((1, 1.12, 1.6), (64, 1.005, 1.06)):
        est = SurvivalEstimate(4, measured=np.array([0.5, 0.25, 0.125, 0.0625]))
        for _ in range(32):
            acc = np.minimum(rng.geometric(0.5, rows) - 1, 4)           # P(accept each) = 0.5
            est.add(acc, np.full(rows, 4))
        point, upper = est.curve(), est.optimistic()
        ratio = upper / point
        assert np.allclose(ratio, ratio[0]) and lo < ratio[0] < hi, (rows, ratio)
        mu = point.sum()
        var = ((2 * np.arange(4) + 1) * point).sum() - mu * mu
        assert ratio[0] == pytest.approx(1 + 1.645 * np.sqrt(var / (rows * 32 + 4)) / mu)
    fresh = SurvivalEstimate(4, measured=np.array([0.5, 0.25, 0.125, 0.0625]))
    point = fresh.curve()
    mu, var = point.sum(), ((2 * np.arange(4) + 1) * point).sum() - point.sum() ** 2
    np.testing.assert_allclose(fresh.optimistic(),                        # nothing verified: 4 rows' worth
                               np.minimum(point * (1 + 1.645 * np.sqrt(var / 4) / mu), 1.0))
    assert fresh.optimistic()[0] == 1.0 and fresh.optimistic()[1] > 0.5


def test_ar_fallback_needs_evidence_at_batch_1():
    """Drafting wins at batch 1 on average (fixed round 0.65 ms, AR 0.42 ms; requests of 16 rounds,
    each accepting each draft with its own probability, uniform in [0.2, 0.8]: ~2 tokens a round,
    1.3x AR), but the estimate over 32 batch-1 rounds (32 rows) dips: in a stream of 2000 rounds
    its point curve says AR at dozens of rounds (each would start a streak that its dear probes
    keep for ~200 rounds; H100, default pair: 205 AR rounds to 123), the optimistic curve at a fifth
    as many at most (seeds 0-5: 43-121 rounds against 0-12). Where AR wins by 1.4x (acceptance
    0.1) the optimistic curve still says AR at a third of the rounds or more at batch 1 (seeds 0-5:
    44-84 %; the first such round starts the streak), at every round at batch 64."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    curve = CostCurve([2, 512], [0.40, 0.40], "flat verify", rows=[1, 64], draft_ms=[0.14, 0.14],
                      ar_ms=[0.31, 0.31])
    sched = VerifyScheduler(7, 512, "cpu", cost=curve, round_overhead_ms=0.11)
    assert not sched.prefers_ar(1, 0.5 ** np.arange(1, 8))            # the mean request: drafting wins

    def stream(rows, acceptance, rounds=2000, seed=1):
        rng, est, said = np.random.default_rng(seed), SurvivalEstimate(7, window=32, refresh=1), [0, 0]
        for i in range(rounds):
            if i % 16 == 0:
                a = acceptance(rng)
            est.add(np.minimum(rng.geometric(1 - a, rows) - 1, 7), np.full(rows, 7))
            if i >= 32:                                               # a full window
                said[0] += sched.prefers_ar(rows, est.curve())
                said[1] += sched.prefers_ar(rows, est.optimistic())
        return said

    point, upper = stream(1, lambda rng: rng.uniform(0.2, 0.8))
    assert point > 20 and upper <= point / 5, (point, upper)
    for rows, share in ((1, 1 / 3), (64, 1.0)):
        point, upper = stream(rows, lambda rng: 0.1, rounds=300)
        assert upper >= share * (300 - 32), (rows, upper)


def _ar_wins_at_batch_1() -> CostCurve:
    """The default pair's prices on the H100 at 6770686, roughly: a flat verify, AR rounds far cheaper."""
    return CostCurve([2, 512], [0.41, 0.41], "flat verify", rows=[1, 64], draft_ms=[0.14, 0.14], ar_ms=[0.18, 0.18])


def test_an_ar_streak_ends_on_the_point_estimate_not_its_upper_bound():
    """Where AR wins at batch 1 (fixed round 0.66 ms at ~1.8 tokens, AR 0.29 ms: the default pair on
    the H100 at 6770686 ran 86 fixed rounds beside 213 AR ones) the optimistic curve of 32 batch-1
    rows says "draft" at about half the rounds of a stream (seeds 0-3: 1,100-1,232 of 1,968), so a
    streak that ended on it ended at nearly every probe; the rule that keeps a streak (AR within
    ``AR_STAY_MARGIN`` of the best window under the point estimate) says so at a few percent (0-78)."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    from dspark_trt.runtime.verify_scheduler import AR_STAY_MARGIN
    curve = _ar_wins_at_batch_1()
    sched = VerifyScheduler(7, 512, "cpu", cost=curve, round_overhead_ms=0.11)
    assert sched.prefers_ar(1, 0.45 ** np.arange(1, 8))               # the mean request: AR wins
    for seed in range(4):
        rng, est, ends_upper, ends_point = np.random.default_rng(seed), SurvivalEstimate(7, window=32, refresh=1), 0, 0
        for i in range(2000):
            if i % 16 == 0:
                a = rng.uniform(0.3, 0.6)
            est.add(np.minimum(rng.geometric(1 - a, 1) - 1, 7), np.full(1, 7))
            if i >= 32:
                ends_upper += not sched.prefers_ar(1, est.optimistic())
                ends_point += not sched.prefers_ar(1, est.curve(), AR_STAY_MARGIN)
        assert ends_upper > 900 and ends_point < 100, (seed, ends_upper, ends_point)


def test_the_scheduler_keeps_an_ar_streak_in_the_band_between_the_two_estimates(unbudgeted_probes):
    """An estimate whose upper bound says "draft" and whose point estimate says AR within
    ``AR_STAY_MARGIN``: a batch outside a streak does not start one (a speculative round), a batch
    in a streak, or deciding after its probe, goes on with AR."""
    from types import SimpleNamespace
    from dspark_trt.runtime.survival import SurvivalEstimate
    from dspark_trt.runtime.verify_scheduler import AR_STAY_MARGIN
    curve = _ar_wins_at_batch_1()
    llm = _llm(block=7, seed=6, verify_cost=curve, cost_model="trimmed")
    gen = llm.scheduler()
    sched = VerifyScheduler(7, 4 * 8, "cpu", cost=curve, round_overhead_ms=0.11, cost_model="trimmed")
    llm.steps.scheduler = sched
    rng, est = np.random.default_rng(0), SurvivalEstimate(7, window=32, refresh=1)
    for _ in range(200):                # a batch-1 stream until the two estimates disagree
        est.add(np.minimum(rng.geometric(0.55, 1) - 1, 7), np.full(1, 7))
        if not sched.prefers_ar(1, est.optimistic()) and sched.prefers_ar(1, est.curve(), AR_STAY_MARGIN):
            break
    else:
        pytest.fail("no estimate in the band")
    gen._survival = est
    seqs = [SimpleNamespace(slot=0)]
    assert not gen._falls_back_to_ar(seqs, True)                     # no streak: none starts
    gen._ar_streak = 3
    assert gen._falls_back_to_ar(seqs, True)                         # a streak goes on
    gen._ar_streak, gen._probing = 0, True
    assert gen._falls_back_to_ar(seqs, True) and not gen._probing    # the probe's verdict: AR again


def test_capture_takes_the_prefills_of_deferred_prompts_where_the_scheduler_falls_back():
    """``capture_graphs(prefill_lengths=)`` with an AR fallback also captures the prefill graphs that
    keep the prompts' taps (an admission inside an AR streak), and the late draft-context writes'
    row buckets, so none is captured inside the timed rounds; without step costs (no fallback) only
    the plain ones."""
    for verify_cost, deferred in ((probed_curve(), True), (CURVES["linear"], False)):
        llm = _llm(block=4, seed=6, verify_cost=verify_cost, cost_model="trimmed", graphs=True)
        assert _scheduler(llm).falls_back is deferred
        llm.capture_graphs(True, prefill_lengths=[8])
        keys = set(llm.steps.prefills._graphs)
        assert {(b, t) for b, t, ctx, taps in keys if ctx and not taps} == {(4, 16), (2, 16), (1, 16)}
        assert {(b, t) for b, t, ctx, taps in keys if taps} == ({(4, 16), (2, 16), (1, 16)} if deferred else set())
        assert set(llm.steps.context_rows._graphs) == (set(ROW_BUCKETS) if deferred else set())   # late writes


def test_trimmed_rounds_look_their_verify_graphs_up_once():
    """``GraphedSteps._trimmed_verify_graphs``: every (width, slots) graph a trimming or packing
    round may launch, the same objects ``graph`` returns, kept per round shape and cost model (a
    packed round's 27 lookups at batch 64 were on its path before the draft launched)."""
    llm = _llm(block=4, seed=6, batch=8, verify_cost=CURVES["linear"], cost_model="packed", graphs=True)
    steps = llm.steps
    Bb, sched = steps.bucket(8), _scheduler(llm)
    packed = steps._trimmed_verify_graphs("verify_admit", Bb, False)
    assert set(packed) == set(steps._verify_sizes(Bb)) and any(slots for _, slots in packed)
    assert all(g is steps.graph("verify_admit", Bb, False, *s) for s, g in packed.items())
    assert steps._trimmed_verify_graphs("verify_admit", Bb, False) is packed
    sched.cost_model = "trimmed"                               # the admission baked in differs
    trimmed = steps._trimmed_verify_graphs("verify_admit", Bb, False)
    assert not any(slots for _, slots in trimmed) and set(trimmed.values()).isdisjoint(packed.values())


def test_survival_estimate_ages_its_window_by_rounds_that_verify_nothing():
    """``SurvivalEstimate.age``: an AR streak's rounds move as many of the window's oldest rounds
    into the history; the window's running sums stay its rounds' sums, a fully aged window reads
    the history's prior alone, and the estimate stays informed without a measured curve."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    rng, est = np.random.default_rng(0), SurvivalEstimate(7, window=32, refresh=1)
    for _ in range(100):                                           # easy rows, then a hard request's
        est.add(np.minimum(rng.geometric(0.35, 1) - 1, 7), np.full(1, 7))
    for _ in range(32):
        est.add(np.zeros(1, int), np.full(1, 7))
    hard, version = float(est.curve().sum()), est.version
    assert hard < 0.5
    est.age(0)
    assert len(est) == 32 and est.version == version
    est.age(12)
    assert len(est) == 20 and est.version == version + 1
    np.testing.assert_allclose(est._risk, sum(r[0] for r in est.rounds))
    est.age(1000)
    assert len(est) == 0 and est.informed
    np.testing.assert_allclose(est.curve(), np.cumprod(est.prior()))
    assert float(est.curve().sum()) > hard + 0.5                   # the easy history outweighs the 32 zeros


def test_an_ar_streak_ages_out_a_hard_requests_rows(monkeypatch):
    """Batch 1, drafting wins on the mean request (per-draft acceptance 0.65: ~1.8 drafts a round
    against the ~1.1 at which AR ties) and loses on one hard request (0.1) in a stream of 64-token
    requests. The scheduler's AR fallback (``_falls_back_to_ar``, its streak and probes as
    ``Scheduler._spec_round`` keeps them) falls back on the hard request, and without aging its
    window kept the hard rows through the next 12 requests at some seeds (the window's 32 rows
    replaced one per probe, every 64 AR rounds: 513 and 743 of their ~300-750 rounds in AR at
    seeds 3 and 1); with the streak aging the window (``SurvivalEstimate.age``) at most a few."""
    from types import SimpleNamespace
    from dspark_trt.runtime.survival import SurvivalEstimate
    curve = CostCurve([2, 512], [0.40, 0.40], "flat verify", rows=[1, 64], draft_ms=[0.14, 0.14],
                      ar_ms=[0.31, 0.31])
    llm = _llm(block=7, seed=6, verify_cost=curve, cost_model="trimmed")
    llm.steps.scheduler = VerifyScheduler(7, 4 * 8, "cpu", cost=curve, round_overhead_ms=0.11, cost_model="trimmed")

    def after_the_hard_request(seed: int, aging: bool) -> tuple[int, int]:
        gen, rng, seqs = llm.scheduler(), np.random.default_rng(seed), [SimpleNamespace(slot=0)]
        gen._survival = SurvivalEstimate(7, window=32, refresh=1)
        if not aging:
            monkeypatch.setattr(gen._survival, "age", lambda rounds: None)
        kinds = []                                                     # of the requests after the hard one
        for i, h in enumerate([0.65] * 8 + [0.1] + [0.65] * 12):
            left = 64
            while left > 0:
                if gen._falls_back_to_ar(seqs, True):
                    gen._ar_streak += 1
                    left -= 1
                    kinds += ["ar"] * (i > 8)
                    continue
                probing, gen._ar_streak, gen._aged = gen._probing, 0, 0
                a = int(min(rng.geometric(1 - h) - 1, 7))
                gen._survival.add([a], [7], now=probing)
                left -= a + 1
                kinds += ["spec"] * (i > 8)
        return kinds.count("ar"), len(kinds)

    for seed in range(4):
        ar, rounds = after_the_hard_request(seed, aging=True)
        assert ar <= 0.03 * rounds, (seed, ar, rounds)
    without = [after_the_hard_request(seed, aging=False) for seed in (1, 3)]
    assert all(ar > 0.5 * rounds for ar, rounds in without), without


def test_survival_estimate_forgets_the_share_of_rows_that_left():
    """``SurvivalEstimate.forget``: the share of the batch's rows that finished retires as large a
    share of the window's rounds, oldest first, fractions carried; a whole batch leaving (batch 1)
    empties the window, whose next curve is the history's prior."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    rng, est = np.random.default_rng(1), SurvivalEstimate(7, window=32, refresh=1)
    for _ in range(64):
        est.add(np.minimum(rng.geometric(0.4, 2) - 1, 7), np.full(2, 7))
    hist = est._hist_risk[0]
    est.forget(0.25)
    assert len(est) == 24 and est._hist_risk[0] > hist
    est.forget(1 / 64)                                           # 0.375 of a round: carried
    assert len(est) == 24
    est.forget(1 / 32)                                           # 0.375 + 0.75
    assert len(est) == 23
    np.testing.assert_allclose(est._risk, sum(r[0] for r in est.rounds))
    est.forget(1.0)
    assert len(est) == 0 and est.informed
    np.testing.assert_allclose(est.curve(), np.cumprod(est.prior()))


def test_forgetting_a_small_share_waits_for_the_next_prepare():
    """``forget`` of under ``FORGET_NOW`` of the batch retires its rounds but keeps the curve the
    last ``prepare`` estimated for the next round's decisions (at large batches requests finish
    every round or two: estimating on the decision path each time cost 0.06-0.14 ms a round on an
    H100); the next ``prepare`` estimates without them. A share of at least ``FORGET_NOW`` (batch
    1 or 2) drops the curve at once."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    rng, est = np.random.default_rng(2), SurvivalEstimate(7, window=32, refresh=1)
    for _ in range(40):
        est.add(np.minimum(rng.geometric(0.4, 8) - 1, 7), np.full(8, 7))
    est.prepare()
    held = est.curve()
    est.add(np.zeros(8, int), np.full(8, 7), defer=True)       # the round's outcome, deferred
    est.forget(1 / 8)                                            # 4 rounds of 32
    assert est.curve() is held and len(est.rounds) == 28
    est.prepare()
    fresh = est.curve()
    assert fresh is not held
    np.testing.assert_allclose(est._risk, sum(r[0] for r in est.rounds))
    assert est.forget(SurvivalEstimate.FORGET_NOW) is None and est.curve() is not fresh


def test_finished_requests_age_the_survival_window_by_their_share_of_the_batch(monkeypatch):
    """The scheduler tells the estimate which share of a round's rows finished: a batch of two
    whose shorter request ends first (1/2), then the other alone (1/1), in scheduled and fixed
    modes alike (a fixed round feeds the estimate too); plain AR decoding tells it nothing."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    shares, forget = [], SurvivalEstimate.forget
    monkeypatch.setattr(SurvivalEstimate, "forget", lambda self, share: shares.append(share) or forget(self, share))
    llm = _llm(block=4, seed=6, verify_cost=probed_curve(), cost_model="trimmed")
    for mode, speculative, expected in (("scheduled", True, [0.5, 1.0]), ("fixed", True, [0.5, 1.0]),
                                        ("scheduled", False, [])):
        shares.clear()
        gen = llm.scheduler(speculative)
        for prompt, n in (([1, 2, 3], 6), ([4, 5], 40)):
            gen.add_request(prompt, SamplingParams(max_new_tokens=n, verify_mode=mode))
        while gen.has_work():
            gen.step()
        assert shares == expected, mode


def test_an_ar_streak_ends_when_its_batch_has_turned_over():
    """``Scheduler._finished_share``: finished requests age the window (``forget``) and, once they
    were ``STREAK_TURNOVER`` of the batch during an AR streak, end the streak: its AR rounds age
    the window first, the next decision reads the start rule and the probe interval starts over.
    Shares below the turnover accumulate; with no streak nothing but ``forget`` happens."""
    from dspark_trt.runtime.scheduler import AR_PROBE_EVERY, STREAK_TURNOVER
    llm = _llm(block=4, seed=6, verify_cost=probed_curve(), cost_model="trimmed")
    gen, aged = llm.scheduler(), []
    gen._survival.age = aged.append
    gen._ar_streak, gen._aged, gen._probe_every, gen._probe_floor = 40, 8, 64, 100
    gen._finished_share(STREAK_TURNOVER / 2)
    assert (gen._ar_streak, gen._probe_every, aged) == (40, 64, [])           # half of the turnover: goes on
    gen._finished_share(STREAK_TURNOVER / 2)
    assert (gen._ar_streak, gen._aged, gen._probe_every, gen._probe_floor) == (0, 0, AR_PROBE_EVERY, 0)
    assert aged == [32] and gen._turnover == 0.0 and gen._streak_inputs == (None, None)
    gen._finished_share(1.0)                                                   # no streak: forget alone
    assert aged == [32] and gen._ar_streak == 0


def test_a_batch_1_streak_does_not_outlive_the_hard_request(monkeypatch):
    """Batch 1, a stream of 64-token requests: two that draft well (per-draft acceptance 0.65),
    three near where AR ties (0.4), a hard one (0.1), two good ones; the AR fallback's decisions as
    ``Scheduler._spec_round`` takes them (a streak's rounds skip the decision until a probe is due
    or the batch changes, ``_streak_goes_on``) and the request boundaries as ``Scheduler.step``
    reports them (``_finished_share(1.0)``). The hard request's streak ends with it: the request
    after it starts afresh and runs no more than a few AR rounds. Without the turnover (patched
    out: ``forget`` alone) the streak went on into it under the stay rule, from a history of the
    near-tie requests and the hard one, at the probe interval the hard request had doubled
    (replayed H100 prices, session 46: a request of 2.08 drafts a round ran 71 AR rounds)."""
    from types import SimpleNamespace
    from dspark_trt.runtime import scheduler as scheduler_module
    from dspark_trt.runtime.survival import SurvivalEstimate
    curve = CostCurve([2, 512], [0.40, 0.40], "flat verify", rows=[1, 64], draft_ms=[0.14, 0.14],
                      ar_ms=[0.31, 0.31])
    llm = _llm(block=7, seed=6, verify_cost=curve, cost_model="trimmed")
    llm.steps.scheduler = VerifyScheduler(7, 4 * 8, "cpu", cost=curve, round_overhead_ms=0.11, cost_model="trimmed")
    stream = [0.65, 0.65, 0.4, 0.4, 0.4, 0.1, 0.65, 0.65]

    def ar_rounds(seed: int) -> list[int]:
        """Each request's AR rounds."""
        gen, rng, seqs = llm.scheduler(), np.random.default_rng(seed), [SimpleNamespace(slot=0)]
        gen._survival = SurvivalEstimate(7, window=32, refresh=1)
        counts = []
        for i, h in enumerate(stream):
            left, ar = 64, 0
            while left > 0:
                goes_on = 0 < gen._ar_streak < max(gen._probe_every, gen._probe_floor) and gen._streak_inputs == i
                stay = gen._ar_streak > 0 or gen._probing
                if goes_on or gen._falls_back_to_ar(seqs, True):
                    gen._ar_streak += 1
                    if stay or goes_on:                     # (Scheduler: the batch and the curve)
                        gen._streak_inputs = i
                    left, ar = left - 1, ar + 1
                    continue
                probing = gen._probing
                gen._end_streak()
                a = int(min(rng.geometric(1 - h) - 1, 7))
                gen._survival.add([a], [7], now=probing)
                left -= a + 1
            gen._finished_share(1.0)
            counts.append(ar)
        return counts

    with_turnover = [ar_rounds(seed) for seed in range(6)]
    assert all(runs[6] <= 8 for runs in with_turnover), with_turnover
    assert sum(runs[5] > 0 for runs in with_turnover) >= 4, with_turnover     # the hard request does fall back
    monkeypatch.setattr(scheduler_module, "STREAK_TURNOVER", float("inf"))
    without = [ar_rounds(seed) for seed in range(6)]
    assert sum(runs[6] > 12 for runs in without) >= 2, without


@pytest.mark.parametrize("hooked", [True, False])
def test_an_admission_prefill_estimates_the_curve_a_finished_request_dropped(monkeypatch, hooked):
    """Batch 1: a finished request drops the survival curve (``forget`` of the whole batch), and
    the next request's prefill estimates it and its decision tables while the prefill runs on the
    device (``Scheduler._decide_during_prefill``), so that request's first decision estimates
    nothing on its round's path; with the hook patched out it does. Nothing estimates it before
    the prefill (``_starts_with_ar`` asks only a fresh estimate)."""
    from dspark_trt.runtime.survival import SurvivalEstimate
    from dspark_trt.runtime.scheduler import Scheduler
    pays = CostCurve([1, 64], [0.5, 0.5], "test: drafting pays", rows=[1, 64], draft_ms=[0.1, 0.1],
                     ar_ms=[1.0, 1.0])
    llm = _llm(block=4, seed=6, batch=1, verify_cost=pays, cost_model="trimmed")
    stage, estimates = ["other"], []

    def staged(name: str, fn):
        def call(*args):
            stage[0] = name
            try:
                return fn(*args)
            finally:
                stage[0] = "other"
        return call
    estimate = SurvivalEstimate._estimate
    monkeypatch.setattr(SurvivalEstimate, "_estimate", lambda self: estimates.append(stage[0]) or estimate(self))
    monkeypatch.setattr(Scheduler, "_falls_back_to_ar", staged("decision", Scheduler._falls_back_to_ar))
    monkeypatch.setattr(Scheduler, "_ready_window", staged("decision", Scheduler._ready_window))
    monkeypatch.setattr(Scheduler, "_decide_during_prefill",
                        staged("prefill", Scheduler._decide_during_prefill) if hooked else lambda self, rows: None)
    gen = llm.scheduler()
    gen.add_request([1, 2, 3], SamplingParams(max_new_tokens=12, verify_mode="scheduled"))
    while gen.has_work():
        gen.step()
    assert gen._survival.dropped and gen._survival.informed        # the finished request dropped it
    gen.add_request([4, 5], SamplingParams(max_new_tokens=12, verify_mode="scheduled"))
    estimates.clear()
    gen.step()                                                       # the admission's prefill
    gen.step()                                                       # the request's first round
    assert gen._round_kind == "fixed"
    assert estimates == (["prefill"] if hooked else ["decision"]), estimates


@pytest.mark.parametrize("batch, curve", [(1, "pays"), (1, "probed"), (12, "pays")])
def test_a_ready_decision_is_the_decision_the_round_would_make(monkeypatch, batch, curve):
    """``Scheduler._ready_window``: where the last host work's decision still holds (the same
    survival curve, rows, cost curve and model, no AR streak or probe), the round reads it in place
    of ``_falls_back_to_ar`` and ``_estimated_window``. A steady stream of scheduled requests runs
    the same rounds, drafts and windows with it as with every decision taken on the round's path
    (``_ready_window`` patched to UNDECIDED), at batch 1 where drafting pays, where AR streaks and
    probes take turns, and at 12 rows (windows from the estimate); where drafting pays at batch 1
    most rounds read it."""
    from dspark_trt.runtime import scheduler as scheduler_module
    from dspark_trt.runtime.scheduler import Scheduler
    costs = {"pays": CostCurve([1, 64], [0.5, 0.5], "test: drafting pays", rows=[1, 64], draft_ms=[0.1, 0.1],
                               ar_ms=[1.0, 1.0]),
             "probed": probed_curve()}
    ready, hits = Scheduler._ready_window, []

    def counted(self, seqs, estimates, sched):
        w = ready(self, seqs, estimates, sched)
        hits.append(w != scheduler_module.UNDECIDED)
        return w

    def run(fast: bool) -> list:
        monkeypatch.setattr(Scheduler, "_ready_window", counted if fast else
                            lambda self, seqs, estimates, sched: scheduler_module.UNDECIDED)
        llm = _llm(block=4, seed=6, batch=batch, verify_cost=costs[curve], cost_model="trimmed")
        gen = llm.scheduler()
        for i in range(3 * batch + 2):
            gen.add_request([1 + i % 7, 2, 3], SamplingParams(max_new_tokens=10 + 7 * (i % 3), verify_mode="scheduled"))
        kinds, done = [], []
        while gen.has_work():
            done += gen.step()
            kinds.append((gen._round_kind, gen._round_width))
        done.sort(key=lambda s: s.request_id)
        return kinds, [(s.output_ids, s.stats.proposed, s.stats.accepted) for s in done]

    slow = run(fast=False)
    hits.clear()
    fast = run(fast=True)
    assert fast == slow
    if curve == "pays":                          # (12 rows: the rows change as requests finish)
        assert sum(hits) >= (0.5 * len(hits) if batch == 1 else 1), (sum(hits), len(hits))
