"""The OpenAI-compatible server, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from engine import LLM, BeamSearchParams, SamplingParams
from tests.engine.serve_errors import CHAT, ERRORS, error_request
from tests.engine.server import SERVER_ARGS, running_server

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def url():
    with running_server(*SERVER_ARGS, "--api-key", API_KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY)


def http(url, method, path, **kwargs):
    headers = {"Authorization": f"Bearer {API_KEY}", **kwargs.pop("headers", {})}
    return httpx.request(method, url + path, headers=headers, timeout=60, **kwargs)


def test_greedy_completion_equals_llm_generate(client):
    prompt = "The three primary colors are"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    llm = LLM(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512, swap_space=0.1, warmup=False)
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.choices[0].finish_reason == expected.finish_reason


def test_chat_completion(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20,
        temperature=0, logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert len(choice.logprobs.content) == response.usage.completion_tokens
    assert response.usage.prompt_tokens > 10


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-2].choices[0].finish_reason == "length"
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])  # null, as OpenAI sends
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                          max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat)


def test_n_samples_and_stop(client):
    response = client.completions.create(model=MODEL, prompt="My favourite animal is the", max_tokens=12, n=2,
                                         temperature=1.0, seed=3)
    assert sorted(c.index for c in response.choices) == [0, 1]
    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
    stop = greedy.choices[0].text.split(",")[2]  # a number the model writes
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text


def test_several_prompts_echo_and_logprobs(client):
    response = client.completions.create(model=MODEL, prompt=["Hello there", "The sky is"], max_tokens=4,
                                         temperature=0, logprobs=2, echo=True)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].text.startswith("Hello there")
    assert response.choices[1].text.startswith("The sky is")
    logprobs = response.choices[1].logprobs
    assert logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == response.choices[1].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])


@pytest.mark.parametrize("case,status,fragment", ERRORS)
def test_errors_are_openai_shaped_and_the_server_keeps_serving(url, client, case, status, fragment):
    request = error_request(case, MODEL)
    response = http(url, "POST", request.pop("path"), **request)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["code"] == status and error["type"]
    if case == "too_long":
        assert "600" in error["message"] or "601" in error["message"]
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text is not None


def test_beam_search_is_served_as_vllm_serves_it(client):
    # vLLM's use_beam_search: the n best beams, best first, as LLM.beam_search finds them.
    prompt = "The capital of France is"
    beams = dict(model=MODEL, max_tokens=6, n=3, extra_body={"use_beam_search": True})
    response = client.completions.create(prompt=prompt, logprobs=2, **beams)
    llm = LLM(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512, swap_space=0.1, warmup=False)
    (want,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
    generated = [len(s.tokens) - len(response_prompt_ids(llm, prompt)) for s in want.sequences]
    assert response.usage.completion_tokens == sum(generated)
    for choice, beam in zip(response.choices, want.sequences, strict=True):
        assert beam.text.startswith(prompt + choice.text) and choice.text
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(beam.cum_logprob, abs=1e-3)
        assert all(2 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)  # the chosen token and the best 2
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(messages=messages, **beams)
    assert len({c.message.content for c in whole.choices}) == 3
    streamed = {}
    for chunk in client.chat.completions.create(messages=messages, stream=True, **beams):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in whole.choices]


def test_bad_words_are_never_generated(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in client.completions.create(**kwargs).choices[0].text
    assert "Paris" not in client.completions.create(**kwargs, extra_body={"bad_words": ["Paris"]}).choices[0].text


def test_a_request_that_outgrows_the_kv_cache_is_an_error_not_a_short_answer():
    # 32 blocks of 16 tokens: the context is lowered to the 512 tokens the cache holds, and
    # four 200-token samples outgrow it part-way through. Its cache's shape is its own, so
    # no step shape is compiled ahead (--enforce-eager): only the few its requests run.
    with running_server("--num-blocks", "32", "--max-model-len", "2048", "--max-num-seqs", "8",
                        "--enforce-eager") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens"):
            client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=200)
        body = {"model": MODEL, "prompt": "Once upon a time", "n": 4, "max_tokens": 200, "temperature": 1.0,
                "ignore_eos": True}
        with pytest.raises(openai.BadRequestError, match="KV blocks"):
            client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                      extra_body={"ignore_eos": True})
        events = httpx.post(base + "/v1/completions", json={**body, "stream": True}, timeout=120).text
        assert '"text"' in events and "KV blocks" in events and events.endswith("data: [DONE]\n\n")
        for _ in range(50):  # the group's blocks are freed
            metrics = httpx.get(base + "/metrics").text
            if re.search(r"vllm:kv_cache_usage_perc\{[^}]*\} 0\.0$", metrics, re.MULTILINE):
                break
            time.sleep(0.2)
        assert re.search(r"vllm:kv_cache_usage_perc\{[^}]*\} 0\.0$", metrics, re.MULTILINE)
        assert re.search(r"vllm:num_requests_running\{[^}]*\} 0\.0$", metrics, re.MULTILINE)


def response_prompt_ids(llm, prompt):
    return llm.get_tokenizer()(prompt)["input_ids"]


def test_sampling_values_beyond_the_arrays_are_served(client):
    """vLLM accepts any 64-bit seed and a top_k above the vocabulary; neither may stop the engine."""
    for extra in ({"seed": -1}, {"seed": 2**40}, {"extra_body": {"top_k": 3_000_000_000}}):
        response = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, **extra)
        assert response.choices[0].finish_reason == "length"
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text is not None


def test_streamed_choices_finish_once_and_logprobs_match_unstreamed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, n=3, temperature=1.0, seed=1, stop=["."])
    finishes = [c.choices[0].index for c in client.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    kwargs = dict(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert sum((c.tokens for c in chunks), []) == whole.tokens
    assert sum((c.text_offset for c in chunks), []) == whole.text_offset
    assert sum((c.token_logprobs for c in chunks), []) == whole.token_logprobs


@pytest.mark.parametrize("top", [None, 2])
def test_chat_top_logprobs_has_as_many_entries_as_asked(client, top):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0.8,
        seed=4, logprobs=True, **({} if top is None else {"top_logprobs": top}))
    assert [len(token.top_logprobs) for token in response.choices[0].logprobs.content] == [top or 0] * 8


def test_logit_bias_forces_and_bans_tokens(url, client):
    """OpenAI's ``logit_bias``: +100 makes a token every choice, -100 keeps it out, in
    completions and chat, sampling and greedy."""
    (blue,) = http(url, "POST", "/tokenize", json={"prompt": " blue"}).json()["tokens"]
    forced = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, logit_bias={str(blue): 100},
                                       seed=0)
    assert forced.choices[0].text == " blue" * 3
    only = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3,
                                     extra_body={"allowed_token_ids": [blue]})
    assert only.choices[0].text == " blue" * 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=3, temperature=0, logit_bias={str(blue): 100})
    assert chat.choices[0].message.content.strip() == "blue blue blue"
    greedy = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0)
    first = http(url, "POST", "/tokenize", json={"prompt": greedy.choices[0].text, "add_special_tokens": False})
    banned = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0,
                                       logit_bias={str(t): -100 for t in first.json()["tokens"]})
    assert banned.choices[0].text != greedy.choices[0].text


def test_echo_without_generation_scores_the_prompt(client):
    """echo with max_tokens 0 (how evaluation harnesses score a text): the prompt and its
    log-probabilities, the same as when one token follows, and nothing generated or billed."""
    kwargs = dict(model=MODEL, prompt="The capital of France is Paris", echo=True, logprobs=1, temperature=0)
    scored = client.completions.create(max_tokens=0, **kwargs)
    one_more = client.completions.create(max_tokens=1, **kwargs).choices[0].logprobs
    choice, logprobs = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == "The capital of France is Paris" == "".join(logprobs.tokens)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs == one_more.token_logprobs[:-1]
    assert scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
    streamed = list(client.completions.create(max_tokens=0, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [c.choices[0].finish_reason for c in streamed][-1] == "length"


def test_truncate_prompt_tokens_serves_a_prompt_over_the_context(client):
    long_prompt = "word " * 600  # over max_model_len 512
    response = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0,
                                         extra_body={"truncate_prompt_tokens": 100})
    assert response.usage.prompt_tokens == 100 and response.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 100})
    assert chat.usage.prompt_tokens == 100


def test_null_fields_take_their_defaults_and_text_parts_join_by_newlines(url):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "n": None, "presence_penalty": None,
            "frequency_penalty": None, "stream": None, "echo": None, "min_p": None, "repetition_penalty": None}
    response = http(url, "POST", "/v1/completions", json=body)
    assert response.status_code == 200 and len(response.json()["choices"]) == 1
    chat = {"model": MODEL, "max_tokens": 2, "logprobs": None, "n": None,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a"},
                                                      {"type": "text", "text": "colour."}]}]}
    assert http(url, "POST", CHAT, json=chat).status_code == 200
    tokens = http(url, "POST", "/tokenize", json={"messages": chat["messages"], "add_special_tokens": None,
                                                   "add_generation_prompt": None}).json()["tokens"]
    assert "Name a\ncolour." in http(url, "POST", "/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_continue_final_message_leaves_the_assistant_turn_open(url, client):
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    closed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"add_generation_prompt": False})
    open_turn = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                               extra_body={"add_generation_prompt": False,
                                                           "continue_final_message": True})
    # Without the end-of-turn token and newline that close the assistant's message.
    assert open_turn.usage.prompt_tokens == closed.usage.prompt_tokens - 2
    tokenized = http(url, "POST", "/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                      "continue_final_message": True}).json()
    assert tokenized["count"] == open_turn.usage.prompt_tokens
    assert "three" in open_turn.choices[0].message.content.lower()


def test_metrics_count_finished_requests_by_reason_and_size(url, client):
    def sample(name):
        lines = http(url, "GET", "/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))

    before = {name: sample(name) for name in ('vllm:request_success_total{finished_reason="length"',
                                              "vllm:request_generation_tokens_sum", "vllm:request_prompt_tokens_count")}
    response = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, n=2, seed=1)
    assert response.usage.completion_tokens == 6
    after = {name: sample(name) for name in before}
    assert [after[name] - before[name] for name in before] == [2, 6, 1]
    # A scored prompt (echo, max_tokens 0) generated nothing the client sees, and neither do the metrics.
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=0, echo=True, logprobs=0)
    scored = {name: sample(name) for name in before}
    assert [scored[name] - after[name] for name in before] == [1, 0, 1]
    # A stream's outputs are deltas: the metrics and its usage still count every token of every choice.
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, n=2, seed=1,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6
    streamed = {name: sample(name) for name in before}
    assert [streamed[name] - scored[name] for name in before] == [2, 6, 1]


def test_models_tokenize_detokenize_health(url):
    assert http(url, "GET", "/health").status_code == 200
    assert http(url, "GET", "/v1/models").json()["data"][0]["id"] == MODEL
    tokens = http(url, "POST", "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert http(url, "POST", "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    assert http(url, "GET", "/version").json()["version"]
    for path in ("/v1/completions", "/tokenize"):  # a body that is not UTF-8: OpenAI's error shape
        response = http(url, "POST", path, content=b'{"prompt": "\xff hi"}',
                        headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == 400
    missing = http(url, "GET", "/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"


def test_load_with_cancellations_leaves_nothing_running(url):
    """64 concurrent streams, every fourth cancelled mid-stream: the rest finish, nothing leaks."""

    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=24,
                                                 temperature=0.7, seed=i, stream=True)
        text, chunks = "", 0
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text if chunk.choices else ""
            if i % 4 == 0 and chunks == 3:
                await stream.close()
                return None
        return chunk.choices[0].finish_reason, text

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    finished = [r for r in results if r is not None]
    assert len(finished) == 48 and all(reason in ("length", "stop") and text for reason, text in finished)
    for _ in range(50):
        metrics = http(url, "GET", "/metrics").text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("vllm:") and "{" in line}
        if values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0:
            break
        asyncio.run(asyncio.sleep(0.2))
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0
    assert values["vllm:generation_tokens_total"] > 0


def test_prefix_cache_metrics_count_tokens_as_vllm_does():
    """With prefix caching, a repeated prompt's cached blocks show up as tokens (vLLM's unit)."""
    with running_server(*SERVER_ARGS, "--enable-prefix-caching", "--enforce-eager") as base:
        prompt = "word " * 100  # 101 tokens: six whole 16-token blocks
        for _ in range(2):
            assert httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                              timeout=60).status_code == 200
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                  for line in httpx.get(base + "/metrics").text.splitlines()
                  if line.startswith("vllm:prefix_cache") and "{" in line}
    assert values["vllm:prefix_cache_hits_total"] == 96
    assert values["vllm:prefix_cache_queries_total"] == 192
