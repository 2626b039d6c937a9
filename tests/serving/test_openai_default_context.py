"""The OpenAI server with the default max_seq_len (#22: the model's context where a wide block
table costs nothing, as with Qwen3 on CUDA; 2,048 on this CPU): ``/v1/models`` reports it, and a
request longer than it gets a 400 naming the field (prompt + max_tokens, or the prompt alone)."""
from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dspark_trt.config.source import DEFAULT_MAX_SEQ_LEN, default_pair_dirs  # noqa: E402
import dspark_trt.runtime.llm as llm_mod  # noqa: E402
from dspark_trt.runtime.llm import LLM  # noqa: E402
from tests.support.openai_serving import serving  # noqa: E402

pytestmark = pytest.mark.skipif(default_pair_dirs() is None, reason="the default pair is not shipped here")


@pytest.mark.parametrize("cheap_width", [False, True], ids=["cpu", "as-on-cuda"])
def test_default_context_and_longer_requests_get_400(monkeypatch, cheap_width):
    target, draft = default_pair_dirs()
    if cheap_width:
        monkeypatch.setattr(llm_mod, "table_width_cost", lambda pair, device: None)
    llm = LLM.from_checkpoints(target, draft, max_batch_size=2)
    context = 4096 if cheap_width else DEFAULT_MAX_SEQ_LEN
    assert llm.pair.target.max_position_embeddings == 4096 and llm.max_seq_len == context
    with serving(llm, "m") as (_, thread), httpx.Client(base_url=thread.url, timeout=60) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == context
        r = c.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        r = c.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": context - 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens" and f"{context} tokens" in err["message"]
        r = c.post("/v1/completions", json={"model": "m", "prompt": [5] * context, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert c.get("/health").status_code == 200                      # still up
