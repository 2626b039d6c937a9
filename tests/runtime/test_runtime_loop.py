"""The draft-verify loop with continuous batching: lossless vs per-sequence greedy target decoding,
requests joining / leaving mid-run, streaming, padded rows, KV budget (float64 tiny model, CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_trt.runtime import LLM, RequestError, SamplingParams
from dspark_trt.runtime.cuda_graphs import GraphedSteps, batch_buckets
from dspark_trt.runtime.kv_manager import KVBudgetError, kv_bytes_per_token
from dspark_trt.runtime.networks import EagerNetworks
from dspark_trt.runtime.steps import DecodeSteps, DeviceInputs, RoundInputs

PRESET = "qwen3-tiny-dspark"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3, 3], [5, 6]]
NEW = [12, 7, 16, 3, 10]            # different lengths: requests leave at different rounds
PAGE = 8


@pytest.fixture(scope="module")
def llm():
    return LLM.from_preset(PRESET, dtype=torch.float64, device="cpu", max_batch_size=3,
                           max_seq_len=64, page_size=PAGE)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy target decoding, one sequence at a time, recomputing the whole prefix each token."""
    nets = EagerNetworks(llm.target, None, num_pages=8, page_size=PAGE, device="cpu",
                         dtype=torch.float64)
    table = torch.arange(8)[None]
    out = []
    for prompt, n in zip(PROMPTS, NEW):
        ids = list(prompt)
        for _ in range(n):
            logits, _ = nets.target(torch.tensor([ids]), torch.arange(len(ids))[None], table)
            ids.append(int(logits[0, -1].argmax()))
        out.append(ids[len(prompt):])
    return out


def params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


class ScriptedDraft:
    """Networks whose draft proposes the known greedy continuation with some tokens corrupted, so
    the verifier accepts long prefixes (random weights alone accept almost nothing)."""

    def __init__(self, nets, script: dict[int, tuple[int, list[int]]], every: int = 5):
        self.nets, self.script, self.every = nets, script, every   # first page id -> (L, output)

    def __getattr__(self, name):
        return getattr(self.nets, name)

    def draft_block(self, anchor, start, table, temperature, seed):
        N, V = self.nets.num_spec_tokens, self.nets.vocab_size
        drafts = torch.zeros(anchor.shape[0], N, dtype=torch.int64)
        for b, (page, P) in enumerate(zip(table[:, 0].tolist(), start.tolist())):
            if P < 0:
                drafts[b] = -1
                continue
            L, ref = self.script[page]
            for k in range(N):
                j = P - L + 1 + k                                   # output index of position P+k+1
                tok = ref[j] if j < len(ref) else 0
                drafts[b, k] = (tok + 1) % V if (P + k) % self.every == 0 else tok
        z = torch.nn.functional.one_hot(drafts.clamp(min=0), V).double() * 10
        return drafts, z


def test_spec_batch_equals_per_sequence_greedy(llm, reference):
    outs = llm.generate(PROMPTS, [params(n) for n in NEW])
    assert [o.output_ids for o in outs] == reference
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    assert all(1 <= o.stats.tau <= llm.networks.num_spec_tokens + 1 for o in outs)


def test_autoregressive_mode_equals_greedy(llm, reference):
    outs = llm.generate(PROMPTS, [params(n) for n in NEW], speculative=False)
    assert [o.output_ids for o in outs] == reference
    assert all(o.stats.rounds == 0 for o in outs)


def test_high_acceptance_is_still_lossless(llm, reference):
    gen = llm.scheduler()
    seqs = [gen.add_request(p, params(n)) for p, n in zip(PROMPTS, NEW)]
    script: dict[int, tuple[int, list[int]]] = {}
    gen.steps = DecodeSteps(ScriptedDraft(llm.networks, script))
    while gen.has_work():
        gen.step()
        for s in gen.running:                   # admitted this step: drafted from the next step on
            script[int(s.table_row[0])] = (len(s.prompt_ids), reference[seqs.index(s)])
    assert [s.output_ids for s in seqs] == reference
    accepted = sum(sum(s.stats.accepted) for s in seqs)
    rounds = sum(s.stats.rounds for s in seqs)
    assert accepted / rounds >= 1.5, "the scripted draft should be accepted often"


def test_requests_join_and_leave_mid_run(llm, reference):
    gen = llm.scheduler()
    first = [gen.add_request(PROMPTS[i], params(NEW[i])) for i in (0, 1)]
    for _ in range(3):
        gen.step()
    assert all(s.output_ids for s in first) and gen.running
    late = [gen.add_request(PROMPTS[i], params(NEW[i])) for i in (2, 3, 4)]   # 5 > max batch 3
    finished = []
    while gen.has_work():
        finished += gen.step()
    by_prompt = dict(zip((0, 1, 2, 3, 4), first + late))
    assert [by_prompt[i].output_ids for i in range(5)] == reference
    assert sorted(s.request_id for s in finished + [s for s in first if s not in finished]) \
        == sorted(s.request_id for s in first + late)
    assert len(gen.kv.free) == gen.kv.num_pages and not gen.kv.owned   # every page came back


def test_abort_frees_pages_and_keeps_others(llm, reference):
    gen = llm.scheduler()
    seqs = [gen.add_request(p, params(n)) for p, n in zip(PROMPTS[:3], NEW[:3])]
    gen.step()
    assert gen.abort(seqs[1].request_id) and not gen.abort(seqs[1].request_id)
    while gen.has_work():
        gen.step()
    assert seqs[1].finish_reason == "abort"
    assert seqs[0].output_ids == reference[0] and seqs[2].output_ids == reference[2]
    assert len(gen.kv.free) == gen.kv.num_pages


def test_stream_batch_and_callback_match_generate(llm, reference):
    got: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    reasons = {}
    for c in llm.stream_batch(PROMPTS, [params(n) for n in NEW]):
        assert c.index not in reasons, "no chunk after a request's last chunk"
        got[c.index] += c.token_ids
        if c.finish_reason is not None:
            reasons[c.index] = c.finish_reason
    assert [got[i] for i in range(len(PROMPTS))] == reference
    assert reasons == {i: "length" for i in range(len(PROMPTS))}
    seen: list = []
    outs = llm.generate(PROMPTS[:2], [params(n) for n in NEW[:2]], on_chunk=seen.append)
    for i, o in enumerate(outs):
        assert sum((c.token_ids for c in seen if c.index == i), []) == o.output_ids
    assert list(llm.stream(PROMPTS[1], params(NEW[1]))) and \
        sum(llm.stream(PROMPTS[1], params(NEW[1])), []) == reference[1]


def test_stream_batch_rejects_bad_request_before_running(llm):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.stream_batch([[1, 2], [10**6]], params(4))


def test_padded_rows_are_inert(llm):
    """What the graph buckets rely on: appending inert rows changes no live output and no cache
    entry outside the pad page."""
    steps = DecodeSteps(llm.networks)
    gen = llm.scheduler()
    seqs = [gen.add_request(p, params(8)) for p in PROMPTS[:2]]
    gen.step()                                          # prefill: anchors and pages exist
    live = gen.round_inputs(seqs)
    pad = 2
    inert = dict(anchor=-1, start=-1, seed=0, temperature=0, top_p=1, table=-1)
    padded = RoundInputs(**{f: np.concatenate([getattr(live, f), np.full(
        (pad, *getattr(live, f).shape[1:]), v, dtype=getattr(live, f).dtype)]) for f, v in inert.items()})
    caches = [llm.networks.target_cache, llm.networks.draft_cache]
    snapshot = lambda: [t[:-1].clone() for c in caches for t in c["k"] + c["v"]]  # noqa: E731
    before = snapshot()
    out_live = steps.spec_round(live, mods=False)
    after_live = snapshot()
    for c, t in zip(before, [t for c in caches for t in c["k"] + c["v"]]):
        t[:-1].copy_(c)                                 # restore, then run padded
    out_pad = steps.spec_round(padded, mods=True)  # top-p 1.0 rows: the masked path too
    assert np.array_equal(out_pad[:2], out_live)
    assert (out_pad[2:, 0] == 0).all() and (out_pad[2:, 1:] == -1).all()
    for a, b in zip(after_live, snapshot()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    x = DeviceInputs.from_host(padded, "cpu")
    assert (steps.ar_step(x, mods=False)[2:] == -1).all()


def test_staged_round_is_the_rounds_own_steps(llm):
    """The public round interface bench and profiling time through: ``steps.stage(r)`` runs the
    round's steps, its verify equals ``spec_round`` and its AR step ``ar_round`` (same caches)."""
    from dspark_trt.runtime.steps import verify_window
    steps = DecodeSteps(llm.networks)
    assert steps.eager is steps and steps.replayable(len) is len
    gen = llm.scheduler()
    seqs = [gen.add_request(p, params(8)) for p in PROMPTS[:2]]
    gen.step()
    r = gen.round_inputs(seqs)
    caches = [t for c in (llm.networks.target_cache, llm.networks.draft_cache) for t in c["k"] + c["v"]]
    saved = [t.clone() for t in caches]
    want, want_ar = steps.spec_round(r, mods=False), steps.ar_round(r, mods=False)
    for t, c in zip(caches, saved):
        t.copy_(c)
    st = steps.stage(r)
    N = llm.networks.num_spec_tokens
    assert st.drafts.shape == (2, N) and st.z.shape[:2] == (2, N)
    np.testing.assert_array_equal(st.verify().numpy(), want)
    np.testing.assert_array_equal(st.ar().numpy(), want_ar)
    tokens, pos = verify_window(st.x, st.drafts)
    assert tokens[:, 0].tolist() == r.anchor.tolist() and pos[:, 0].tolist() == r.start.tolist()
    assert (pos[:, 1:] - pos[:, :-1] == 1).all()
    for t, c in zip(caches, saved):
        t.copy_(c)
    from dspark_trt.runtime.cuda_graphs import EAGER_REPLAY
    graphed = GraphedSteps(steps, llm.max_batch_size, llm.max_pages_per_seq, EAGER_REPLAY)
    assert graphed.eager is steps
    st = graphed.stage(r)                               # the static-buffer plumbing on the CPU
    st.verify()
    np.testing.assert_array_equal(graphed.graph("verify", graphed.bucket(2)).outputs[:2].numpy(), want)
    for t, c in zip(caches, saved):
        t.copy_(c)
    for s in seqs:
        gen.abort(s.request_id)


def test_graph_path_skipped_on_cpu_with_reason(llm):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU tests cover the graph path")
    cpu = LLM(llm.pair, llm.target, llm.draft, max_batch_size=2, max_seq_len=32, page_size=PAGE,
              cuda_graphs=True)
    assert "CUDA device" in cpu.graphs_skipped and "cpu" in cpu.graphs_skipped
    assert isinstance(cpu.steps, DecodeSteps)
    with pytest.raises(RuntimeError, match="cannot build CUDA graphs: .*'cpu'"):
        GraphedSteps(DecodeSteps(cpu.networks), 2, 4)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="max_batch_size"):
        batch_buckets(0)


def test_kv_budget(llm):
    per_tok = kv_bytes_per_token(llm.pair, torch.float64)
    t, d = llm.pair.target, llm.pair.draft
    assert per_tok == 2 * 8 * (t.num_hidden_layers * t.num_key_value_heads * t.head_dim
                               + d.num_hidden_layers * d.backbone.num_key_value_heads * d.backbone.head_dim)
    make = lambda **kw: LLM(llm.pair, llm.target, llm.draft, max_batch_size=4, max_seq_len=32,  # noqa: E731
                            page_size=PAGE, **kw)
    per_seq = -(-(32 + llm.networks.num_spec_tokens + 1) // PAGE)
    m = make(kv_cache_bytes=(2 * per_seq + 1) * PAGE * per_tok + 5)
    assert m.networks.num_pages == 2 * per_seq
    assert m.networks.target_cache["k"][0].shape[0] == 2 * per_seq + 1        # + the pad page
    with pytest.raises(KVBudgetError, match=f"needs {per_seq}"):
        make(kv_cache_bytes=per_seq * PAGE * per_tok)                        # no room for the pad page
    with pytest.raises(KVBudgetError, match="CUDA device"):
        make(gpu_memory_utilization=0.5)
    with pytest.raises(KVBudgetError, match="not both"):
        make(kv_cache_bytes=10**9, gpu_memory_utilization=0.5)
    gen = m.scheduler()             # 2 whole budgets fit; pages are reserved as sequences grow,
    seqs = [gen.add_request([1, 2, 3], params(20)) for _ in range(3)]   # so all three start
    gen.step()
    assert len(gen.running) == 3 and not gen.waiting
    while gen.has_work():
        gen.step()
    assert seqs[2].output_ids == seqs[0].output_ids and len(seqs[2].output_ids) == 20
    with pytest.raises(RequestError, match="exceeds max_seq_len"):
        gen.add_request([1] * 30, params(8))
