"""Online serving: the real OpenAI-compatible server under Poisson arrivals (the paper's Fig. 12).

    python -m benchmarks.serving [--quick] [--sharegpt-rates 0.25 0.5 1] [--alpaca-rates 1 2 4 8]
        [--num-scheduler-steps K]   # results in serving_steps{K}[_quick].* when K > 1
        [--engine-process]          # the server's engine in a process of its own: serving_process*

Starts ``python -m engine.serve`` on a free loopback port (with the KV memory and budgets of
the offline benchmarks), then, per trace and request rate, sends the trace's requests at
Poisson arrival times through the official ``openai`` client (``AsyncOpenAI``, streaming
completions of the trace's prompt token ids, ``ignore_eos`` so every output has the trace's
length). Reports throughput, TTFT, TPOT (time per output token after the first), inter-token
latency (between streamed chunks) and end-to-end latency at p50 and p99, and the paper's
normalised latency: the mean over requests of end-to-end latency divided by output length.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

import numpy as np
import openai

from benchmarks import offline, workloads
from benchmarks.timing import print_table, result_name, save_figure, save_text
from tests.engine.server import running_server

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152  # SmolLM2's; prompts are random ids in [100, VOCAB_SIZE - 100)
RATES = {False: {"sharegpt": (0.25, 0.5, 1.0), "alpaca": (1.0, 2.0, 4.0, 8.0)},  # by --quick
         True: {"sharegpt": (0.5, 2.0), "alpaca": (2.0, 8.0)}}


@dataclasses.dataclass(frozen=True)
class Timing:
    """One request: when it was sent (``time.perf_counter``), and in seconds from then, each
    streamed chunk's arrival and the end of the stream; its output tokens."""

    sent: float
    chunks: list[float]
    end: float
    tokens: int

    @property
    def ttft(self) -> float:
        return self.chunks[0]

    @property
    def tpot(self) -> float:
        return (self.end - self.ttft) / max(self.tokens - 1, 1)


def server_args(scale: offline.Scale, num_scheduler_steps: int = 1, engine_process: bool = False) -> list[str]:
    return ["--max-model-len", str(scale.max_model_len), "--num-blocks", str(scale.kv_tokens // 16),
            "--max-num-seqs", str(scale.max_num_seqs), "--max-num-batched-tokens", str(scale.max_num_batched_tokens),
            "--swap-space", "1", "--no-enable-prefix-caching",  # as the paper's vLLM
            "--num-scheduler-steps", str(num_scheduler_steps)] + (["--engine-process"] if engine_process else [])


async def send(client: openai.AsyncOpenAI, prompt: list[int], output_len: int, at: float, origin: float) -> Timing:
    """Wait until ``origin + at``, then stream one completion of exactly ``output_len`` tokens."""
    await asyncio.sleep(max(0.0, origin + at - time.perf_counter()))
    sent = time.perf_counter()
    chunks, tokens = [], 0
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            chunks.append(time.perf_counter() - sent)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if tokens != output_len:
        raise RuntimeError(f"asked for {output_len} tokens, got {tokens}")
    return Timing(sent, chunks, time.perf_counter() - sent, tokens)


async def replay(url: str, trace: workloads.Trace) -> tuple[list[Timing], float]:
    """Every request of ``trace`` at its arrival time; returns their timings and the wall time
    from the first send to the last answer."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=3600, max_retries=0) as client:
        await send(client, trace.prompts[0][:8], 4, 0.0, time.perf_counter())  # warm the server's sampler
        origin = time.perf_counter()
        timings = await asyncio.gather(*(send(client, prompt, n, at, origin) for prompt, n, at in
                                         zip(trace.prompts, trace.output_lens, trace.arrivals)))
    return timings, max(t.sent + t.end for t in timings) - min(t.sent for t in timings)


def summarise(trace: workloads.Trace, rate: float, timings: list[Timing], seconds: float) -> list:
    """One table row: throughput, p50/p99 of each latency (ms; end-to-end in s), normalised latency."""
    def percentiles(values, unit=1e3):
        return [float(np.percentile(values, 50)) * unit, float(np.percentile(values, 99)) * unit]

    gaps = np.concatenate([np.diff(t.chunks) for t in timings])
    tokens = sum(t.tokens for t in timings)
    return [trace.name, rate, len(timings) / seconds, tokens / seconds,
            *percentiles([t.ttft for t in timings]), *percentiles([t.tpot for t in timings]),
            *percentiles(gaps), *percentiles([t.end for t in timings], 1),
            float(np.mean([t.end / t.tokens for t in timings]))]


HEADERS = ["trace", "rate req/s", "served req/s", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
           "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E p50 s", "E2E p99 s", "normalised latency s/token"]


def plot(rows, name: str):
    """Normalised latency against request rate, one panel per trace (the paper's Fig. 12)."""
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(row[0] for row in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(5.5 * len(traces), 4), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        mine = [row for row in rows if row[0] == trace]
        ax.plot([row[1] for row in mine], [row[-1] for row in mine], marker="o")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalised latency (s/token)")
        ax.set_title(f"{trace}-like trace")
    return save_figure(fig, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few short requests at two rates per trace")
    parser.add_argument("--sharegpt-rates", type=float, nargs="+")
    parser.add_argument("--alpaca-rates", type=float, nargs="+")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="the server's multi-step decode")
    parser.add_argument("--engine-process", action="store_true", help="the server's engine in a process of its own")
    args = parser.parse_args()
    scale = offline.scale(args.quick)
    rates = RATES[args.quick] | {name: getattr(args, f"{name}_rates") for name in scale.requests
                                 if getattr(args, f"{name}_rates")}
    note = (f"float32; KV memory {scale.kv_tokens} tokens, max_model_len {scale.max_model_len}; "
            f"num_scheduler_steps {args.num_scheduler_steps}; engine "
            f"{'in a process of its own (--engine-process)' if args.engine_process else 'on a thread'}; "
            f"{offline.machine_note()}.")
    rows = []
    with running_server(*server_args(scale, args.num_scheduler_steps, args.engine_process)) as url:
        for name, count in scale.requests.items():
            for rate in rates[name]:
                trace = workloads.trace(name, count, vocab_size=VOCAB_SIZE, rate=rate, max_len=scale.max_model_len)
                rows.append(summarise(trace, rate, *asyncio.run(replay(url, trace))))
                print(f"{name} at {rate} req/s: normalised latency {rows[-1][-1]:.3f} s/token", flush=True)
    k = args.num_scheduler_steps
    name = "serving" + (f"_steps{k}" if k > 1 else "") + ("_process" if args.engine_process else "")
    name = result_name(name, args.quick)
    save_text(f"{note}\n\n{print_table(HEADERS, rows)}", name)
    print(f"wrote {plot(rows, name)}")


if __name__ == "__main__":
    main()
