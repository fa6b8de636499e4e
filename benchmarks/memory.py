"""Memory: where the KV cache goes under each policy, what sharing saves, and block size.

    python -m benchmarks.memory [--quick] [--part batching|sharing|block-size ...]

batching: per policy, on both traces at the same KV memory, the KV waste (allocated slots
    holding no token, over all allocated slots, summed over every step) and the average
    number of requests batched per step (running groups; the paper's Fig. 13), over all
    steps and over the steps that left requests waiting. Every request arrives at once, so
    the last steps drain the long tail with few requests under any policy; the second
    average leaves them out.
sharing: on the Alpaca-like trace, the share of device blocks that sharing saves for
    parallel sampling n = 2, 4, 6 and beam search of width 2, 4, 6 (Fig. 15): blocks saved
    over the blocks the same sequences would hold without sharing, summed over every step.
block-size: for block sizes 4..256 at the same KV memory (Fig. 18b and 19): offline
    throughput and KV waste of paged memory on both traces; and the time to swap out and
    back in the blocks of a sequence of max_model_len / 2 tokens vs recomputing those tokens
    (a prefill). Waste is mostly the unfilled part of each sequence's last block, about half
    a block, so short sequences (Alpaca-like: about 80 tokens) need small blocks to keep it
    low.

Every number comes from the real engine running SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import gc
import math

from benchmarks import offline, workloads
from benchmarks.timing import print_table, result_name, save_figure, save_text, time_interleaved
from engine import BeamSearchParams, SamplingParams

PARTS = ("batching", "sharing", "block-size")
SHARING_WIDTHS = (2, 4, 6)
BLOCK_SIZES = {False: (4, 8, 16, 64, 256), True: (4, 64, 256)}  # by --quick


def occupancy(engine) -> tuple[int, int, int, int]:
    """(running groups, waiting groups, allocated device slots, tokens in them) after a step."""
    stats = engine.stats()
    return stats.num_running, stats.num_waiting, stats.blocks.slots_allocated, stats.blocks.tokens_stored


def summarise(samples) -> tuple[float, float, float]:
    """Requests batched per step, over all steps and over the steps that left requests waiting
    (when memory or the step budgets, not the trace, limit the batch; NaN if none did); and
    KV waste over all steps."""
    running, _, slots, tokens = (sum(column) for column in zip(*samples))
    queued = [sample[0] for sample in samples if sample[1]]
    return running / len(samples), sum(queued) / len(queued) if queued else math.nan, 1 - tokens / slots


def batching(scale: offline.Scale, dtype: str) -> tuple[list, str]:
    """KV waste and requests batched per step, per trace and policy."""
    _, results = offline.run_policies(scale, dtype=dtype, observe=occupancy)
    summary = {key: summarise(run.samples) for key, run in results.items()}
    rows = sorted(([trace, policy, *values, values[1] / summary[trace, "orca-oracle"][1]]
                   for (trace, policy), values in summary.items()), key=lambda row: row[0])
    headers = ["trace", "policy", "batched requests per step", "batched while requests wait", "KV waste",
               "batched while waiting vs orca-oracle"]
    return rows, print_table(headers, rows)


def blocks_in_use(engine) -> tuple[int, int]:
    """(device blocks in use, blocks that sharing saves) after a step."""
    blocks = engine.stats().blocks
    return blocks.device_blocks_used, blocks.blocks_saved_by_sharing


def sampling(width: int):
    """Request parameters: ``width`` random samples of the trace's output length."""
    return lambda output_len: SamplingParams(n=width, temperature=1.0, max_tokens=output_len, ignore_eos=True)


def beams(width: int):
    """Request parameters: beam search of ``width`` beams to the trace's output length."""
    return lambda output_len: BeamSearchParams(beam_width=width, max_tokens=output_len, ignore_eos=True)


def sharing(scale: offline.Scale, dtype: str) -> tuple[list, str]:
    """Blocks saved by sharing the prompt (parallel sampling) and common prefixes (beam search),
    on the whole Alpaca-like trace. (A quarter of it, as this used to run, drew 32 prompts of
    mean 15 tokens against the trace's 19.3: most then had no full block to share.)"""
    llm = offline.make_llm("paged", scale, dtype=dtype)
    trace = workloads.trace("alpaca", scale.requests["alpaca"], vocab_size=llm.engine.model_config.vocab_size,
                            max_len=scale.max_model_len)
    rows = []
    for mode, params in (("parallel sampling", sampling), ("beam search", beams)):
        for width in SHARING_WIDTHS:
            run = offline.run_trace(llm, trace, params(width), observe=blocks_in_use)
            used, saved = (sum(column) for column in zip(*run.samples))
            rows.append([mode, width, len(trace.prompts), saved / (used + saved)])
            print(f"{mode} {width}: {rows[-1][3]:.1%} saved", flush=True)
    headers = ["mode", "n or beam width", "requests", "memory saved by sharing"]
    return rows, print_table(headers, rows)


def swap_vs_recompute(llm, num_tokens: int, rounds: int) -> tuple[float, float]:
    """Seconds to swap the blocks of a ``num_tokens``-token sequence out to host memory and
    back in (``CacheEngine.apply``), and to recompute its KV instead (a prefill of
    ``num_tokens`` tokens through the engine, sampling one token)."""
    cache = llm.engine.cache
    pairs = [(block, block) for block in range(-(-num_tokens // cache.spec.block_size))]

    def swap():
        cache.apply(swap_out=pairs)
        cache.apply(swap_in=pairs)
        return cache.kv_caches

    prompt = list(range(1000, 1000 + num_tokens))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = time_interleaved({"swap": swap, "recompute": lambda: llm.generate([prompt], params, use_tqdm=False)},
                             rounds=rounds)
    return times["swap"], times["recompute"]


def block_sizes(scale: offline.Scale, dtype: str, sizes, rounds: int) -> tuple[list, str]:
    """Paged throughput and KV waste on both traces, and swap vs recompute, per block size."""
    rows = []
    for block_size in sizes:
        llm = offline.make_llm("paged", scale, dtype=dtype, block_size=block_size)
        runs = {trace.name: offline.run_trace(llm, trace, observe=occupancy)
                for trace in offline.traces(scale, llm.engine.model_config.vocab_size)}
        waste = {name: summarise(run.samples)[2] for name, run in runs.items()}
        swap, recompute = swap_vs_recompute(llm, scale.max_model_len // 2, rounds)
        rows.append([block_size, runs["sharegpt"].tokens_per_s, runs["alpaca"].tokens_per_s, waste["sharegpt"],
                     waste["alpaca"], swap * 1e3, recompute * 1e3, swap / recompute])
        print(f"block size {block_size} done", flush=True)
        del llm
        gc.collect()
    headers = ["block size", "sharegpt tokens/s", "alpaca tokens/s", "sharegpt KV waste", "alpaca KV waste",
               f"swap out+in ms ({scale.max_model_len // 2} tokens)", "recompute ms", "swap / recompute"]
    return rows, print_table(headers, rows)


def plot_batching(rows, name: str):
    """Bars per policy, one colour per trace, for each column of the batching table."""
    import matplotlib.pyplot as plt

    panels = [(2, "requests batched per step (Fig. 13)", 1), (3, "requests batched while others wait", 1),
              (4, "KV waste (% of allocated slots)", 100)]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4))
    traces = sorted({row[0] for row in rows})
    policies = list(dict.fromkeys(row[1] for row in rows))
    width = 0.8 / len(traces)
    for ax, (column, label, unit) in zip(axes, panels):
        for i, trace in enumerate(traces):
            mine = {row[1]: row for row in rows if row[0] == trace}
            ax.bar([p + i * width for p in range(len(policies))], [unit * mine[p][column] for p in policies], width,
                   label=f"{trace}-like")
        ax.set_xticks([p + width * (len(traces) - 1) / 2 for p in range(len(policies))], policies, rotation=30)
        ax.set_ylabel(label)
        ax.legend()
    return save_figure(fig, name)


def plot_sharing(rows, name: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(row[0] for row in rows):
        mine = [row for row in rows if row[0] == mode]
        ax.plot([row[1] for row in mine], [100 * row[3] for row in mine], marker="o", label=mode)
    ax.axhspan(6.1, 9.8, alpha=0.15, color="C0", label="paper: parallel sampling")
    ax.axhspan(37.6, 55.2, alpha=0.15, color="C1", label="paper: beam search")
    ax.set_xlabel("n (parallel samples) or beam width")
    ax.set_ylabel("memory saved by sharing (%)")
    ax.set_title("Alpaca-like trace (Fig. 15)")
    ax.legend()
    return save_figure(fig, name)


def plot_block_sizes(rows, name: str):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    sizes = [row[0] for row in rows]
    for column, label in ((1, "ShareGPT-like"), (2, "Alpaca-like")):
        axes[0].plot(sizes, [row[column] for row in rows], marker="o", label=label)
        axes[1].plot(sizes, [100 * row[column + 2] for row in rows], marker="o", label=label)
    axes[0].set_ylabel("generated tokens/s (Fig. 18b)")
    axes[1].set_ylabel("KV waste (% of allocated slots)")
    axes[2].plot(sizes, [row[5] for row in rows], marker="o", label="swap out + in")
    axes[2].plot(sizes, [row[6] for row in rows], marker="o", label="recompute")
    axes[2].set_ylabel("ms (Fig. 19)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.legend()
    return save_figure(fig, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short traces, a small KV cache, three block sizes")
    parser.add_argument("--part", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    scale = offline.scale(args.quick)
    note = (f"{args.dtype}; KV memory {scale.kv_tokens} tokens, max_model_len {scale.max_model_len}; "
            f"{offline.machine_note()}.")
    parts = {
        "batching": (lambda: batching(scale, args.dtype), plot_batching),
        "sharing": (lambda: sharing(scale, args.dtype), plot_sharing),
        "block-size": (lambda: block_sizes(scale, args.dtype, BLOCK_SIZES[args.quick], 3 if args.quick else 7),
                       plot_block_sizes),
    }
    for part in args.part:
        measure, plot = parts[part]
        rows, table = measure()
        name = result_name(f"memory_{part.replace('-', '_')}", args.quick)
        save_text(f"{note}\n\n{table}", name)
        print(f"wrote {plot(rows, name)}", flush=True)


if __name__ == "__main__":
    main()
