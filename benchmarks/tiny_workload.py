"""The tiny-model workload of the host-cost benchmarks (``host_overhead``, ``server_loop``,
``engine_process``): a random LLaMA so small that the device does almost nothing, N requests
of random prompts decoding a fixed number of tokens, the engine's settings for them, and one
timed pass of ``LLMEngine.step()`` over them."""

from __future__ import annotations

import cProfile
import dataclasses
import itertools
import pathlib
import time

import numpy as np

import models
from engine import LLM, RequestOutputKind, SamplingParams, gc_freeze
from tests.models.tiny_models import write_checkpoint

MODEL = "llama_gqa_tied"
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 64
BLOCK_SIZE = 16
MODES = {"greedy": dict(temperature=0.0, detokenize=False),
         "sampled": dict(temperature=0.8, top_p=0.9, detokenize=False),
         "sampled, n=4": dict(temperature=0.8, top_p=0.9, detokenize=False, n=4),
         "greedy, text": dict(temperature=0.0)}
TOKENIZER = "SmolLM2-135M-Instruct"  # the text mode's (a vocabulary of 49152: any tiny model's ids decode)


def engine_settings(count: int, output_tokens: int, num_scheduler_steps: int = 1) -> dict:
    """``LLM`` keyword arguments for ``count`` sequences of ``PROMPT_TOKENS + output_tokens``:
    room for all of them at full length (and the block each may hold a step early)."""
    model_len = PROMPT_TOKENS + output_tokens
    blocks = count * (-(-model_len // BLOCK_SIZE) + 1) + 16
    return dict(max_model_len=model_len, max_num_seqs=count, block_size=BLOCK_SIZE, num_blocks=blocks,
                warmup=False, seed=0, num_scheduler_steps=num_scheduler_steps)


def write_model(directory) -> pathlib.Path:
    """The tiny random ``MODEL`` and ``TOKENIZER`` (loaded once from the default model's GGUF,
    saved as an HF tokenizer beside it) in ``directory``; returns it."""
    write_checkpoint(MODEL, directory)
    models.load_tokenizer(TOKENIZER).save_pretrained(directory)
    return pathlib.Path(directory)


def sampling_params(mode: str, index: int, output_tokens: int) -> SamplingParams:
    """Exactly ``output_tokens`` tokens; sampled requests seeded by their index; only the final
    output returned, as ``LLM.generate`` and the server's whole (not streamed) answers ask."""
    seed = {"seed": index} if MODES[mode]["temperature"] > 0 else {}
    return SamplingParams(**MODES[mode], **seed, max_tokens=output_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def samples_per_prompt(mode: str) -> int:
    """The sequences each request of ``mode`` runs (``n``)."""
    return MODES[mode].get("n", 1)


def random_prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``PROMPT_TOKENS`` random token ids (from 3, past the special ids)."""
    return np.random.default_rng(seed).integers(3, vocab_size, (count, PROMPT_TOKENS)).tolist()


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass over the workload: seconds of each step in which every sequence decoded, the
    tokens each sequence generated in those steps (1 each without multi-step scheduling),
    every step's seconds, and the main thread's CPU seconds in each decode step (the host's
    work: XLA runs the model on threads of its own)."""

    decode_seconds: list[float]
    decode_tokens: list[float]
    all_seconds: list[float]
    decode_cpu: list[float]


_ids = itertools.count()


def run_pass(llm: LLM, prompts: list[list[int]], mode: str, output_tokens: int, *,
             profiler: cProfile.Profile | None = None, profile_steps: int = 0) -> Pass:
    """Submit every prompt at once, step the engine until all finish, time every step; with
    ``profiler``, profile the first ``profile_steps`` steps in which every sequence decodes."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"host-{next(_ids)}", prompt, sampling_params(mode, i, output_tokens))
    decode_seconds, decode_tokens, all_seconds, decode_cpu, generated = [], [], [], [], {}
    samples = samples_per_prompt(mode)
    with gc_freeze.older_objects_frozen():  # as the engine's own loops run (LLM.generate, the server)
        while engine.has_unfinished_requests():
            every_one_decodes = all_decode(engine.state, len(prompts))
            profiling = profiler is not None and every_one_decodes and len(decode_seconds) < profile_steps
            if profiling:
                profiler.enable()
            before = engine.counters.generation_tokens
            start, cpu = time.perf_counter(), time.thread_time()
            outputs = engine.step()
            seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
            if profiling:
                profiler.disable()
            for output in outputs:
                if output.error:
                    raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                generated[output.request_id] = {len(completion.token_ids) for completion in output.outputs}
            all_seconds.append(seconds)
            if every_one_decodes:
                decode_seconds.append(seconds)
                decode_cpu.append(cpu)
                decode_tokens.append((engine.counters.generation_tokens - before) / len(prompts) / samples)
    if len(generated) != len(prompts) or any(n != {output_tokens} for n in generated.values()):
        raise RuntimeError(f"requests generated {sorted(set().union(*generated.values()))} tokens, not {output_tokens}")
    return Pass(decode_seconds, decode_tokens, all_seconds, decode_cpu)


def all_decode(state, count: int) -> bool:
    """Whether every one of ``count`` sequences decodes in the step after scheduler ``state``:
    all run, none waits or still has prompt to compute."""
    return (not state.waiting and state.num_running == count
            and not any(group.in_prefill for group in state.running_groups))  # rows never are
