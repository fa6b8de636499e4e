"""Offline throughput: this engine against Hugging Face ``generate``, and the paper's baselines.

    python -m benchmarks.throughput chat        # the targets: 32 chat prompts, 128 tokens each
    python -m benchmarks.throughput traces      # ShareGPT-like and Alpaca-like traces, per policy

Everything is measured in one run on one machine, and compared as ratios. ``ignore_eos`` makes
every system generate the same number of tokens.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_paged
from benchmarks import offline, workloads
from benchmarks.timing import print_table, result_name, save_figure, save_text, time_interleaved
from engine import LLM, SamplingParams
from engine.worker import huge_pages


def engine_run(llm: LLM, prompts, output_lens) -> tuple[float, int]:
    """Seconds to generate ``output_lens[i]`` tokens for every prompt at once, and tokens made.
    The prefix cache starts empty, so every round computes what the first did."""
    llm.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def decode_rate(llm: LLM, prompt, max_tokens: int) -> tuple[float, float]:
    """One sequence: (tokens/s over the whole request, tokens/s after its first token). The
    second leaves out the prompt phase, as llama.cpp's ``tg`` rate does, so it is what the
    memory-bandwidth bound (one pass over the weights per token) describes. The prefix cache
    starts empty."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens, metrics = len(output.outputs[0].token_ids), output.metrics
    return tokens / seconds, (tokens - 1) / (metrics.finished_time - metrics.first_token_time)


def memory_bandwidth(gigabytes: float = 0.5) -> float:
    """Bytes per second a jitted sum reads from a float32 array far larger than the caches,
    on every core (the same way the model's matrix-vector products read their weights), on
    the same kind of pages as the engine's weights (:mod:`engine.worker.huge_pages`): the sum reads
    faster from huge pages too, and the bound must not count that as the engine's gain."""
    data = jnp.ones(int(gigabytes * 2**30) // 4, jnp.float32)
    if huge_pages.enabled():
        huge_pages.back_with_huge_pages([data])
    total = jax.jit(jnp.sum)
    seconds = time_interleaved({"sum": lambda: total(data)}, rounds=9, min_seconds=0)["sum"]
    return data.nbytes / seconds


def weight_bytes(llm: LLM) -> int:
    """Bytes of weights one greedy decode step reads: every parameter once, but the token
    embeddings only when they are the head too (otherwise a step reads one row of them; with
    packed weights a tied embedding has a packed copy as the head), a float32 head's bfloat16
    screen instead of the head where it has one (:func:`pallas_paged.argmax_head`: a greedy
    step reads the screen, and a few of the head's rows), and none of the RoPE tables (a row
    each)."""
    params = llm.engine.runner.params
    read = {key: value for key, value in params.items()
            if key != "rope" and (key != "embed" or "lm_head" not in params)}
    if "screen" in read.get("lm_head", {}):
        read["lm_head"] = {key: value for key, value in read["lm_head"].items() if key != "w"}
    return sum(leaf.nbytes for leaf in jax.tree.leaves(read))


def matvec(dtype: str, rows=(1, 2, 8, 32), *, packed: bool = False) -> list[list]:
    """The rate of SmolLM2's per-layer products ([rows, in] x [in, out] for each weight; 30
    distinct layers, so the weights come from memory, not the caches) per weight dtype and
    row count: XLA:CPU's (why the runner gives its 16-bit products at least two rows), or
    with ``packed`` the native product on packed weights (what the engine runs)."""
    shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
    rng = np.random.default_rng(0)
    weights = [[jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes] for _ in range(30)]
    widths = [[w.shape[0] for w in layer] for layer in weights]
    if packed:
        weights = [[pallas_paged.pack(w) for w in layer] for layer in weights]
    nbytes = sum(w.nbytes for layer in weights for w in layer)

    @jax.jit
    def products(x, weights):
        return [pallas_paged.matmul(x[:, :k], w) for layer, ks in zip(weights, widths) for w, k in zip(layer, ks)]

    inputs = {m: jnp.ones((m, 1536), jnp.float32) for m in rows}
    times = time_interleaved({m: functools.partial(products, inputs[m], weights) for m in rows}, rounds=5)
    name = f"{dtype} weights, packed," if packed else f"{dtype} weights"
    return [[f"{name} x {m} rows", nbytes, times[m] * 1e3, nbytes / times[m] / 1e9] for m in rows]


# A decode's bandwidth is the mean of the readings just before and just after it; when those
# differ by more than this share, the machine changed state during the decode (it flips between
# about 30 and 50 GB/s within minutes), and the decode's ratio, which divides a rate from one
# state by a bound from the other, is left out (one run's ratios ranged from 0.54 to 1.21 so).
STEADY_TOLERANCE = 0.2


def steady_samples(samples: list[tuple], tolerance: float = STEADY_TOLERANCE) -> list[tuple]:
    """The samples ``(bandwidth before, bandwidth after, ...)`` whose two readings agree within
    ``tolerance`` (the larger at most ``1 + tolerance`` times the smaller); all of them if none do,
    rather than no result."""
    kept = [sample for sample in samples if max(sample[:2]) <= (1 + tolerance) * min(sample[:2])]
    return kept or list(samples)


def single_sequence(llm: LLM, synchronous: LLM, prompt, max_tokens: int, rounds: int) -> list[list]:
    """One sequence against the memory-bandwidth bound, with and without async scheduling:
    the bandwidth is measured before the first engine's decode, between the two and after the
    second, so that each ratio divides numbers taken under the same load (readings of the
    bandwidth on this shared machine ranged from 13 to 58 GB/s between runs, and one process's
    ratios from 0.54 to 1.21 within minutes); decodes whose two readings disagree are left
    out (:func:`steady_samples`). Rows: engine, weights MiB, median bandwidth, median bound,
    median rates (overall, after the first token), median ratio, the lowest and highest ratio,
    and the rounds kept."""
    samples = {"on": [], "off": []}
    readings = [memory_bandwidth()]
    for _ in range(rounds):
        for key, engine in (("on", llm), ("off", synchronous)):
            overall, decoding = decode_rate(engine, prompt, max_tokens)
            readings.append(memory_bandwidth())
            samples[key].append((*readings[-2:], overall, decoding))
    rows = []
    for key, engine in (("on", llm), ("off", synchronous)):
        kept = steady_samples(samples[key])
        bandwidths = [(before + after) / 2 for before, after, *_ in kept]
        bounds = [bandwidth / weight_bytes(engine) for bandwidth in bandwidths]
        ratios = [decoding / bound for (*_, decoding), bound in zip(kept, bounds)]
        columns = [[b / 1e9 for b in bandwidths], bounds, [s[2] for s in kept], [s[3] for s in kept], ratios]
        rows.append([key, weight_bytes(engine) / 2**20, *(float(np.median(column)) for column in columns),
                     f"{min(ratios):.2f}-{max(ratios):.2f}", f"{len(kept)}/{len(samples[key])}"])
    return rows


def chat(args) -> None:
    """The targets' setting: both dtypes, this engine vs HF, plus single-sequence decode
    against the memory-bandwidth bound (weights bytes per token / measured bandwidth)."""
    from benchmarks import hf_baseline  # torch: only where Hugging Face is the baseline

    rows, bound_rows, baseline = [], [], {}
    for dtype in ("float32", "bfloat16"):
        hf = hf_baseline.HFModel(dtype)
        prompts = workloads.chat_prompts(hf.tokenizer, args.requests, args.prompt_tokens)
        lens = [args.max_tokens] * len(prompts)
        llm = LLM(dtype=dtype, max_num_seqs=max(args.requests, 8), max_model_len=1024)
        engine_run(llm, prompts[:2], [4, 4])  # first call compiles the sampler
        # Rounds alternate the two systems, and each reports its median round: the machine
        # is shared, and a single pass of each, one after the other, moved the ratio by 10%.
        runs = {"hf": [], "ours": []}
        for _ in range(args.rounds):
            runs["hf"].append(hf.generate(prompts, lens, batch_size=len(prompts)))
            runs["ours"].append(engine_run(llm, prompts, lens))
        (hf_seconds, tokens), (seconds, ours) = (sorted(runs[k])[len(runs[k]) // 2] for k in ("hf", "ours"))
        baseline[dtype] = tokens / hf_seconds
        rows.append([f"HF generate {dtype}", tokens, hf_seconds, tokens / hf_seconds, 1.0])
        rows.append([f"pallas-paged {dtype}", ours, seconds, ours / seconds, ours / seconds / baseline[dtype]])
        del hf
        gc.collect()
        synchronous = LLM(dtype=dtype, max_num_seqs=max(args.requests, 8), max_model_len=1024, async_scheduling=False)
        engine_run(synchronous, prompts[:2], [4, 4])
        single = single_sequence(llm, synchronous, prompts[0], args.max_tokens, args.single_rounds)
        bound_rows += [[dtype, f"async {scheduling}", *numbers] for scheduling, *numbers in single]
        del llm, synchronous
        gc.collect()
    rows.append(["best pallas-paged vs HF bf16", "", "", "", max(r[3] for r in rows if "paged" in r[0])
                 / baseline["bfloat16"]])
    table = print_table(["system", "tokens", "seconds", "tokens/s", "vs HF same dtype"], rows)
    table += f"\n\nMedian of {args.rounds} rounds per system, alternating HF and this engine."
    bounds = print_table(["dtype", "scheduling", "weights MiB", "bandwidth GB/s", "bound tokens/s",
                          "1 sequence tokens/s", "after the first token", "vs bound", "range", "kept"], bound_rows)
    products = print_table(["products", "weight bytes", "ms", "GB/s"], [
        *matvec("float32"), *(matvec("float32", packed=True) if pallas_paged.packing_enabled() else []),
        *matvec("bfloat16"), *(matvec("bfloat16", packed=True) if pallas_paged.packing_enabled() else [])])
    save_text(f"{table}\n\nSingle-sequence decode against the memory-bandwidth bound ({args.single_rounds} rounds, "
              "each decoding with async scheduling on and off, the bandwidth measured before, between and "
              "after the two; each decode's bound uses the mean of the readings around it, and a decode "
              f"whose two readings differ by more than {STEADY_TOLERANCE:.0%} is left out ('kept'); medians, "
              "'vs bound' the median ratio of the rate after the first token, without the prompt phase, to "
              "its bound, and 'range' the lowest and highest of those ratios):"
              f"\n\n{bounds}\n\nOne layer's products, 30 layers:\n\n"
              f"{products}", "throughput_chat")


def traces(args) -> None:
    """Offline throughput on the ShareGPT-like and Alpaca-like traces: this engine (paged) vs
    the paper's baselines in the same engine, at the same KV memory, vs HF ``generate`` in
    static batches of what that memory holds at ``max_model_len``."""
    from benchmarks import hf_baseline  # torch: only where Hugging Face is the baseline

    scale, load = offline.scale(args.quick), offline.machine_note()
    workload, results = offline.run_policies(scale, dtype=args.dtype)
    hf = hf_baseline.HFModel(args.dtype)
    for trace in workload:
        seconds, tokens = hf.generate(trace.prompts, trace.output_lens, batch_size=scale.static_batch)
        results[trace.name, "HF generate"] = offline.Run(seconds, len(trace.prompts), tokens, 0, [])
    rows = [[trace, system, run.requests, run.tokens, run.seconds, run.requests_per_s, run.tokens_per_s,
             run.tokens_per_s / results[trace, "HF generate"].tokens_per_s] for (trace, system), run in results.items()]
    rows.sort(key=lambda row: row[0])
    headers = ["trace", "system", "requests", "tokens", "seconds", "requests/s", "tokens/s", "tokens/s vs HF"]
    note = (f"{args.dtype}; KV memory {scale.kv_tokens} tokens for every engine policy, max_model_len "
            f"{scale.max_model_len}; HF static batches of {scale.static_batch}; {load}.")
    name = result_name("throughput_traces", args.quick)
    save_text(f"{note}\n\n{print_table(headers, rows)}", name)
    print(f"wrote {plot_traces(rows, name)}")


def plot_traces(rows, name: str):
    """Generated tokens/s per system, one panel per trace."""
    import matplotlib.pyplot as plt

    names = sorted({row[0] for row in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4))
    for ax, trace in zip(axes, names):
        mine = [row for row in rows if row[0] == trace]
        ax.bar([row[1] for row in mine], [row[6] for row in mine])
        ax.set_title(f"{trace}-like trace")
        ax.set_ylabel("generated tokens/s")
        ax.tick_params(axis="x", rotation=40)
    return save_figure(fig, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["chat", "traces"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=110)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="chat: alternating rounds per system (median)")
    parser.add_argument("--single-rounds", type=int, default=7,
                        help="chat: rounds of the single-sequence decode against the bound (median)")
    parser.add_argument("--quick", action="store_true", help="traces: a few short requests, a small KV cache")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="traces: weights' dtype")
    args = parser.parse_args()
    {"chat": chat, "traces": traces}[args.workload](args)


if __name__ == "__main__":
    main()
