"""The OpenAI server's engine thread, stepped by hand: a late abort from a request of a scheduler
that was replaced after a failed step must not hit the new request that reuses its id; a failed
engine answers new requests at once."""
from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("fastapi", reason="needs the [openai] extra")

from dspark_trt.openai_server.engine import (Admitted, EngineThread, Finished, Rejected,  # noqa: E402
                                             RequestHandle, Tokens)
from dspark_trt.runtime.llm import LLM  # noqa: E402
from dspark_trt.runtime.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    return LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_batch_size=2,
                           max_seq_len=64, page_size=8)


def events(loop, handle) -> list:
    loop.run_until_complete(asyncio.sleep(0))                 # deliver what the engine pushed
    out = []
    while not handle.events.empty():
        out.append(handle.events.get_nowait())
    return out


def test_late_abort_of_a_failed_generators_request_does_not_hit_its_successor(llm):
    loop = asyncio.new_event_loop()
    engine = EngineThread(llm)                                # not started: stepped here
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a = RequestHandle([1, 2, 3], params, loop)
    engine.submit(a)
    engine._drain_commands(block=False)

    def broken_step():
        raise RuntimeError("injected step failure")
    engine.scheduler.step = broken_step
    engine._step()                                            # a fails; a fresh scheduler takes over
    b = RequestHandle([4, 5, 6], params, loop)
    engine.submit(b)
    engine.abort(a)                                           # a's client leaves late
    engine._drain_commands(block=False)
    assert a.request_id == b.request_id == 0                  # the new scheduler reuses the id
    while engine.scheduler.has_work():
        engine._step()
    got = events(loop, b)
    assert isinstance(got[0], Admitted) and isinstance(got[-1], Finished)
    assert got[-1].finish_reason == "length"
    assert sum(len(e.token_ids) for e in got if isinstance(e, Tokens)) == 8
    assert [e.finish_reason for e in events(loop, a) if isinstance(e, Finished)] == ["error"]
    loop.close()


def test_a_stopped_engine_rejects_new_requests_at_once(llm):
    loop = asyncio.new_event_loop()
    engine = EngineThread(llm)
    engine.start()
    engine.stop()
    h = RequestHandle([1, 2], SamplingParams(max_new_tokens=4), loop)
    engine.submit(h)
    got = events(loop, h)
    assert len(got) == 1 and isinstance(got[0], Rejected)
    loop.close()
