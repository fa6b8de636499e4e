"""Requests queued behind a full batch: more prompts than ``max_num_seqs``, as ``LLM.generate``
of a large prompt list, or a server under load, runs them.

    PYTHONPATH=. python -m benchmarks.queued [--quick] [--num-seqs 64,256] [--rounds N]

Model: ``host_overhead``'s tiny random LLaMA (``benchmarks.tiny_workload``), float32, so that the
engine's own cost shows. Workload: 4N requests of 32 random prompt tokens, all submitted at once,
each decoding a seeded random number of tokens from 16 to 96 (56 on average, ``ignore_eos``,
final outputs only), greedy or seeded sampling (temperature 0.8, top_p 0.9), through an engine
of ``max_num_seqs`` N with KV blocks for N sequences at full length: most of the run, N decode
and the rest wait for a seat, which a finished request frees. Two engines per N, one with
async scheduling (the default) and one without, their passes alternating in one process after
a compiling pass each.

The table gives, per N, mode and async scheduling: tokens generated per second over a pass
(the median pass), engine steps per pass, the share of them taken from a lookahead
(``engine.async_scheduling``: the step dispatched before the one before it was recorded), and
the median ms of the steps that only decoded while requests waited. Async scheduling can
dispatch a lookahead while requests wait once the step before admitted all that fit
(``SchedulerState.queue_settled``); before that, a queue turned it off and every step waited
for the one before it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import pathlib
import sys
import tempfile
import time

import numpy as np

from benchmarks import provenance
from benchmarks.gpu_report import header
from benchmarks.timing import print_table, result_name, save_text
from benchmarks.tiny_workload import (
    BLOCK_SIZE,
    MODEL,
    MODES,
    PROMPT_TOKENS,
    engine_settings,
    random_prompts,
    write_model,
)
from engine import LLM, RequestOutputKind, SamplingParams, gc_freeze

COUNTS = {False: (64, 256), True: (16, 64)}  # N (max_num_seqs), by --quick
ROUNDS = {False: 3, True: 1}
QUEUE = 4  # requests per seat
OUTPUT_TOKENS = (16, 96)  # each request's, drawn uniformly (inclusive): to the model's 128 positions
SCHEDULING = {"async": True, "sync": False}
QUEUED_MODES = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass: its seconds, tokens generated, steps, steps taken from lookaheads, and the
    seconds of each step that only decoded while requests waited."""

    seconds: float
    tokens: int
    steps: int
    lookahead_steps: int
    queued_decode_seconds: list[float]


def requests(count: int, vocab_size: int, mode: str, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """``count`` random prompts with their parameters: ``mode``'s sampling (seeded), a random
    number of new tokens each, the final output only."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1, count).tolist()
    sampling = {**MODES[mode], "output_kind": RequestOutputKind.FINAL_ONLY, "ignore_eos": True}
    return [(prompt, SamplingParams(**sampling, max_tokens=n, **({"seed": i} if sampling["temperature"] else {})))
            for i, (prompt, n) in enumerate(zip(random_prompts(count, vocab_size, seed), lengths))]


_ids = itertools.count()


def run_pass(llm: LLM, batch: list[tuple[list[int], SamplingParams]]) -> Pass:
    """Submit ``batch`` at once and step the engine until every request ends, timing each step."""
    engine, counters = llm.engine, llm.engine.counters
    for prompt, params in batch:
        engine.add_request(f"queued-{next(_ids)}", prompt, params)
    tokens, steps, taken = counters.generation_tokens, counters.steps, counters.lookahead_steps
    queued_decodes = []
    start = time.perf_counter()
    with gc_freeze.older_objects_frozen():  # as LLM.generate and the server run
        while engine.has_unfinished_requests():
            waiting, prompt_tokens = bool(engine.state.waiting), counters.prompt_tokens
            step_start = time.perf_counter()
            for output in engine.step():
                if output.error:
                    raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            if waiting and counters.prompt_tokens == prompt_tokens:
                queued_decodes.append(time.perf_counter() - step_start)
    return Pass(time.perf_counter() - start, counters.generation_tokens - tokens, counters.steps - steps,
                counters.lookahead_steps - taken, queued_decodes)


def measure(directory: pathlib.Path, count: int, rounds: int) -> list[list]:
    """Table rows for ``count`` seats: each mode with async scheduling and without."""
    output_len = OUTPUT_TOKENS[1]
    llms = {name: LLM(str(directory), **{**engine_settings(count, output_len), "async_scheduling": on})
            for name, on in SCHEDULING.items()}
    vocab_size = llms["async"].engine.model_config.vocab_size
    seeds = itertools.count(1)
    for mode, llm in itertools.product(QUEUED_MODES, llms.values()):  # compiles every program a pass runs
        run_pass(llm, requests(QUEUE * count, vocab_size, mode, next(seeds)))
    passes: dict[tuple[str, str], list[Pass]] = {}
    for _ in range(rounds):
        for mode in QUEUED_MODES:
            batch = requests(QUEUE * count, vocab_size, mode, next(seeds))  # the same for both engines
            for name, llm in llms.items():
                passes.setdefault((mode, name), []).append(run_pass(llm, batch))
    rows = []
    for (mode, name), runs in passes.items():
        median = sorted(runs, key=lambda run: run.tokens / run.seconds)[len(runs) // 2]
        decodes = [s for run in runs for s in run.queued_decode_seconds]
        rows.append([count, QUEUE * count, mode, name, f"{median.tokens / median.seconds:.0f}", median.steps,
                     f"{100 * median.lookahead_steps / median.steps:.0f}%",
                     f"{np.median(decodes) * 1e3:.2f}" if decodes else "n/a"])
        print(f"N={count} {mode} {name}: {rows[-1][4]} tokens/s, {rows[-1][6]} of {median.steps} steps from "
              f"lookaheads, {rows[-1][7]} ms per queued decode step", flush=True)
    return rows


HEADERS = ["N (max_num_seqs)", "requests", "mode", "scheduling", "tokens/s (median pass)", "steps per pass",
           "steps from lookaheads", "median ms per decode step while requests wait"]


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print the table and write it; return the text."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small N and one round, written to queued_quick.md")
    parser.add_argument("--num-seqs", default=None, help="comma-separated N (max_num_seqs), a row each per mode")
    parser.add_argument("--rounds", type=int, default=None, help="timed passes per engine and mode")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.num_seqs.split(",")] if args.num_seqs else list(COUNTS[args.quick])
    rounds = args.rounds or ROUNDS[args.quick]
    top = header("benchmarks.queued", list(sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="queued-") as folder:
        directory = write_model(folder)
        rows = [row for count in counts for row in measure(directory, count, rounds)]
    note = (f"Machine: {provenance.machine()}.  \nEngine: git {provenance.revision()}.\n\n"
            f"Random `{MODEL}`, float32; {QUEUE}N requests of {PROMPT_TOKENS} random prompt tokens, "
            f"{OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} new tokens each (seeded, uniform; ignore_eos; final outputs "
            f"only), all submitted at once, through an engine of max_num_seqs N (KV blocks for N at full length, "
            f"block size {BLOCK_SIZE}, prefix caching on): most steps, N decode while the rest wait for a seat. "
            f"greedy: temperature 0; sampled: temperature 0.8, top_p 0.9, seeded. async / sync: async scheduling "
            f"on (the default) or off, two engines whose passes alternate, {rounds} timed pass(es) each after a "
            f"compiling one. Took {time.perf_counter() - start:.0f} s.")
    text = "\n\n".join([top, note, print_table(HEADERS, rows)])
    print(f"wrote {save_text(text, result_name('queued', args.quick))}")
    return text


if __name__ == "__main__":
    main()
