"""Structured outputs through the OpenAI-compatible server, with the official ``openai`` client:
OpenAI's ``response_format`` and vLLM's ``guided_*`` and ``structured_outputs`` fields."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def url(served_url):
    return served_url


@pytest.fixture(scope="module")
def client(served_client):
    return served_client


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("who", ["Ann, aged 31", "a retired sailor", "the author of Hamlet"])
def test_parse_with_a_pydantic_model_gives_a_valid_object(client, who):
    response = client.chat.completions.parse(model=MODEL, messages=ask(f"Describe {who} as JSON."),
                                             response_format=Person, max_tokens=100, temperature=0)
    assert isinstance(response.choices[0].message.parsed, Person)


def test_json_object_regex_and_choice(client):
    text = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=80, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}}).choices[0].text
    assert isinstance(json.loads(text), dict)
    date = client.completions.create(model=MODEL, prompt="Today's date is", max_tokens=20, temperature=0.7, seed=2,
                                     extra_body={"guided_regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}).choices[0].text
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)
    choices = ["yes", "no", "maybe"]
    response = client.chat.completions.create(model=MODEL, messages=ask("Is the sky blue?"), n=4, temperature=1.0,
                                              seed=5, extra_body={"guided_choice": choices})
    assert all(choice.message.content in choices for choice in response.choices)
    vllm_new = client.chat.completions.create(model=MODEL, messages=ask("Is the sky blue?"), temperature=0,
                                              extra_body={"structured_outputs": {"choice": choices}})
    assert vllm_new.choices[0].message.content in choices


def test_a_streamed_json_schema_response_joins_to_valid_json(client):
    schema = {**Person.model_json_schema(), "additionalProperties": False}  # strict, as parse() sends it
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Describe Bob as JSON."), max_tokens=100, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Person.model_validate_json(text)


def test_unconstrained_requests_get_the_same_tokens_beside_constrained_ones(url):
    prompts = [f"Tell me about {topic}." for topic in ("rivers", "owls", "bread")]

    async def plain(client, prompt):
        response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        return response.choices[0].text

    async def constrained(client, i):
        await client.chat.completions.create(model=MODEL, messages=ask(f"Person {i} as JSON."), max_tokens=40,
                                             temperature=0.8, seed=i,
                                             extra_body={"guided_json": Person.model_json_schema()})

    async def run(with_constrained: bool):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=300) as client:
            others = [constrained(client, i) for i in range(6)] if with_constrained else []
            results = await asyncio.gather(*(plain(client, p) for p in prompts), *others)
            return results[: len(prompts)]

    assert asyncio.run(run(True)) == asyncio.run(run(False))


@pytest.mark.parametrize("body, fragment", [
    ({"guided_regex": "[a-"}, "unclosed character class"),
    ({"guided_json": {"type": "colour"}}, "colour"),
    ({"guided_grammar": "start: (("}, "invalid grammar constraint"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex and guided_choice"),
    ({"response_format": {"type": "xml"}}, "'xml' is not supported"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"structured_outputs": {"colour": "red"}}, "unknown fields ['colour']"),
    ({"guided_choice": ["a", "b"], "use_beam_search": True, "n": 2}, "cannot be used with use_beam_search"),
])
def test_a_bad_constraint_is_a_400_naming_it_and_the_server_keeps_serving(url, client, body, fragment):
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **body},
                          timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r"^vllm:num_requests_running\{[^}]*\} 0", metrics, re.M)
