"""Load test of the OpenAI-compatible server (``dspark-trt serve``): C concurrent streaming clients
x R requests each (the official ``openai`` async client; ``httpx`` where it is not installed,
``--client``), every response checked token for token
against ``LLM.generate`` at temperature 0; requests/s, TTFT, inter-chunk latency and per-request
time per output token (TPOT) percentiles, client side, as JSON (git sha, device, GPU, model
dimensions, command) to ``benchmarks/results/`` or ``$OUT``.

    # CPU, default pair (2 cores: ~1 min)
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/openai_load.py --clients 32 --requests 4
    # H200, Qwen3-8B dimensions with random bf16 weights (token-id prompts, no tokenizer; < 3 min)
    python benchmarks/openai_load.py --model qwen3-8b-dspark-block7 --device cuda --dtype bf16 \
        --max-batch-size 32 --clients 32 --requests 4 --max-tokens 64

Exit status 1 when a response differs from ``LLM.generate`` in fp32 / fp64; in bf16 / fp16 the
mismatches are only reported (``wrong_responses``, ``matching_prefix_mean``): random weights give
near-uniform logits, whose greedy argmax flips with the batch composition's rounding.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_trt.commands.common import default_pair_dirs  # noqa: E402
from dspark_trt.config.dtypes import torch_dtype  # noqa: E402
from dspark_trt.openai_server.app import OpenAIServer, build_app  # noqa: E402
from dspark_trt.openai_server.chat_template import ChatTemplate  # noqa: E402
from dspark_trt.openai_server.launch import UvicornThread  # noqa: E402
from dspark_trt.runtime.llm import LLM  # noqa: E402
from dspark_trt.runtime.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Once upon a time", "The cat sat", "def main():", "import numpy as np\n", "In 1492,",
           "Hello world", "The quick brown fox", "class Node:", "for i in range(10):", "# TODO:",
           "She said", "x = [", "while True:", "return self.", "The results show", "print("]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50_ms": 1e3 * q[49], "p90_ms": 1e3 * q[89], "p99_ms": 1e3 * q[98],
            "mean_ms": 1e3 * statistics.fmean(values), "n": len(values)}


async def openai_stream(client, model, prompt, max_tokens):
    """The official ``openai`` async client's completion stream, as plain dicts."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"return_token_ids": True})
    async for chunk in stream:
        yield chunk.model_dump()


async def httpx_stream(client, model, prompt, max_tokens):
    """The same request over ``httpx`` (server-sent events parsed here), where ``openai`` is not
    installed (the H200 image has httpx but not the openai client)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:].strip() == "[DONE]":
                break
            yield json.loads(line[6:])


async def one_client(stream, client, jobs, model, stats, results):
    for key, prompt, max_tokens in jobs:
        start, last, chunks = time.perf_counter(), None, 0
        ids, first = None, None
        async for chunk in stream(client, model, prompt, max_tokens):
            now = time.perf_counter()
            for c in chunk.get("choices") or []:
                if c.get("text") or c.get("finish_reason") is None:
                    if last is None:
                        first = now - start
                        stats["ttft"].append(first)
                    else:
                        stats["itl"].append(now - last)
                    last, chunks = now, chunks + 1
                if c.get("finish_reason") is not None:
                    ids = c.get("token_ids")
        results[key] = ids
        e2e = time.perf_counter() - start
        stats["e2e"].append(e2e)
        if ids and len(ids) > 1 and first is not None:
            stats["tpot"].append((e2e - first) / (len(ids) - 1))
        stats["chunks"] += chunks


def client_kind() -> str:
    """"openai" (the official client) where installed, else "httpx"."""
    return "openai" if importlib.util.find_spec("openai") else "httpx"


async def run_load(url, model, prompts, clients, requests, max_tokens, kind="openai"):
    if kind == "openai":
        import openai
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        stream = openai_stream
    else:
        import httpx
        client = httpx.AsyncClient(base_url=url, timeout=600,
                                   limits=httpx.Limits(max_connections=clients + 1))
        stream = httpx_stream
    jobs = {c: [((c, k), prompts[(c * requests + k) % len(prompts)], max_tokens) for k in range(requests)]
            for c in range(clients)}
    stats = {"ttft": [], "itl": [], "e2e": [], "tpot": [], "chunks": 0}
    results: dict = {}
    start = time.perf_counter()
    try:
        await asyncio.gather(*(one_client(stream, client, jobs[c], model, stats, results)
                               for c in range(clients)))
    finally:
        await client.close() if kind == "openai" else await client.aclose()
    return time.perf_counter() - start, stats, results, jobs


def load_llm(args) -> tuple[LLM, list, object]:
    """(the model, the prompts, the chat template): the default pair with text prompts, or a preset
    with random weights and token-id prompts."""
    dtype = torch_dtype(args.dtype)
    kw = dict(device=args.device, dtype=dtype, max_batch_size=args.max_batch_size,
              max_seq_len=args.max_seq_len)
    if args.model is None:
        target, draft = default_pair_dirs()
        return LLM.from_checkpoints(target, draft, **kw), PROMPTS, ChatTemplate.from_dir(target)
    llm = LLM.from_preset(args.model, **kw)
    rng = random.Random(0)
    V = llm.pair.target.vocab_size
    prompts = [[rng.randrange(V) for _ in range(rng.randint(16, 64))] for _ in range(16)]
    return llm, prompts, None


def git(*cmd) -> str:
    return subprocess.run(["git", *cmd], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a preset (random weights); default: the default pair")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--client", choices=("openai", "httpx"), default=None,
                    help="the load's HTTP client (default: openai where installed, else httpx)")
    ap.add_argument("--output-dir", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    kind = args.client or client_kind()
    commit = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    t0 = time.perf_counter()
    llm, prompts, template = load_llm(args)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if hasattr(llm.steps, "capture"):             # CUDA graphs: every bucket now, not mid-load
        llm.steps.capture(speculative=llm.networks.num_spec_tokens > 0)
    capture_s = time.perf_counter() - t0
    name = args.model or "default-pair"
    server = OpenAIServer(llm, model_name="dspark", chat_template=template)
    thread = UvicornThread(build_app(server)).start()
    try:   # one warm-up request (CUDA graphs capture lazily), then the load
        asyncio.run(run_load(thread.url, "dspark", prompts[:1], 1, 1, 4, kind))
        elapsed, stats, results, jobs = asyncio.run(run_load(thread.url, "dspark", prompts, args.clients,
                                                             args.requests, args.max_tokens, kind))
        preemptions = server.engine.scheduler.preemptions
    finally:
        thread.stop()
    unique = list({json.dumps(j[1]): j[1] for js in jobs.values() for j in js}.values())
    refs = llm.generate(unique, SamplingParams(max_new_tokens=args.max_tokens))
    expected = {json.dumps(p): o.output_ids for p, o in zip(unique, refs)}
    wrong = [key for js in jobs.values() for key, p, _ in js if results.get(key) != expected[json.dumps(p)]]
    prefix = [next((i for i, (a, b) in enumerate(zip(results.get(key) or [], expected[json.dumps(p)]))
                    if a != b), len(expected[json.dumps(p)])) for js in jobs.values() for key, p, _ in js]
    total = args.clients * args.requests
    tokens = sum(len(v or []) for v in results.values())
    import torch
    t = llm.pair.target
    result = {"model": name, "clients": args.clients, "requests_per_client": args.requests,
              "max_tokens": args.max_tokens, "max_batch_size": args.max_batch_size,
              "max_seq_len": args.max_seq_len, "device": args.device, "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "commit": commit, "dirty": dirty, "client": kind,
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "target_dims": {"hidden": t.hidden_size, "layers": t.num_hidden_layers,
                              "heads": t.num_attention_heads, "kv_heads": t.num_key_value_heads,
                              "vocab": t.vocab_size},
              "num_spec_tokens": llm.networks.num_spec_tokens, "load_seconds": load_s,
              "graph_capture_seconds": capture_s,
              "requests": total, "wrong_responses": len(wrong),
              "matching_prefix_mean": statistics.fmean(prefix), "seconds": elapsed,
              "requests_per_s": total / elapsed, "completion_tokens": tokens,
              "completion_tokens_per_s": tokens / elapsed, "chunks": stats["chunks"],
              "preemptions": preemptions,
              "ttft": percentiles(stats["ttft"]), "inter_chunk_latency": percentiles(stats["itl"]),
              "tpot": percentiles(stats["tpot"]), "e2e": percentiles(stats["e2e"]),
              "note": "client-side times; a chunk carries the tokens of one draft-verify round, so "
                      "inter_chunk_latency is per round and tpot = (e2e - ttft) / (tokens - 1) per "
                      "request is the per-token figure"}
    out = Path(args.output_dir) / (f"openai-load-{name}-{args.device}-b{args.max_batch_size}-"
                                   f"c{args.clients}x{args.requests}-{commit}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {out}")
    if wrong and args.dtype not in ("fp32", "fp64"):
        print(f"{len(wrong)} of {total} responses differ from LLM.generate ({args.dtype}: reported only)")
    if wrong and args.dtype in ("fp32", "fp64"):
        raise SystemExit(f"{len(wrong)} of {total} responses differ from LLM.generate: {wrong[:5]}")


if __name__ == "__main__":
    main()
