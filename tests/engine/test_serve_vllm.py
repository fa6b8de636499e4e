"""vLLM's extra request fields through the server, as a vLLM user's client sends them."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.engine.server import SERVER_ARGS, running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def url():
    with running_server(*SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused")


def test_prompt_logprobs_are_served_as_llm_generate_computes_them(client):
    prompt = "The quick brown fox jumps over the lazy dog"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    served = response.choices[0].model_extra["prompt_logprobs"]
    llm = LLM(max_model_len=512, max_num_seqs=4, warmup=False)
    expected = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                            use_tqdm=False)[0].prompt_logprobs
    assert len(served) == len(expected) and served[0] is None
    for entry, step in zip(served[1:], expected[1:]):
        assert {int(token) for token in entry} == set(step)
        for token, value in entry.items():
            assert value["logprob"] == pytest.approx(step[int(token)], abs=1e-3)
            assert value["rank"] == step[int(token)].rank and value["decoded_token"] == step[int(token)].decoded_token


def test_chat_prompt_logprobs_cover_the_templated_prompt(url, client):
    messages = [{"role": "user", "content": "Hi there"}]
    response = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}).json()
    prompt_ids = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    entries = response["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) == response["usage"]["prompt_tokens"]
    assert [list(entry) for entry in entries[1:]] == [[str(token)] for token in prompt_ids[1:]]


@pytest.mark.parametrize("body, fragment", [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs cannot be streamed"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "use_beam_search": True}, "prompt_logprobs cannot be used with use_beam_search"),
])
def test_prompt_logprobs_it_cannot_serve_are_refused(url, body, fragment):
    response = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                                     **body})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
