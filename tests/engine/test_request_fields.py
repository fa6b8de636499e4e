"""Every field of every request this server declares, and every field of vLLM's own requests,
is honoured, refused with a 400 naming it, or cannot change the output and is accepted: one
table, each entry checked against a running server, and a test that the table covers every
field, so a new field cannot slip in silently ignored.

The server is the session's tiny random LLaMA with SmolLM2's tokenizer (which adds BOS here);
its greedy output repeats itself, which the penalties visibly change.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

import httpx
import pytest

import models
from engine.entrypoints.protocol import (
    REFUSED_FIELDS,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from tests.engine.vllm_fields import VLLM_FIELDS

pytestmark = pytest.mark.slow

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize",
         "detokenize": "/detokenize"}
USER = {"role": "user", "content": "Name a color."}
BASE = {"completions": {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        "chat": {"messages": [USER], "max_tokens": 4, "temperature": 0},
        "tokenize": {"prompt": "Name a color."}, "detokenize": {"tokens": [42, 43]}}
HOT = {"temperature": 1.0, "seed": 0}
TOKEN = 42  # a token whose text is one character
CHOICE = ("yes", "no")


@dataclasses.dataclass(frozen=True)
class Server:
    """The running server, its greedy answers to BASE, and what the checks compare with."""

    url: str
    eos: int
    token_text: str  # TOKEN's text

    def post(self, route: str, extra: dict | None = None) -> httpx.Response:
        return httpx.post(self.url + PATHS[route], json={**BASE[route], **(extra or {})}, timeout=120)

    def json(self, route: str, extra: dict | None = None) -> dict:
        response = self.post(route, extra)
        assert response.status_code == 200, response.text
        return response.json()


def text(answer: dict, i: int = 0) -> str:
    choice = answer["choices"][i]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def tokens(answer: dict, kind: str = "completion") -> int:
    return answer["usage"][f"{kind}_tokens"]


def sampled_logprob(answer: dict, i: int) -> float:
    """The sum of choice ``i``'s token log-probabilities (completions' or chat's shape)."""
    logprobs = answer["choices"][i]["logprobs"]
    return sum(logprobs["token_logprobs"]) if "token_logprobs" in logprobs else sum(
        entry["logprob"] for entry in logprobs["content"])


@dataclasses.dataclass(frozen=True)
class Honoured:
    """Sending ``extra`` (or what ``extra(server, route)`` gives) on ``route`` does what ``check``
    asserts about the answer (``check(server, route, answer)``)."""

    extra: dict | Callable
    check: Callable
    route: str | None = None  # None: the route of the schema the field belongs to

    def run(self, server: Server, route: str) -> None:
        extra = self.extra(server, route) if callable(self.extra) else self.extra
        self.check(server, route, server.json(route, extra))


@dataclasses.dataclass(frozen=True)
class Refused:
    """``extra`` is an error (400, or ``status``) whose message has ``fragment``."""

    extra: dict
    fragment: str
    route: str | None = None
    status: int = 400

    def run(self, server: Server, route: str) -> None:
        response = server.post(route, self.extra)
        message = response.json()["error"]["message"]
        assert response.status_code == self.status and self.fragment in message, response.text


@dataclasses.dataclass(frozen=True)
class NoEffect:
    """``extra`` cannot change the answer: accepted, and the same answer as with ``without`` alone."""

    extra: dict
    route: str | None = None
    without: dict = dataclasses.field(default_factory=dict)

    def run(self, server: Server, route: str) -> None:
        assert _comparable(server.json(route, self.extra)) == _comparable(server.json(route, self.without))


def _comparable(answer: dict) -> dict:
    return {key: value for key, value in answer.items() if key not in ("id", "created")}


def same_as_greedy(server, route, answer):
    assert text(answer) == text(server.json(route))


def differs_from_greedy(server, route, answer):
    assert text(answer) != text(server.json(route))


def in_choice(server, route, answer):
    assert text(answer) in CHOICE or json.loads(text(answer)) in CHOICE


def stops_at(server, route, answer):
    greedy = text(server.json(route))
    stop = greedy[4:6]
    assert text(answer) == greedy[:greedy.index(stop)] and answer["choices"][0]["finish_reason"] == "stop"


def best_of_three(server, route, answer):
    """The one answer is the likeliest of the three samples that ``n=3`` draws with the same seed."""
    logprobs = {"logprobs": 0} if route == "completions" else {"logprobs": True}
    three = server.json(route, {**HOT, "n": 3, **logprobs})
    best = max(range(3), key=lambda i: sampled_logprob(three, i))
    assert text(answer) == text(three, best)


def streamed(body: str) -> list[dict]:
    """The JSON chunks of a server-sent-events body."""
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _stream_check(include_usage: bool):
    def check(server, route, _):
        body = {"stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
        chunks = streamed(server.post(route, body).text)
        pieces = [c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content", ""))
                  for c in chunks if c["choices"]]
        assert "".join(p or "" for p in pieces) == text(server.json(route))
        assert (chunks[-1].get("usage") is not None) == include_usage
    return check


def _prompt_tokens_change_by(delta: int):
    def check(server, route, answer):
        assert tokens(answer, "prompt") == tokens(server.json(route), "prompt") + delta
    return check


def _whitespace_as_given(server, route, answer):
    """Whitespace only as the pattern (newlines) allows: the array, maybe cut short by max_tokens."""
    assert " " not in text(answer) and "[1,1]".startswith(text(answer).replace("\n", "")), answer


SHARED = {
    "model": Refused({"model": "another-model"}, "does not exist", status=404),
    "max_tokens": Honoured({"max_tokens": 2}, lambda s, r, a: tokens(a) == 2 or pytest.fail(str(a))),
    "temperature": Honoured(HOT, differs_from_greedy),
    "top_p": Honoured({**HOT, "top_p": 1e-6}, same_as_greedy),
    "top_k": Honoured({**HOT, "top_k": 1}, same_as_greedy),
    "min_p": Honoured({**HOT, "min_p": 1.0}, same_as_greedy),
    "n": Honoured({"n": 2}, lambda s, r, a: len(a["choices"]) == 2 or pytest.fail(str(a))),
    "stop": Honoured(lambda s, r: {"stop": [text(s.json(r))[4:6]]}, stops_at),
    "seed": Honoured({**HOT, "seed": 1}, lambda s, r, a: text(a) != text(s.json(r, HOT)) == text(s.json(r, HOT))
                     or pytest.fail(str(a))),
    "presence_penalty": Honoured({"presence_penalty": 2.0}, differs_from_greedy),
    "frequency_penalty": Honoured({"frequency_penalty": 2.0}, differs_from_greedy),
    "repetition_penalty": Honoured({"repetition_penalty": 2.0}, differs_from_greedy),
    "stream": Honoured({}, _stream_check(include_usage=False)),
    "stream_options": Honoured({}, _stream_check(include_usage=True)),
    "user": NoEffect({"user": "someone"}),
    "ignore_eos": Honoured(lambda s, r: {"logit_bias": {str(s.eos): 100}, "ignore_eos": True},
                           lambda s, r, a: (tokens(a) == 4 and tokens(s.json(r, {"logit_bias": {str(s.eos): 100}}))
                                            <= 1) or pytest.fail(str(a))),
    "min_tokens": Honoured(lambda s, r: {"logit_bias": {str(s.eos): 100}, "min_tokens": 3},
                           lambda s, r, a: tokens(a) >= 3 or pytest.fail(str(a))),
    "stop_token_ids": Honoured({"logit_bias": {str(TOKEN): 100}, "stop_token_ids": [TOKEN]},
                               lambda s, r, a: (a["choices"][0]["stop_reason"] == TOKEN and text(a) == "")
                               or pytest.fail(str(a))),
    "include_stop_str_in_output": Honoured(
        lambda s, r: {"logit_bias": {str(TOKEN): 100}, "stop": [s.token_text], "include_stop_str_in_output": True},
        lambda s, r, a: text(a) == s.token_text or pytest.fail(str(a))),
    "skip_special_tokens": Honoured({"logit_bias": {"1": 100}, "skip_special_tokens": False},
                                    lambda s, r, a: "<|im_start|>" in text(a) or pytest.fail(str(a))),
    "logit_bias": Honoured({"logit_bias": {str(TOKEN): 100}}, lambda s, r, a: text(a) == s.token_text * 4
                           or pytest.fail(str(a))),
    "allowed_token_ids": Honoured({"allowed_token_ids": [TOKEN]}, lambda s, r, a: text(a) == s.token_text * 4
                                  or pytest.fail(str(a))),
    "truncate_prompt_tokens": Honoured({"truncate_prompt_tokens": 2},
                                       lambda s, r, a: tokens(a, "prompt") == 2 or pytest.fail(str(a))),
    "bad_words": Honoured(lambda s, r: {"logit_bias": {str(TOKEN): 100}, "bad_words": [s.token_text]},
                          lambda s, r, a: s.token_text not in text(a) or pytest.fail(str(a))),
    "use_beam_search": Honoured({"use_beam_search": True, "n": 2},
                                lambda s, r, a: len({text(a, 0), text(a, 1)}) == 2 or pytest.fail(str(a))),
    "best_of": Honoured({**HOT, "best_of": 3}, best_of_three),
    # Only ranks finished beams of different lengths: checked where the request becomes BeamSearchParams.
    "length_penalty": Honoured({"use_beam_search": True, "n": 2, "length_penalty": 0.5},
                               lambda s, r, a: _length_penalty_reaches_the_beam_search()),
    "prompt_logprobs": Honoured({"prompt_logprobs": 1}, lambda s, r, a: len(
        a.get("prompt_logprobs") or a["choices"][0]["prompt_logprobs"]) == tokens(a, "prompt")
        or pytest.fail(str(a))),
    "request_id": Honoured({"request_id": "mine-1"},
                           lambda s, r, a: a["id"].endswith("-mine-1") or pytest.fail(str(a))),
    "response_format": Honoured({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"enum": list(CHOICE)}}}}, in_choice),
    "guided_json": Honoured({"guided_json": {"enum": list(CHOICE)}}, in_choice),
    "guided_regex": Honoured({"guided_regex": "[ab]{3}"}, lambda s, r, a: re.fullmatch("[ab]{3}", text(a))
                             or pytest.fail(str(a))),
    "guided_choice": Honoured({"guided_choice": list(CHOICE)}, in_choice),
    "guided_grammar": Honoured({"guided_grammar": 'root ::= "yes" | "no"'}, in_choice),
    "guided_whitespace_pattern": Honoured({"guided_json": {"type": "array", "items": {"enum": [1]}, "minItems": 2,
                                                           "maxItems": 2}, "guided_whitespace_pattern": "\n",
                                           "max_tokens": 6}, _whitespace_as_given),
    "guided_decoding_backend": NoEffect({"guided_choice": list(CHOICE), "guided_decoding_backend": "xgrammar"},
                                        without={"guided_choice": list(CHOICE)}),
    "structured_outputs": Honoured({"structured_outputs": {"choice": list(CHOICE)}}, in_choice),
    # vLLM's fields this server does not declare, which cannot change the answer: accepted and logged.
    "include_reasoning": NoEffect({"include_reasoning": True}, route="chat"),
    "parallel_tool_calls": NoEffect({"parallel_tool_calls": False}, route="chat"),
    "store": NoEffect({"store": True}, route="chat"),
    "metadata": NoEffect({"metadata": {"team": "a"}}, route="chat"),
    "service_tier": NoEffect({"service_tier": "auto"}, route="chat"),
    "prediction": NoEffect({"prediction": {"type": "content", "content": "Blue"}}, route="chat"),
}

REFUSED_VALUES = {"return_tokens_as_token_ids": True, "functions": [{"name": "f"}], "function_call": "auto",
                  "spaces_between_special_tokens": False, "prompt_embeds": "AAAA", "logits_processors": ["m.f"],
                  "documents": [{"title": "t", "text": "x"}], "mm_processor_kwargs": {"a": 1},
                  "structural_tag": "{}", "priority": 1, "cache_salt": "salt", "kv_transfer_params": {"a": 1},
                  "vllm_xargs": {"a": 1}, "reasoning_effort": "low", "modalities": ["audio"],
                  "audio": {"voice": "alloy"}, "web_search_options": {}, "verbosity": "low"}

COMPLETIONS = {
    "prompt": Honoured({"prompt": [5, 6, 7]}, lambda s, r, a: tokens(a, "prompt") == 3 or pytest.fail(str(a))),
    "logprobs": Honoured({"logprobs": 2}, lambda s, r, a: all(len(top) >= 2 for top in a["choices"][0]["logprobs"][
        "top_logprobs"]) or pytest.fail(str(a))),
    "echo": Honoured({"echo": True}, lambda s, r, a: text(a).startswith(BASE["completions"]["prompt"])
                     or pytest.fail(str(a))),
    "suffix": Refused({"suffix": "!"}, "suffix is not supported"),
    "add_special_tokens": Honoured({"add_special_tokens": False}, _prompt_tokens_change_by(-1)),
}

CHAT = {
    "messages": Honoured({"messages": [{"role": "user", "content": "Hi"}]},
                         lambda s, r, a: tokens(a, "prompt") < tokens(s.json(r), "prompt") or pytest.fail(str(a))),
    "logprobs": Honoured({"logprobs": True}, lambda s, r, a: len(a["choices"][0]["logprobs"]["content"]) == 4
                         or pytest.fail(str(a))),
    "top_logprobs": Honoured({"logprobs": True, "top_logprobs": 2}, lambda s, r, a: all(
        len(entry["top_logprobs"]) == 2 for entry in a["choices"][0]["logprobs"]["content"])
        or pytest.fail(str(a))),
    "max_completion_tokens": Honoured({"max_completion_tokens": 2},
                                      lambda s, r, a: tokens(a) == 2 or pytest.fail(str(a))),
    "add_generation_prompt": Honoured({"add_generation_prompt": False},
                                      lambda s, r, a: tokens(a, "prompt") < tokens(s.json(r), "prompt")
                                      or pytest.fail(str(a))),
    "continue_final_message": Honoured(
        {"messages": [USER, {"role": "assistant", "content": "Blue"}], "add_generation_prompt": False,
         "continue_final_message": True},
        lambda s, r, a: tokens(a, "prompt") < tokens(s.json(r, {"messages": [USER, {"role": "assistant", "content":
                                                                                 "Blue"}],
                                                                "add_generation_prompt": False}), "prompt")
        or pytest.fail(str(a))),
    "echo": Refused({"echo": True}, "echo is not supported for chat"),
    "tools": Refused({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool calling is not supported"),
    "tool_choice": Refused({"tool_choice": "required"}, "tool calling is not supported"),
    "chat_template": Honoured({"chat_template": "{{ messages[0]['content'] }}"},
                              lambda s, r, a: tokens(a, "prompt") == len(s.json("tokenize", {
                                  "add_special_tokens": False})["tokens"]) or pytest.fail(str(a))),
    "chat_template_kwargs": Honoured({"chat_template": "{{ greeting }}{{ messages[0]['content'] }}",
                                      "chat_template_kwargs": {"greeting": "Hello there. "}},
                                     lambda s, r, a: tokens(a, "prompt") > tokens(s.json(r, {
                                         "chat_template": "{{ messages[0]['content'] }}"}), "prompt")
                                     or pytest.fail(str(a))),
    "add_special_tokens": Honoured({"add_special_tokens": True}, _prompt_tokens_change_by(+1)),
}

TOKENIZE = {
    "model": Refused({"model": "another-model"}, "does not exist", status=404),
    "prompt": Honoured({"prompt": "Hi"}, lambda s, r, a: a["count"] == 2 or pytest.fail(str(a))),  # BOS, "Hi"
    "messages": Honoured({"prompt": None, "messages": [USER]},
                         lambda s, r, a: a["count"] == tokens(s.json("chat"), "prompt") or pytest.fail(str(a))),
    "add_special_tokens": Honoured({"add_special_tokens": False},
                                   lambda s, r, a: a["count"] == s.json(r)["count"] - 1 or pytest.fail(str(a))),
    "add_generation_prompt": Honoured({"prompt": None, "messages": [USER], "add_generation_prompt": False},
                                      lambda s, r, a: a["count"] < tokens(s.json("chat"), "prompt")
                                      or pytest.fail(str(a))),
    "continue_final_message": Refused({"prompt": None, "messages": [USER], "continue_final_message": True},
                                      "continue_final_message needs add_generation_prompt set to false"),
    "chat_template": Honoured({"prompt": None, "messages": [USER], "chat_template": "{{ messages[0]['content'] }}"},
                              lambda s, r, a: a["count"] == s.json(r, {"add_special_tokens": False})["count"]
                              or pytest.fail(str(a))),
    "chat_template_kwargs": Refused({"prompt": None, "messages": [USER], "chat_template_kwargs": {"tokenize": True}},
                                    "chat_template_kwargs cannot set ['tokenize']"),
    "return_token_strs": Honoured({"return_token_strs": True},
                                  lambda s, r, a: len(a["token_strs"]) == a["count"] or pytest.fail(str(a))),
}

DETOKENIZE = {
    "model": Refused({"model": "another-model"}, "does not exist", status=404),
    "tokens": Honoured({"tokens": [TOKEN]}, lambda s, r, a: a["prompt"] == s.token_text or pytest.fail(str(a))),
}

NESTED = {
    ("StreamOptions", "include_usage"): Honoured({}, _stream_check(include_usage=True), route="completions"),
    ("StreamOptions", "continuous_usage_stats"): Refused(
        {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats is not "
        "supported", route="completions"),
    ("ChatMessage", "role"): Honoured({"messages": [{"role": "system", "content": USER["content"]}]},
                                      lambda s, r, a: tokens(a, "prompt") != tokens(s.json(r), "prompt")
                                      or pytest.fail(str(a)), route="chat"),
    ("ChatMessage", "content"): Honoured({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
                                         lambda s, r, a: tokens(a, "prompt") == tokens(s.json(r, {"messages": [
                                             {"role": "user", "content": "Hi"}]}), "prompt") or pytest.fail(str(a)),
                                         route="chat"),
    ("ChatMessage", "tool_calls"): Refused({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "1"}]}]},
                                           "tool_calls in a message are not supported", route="chat"),
}


def _table() -> dict[tuple[str, str], tuple[str, object]]:
    """(schema, field) → (route, case) for every field of every request schema."""
    table = {}
    for route, own, schema in (("completions", COMPLETIONS, "CompletionRequest"), ("chat", CHAT, "ChatRequest")):
        cases = {**SHARED, **{name: Refused({name: value}, f"{name} is not supported")
                              for name, value in REFUSED_VALUES.items()}, **own}
        for name, case in cases.items():
            if case.route in (None, route):
                table[(schema, name)] = (route, case)
    table |= {("TokenizeRequest", name): ("tokenize", case) for name, case in TOKENIZE.items()}
    table |= {("DetokenizeRequest", name): ("detokenize", case) for name, case in DETOKENIZE.items()}
    table |= {key: (case.route, case) for key, case in NESTED.items()}
    return table


TABLE = _table()


def _length_penalty_reaches_the_beam_search() -> None:
    request = ChatRequest(messages=[USER], use_beam_search=True, n=2, length_penalty=0.5)
    assert request.engine_params(max_tokens=4, logprobs=None).length_penalty == 0.5


@pytest.fixture(scope="module")
def server(tiny_served_url) -> Server:
    tokenizer = models.load_tokenizer("SmolLM2-135M-Instruct")
    return Server(tiny_served_url, eos=tokenizer.eos_token_id, token_text=tokenizer.decode([TOKEN]))


@pytest.mark.parametrize("schema, field", sorted(TABLE), ids=lambda value: value)
def test_each_field_is_honoured_refused_or_has_no_effect(server, schema, field):
    route, case = TABLE[(schema, field)]
    case.run(server, route)


@pytest.mark.parametrize("schema, route", [(CompletionRequest, "completions"), (ChatRequest, "chat"),
                                           (TokenizeRequest, None), (DetokenizeRequest, None),
                                           (StreamOptions, None), (ChatMessage, None)])
def test_the_table_has_every_declared_field_and_every_field_of_vllms(schema, route):
    covered = {field for name, field in TABLE if name == schema.__name__}
    assert set(schema.model_fields) <= covered, set(schema.model_fields) - covered
    if route is not None:
        assert set(VLLM_FIELDS[route].split()) | set(REFUSED_FIELDS) <= covered
