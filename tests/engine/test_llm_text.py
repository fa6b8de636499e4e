"""Text in and text out on the real SmolLM2: chat template, stop strings, incremental detokenisation."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.test_llm_parity import COMMON, CONFIGS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(**COMMON, **CONFIGS["batched"])


def test_chat_answers_through_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert "<|im_end|>" not in out.outputs[0].text


def test_text_equals_decoding_the_tokens(llm):
    tokenizer = llm.get_tokenizer()
    outs = llm.generate(["Write a haiku about the sea.", "日本の首都は"], SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_stop_string_ends_generation_and_is_cut(llm):
    free = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0].text
    stop = free.strip().split()[1]  # a word the model is about to write
    out = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free[: free.index(stop)]
