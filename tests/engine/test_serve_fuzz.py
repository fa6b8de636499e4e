"""The server against its own ``/openapi.json``, fuzzed with Schemathesis: no 5xx, and every
response's status, media type and body as the schema documents them. Afterwards nothing runs,
nothing waits, and every KV block is free.

The model is a tiny random LLaMA with SmolLM2's tokenizer and chat template (so text prompts
and chats get past validation). Generated requests are capped by the test (``max_tokens`` 4,
prompts within the context) rather than by weakening the server."""

from __future__ import annotations

import re

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from engine.entrypoints.server import build_parser
from tests.engine.conftest import TINY_MAX_NEW_TOKENS

pytestmark = pytest.mark.slow

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_TOKENS = 4
EXAMPLES = 40  # per route, from a fixed seed


@pytest.fixture(scope="module")
def url(tiny_served_url):
    return tiny_served_url


def bounded(case) -> None:
    """Keep a generated body cheap to serve: a few tokens, no unbounded completion."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if field in case.body or field == "max_tokens":
                value = case.body.get(field)
                case.body[field] = min(value, MAX_TOKENS) if isinstance(value, int) and value >= 0 else MAX_TOKENS


def test_every_route_answers_as_its_schema_says(url):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 8, [op.label for op in operations]
    for operation in operations:
        @hypothesis.given(case=operation.as_strategy())
        @hypothesis.settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def fuzz(case):
            bounded(case)
            case.call_and_validate(checks=CHECKS, timeout=120)

        fuzz()


def test_the_schema_declares_what_each_route_answers(url):
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    errors = {"400", "401", "404", "413", "500", "503"}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200"} | errors, path  # 400 for a body that does not validate, never 422
        error_schema = responses["400"]["content"]["application/json"]["schema"]
        assert error_schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(paths["/v1/completions"]["post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                   "text/event-stream"}
    assert set(paths["/health"]["get"]["responses"]) == {"200", "500", "503"}
    assert "content" not in paths["/health"]["get"]["responses"]["200"]  # an empty body, as vLLM's
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert httpx.get(url + "/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_max_new_tokens_is_the_default_and_the_cap_of_max_tokens(url):
    for body in ({}, {"max_tokens": 50}, {"max_tokens": 3}):
        response = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Count to ten."}], "ignore_eos": True, **body}).json()
        cap = TINY_MAX_NEW_TOKENS
        assert response["usage"]["completion_tokens"] == min(body.get("max_tokens", cap), cap)


@pytest.mark.parametrize("value, fragment", [
    ('{"seed": 5}', "keys among temperature"), ('{"max_new_tokens": 0}', "max_new_tokens must be"),
    ('{"temperature": -1}', "temperature must be a number >= 0"), ("{", "not JSON")])
def test_override_generation_config_refuses_what_it_cannot_honour(value, fragment, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--override-generation-config", value])
    assert fragment in capsys.readouterr().err


def test_after_the_fuzzing_nothing_runs_and_every_block_is_free(url):
    values = {}
    for _ in range(100):
        metrics = httpx.get(url + "/metrics").text
        values = {name: float(value) for name, value in re.findall(r"^(vllm:[a-z_]+)\{[^}]*\} (\S+)$", metrics, re.M)}
        if values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0:
            break
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0
