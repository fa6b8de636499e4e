"""Start-up: after the warm-up, serving compiles nothing (every step's shapes were bucketed and
compiled, and the greedy sampler for each of them)."""

from __future__ import annotations

from engine import BeamSearchParams, SamplingParams, programs, sampler
from tests.engine.tiny import prompts, tiny_llm


def test_no_step_compiles_after_warm_up(tmp_path, monkeypatch):
    llm, hf = tiny_llm("llama_gqa_tied", tmp_path, warmup=True, max_num_batched_tokens=64)
    compiled = []
    original = programs._compile
    monkeypatch.setattr(programs, "_compile", lambda key, lowered: compiled.append(key[0]) or original(key, lowered))
    vocab = hf.config.vocab_size
    samplers = sampler.sample._cache_size()
    # Prompts of 1-60 tokens, several per step and chunked (64 tokens a step): every mix of
    # prefill tokens and logits rows; then decodes of 1-16 sequences, greedy, which the
    # sampler's warm-up covers too.
    llm.generate(prompts(16, vocab), SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert sampler.sample._cache_size() == samplers
    # Sampling with a temperature, parallel sampling and beams.
    llm.generate(prompts(3, vocab, seed=2), SamplingParams(n=3, best_of=4, temperature=1.0, max_tokens=5, seed=0),
                 use_tqdm=False)
    llm.beam_search(prompts(2, vocab, seed=3), BeamSearchParams(beam_width=3, max_tokens=4))
    assert compiled == []

