"""The server's engine loop per decode step: ``host_overhead``'s workload, streamed.

    PYTHONPATH=. python -m benchmarks.server_loop [--quick] [--num-seqs 64,256] [--rounds N]
        [--stream-interval 1,8]

``benchmarks.host_overhead`` drives ``LLMEngine.step()`` and asks for final outputs only, as
``LLM.generate`` does. A server (``python -m engine.serve``) runs the same engine differently:
``AsyncLLMEngine``'s thread steps it, logs its stats (the server's default), hands every
request's output to the request's asyncio stream after each step that returns one, and keeps
a snapshot for ``/metrics``; each request's handler turns its outputs (deltas, ``RequestOutputKind.DELTA``)
into the server-sent events of an OpenAI completion stream
(``OpenAIServing.completion_stream``, with ``stream_options.include_usage``). This measures that loop with the same tiny
model and requests (N prompts of 32 random tokens, 64 greedy tokens each, all submitted at once,
``tiny_workload.engine_settings``), one step per dispatch, with text (``tiny_workload.write_model``:
SmolLM2's tokenizer beside the tiny model), as a server's streams have it.

Per step of the engine thread in which all N sequences decode: the whole step
(``AsyncLLMEngine._step``: the engine's step, the deliveries, the snapshot; median, mean and
90th percentile) and the engine's step alone inside it (median), over ``rounds`` passes after a
compiling one. The handlers run on the main thread's event loop meanwhile, as a server's
do: they share the GIL. The HTTP layer (the sockets) is left out. Each N runs once per
``--stream-interval`` (the engine's ``stream_interval``, the server's ``--stream-interval``:
after its first token, a stream's output every that many tokens): with more than 1, most
steps build and deliver no output, and the mean shows what they cost together.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import pathlib
import sys
import tempfile
import time

import numpy as np

from benchmarks.gpu_report import header
from benchmarks.provenance import machine, revision
from benchmarks.timing import print_table, result_name, save_text
from benchmarks.tiny_workload import (
    MODEL,
    OUTPUT_TOKENS,
    TOKENIZER,
    all_decode,
    engine_settings,
    random_prompts,
    write_model,
)
from engine import LLM
from engine.entrypoints.async_engine import AsyncLLMEngine
from engine.entrypoints.openai_serving import OpenAIServing
from engine.entrypoints.protocol import CompletionRequest

COUNTS = {False: (64, 256, 512), True: (64, 256)}  # by --quick
ROUNDS = {False: 3, True: 2}


class TimedLoop(AsyncLLMEngine):
    """``AsyncLLMEngine`` that times each ``_step`` whose engine state has ``count`` sequences
    all decoding when it starts, once ``recording`` is set: the whole of it, and the engine's
    ``step()`` within it."""

    def __init__(self, engine, count: int):
        self.count, self.whole, self.inner, self.recording = count, [], [], False
        super().__init__(engine)

    def _step(self) -> None:
        timed = self.recording and all_decode(self.engine.state, self.count)
        step, inner = self.engine.step, []

        def timed_step():
            start = time.perf_counter()
            try:
                return step()
            finally:
                inner.append(time.perf_counter() - start)

        self.engine.step = timed_step
        start = time.perf_counter()
        try:
            super()._step()
        finally:
            del self.engine.step
        if timed:
            self.whole.append(time.perf_counter() - start)
            self.inner.append(inner[0])


async def _stream(serving: OpenAIServing, prompt: list[int], output_tokens: int) -> int:
    """Stream one completion as the server does, its events taken; the tokens its usage reports."""
    request = CompletionRequest(prompt=prompt, max_tokens=output_tokens, temperature=0.0, ignore_eos=True,
                                stream=True, stream_options={"include_usage": True})
    events = [event async for event in serving.completion_stream(request)]
    return json.loads(events[-2].removeprefix("data: "))["usage"]["completion_tokens"]


def run_pass(serving: OpenAIServing, prompts: list[list[int]], output_tokens: int) -> None:
    """Every prompt streamed at once until all finish."""
    async def main():
        return await asyncio.gather(*(_stream(serving, prompt, output_tokens) for prompt in prompts))

    got = asyncio.run(main())
    if any(n != output_tokens for n in got):
        raise RuntimeError(f"requests got {sorted(set(got))} tokens, not {output_tokens}")


@dataclasses.dataclass(frozen=True)
class Result:
    interval: int
    count: int
    whole: list[float]
    inner: list[float]

    def row(self) -> list:
        whole, inner = np.median(self.whole) * 1e3, np.median(self.inner) * 1e3
        return [self.interval, self.count, len(self.whole), f"{whole:.2f}", f"{np.mean(self.whole) * 1e3:.2f}",
                f"{np.percentile(self.whole, 90) * 1e3:.2f}", f"{inner:.2f}", f"{whole - inner:.2f}"]


def measure(directory: pathlib.Path, count: int, rounds: int, output_tokens: int, interval: int = 1) -> Result:
    llm = LLM(str(directory), **engine_settings(count, output_tokens), disable_log_stats=False,
              stream_interval=interval)
    loop = TimedLoop(llm.engine, count)
    serving = OpenAIServing(loop, [MODEL])
    try:
        vocab_size, seeds = llm.engine.model_config.vocab_size, itertools.count(1)
        run_pass(serving, random_prompts(count, vocab_size, next(seeds)), output_tokens)  # compiles
        loop.recording = True  # (the compiling pass's last step may still be ending: it is not timed)
        for _ in range(rounds):
            run_pass(serving, random_prompts(count, vocab_size, next(seeds)), output_tokens)
    finally:
        loop.shutdown()
    if not loop.whole:
        raise RuntimeError(f"N={count}: no step in which every sequence decoded")
    result = Result(interval, count, list(loop.whole), list(loop.inner))
    print(f"stream interval {interval}, N={count}: {result.row()}", flush=True)
    return result


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer N and rounds, written to server_loop_quick.md")
    parser.add_argument("--num-seqs", default=None, help="comma-separated N")
    parser.add_argument("--rounds", type=int, default=None, help="timed passes per N (after one to compile)")
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS, help="tokens each request decodes")
    parser.add_argument("--stream-interval", default="1,8", help="comma-separated stream intervals")
    args = parser.parse_args(argv)
    intervals = [int(k) for k in args.stream_interval.split(",")]
    counts = [int(n) for n in args.num_seqs.split(",")] if args.num_seqs else list(COUNTS[args.quick])
    rounds = args.rounds or ROUNDS[args.quick]
    top = header("benchmarks.server_loop", list(sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="server-loop-") as folder:
        write_model(folder)
        results = [measure(pathlib.Path(folder), count, rounds, args.output_tokens, interval)
                   for interval in intervals for count in counts]
    note = (f"Machine: {machine()}.  \nEngine: git {revision()}.\n\n"
            f"`host_overhead`'s workload ({MODEL}, float32, N prompts of 32 random tokens, {args.output_tokens} "
            f"greedy tokens each, all at once, one step per dispatch) through `AsyncLLMEngine` as the server runs "
            f"it: stats logged, outputs streamed as deltas with their text (`{TOKENIZER}`'s tokenizer) to N "
            f"handlers on an asyncio loop that make them OpenAI completion chunks "
            f"(`OpenAIServing.completion_stream`, no sockets). Per "
            f"step of the engine thread in which all N decode, {rounds} passes pooled after a compiling one. "
            f"Stream interval: after its first token, a stream's output every that many tokens "
            f"(`--stream-interval`). "
            f"Took {time.perf_counter() - start:.0f} s.")
    headers = ["stream interval", "N", "steps timed", "median ms per loop step", "mean ms", "p90 ms",
               "of it LLMEngine.step (median ms)", "deliveries and snapshot (ms)"]
    text = "\n\n".join([top, note, print_table(headers, [r.row() for r in results])])
    print(f"wrote {save_text(text, result_name('server_loop', args.quick))}")
    return text


if __name__ == "__main__":
    main()
