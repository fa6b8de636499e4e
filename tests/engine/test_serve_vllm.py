"""vLLM's extra request fields through the server, as a vLLM user's client sends them."""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def url(served_url):
    return served_url


@pytest.fixture(scope="module")
def client(served_client):
    return served_client


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
    ({"prompt_logprobs": 21}, "prompt_logprobs=21 is more than max_logprobs=20"),
    ({"prompt_logprobs": 1, "use_beam_search": True}, "prompt_logprobs cannot be used with use_beam_search"),
])
def test_prompt_logprobs_it_cannot_serve_are_refused(url, body, fragment):
    response = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                                     **body})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]


TEMPLATE = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_requests_chat_template_and_its_kwargs_are_used(url):
    messages = [{"role": "user", "content": " how are you?"}]
    body = {"messages": messages, "chat_template": TEMPLATE, "chat_template_kwargs": {"greeting": "Hello,"}}
    templated = httpx.post(url + "/tokenize", json={**body, "add_generation_prompt": False}).json()["tokens"]
    plain = httpx.post(url + "/tokenize", json={"prompt": "Hello, how are you?", "add_special_tokens": False}).json()
    assert templated == plain["tokens"]
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={**body, "max_tokens": 2}).json()
    assert chat["usage"]["prompt_tokens"] == len(templated)
    reserved = httpx.post(url + "/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": False}})
    assert reserved.status_code == 400 and "chat_template_kwargs cannot set ['tokenize']" in reserved.text


def test_tokenize_returns_token_strings_when_asked(url):
    response = httpx.post(url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert response["token_strs"] == ["Hello", "Ġworld"] and response["count"] == 2


def test_a_body_request_id_names_the_response(client):
    response = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"request_id": "job-7"})
    assert response.id == "cmpl-job-7"
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                            stream=True, extra_body={"request_id": "job-8"})
    assert {chunk.id for chunk in stream} == {"chatcmpl-job-8"}


CHAT = [{"role": "user", "content": "Hi"}]
# Every refused field, field by field: tests/engine/test_request_fields.py.


def test_fields_that_cannot_change_the_output_are_accepted(url):
    extra = {"user": "u1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto", "a_future_field": 1,
             "return_tokens_as_token_ids": False, "function_call": "none"}  # refused fields at their no-op values
    response = httpx.post(url + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, **extra})
    plain = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
