"""Driving the engine over a trace, for every memory policy of the paper in one engine.

Every policy of a comparison runs with the same ``Scale``: the same KV memory (in tokens),
``max_model_len``, per-step budgets and block size, so the engines share their compiled
programs and differ only in how they reserve memory or batch. Requests go straight to
``LLMEngine.add_request`` because the Orca baselines need each request's true output length
(``expected_output_len``), which ``LLM.generate`` does not take.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import time
from collections.abc import Callable

from benchmarks import workloads
from engine import LLM, SamplingParams

# The systems of the paper's Fig. 12, as LLM keyword arguments. "static" is FasterTransformer-
# style: a batch runs until all its members finish, each holding KV for max_model_len tokens.
POLICIES = {
    "paged": {"reservation": "paged", "enable_prefix_caching": False},  # the paper's vLLM had none
    "orca-oracle": {"reservation": "orca-oracle"},
    "orca-pow2": {"reservation": "orca-pow2"},
    "orca-max": {"reservation": "orca-max"},
    "static": {"policy": "static", "reservation": "orca-max"},
}


@dataclasses.dataclass(frozen=True)
class Scale:
    """Trace sizes and the engine settings shared by every policy.

    ``kv_tokens`` is the device KV memory in token slots (``num_blocks = kv_tokens //
    block_size``); ``max_model_len`` holds the longest request of a trace (each trace's prompt
    and output lengths are clipped to half of it). Orca (Max) then batches ``kv_tokens //
    max_model_len`` requests, while paged memory holds as many as fit.
    """

    requests: dict[str, int]
    max_model_len: int
    kv_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def llm_kwargs(self, block_size: int = 16) -> dict:
        return dict(block_size=block_size, num_blocks=self.kv_tokens // block_size, max_model_len=self.max_model_len,
                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                    swap_space=1)

    @property
    def static_batch(self) -> int:
        """Requests a static batch can hold when every one may reach ``max_model_len``."""
        return self.kv_tokens // self.max_model_len


# max_model_len 2048 is the paper's (OPT's context). It clips each length at 1024, which leaves the
# ShareGPT-like trace its dataset's mean output (340 tokens against 338); at 1024 (clipping at
# 512) the mean output was 292, and long requests, the ones that matter most here, were cut.
FULL = Scale(requests={"sharegpt": 64, "alpaca": 128}, max_model_len=2048, kv_tokens=16384, max_num_seqs=128,
             max_num_batched_tokens=2048)
QUICK = Scale(requests={"sharegpt": 4, "alpaca": 12}, max_model_len=256, kv_tokens=1024, max_num_seqs=16,
              max_num_batched_tokens=256)


def scale(quick: bool) -> Scale:
    return QUICK if quick else FULL


def traces(scale: Scale, vocab_size: int) -> list[workloads.Trace]:
    """The ShareGPT-like and Alpaca-like traces at ``scale`` (seed 0), all arriving at once."""
    return [workloads.trace(name, count, vocab_size=vocab_size, max_len=scale.max_model_len)
            for name, count in scale.requests.items()]


def make_llm(policy: str, scale: Scale, *, dtype: str = "float32", block_size: int = 16) -> LLM:
    """An engine with one of ``POLICIES``; every bucket is compiled now (once per process
    for a given set of shapes), so no timed step waits for the compiler."""
    return LLM(dtype=dtype, **scale.llm_kwargs(block_size), **POLICIES[policy])


def greedy(output_len: int) -> SamplingParams:
    """Exactly ``output_len`` tokens, whatever the model wants to say."""
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)


@dataclasses.dataclass(frozen=True)
class Run:
    """One pass over a trace: wall time, requests and generated tokens (the first completion
    of each), steps, and ``samples[i] = observe(engine)`` after step i, if asked for."""

    seconds: float
    requests: int
    tokens: int
    steps: int
    samples: list

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


_ids = itertools.count()


def run_trace(llm: LLM, trace: workloads.Trace, params: Callable[[int], object] = greedy,
              observe: Callable | None = None) -> Run:
    """Queue every request of ``trace`` at once (offline), each with ``params(output_len)``,
    and step the engine until all finish. Raises if any request was refused."""
    engine = llm.engine
    for prompt, output_len in zip(trace.prompts, trace.output_lens):
        engine.add_request(f"{trace.name}-{next(_ids)}", prompt, params(output_len), expected_output_len=output_len)
    samples, tokens, steps = [], 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
        steps += 1
        if observe is not None:
            samples.append(observe(engine))
    return Run(time.perf_counter() - start, len(trace.prompts), tokens, steps, samples)


def run_policies(scale: Scale, *, dtype: str = "float32", observe: Callable | None = None):
    """Both traces under every policy of ``POLICIES``, one engine per policy. Returns the
    traces and ``{(trace name, policy): Run}``."""
    workload, results = [], {}
    for policy in POLICIES:
        llm = make_llm(policy, scale, dtype=dtype)
        workload = workload or traces(scale, llm.engine.model_config.vocab_size)
        for trace in workload:
            results[trace.name, policy] = run = run_trace(llm, trace, observe=observe)
            print(f"{trace.name} {policy}: {run.tokens_per_s:.1f} tokens/s in {run.steps} steps", flush=True)
        del llm
        gc.collect()
    return workload, results


def machine_note() -> str:
    """The machine's load when a benchmark starts: it is shared, and numbers depend on it."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start"
