"""Streams served with the engine on a thread of the server's process, or in a process of its own.

    PYTHONPATH=. python -m benchmarks.engine_process [--quick] [--num-seqs 64,256] [--rounds N]
    PYTHONPATH=. python -m benchmarks.engine_process --gpu     # make bench-gpu: Llama-3.2-1B's shape

The server runs its engine on a thread (``AsyncLLMEngine``, the default) or, with
``--engine-process``, in a child process (``EngineProcess``). This streams N OpenAI completions
at once through the server's OpenAI layer (``OpenAIServing.completion_stream``: the events as
the server writes them, with a usage chunk; no sockets) and times each pass from the first
request to the last event: tokens/s delivered (N times the tokens each, over the pass), the
median over ``rounds`` passes per N after a compiling one. Greedy, ``ignore_eos``, prompts of
32 random tokens, warm-up on (a server's default), ``max_num_seqs`` the largest N.

Model: on a CPU, ``tiny_workload``'s tiny random LLaMA with SmolLM2's tokenizer (texts
streamed), 64 tokens each; with ``--gpu``, random bfloat16 weights in Llama-3.2-1B's shape
(``gpu_throughput``; token ids only, no tokenizer), 128 tokens each, N=256, into
``benchmarks/results/gpu_engine_process.md``. Each mode runs in a fresh subprocess of its own
(on a GPU, two engines in one process would share its memory), the two modes alternating
``--repeats`` times; this process itself never starts JAX on a device until the runs are done.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

COUNTS = {False: (64, 256, 512), True: (64, 256)}  # by --quick
GPU_COUNT = 256  # --gpu: one N, so that both runs fit in a lent GPU's few minutes
MODES = ("thread", "process")


def write_model(directory: pathlib.Path, gpu: bool, quick: bool) -> None:
    """The benchmark's model in ``directory`` (run in a subprocess of its own: it uses JAX);
    ``gpu`` and ``quick``: Llama-3.2-1B's shape with 2 layers and a small vocabulary."""
    if gpu:
        from benchmarks.gpu_throughput import model_config, write_checkpoint
        write_checkpoint(model_config("llama-3.2-1b", quick=quick), directory)
    else:
        from benchmarks.tiny_workload import write_model as write_tiny
        write_tiny(directory)


def run_mode(mode: str, directory: pathlib.Path, counts: list[int], rounds: int, output_tokens: int) -> dict:
    """Seconds of each timed pass per N, with the engine on a thread (``thread``) or in a
    process of its own (``process``)."""
    from benchmarks.server_loop import run_pass
    from benchmarks.tiny_workload import engine_settings, random_prompts
    from engine.config import EngineConfig
    from engine.entrypoints.async_engine import AsyncLLMEngine
    from engine.entrypoints.engine_process import EngineProcess
    from engine.entrypoints.openai_serving import OpenAIServing
    from engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(directory), **{**engine_settings(max(counts), output_tokens), "warmup": True})
    engine = EngineProcess(config) if mode == "process" else AsyncLLMEngine(LLMEngine(config))
    serving, seeds, seconds = OpenAIServing(engine, ["model"]), itertools.count(1), {}
    vocab_size = engine.engine.model_config.vocab_size
    try:
        for count in counts:
            seconds[count] = []
            for timed in [False] + [True] * rounds:  # the first compiles what the warm-up left out
                start = time.perf_counter()
                run_pass(serving, random_prompts(count, vocab_size, next(seeds)), output_tokens)
                if timed:
                    seconds[count].append(time.perf_counter() - start)
    finally:
        engine.shutdown()
    return seconds


def _subprocess(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "benchmarks.engine_process", *args], capture_output=True,
                            text=True)
    if result.returncode:
        raise RuntimeError(f"benchmarks.engine_process {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    return result.stdout


def table_rows(runs: list[tuple[str, dict]], counts: list[int], output_tokens: int) -> list[list]:
    """A row per N and mode: passes, median seconds per pass, tokens/s, and process over thread."""
    rows = []
    for count in counts:
        median = {mode: np.median([s for m, run in runs if m == mode for s in run[str(count)]]) for mode in MODES}
        for mode in MODES:
            passes = [s for m, run in runs if m == mode for s in run[str(count)]]
            rows.append([count, mode, len(passes), " ".join(f"{s:.2f}" for s in passes), f"{median[mode]:.3f}",
                         f"{count * output_tokens / median[mode]:.0f}",
                         f"{median['thread'] / median['process']:.2f}" if mode == "process" else ""])
    return rows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer N and passes, written to *_quick.md")
    parser.add_argument("--gpu", action="store_true", help="Llama-3.2-1B's shape on a GPU, gpu_engine_process.md")
    parser.add_argument("--num-seqs", default=None, help="comma-separated N")
    parser.add_argument("--rounds", type=int, default=None, help="timed passes per N in each run")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each mode, alternating")
    parser.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)  # one mode's run (a subprocess)
    parser.add_argument("--write", action="store_true", help=argparse.SUPPRESS)  # write the model (a subprocess)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    output_tokens = 128 if args.gpu else 64
    counts = ([int(n) for n in args.num_seqs.split(",")] if args.num_seqs
              else [GPU_COUNT] if args.gpu else list(COUNTS[args.quick]))
    rounds = args.rounds or (1 if args.quick or args.gpu else 2)
    if args.write:
        write_model(pathlib.Path(args.model), args.gpu, args.quick)
        return ""
    if args.run:
        print(json.dumps(run_mode(args.run, pathlib.Path(args.model), counts, rounds, output_tokens)))
        return ""
    repeats = args.repeats or (1 if args.gpu else 2)
    start, runs = time.perf_counter(), []
    gpu = ["--gpu"] if args.gpu else []
    common = ["--num-seqs", ",".join(map(str, counts)), "--rounds", str(rounds), *gpu]
    with tempfile.TemporaryDirectory(prefix="engine-process-") as folder:
        _subprocess("--write", "--model", folder, *gpu, *(["--quick"] if args.quick else []))
        for _, mode in itertools.product(range(repeats), MODES):
            runs.append((mode, json.loads(_subprocess("--run", mode, "--model", folder, *common).splitlines()[-1])))
            print(f"{mode}: {runs[-1][1]}", flush=True)
    return report(args, runs, counts, rounds, repeats, output_tokens, time.perf_counter() - start)


def report(args, runs, counts, rounds, repeats, output_tokens, seconds: float) -> str:
    from benchmarks.gpu_report import header, save
    from benchmarks.provenance import machine, revision
    from benchmarks.timing import print_table, result_name, save_text
    from benchmarks.tiny_workload import PROMPT_TOKENS
    model = ("random bfloat16 weights in Llama-3.2-1B's shape (token ids only)" if args.gpu
             else "tiny_workload's tiny random LLaMA, float32, with SmolLM2's tokenizer (texts streamed)")
    note = (f"Machine: {machine()}.  \nEngine: git {revision()}.\n\n"
            f"N OpenAI completion streams at once through `OpenAIServing.completion_stream` (no sockets), "
            f"{PROMPT_TOKENS} random prompt tokens and {output_tokens} greedy tokens each; {model}. The engine on "
            f"a thread of the serving process (`thread`, the default) or in a process of its own (`process`, "
            f"`--engine-process`). Each run a fresh subprocess, modes alternating, {repeats} run(s) each, "
            f"{rounds} timed pass(es) per N per run after a compiling one. Took {seconds:.0f} s.")
    headers = ["N", "engine", "passes", "seconds per pass", "median s", "tokens/s delivered",
               "process speed-up (thread s / process s)"]
    argv = list(sys.argv[1:])
    text = "\n\n".join([header("benchmarks.engine_process", argv), note,
                        print_table(headers, table_rows(runs, counts, output_tokens))])
    if args.gpu:
        save(text, "gpu_engine_process", args.quick)
    else:
        print(f"wrote {save_text(text, result_name('engine_process', args.quick))}")
    return text


if __name__ == "__main__":
    main()
