"""The confidence-scheduling metrics of the OpenAI server (issue #25), scraped from /metrics with
prometheus_client's parser and checked against the responses' ``dspark`` stats: the histogram of
tokens verified per request per round, the admitted-token counter and the acceptance of admitted
drafts. Its own server on the default pair (a fresh registry: the gauge covers these requests)."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="needs the [openai] and [test] extras")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.support.openai_serving import default_pair_llm, serving  # noqa: E402

MODEL = "dspark-default"
HIST = "dspark:spec_decode_verified_tokens_per_round"


@pytest.fixture(scope="module")
def server_url():
    with serving(default_pair_llm(), MODEL) as (_, thread):
        yield thread.url


def scrape(url: str) -> dict:
    """{(sample name, le label or None): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            out[(s.name, s.labels.get("le"))] = s.value
    return out


def test_verified_tokens_histogram_and_admitted_acceptance_match_the_responses(server_url):
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0, timeout=60)
    bodies = [{}, {"verify_mode": "threshold", "confidence_threshold": 0.5},
              {"verify_mode": "threshold", "confidence_threshold": 0.9}, {"verify_mode": "scheduled"}]
    responses = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, extra_body=b)
                 for p in ("def main():", "import os\n") for b in bodies]
    stats = [r.dspark for r in responses]
    m = scrape(server_url)
    n = stats[0]["num_spec_tokens"]
    rounds = sum(s["rounds"] for s in stats)
    assert m[(HIST + "_count", None)] == rounds
    assert m[(HIST + "_sum", None)] == sum(s["proposed"] + s["rounds"] for s in stats)
    for s in stats:                                          # the response's own mean agrees
        assert s["verified_per_round"] == pytest.approx((s["proposed"] + s["rounds"]) / s["rounds"])
    buckets = [m[(HIST + "_bucket", f"{float(b)}")] for b in range(1, n + 2)]
    assert buckets == sorted(buckets) and buckets[-1] == rounds == m[(HIST + "_bucket", "+Inf")]
    assert buckets[n - 1] > 0                  # the 0.9-threshold requests verified fewer than N drafts
    admitted = sum(s["proposed"] for s in stats)
    assert m[("dspark:spec_decode_num_admitted_tokens_total", None)] == admitted
    accepted = sum(s["accepted"] for s in stats)
    assert 0 < accepted < admitted
    assert m[("dspark:spec_decode_admitted_acceptance_rate", None)] == pytest.approx(accepted / admitted)
    for s in stats:
        assert s["admitted_acceptance"] == pytest.approx(s["accepted"] / s["proposed"] if s["proposed"] else 0)
