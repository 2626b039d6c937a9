"""Load test of ``dspark-trt serve --openai`` on the default pair: C concurrent streaming clients x
R requests each (official ``openai`` async client), every text checked against ``LLM.generate``
at temperature 0; requests/s, TTFT and inter-token latency percentiles (client side) to
``benchmarks/results/openai-load-<device>-<commit>.json``.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/openai_load.py --clients 32 --requests 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

from dspark_trt.commands.common import default_pair_dirs
from dspark_trt.openai_server.app import OpenAIServer, build_app
from dspark_trt.openai_server.chat_template import ChatTemplate
from dspark_trt.openai_server.launch import UvicornThread
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "The cat sat", "def main():", "import numpy as np\n", "In 1492,",
           "Hello world", "The quick brown fox", "class Node:", "for i in range(10):", "# TODO:",
           "She said", "x = [", "while True:", "return self.", "The results show", "print("]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50_ms": 1e3 * q[49], "p90_ms": 1e3 * q[89], "p99_ms": 1e3 * q[98], "n": len(values)}


async def one_client(client, jobs, model, ttft, itl, texts, tokens):
    for key, prompt, max_tokens in jobs:
        start, last, parts = time.perf_counter(), None, []
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now = time.perf_counter()
                (ttft if last is None else itl).append(now - (start if last is None else last))
                last = now
                parts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                tokens.append(chunk.usage.completion_tokens)
        texts[key] = "".join(parts)


async def run_load(url, model, clients, requests, max_tokens):
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    jobs = {c: [((c, k), PROMPTS[(c * requests + k) % len(PROMPTS)], max_tokens) for k in range(requests)]
            for c in range(clients)}
    ttft, itl, texts, tokens = [], [], {}, []
    start = time.perf_counter()
    await asyncio.gather(*(one_client(client, jobs[c], model, ttft, itl, texts, tokens)
                           for c in range(clients)))
    return time.perf_counter() - start, ttft, itl, texts, tokens, jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--output-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    target, draft = default_pair_dirs()
    llm = LLM.from_checkpoints(target, draft, device=args.device, max_batch_size=args.max_batch_size)
    server = OpenAIServer(llm, model_name="dspark", chat_template=ChatTemplate.from_dir(target))
    thread = UvicornThread(build_app(server)).start()
    try:
        elapsed, ttft, itl, texts, tokens, jobs = asyncio.run(run_load(thread.url, "dspark", args.clients,
                                                               args.requests, args.max_tokens))
    finally:
        thread.stop()
    expected = {p: llm.generate(p, SamplingParams(max_new_tokens=args.max_tokens))[0].text
                for p in {j[1] for js in jobs.values() for j in js}}
    wrong = [key for js in jobs.values() for key, p, _ in js if texts.get(key) != expected[p]]
    total = args.clients * args.requests
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    result = {"clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
              "max_batch_size": args.max_batch_size, "device": args.device, "commit": commit,
              "requests": total, "wrong_texts": len(wrong), "seconds": elapsed,
              "requests_per_s": total / elapsed,
              "completion_tokens": sum(tokens), "completion_tokens_per_s": sum(tokens) / elapsed,
              "ttft": percentiles(ttft), "inter_chunk_latency": percentiles(itl),
              "note": "client-side times; one chunk per draft-verify round that produced text, so "
                      "a chunk may carry several tokens (completion_tokens / chunks: tokens per chunk)"}
    out = Path(args.output_dir) / f"openai-load-{args.device}-b{args.max_batch_size}-c{args.clients}x{args.requests}-{commit}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {out}")
    if wrong:
        raise SystemExit(f"{len(wrong)} of {total} responses differ from LLM.generate: {wrong[:5]}")


if __name__ == "__main__":
    main()
