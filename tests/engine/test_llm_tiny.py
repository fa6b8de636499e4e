"""The engine on tiny random LLaMA and OPT models against Hugging Face: greedy and beam search."""

from __future__ import annotations

import pytest

from engine import BeamSearchParams, SamplingParams
from tests.engine.tiny import assert_same_or_close, hf_greedy, prompts, tiny_llm


@pytest.mark.parametrize("name", ["llama_gqa_tied", "opt"])
def test_greedy_batch_matches_hugging_face(name, tmp_path):
    llm, hf = tiny_llm(name, tmp_path)
    batch = prompts(16, hf.config.vocab_size)
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=12, logprobs=5), use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        completion = output.outputs[0]
        assert_same_or_close(list(completion.token_ids), list(completion.logprobs), *hf_greedy(hf, prompt, 12))


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_matches_hugging_face(length_penalty, tmp_path):
    llm, hf = tiny_llm("llama_gqa_tied", tmp_path)
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty)
    batch = prompts(3, hf.config.vocab_size, seed=1)
    outputs = llm.beam_search(batch, params)
    import torch

    for prompt, output in zip(batch, outputs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, early_stopping=True,
                               length_penalty=length_penalty, max_new_tokens=8, do_sample=False,
                               pad_token_id=hf.config.eos_token_id)
        expected = [_strip(row[len(prompt):].tolist(), hf.config.eos_token_id) for row in want]
        assert [list(c.token_ids) for c in output.outputs] == expected
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total


def _strip(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
