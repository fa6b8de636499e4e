"""Structured outputs' cost: 32 concurrent chat requests with a JSON schema against the same
requests unconstrained.

    python -m benchmarks.structured_output [--quick] [--rounds N]

Starts ``python -m engine.serve`` on the default model, then sends the 32 requests at once
through the official ``openai`` client (``AsyncOpenAI``, streaming chat completions,
temperature 0.7, seeded, at most ``MAX_TOKENS`` tokens), constrained by ``SCHEMA`` or not,
the two kinds alternating for ``--rounds`` rounds. Constrained requests end when their JSON
object does, so throughput is the completion tokens of all 32 over the time to the last one.
Reports tokens/s and TTFT p50/p99 (medians over the rounds) and the constrained/unconstrained
throughput ratio. Then runs the same constrained requests in this process through ``LLM.chat``
and times llguidance's mask computation (``structured_output.fill_bitmasks``), the host work a
constraint adds to each step, per step.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import time

import jax
import numpy as np
import openai

from benchmarks.timing import print_table, result_name, save_text
from engine import LLM, GuidedDecodingParams, SamplingParams, structured_output
from tests.engine.server import running_server

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 96
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "country", "population", "landmarks"],
    "properties": {"name": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
                   "population": {"type": "integer", "minimum": 0, "maximum": 10**9},
                   "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3}}}
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Rome", "Seoul", "Accra", "Hanoi", "Perth",
          "Dakar", "Riga", "Kyiv", "Bern"]
SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024"]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as a JSON object."}]


async def one(client: openai.AsyncOpenAI, i: int, constrained: bool) -> tuple[float, int]:
    """(TTFT in seconds, completion tokens) of request ``i``."""
    extra = {"guided_json": SCHEMA} if constrained else {}
    sent, first, tokens = time.perf_counter(), None, 0
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages(i), max_tokens=MAX_TOKENS, temperature=0.7, seed=i, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - sent
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first, tokens


async def burst(url: str, num_requests: int, constrained: bool) -> tuple[float, float, float]:
    """(tokens/s, TTFT p50 ms, TTFT p99 ms) of ``num_requests`` sent at once."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, i, constrained) for i in range(num_requests)))
        wall = time.perf_counter() - start
    ttfts = [ttft * 1e3 for ttft, _ in results]
    return sum(tokens for _, tokens in results) / wall, float(np.percentile(ttfts, 50)), float(
        np.percentile(ttfts, 99))


def served(num_requests: int, rounds: int) -> dict[bool, list[float]]:
    """Median (tokens/s, TTFT p50, TTFT p99) by constrained, the two alternating round by round."""
    runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    with running_server(*SERVER_ARGS) as url:
        asyncio.run(burst(url, num_requests, True))  # compiles the masked sampler's programs
        for _ in range(rounds):
            for constrained in (False, True):
                runs[constrained].append(asyncio.run(burst(url, num_requests, constrained)))
    return {kind: [statistics.median(column) for column in zip(*values)] for kind, values in runs.items()}


def mask_cost(num_requests: int) -> tuple[float, float, int]:
    """(ms per step computing masks, ms per constrained row, steps) for the constrained
    requests run offline: llguidance's ``fill_bitmasks`` timed at every step."""
    timings: list[tuple[float, int]] = []
    fill = structured_output.fill_bitmasks

    def timed(matchers, bitmask):
        start = time.perf_counter()
        fill(matchers, bitmask)
        timings.append((time.perf_counter() - start, len(matchers)))

    llm = LLM(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=1024)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=MAX_TOKENS,
                             guided_decoding=GuidedDecodingParams(json=SCHEMA)) for i in range(num_requests)]
    llm.chat([messages(i) for i in range(num_requests)], params, use_tqdm=False)  # compiles, warms the cache
    timings.clear()
    structured_output.fill_bitmasks = timed
    try:
        llm.chat([messages(i) for i in range(num_requests)], params, use_tqdm=False)
    finally:
        structured_output.fill_bitmasks = fill
    seconds, rows = sum(t for t, _ in timings), sum(n for _, n in timings)
    return seconds / len(timings) * 1e3, seconds / rows * 1e3, len(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 requests, 1 round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    num_requests, rounds = (8, 1) if args.quick else (32, args.rounds)
    results = served(num_requests, rounds)
    per_step, per_row, steps = mask_cost(num_requests)
    plain, constrained = results[False], results[True]
    rows = [["unconstrained", *plain, "", ""],
            ["JSON schema", *constrained, f"{per_step:.3f}", f"{per_row * 1e3:.1f}"]]
    table = print_table(["requests", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "mask ms/step", "mask us/row"], rows)
    ratio = constrained[0] / plain[0]
    print(f"constrained / unconstrained throughput: {ratio:.2f} (target >= 0.8); masks timed over {steps} steps")
    machine = f"{os.cpu_count()} CPU cores" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    save_text(f"{num_requests} concurrent streaming chat requests, temperature 0.7, max_tokens {MAX_TOKENS}, "
              f"median of {rounds} alternating rounds (`python -m benchmarks.structured_output`; {machine}, "
              f"JAX {jax.__version__}, {datetime.date.today()}).\n\n{table}\n\n"
              f"Constrained / unconstrained throughput: **{ratio:.2f}**. Mask cost: llguidance's `fill_bitmasks` "
              f"per step with constrained rows, offline, over {steps} steps.",
              result_name("structured_output", args.quick))


if __name__ == "__main__":
    main()
