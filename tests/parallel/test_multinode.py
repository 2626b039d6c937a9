"""Multi-node launches on CPU over gloo: two torchrun agents ("nodes", --nnodes 2, distinct
--node-rank) x 2 processes on this machine, one c10d rendezvous (``tests/support/multinode.py``).

The tensor-parallel group (TP = 4) spans both nodes. ``generate`` and ``serve`` (rank 0 serves
HTTP, the 3 others, 2 of them on the other node, follow) give the tokens one process gives:
the built-in default pair (8 heads, 4 KV heads: divisible by 4) in float64, greedy.

With c10d, torchrun ignores --node-rank: the rendezvous numbers the nodes (GROUP_RANK, by host
name and agent pid), so the tests find which agent got node 0 instead of assuming it.
"""
from __future__ import annotations

import json

import pytest
import torch

from dspark_trt.runtime.sampling_params import SamplingParams
from tests.support.multinode import NODES, PROCS, Nodes
from tests.support.ports import free_port, wait_serving

WORLD = NODES * PROCS
PROMPT, TOKENS = [5, 6, 7, 8], 16
MODEL = ["--device", "cpu", "--dtype", "fp64", "--max-batch-size", "1", "--max-seq-len", "64"]
LAUNCH_TIMEOUT_S = 300                      # ~45 s on 2 loaded cores: 4 ranks + 2 agents start


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """What one process generates (greedy) for PROMPT."""
    from tests.support.openai_serving import default_pair_llm   # imports the server (fastapi)
    llm = default_pair_llm(dtype=torch.float64, device="cpu", max_batch_size=1, max_seq_len=64)
    return llm.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS))[0].output_ids


def _check_ranks(nodes: Nodes) -> int:
    """The 4 ranks: distinct RANK 0..3, LOCAL_RANK 0..1 on each node, node ranks 0 / 1 (GROUP_RANK),
    one rendezvous; -> the agent (its --node-rank) that got node 0, i.e. holds RANK 0."""
    recs = nodes.ranks()
    assert [int(r["RANK"]) for r in recs] == list(range(WORLD)), nodes.tails()
    agents = {a.pid: n for n, a in enumerate(nodes.agents)}     # agent pid -> its --node-rank
    by_agent: dict[int, list[dict]] = {}
    for r in recs:
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["GROUP_WORLD_SIZE"]) == (str(WORLD), str(PROCS), str(NODES))
        by_agent.setdefault(agents[r["agent_pid"]], []).append(r)     # KeyError: not our agents' child
    assert sorted(by_agent) == list(range(NODES))
    node_of = {}
    for agent, group in by_agent.items():
        assert sorted(int(r["LOCAL_RANK"]) for r in group) == list(range(PROCS))
        (node,) = {int(r["GROUP_RANK"]) for r in group}                     # one node rank per agent
        node_of[agent] = node
        for r in group:
            assert int(r["RANK"]) == node * PROCS + int(r["LOCAL_RANK"])
            assert r["launch"] == (f"rank {r['RANK']} of {WORLD} (node {node} of {NODES}, local rank "
                                   f"{r['LOCAL_RANK']} of {PROCS})")         # parallel.topology's reading
    assert sorted(node_of.values()) == list(range(NODES))
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"], r["TORCHELASTIC_RUN_ID"]) for r in recs}) == 1
    return next(agent for agent, node in node_of.items() if node == 0)


def test_generate_on_two_nodes_equals_one_process(tmp_path, reference):
    argv = ["generate", "--tp-size", str(WORLD), *MODEL, "--max-new-tokens", str(TOKENS), "--json",
            "--prompt-ids", ",".join(map(str, PROMPT))]
    with Nodes(argv, tmp_path) as nodes:
        rcs = nodes.wait(LAUNCH_TIMEOUT_S)
        assert rcs == [0] * NODES, nodes.tails()
        leader = _check_ranks(nodes)
        printed = [[json.loads(x) for x in nodes.output(n).splitlines() if x.startswith("{")]
                   for n in range(NODES)]
    assert len(printed[leader]) == 1 and printed[1 - leader] == [], printed   # RANK 0 prints, once
    assert printed[leader][0]["output_ids"] == reference


@pytest.mark.slow
def test_serve_on_two_nodes_answers_as_one_process(tmp_path, reference):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    port = free_port()
    argv = ["serve", "--tp-size", str(WORLD), *MODEL, "--port", str(port), "--model-name", "tp4"]
    url = f"http://127.0.0.1:{port}"
    with Nodes(argv, tmp_path) as nodes:
        wait_serving(url, nodes.alive, nodes.tails, LAUNCH_TIMEOUT_S)
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tp4", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        leader = _check_ranks(nodes)
        banner = f"rank 0 of {WORLD} (node 0 of {NODES}, local rank 0 of {PROCS}) serves HTTP"
        assert banner in nodes.output(leader) and banner not in nodes.output(1 - leader)
    assert r.json()["choices"][0]["token_ids"] == reference
