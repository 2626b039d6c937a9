"""model.py logic without a server: request parsing, streaming text, the Triton model over a fake
pb_utils (continuous batching thread, per-request errors, cancellation, metrics)."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dspark_trt.config import get_preset
from dspark_trt.runtime.sampling_params import RequestError, SamplingParams
from dspark_trt.serving.detokenizer import IncrementalText
from dspark_trt.serving.request import parse_request
from dspark_trt.serving.source import ServedModel
from tests.support.fake_pb import FakePB, FakeRequest, ids_request
from tests.support.text_pair import PRESET, make_tiny_text_pair

MAX_SEQ_LEN = 128


# ---- a tiny text model: random-weight checkpoints + a byte-level BPE tokenizer -----------------

@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_tiny_text_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="module")
def source(pair_dirs):
    return ServedModel(checkpoint=str(pair_dirs[0]), draft_checkpoint=str(pair_dirs[1]), device="cpu",
                       dtype="fp32", max_batch_size=4, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def llm(source):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # the model fixture below uses one thread too
    yield source.load()
    torch.set_num_threads(threads)


# ---- request parsing ----------------------------------------------------------------------------

def getter(**inputs):
    return lambda name: None if name not in inputs else np.asarray(inputs[name])


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_parse_text_request_with_all_options():
    r = parse_request(getter(text_input=np.array([b"hi"], dtype=object), max_tokens=np.array([5], np.int32),
                             temperature=np.array([0.5], np.float32), top_p=np.array([0.9], np.float32),
                             seed=np.array([7], np.uint64), stream=np.array([True]),
                             stop=np.array([b"xy", b"z"], dtype=object), stop_ids=np.array([3, 4], np.int32)),
                      encode)
    assert r.prompt_ids == [104, 105]
    assert (r.params.max_new_tokens, r.params.seed, r.params.stop_token_ids) == (5, 7, [3, 4])
    assert r.params.temperature == pytest.approx(0.5) and r.params.top_p == pytest.approx(0.9)
    assert r.stream is True and r.stop == ["xy", "z"]


def test_parse_defaults_with_ids():
    r = parse_request(getter(input_ids=np.array([1, 2, 3], np.int32)), None, default_max_tokens=9)
    assert r.prompt_ids == [1, 2, 3] and r.params.max_new_tokens == 9 and r.params.temperature == 0.0
    assert r.stream is False and r.stop == [] and r.params.seed is None


@pytest.mark.parametrize("inputs, encoder, message", [
    ({}, encode, "missing input"),
    ({"text_input": np.array([b"a"], dtype=object), "input_ids": np.array([1], np.int32)}, encode, "not both"),
    ({"text_input": np.array([b"a"], dtype=object)}, None, "no tokenizer"),
    ({"text_input": np.array([b"\xff"], dtype=object)}, encode, "not valid UTF-8"),
    ({"input_ids": np.array([1.5])}, encode, "'input_ids' has dtype float64"),
    ({"input_ids": np.array([1]), "max_tokens": np.array([-2], np.int32)}, encode, "max_tokens must be a positive"),
    ({"input_ids": np.array([1]), "max_tokens": np.array([1, 2], np.int32)}, encode, "exactly one value"),
    ({"input_ids": np.array([1]), "max_tokens": np.array([1.0], np.float32)}, encode, "'max_tokens' has dtype"),
    ({"input_ids": np.array([1]), "temperature": np.array([-1.0], np.float32)}, encode, "temperature"),
    ({"input_ids": np.array([1]), "top_p": np.array([0.0], np.float32)}, encode, "top_p"),
    ({"input_ids": np.array([1]), "stop": np.array([b""], dtype=object)}, encode, "empty string"),
    ({"input_ids": np.array([1]), "stop": np.array([b"x"], dtype=object)}, None, "need a tokenizer"),
])
def test_parse_rejects_bad_input(inputs, encoder, message):
    with pytest.raises(RequestError, match=message):
        parse_request(getter(**inputs), encoder)


def test_parse_names_max_tokens_over_the_context():
    get = getter(input_ids=np.array([1, 2, 3]), max_tokens=np.array([126], np.int32))
    with pytest.raises(RequestError, match=r"prompt \(3 tokens\) \+ max_tokens \(126\) = 129 exceeds max_seq_len 128"):
        parse_request(get, encode, max_seq_len=128)
    assert parse_request(get, encode, max_seq_len=129).params.max_new_tokens == 126


# ---- incremental text ---------------------------------------------------------------------------

def chunks(ids, rng):
    i = 0
    while i < len(ids):
        n = rng.randint(1, 5)
        yield ids[i:i + n]
        i += n


def test_streamed_text_concatenates_to_final_text(llm):
    """Random ids (many incomplete UTF-8 byte sequences) in random chunks."""
    dec = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(512) for _ in range(rng.randint(1, 40))]
        inc = IncrementalText(dec)
        out = "".join(inc.push(c)[0] for c in chunks(ids, rng)) + inc.finish()
        assert out == dec(ids)


def test_stop_string_cuts_text_and_ids(llm):
    dec = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids = llm.tokenizer.encode("abc defgh ijk lmnop").ids
    full = dec(ids)
    inc = IncrementalText(dec, stop=["gh i"])
    parts, kept_ids = [], []
    for c in chunks(ids, random.Random(2)):
        delta, kept = inc.push(c)
        parts.append(delta)
        kept_ids += c[:kept]
        if inc.stopped:
            break
    parts.append(inc.finish())
    assert "".join(parts) == full[:full.index("gh i")]
    assert "gh i" in dec(kept_ids) and "gh i" not in dec(kept_ids[:-1])     # minimal id prefix


# ---- the model over a fake pb_utils --------------------------------------------------------------

@pytest.fixture(scope="module")
def model(source):
    from dspark_trt.serving.triton_model import DSparkModel
    params = {k: {"string_value": v} for k, v in {**source.to_parameters(), "default_max_tokens": "8",
                                                               "cpu_threads": "1"}.items()}
    m = DSparkModel(FakePB, {"model_config": json.dumps({"name": "dspark", "parameters": params}),
                             "model_version": "1", "model_instance_kind": "CPU"})
    yield m
    m.finalize()
    assert not m.worker.thread.is_alive()


def test_concurrent_requests_match_the_runtime(model, llm):
    """Requests submitted in several execute calls join one batch; each equals LLM.generate."""
    prompts = [[5 + i, 17, 99, 3 + 2 * i] for i in range(6)]
    reqs = [ids_request(p, 10, seed=100 + i, temperature=0.8 if i % 2 else 0.0) for i, p in enumerate(prompts)]
    model.execute(reqs[:3])
    model.execute(reqs[3:])
    want = llm.generate(prompts, [SamplingParams(temperature=0.8 if i % 2 else 0.0, max_new_tokens=10,
                                                 seed=100 + i) for i in range(6)])
    for r, w in zip(reqs, want):
        (resp,) = r.wait()                             # non-streaming: exactly one response
        assert resp.error is None
        assert resp.outputs["output_ids"].tolist() == w.output_ids
        assert resp.outputs["text_output"][0].decode() == llm.decode(w.output_ids)
        assert resp.outputs["finish_reason"][0] == b"length"
        assert resp.outputs["rounds"][0] == w.stats.rounds
        assert resp.outputs["tau"][0] == pytest.approx(w.stats.tau, rel=1e-6)
        np.testing.assert_allclose(resp.outputs["acceptance_per_position"], w.stats.acceptance_per_position(),
                                   rtol=1e-6)


def test_streaming_chunks_concatenate(model, llm):
    r = ids_request([9, 8, 7], 12, seed=3, temperature=1.0, stream=True)
    model.execute([r])
    resps = r.wait()
    want = llm.generate([9, 8, 7], SamplingParams(temperature=1.0, max_new_tokens=12, seed=3))[0]
    assert len(resps) >= 2 and all(x.error is None for x in resps)
    assert sum((x.outputs["output_ids"].tolist() for x in resps), []) == want.output_ids
    assert "".join(x.outputs["text_output"][0].decode() for x in resps) == llm.decode(want.output_ids)
    assert [x.outputs["finish_reason"][0] for x in resps] == [b""] * (len(resps) - 1) + [b"length"]


def test_bad_requests_fail_alone(model):
    good = ids_request([1, 2, 3], 4, seed=1)
    too_long = ids_request(list(range(MAX_SEQ_LEN)), 4)
    out_of_vocab = ids_request([1, 100000], 4)
    missing = FakeRequest(max_tokens=np.array([3], np.int32))
    model.execute([too_long, missing, good, out_of_vocab])
    for r, msg in ((too_long, "exceeds max_seq_len"), (missing, "missing input"),
                   (out_of_vocab, "outside the vocabulary")):
        (resp,) = r.wait()
        assert msg in resp.error.message
    (resp,) = good.wait()
    assert resp.error is None and len(resp.outputs["output_ids"]) == 4


def test_cancelled_request_is_dropped(model):
    r = ids_request([4, 4, 4], MAX_SEQ_LEN - 10, stream=True)
    other = ids_request([6, 6], 5, seed=2)
    model.execute([r])
    assert r.first.wait(60)
    r.cancelled = True
    model.execute([other])
    resps = r.wait()
    assert resps[-1].error is not None and resps[-1].error.code == "CANCELLED"
    got = sum(len(x.outputs["output_ids"]) for x in resps[:-1])
    assert got < MAX_SEQ_LEN - 10                      # stopped before its length limit
    (o,) = other.wait()
    assert o.error is None and len(o.outputs["output_ids"]) == 5
    assert not model.worker.active and not model.worker.gen.running   # its pages were released


def test_stop_string_over_the_model(model, llm):
    base = llm.generate([2, 3, 5], SamplingParams(max_new_tokens=20, seed=0))[0]
    text = llm.decode(base.output_ids)
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                if "\ufffd" not in text[i:i + 2] and text.index(text[i:i + 2]) == i)
    r = ids_request([2, 3, 5], 20, seed=0, stop=np.array([stop.encode()], dtype=object))
    model.execute([r])
    (resp,) = r.wait()
    assert resp.outputs["text_output"][0].decode() == text[:text.index(stop)]
    assert resp.outputs["finish_reason"][0] == b"stop"
    ids = resp.outputs["output_ids"].tolist()
    assert ids == base.output_ids[:len(ids)] and stop in llm.decode(ids)


def test_probe_requests_stay_out_of_the_metrics(model):
    """The supervisor's 1-token probe (request parameter dspark_probe) is answered, not counted."""
    fams = {f.name: f for f in FakePB.MetricFamily.created}
    before = {n: sum(m.value for m in f.metrics) for n, f in fams.items()}
    probes = [ids_request([0], 1), ids_request([0], 10 ** 6)]      # a good one and a bad one
    for r in probes:
        r.parameters = lambda: '{"dspark_probe": true}'
    model.execute(probes)
    (ok,), (bad,) = probes[0].wait(), probes[1].wait()
    assert ok.error is None and len(ok.outputs["output_ids"]) == 1
    assert "exceeds max_seq_len" in bad.error.message
    after = {n: sum(m.value for m in f.metrics) for n, f in fams.items()}
    assert after == before


def test_metrics_count_finished_requests(model):
    fams = {f.name: f for f in FakePB.MetricFamily.created}
    before = {n: sum(m.value for m in f.metrics) for n, f in fams.items()}
    r = ids_request([1, 1, 2], 7, seed=5)
    model.execute([r])
    (resp,) = r.wait()
    after = {n: sum(m.value for m in f.metrics) for n, f in fams.items()}
    assert after["dspark_generated_tokens_total"] - before["dspark_generated_tokens_total"] == 7
    assert after["dspark_spec_rounds_total"] - before["dspark_spec_rounds_total"] == resp.outputs["rounds"][0]
    assert after["dspark_requests_total"] - before["dspark_requests_total"] == 1
    assert 1.0 <= after["dspark_mean_accepted_length"] <= get_preset(PRESET).draft.block_size + 1


def test_generator_abort_frees_pages_and_keeps_others(llm):
    """Scheduler.abort (added for serving): waiting and running requests, pages returned."""
    gen = llm.scheduler()
    free0 = len(gen.kv.free)
    keep = gen.add_request([1, 2, 3], SamplingParams(max_new_tokens=12, seed=9))
    run = gen.add_request([4, 5], SamplingParams(max_new_tokens=12))
    gen.step()                                          # both admitted and running
    wait = gen.add_request([6], SamplingParams(max_new_tokens=12))
    assert gen.abort(wait.request_id).finish_reason == "abort" and wait not in gen.waiting
    assert gen.abort(run.request_id, "cancelled").finish_reason == "cancelled"
    assert run not in gen.running and gen.abort(run.request_id) is None
    assert len(gen.kv.free) == free0 - len(gen.kv.owned[keep.request_id])   # only keep's pages
    while gen.has_work():
        gen.step()
    assert len(gen.kv.free) == free0
    want = llm.generate([1, 2, 3], SamplingParams(max_new_tokens=12, seed=9))[0]
    assert keep.output_ids == want.output_ids
