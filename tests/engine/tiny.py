"""Tiny random Hugging Face models served by the engine, and their HF reference outputs."""

from __future__ import annotations

import numpy as np
import transformers

from engine import LLM, SamplingParams
from tests.hf_torch import require_torch
from tests.models.tiny_models import write_checkpoint

ENGINE = dict(max_model_len=128, block_size=8, num_blocks=128, max_num_seqs=16, max_num_batched_tokens=256,
              swap_space=0.01, warmup=False)


def tiny_llm(name: str, directory, **overrides) -> tuple[LLM, transformers.PretrainedConfig]:
    """(our LLM, HF's config) for ``tests.models.tiny_models.TINY_CONFIGS[name]``, whose random
    checkpoint is written to ``directory`` (HF's torch model of it: ``tests.hf_torch.load_hf_model``)."""
    config = write_checkpoint(name, directory)
    return LLM(str(directory), **{**ENGINE, **overrides}), config


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` random prompts of varied lengths (1 to 60 tokens) avoiding special ids 0-2."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(1, 60, count).astype(int)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def hf_greedy(hf, prompt, max_tokens, top=5):
    """HF ``generate`` greedy: (tokens, per-step top-``top`` {token: logprob})."""
    torch = require_torch()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=hf.config.eos_token_id)
    tokens = out.sequences[0, len(prompt):].tolist()
    steps = []
    for scores in out.scores:
        logprobs = torch.log_softmax(scores[0].float(), -1)
        values, ids = logprobs.topk(top)
        steps.append(dict(zip(ids.tolist(), values.tolist())))
    return tokens[: len(steps)], steps


def assert_same_or_close(ours_tokens, ours_logprobs, hf_tokens, hf_logprobs):
    """vLLM's check for near-tied random models: identical up to the first divergence, and
    there each side's token is among the other's top-5."""
    for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)):
        if a != b:
            assert a in hf_logprobs[i] and b in ours_logprobs[i], (i, ours_tokens, hf_tokens)
            return
    assert len(ours_tokens) == len(hf_tokens) or ours_tokens[-1] in (ours_logprobs and ()), (ours_tokens, hf_tokens)


def assert_greedy_batch_matches(llm, hf, count: int = 16, max_tokens: int = 12) -> None:
    """Greedy ``count`` random prompts in one batch; each completion as HF's (see :func:`assert_same_or_close`)."""
    batch = prompts(count, hf.config.vocab_size)
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5), use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        completion = output.outputs[0]
        assert_same_or_close(list(completion.token_ids), list(completion.logprobs), *hf_greedy(hf, prompt, max_tokens))


def generate_queued(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> tuple[list, int]:
    """Every request of ``batch`` added at once and stepped to its end (as ``LLM.generate``):
    the outputs in order, and the steps taken from a lookahead (``engine.async_scheduling``)
    while some request was still waiting to enter."""
    engine, finals, taken = llm.engine, {}, 0
    for i, (prompt, p) in enumerate(zip(batch, params)):
        engine.add_request(f"queued-{i}", prompt, p)
    while engine.has_unfinished_requests():
        before, waited = engine.counters.lookahead_steps, bool(engine.state.waiting)
        finals.update((output.request_id, output) for output in engine.step())
        taken += waited * (engine.counters.lookahead_steps - before)
    return [finals[f"queued-{i}"] for i in range(len(batch))], taken
