"""Offline throughput: this engine against Hugging Face ``generate``, and the paper's baselines.

    python -m benchmarks.throughput chat        # the targets: 32 chat prompts, 128 tokens each
    python -m benchmarks.throughput traces      # ShareGPT-like and Alpaca-like traces, per policy

Everything is measured in one run on one machine, and compared as ratios. ``ignore_eos`` makes
every system generate the same number of tokens.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from benchmarks import hf_baseline, workloads
from benchmarks.timing import print_table, save_figure, save_text
from engine import LLM, SamplingParams


def engine_run(llm: LLM, prompts, output_lens) -> tuple[float, int]:
    """Seconds to generate ``output_lens[i]`` tokens for every prompt at once, and tokens made."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def chat(args) -> None:
    """The targets' setting: both dtypes, this engine vs HF, plus single-sequence decode."""
    rows = []
    baseline = {}
    for dtype in ("float32", "bfloat16"):
        hf = hf_baseline.HFModel(dtype)
        prompts = workloads.chat_prompts(hf.tokenizer, args.requests, args.prompt_tokens)
        lens = [args.max_tokens] * len(prompts)
        seconds, tokens = hf.generate(prompts, lens, batch_size=len(prompts))
        baseline[dtype] = tokens / seconds
        rows.append([f"HF generate {dtype}", tokens, seconds, tokens / seconds, 1.0])
        del hf
        gc.collect()
        llm = LLM(dtype=dtype, max_num_seqs=max(args.requests, 8), max_model_len=1024)
        engine_run(llm, prompts[:2], [4, 4])  # first call compiles the sampler
        seconds, tokens = engine_run(llm, prompts, lens)
        rows.append([f"pallas-paged {dtype}", tokens, seconds, tokens / seconds, tokens / seconds / baseline[dtype]])
        single = engine_run(llm, prompts[:1], [args.max_tokens])
        rows.append([f"pallas-paged {dtype}, 1 sequence", single[1], single[0], single[1] / single[0],
                     single[1] / single[0] / baseline[dtype]])
        del llm
        gc.collect()
    rows.append(["best pallas-paged vs HF bf16", "", "", "", max(r[3] for r in rows if "paged" in r[0]
                                                                   and "1 seq" not in r[0]) / baseline["bfloat16"]])
    table = print_table(["system", "tokens", "seconds", "tokens/s", "vs HF same dtype"], rows)
    save_text(table, "throughput_chat")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["chat", "traces"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=110)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    {"chat": chat}[args.workload](args)


if __name__ == "__main__":
    main()
