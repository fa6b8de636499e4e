"""OpenAI's request bodies (with vLLM's extra sampling fields) and how they map to our params;
its error object and ids."""

from __future__ import annotations

import logging
import math
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from engine.entrypoints import structured_fields
from engine.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams

log = logging.getLogger("engine.serve")

# Sampling fields a beam search cannot honour, with the values that ask for nothing. vLLM's
# server ignores them there; this one refuses them rather than answer something else.
_NOT_FOR_BEAMS = {"top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (0.0,), "presence_penalty": (0.0,),
                  "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "stop": (None, [], ""),
                  "stop_token_ids": (None, []), "min_tokens": (0,), "logit_bias": (None, {}),
                  "allowed_token_ids": (None,), "best_of": (None,), "bad_words": (None, []),
                  "prompt_logprobs": (None,)}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _supported(self):
        if self.continuous_usage_stats:
            raise ValueError("stream_options.continuous_usage_stats is not supported: usage comes in the last chunk "
                             "with include_usage")
        return self


# Fields of OpenAI's or vLLM's requests that would change what is generated or returned, which
# this server does not do: refused (400) when sent with anything but these values, never ignored.
REFUSED_FIELDS = {
    "return_tokens_as_token_ids": ((False,), "log-probabilities name tokens by their text"),
    "functions": ((None, []), "tool calling is not supported"),
    "function_call": ((None, "none"), "tool calling is not supported"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer decodes them"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "logits_processors": ((None, []), "logits processors are not supported"),
    "documents": ((None, []), "chat templates get the messages only"),
    "mm_processor_kwargs": ((None, {}), "this model reads text only"),
    "structural_tag": ((None,), "structural tags are not supported; use guided_json or guided_grammar"),
    "priority": ((0,), "requests are scheduled first come, first served"),
    "cache_salt": ((None,), "the prefix cache is not salted per request; start the server with "
                   "--no-enable-prefix-caching to share nothing"),
    "kv_transfer_params": ((None,), "disaggregated serving is not supported"),
    "vllm_xargs": ((None, {}), "custom extensions are not supported"),
    "reasoning_effort": ((None,), "chat templates get no reasoning effort; use chat_template_kwargs"),
    "verbosity": ((None,), "chat templates get no verbosity; use chat_template_kwargs"),
    "modalities": ((None, ["text"]), "this model answers in text only"),
    "audio": ((None,), "this model answers in text only"),
    "web_search_options": ((None,), "web search is not supported"),
}
_logged_fields: set[str] = set()


class _Request(BaseModel):
    """A request body. A field sent as ``null`` takes its default (OpenAI's clients may send
    every optional field), except ``max_tokens``, where null means "up to the context", as in
    vLLM. A field in ``REFUSED_FIELDS`` is a 400 saying why; any other field this server does not
    know (``user``-like metadata, or one newer than it) is accepted and logged once, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            allowed, why = REFUSED_FIELDS.get(name, (None, None))
            if allowed is not None and value not in allowed:
                raise ValueError(f"{name} is not supported ({why}); leave it out")
            if name not in cls.model_fields and name not in REFUSED_FIELDS and name not in _logged_fields:
                _logged_fields.add(name)
                log.warning("request field %r is not one this server knows: accepted and ignored", name)
        return {key: value for key, value in data.items() if value is not None or key == "max_tokens"}


class _Sampling(_Request):
    """Fields shared by completions and chat."""

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs cannot be streamed; leave out stream or prompt_logprobs")
        return self

    # The ranges SamplingParams accepts, declared here too so that /openapi.json states them.
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=20)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[NonNegativeInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[NonNegativeInt] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    best_of: int | None = Field(default=None, ge=1)  # the n best of best_of samples (by cumulative logprob)
    length_penalty: float = 1.0
    prompt_logprobs: int | None = Field(default=None, ge=0)
    request_id: str | None = Field(default=None, min_length=1, max_length=200)  # the response's id: PREFIX-request_id
    # structured outputs: OpenAI's response_format, vLLM's guided_* fields and structured_outputs
    response_format: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict | None = None

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The request's constraint, from whichever of its fields sets one (None if none does).
        Raises ValueError naming the fields when several do, or a field that is malformed."""
        return structured_fields.guided_decoding(self)

    def engine_params(self, *, max_tokens: int, logprobs: int | None, best_of: int | None = None,
                      defaults: dict | None = None) -> SamplingParams | BeamSearchParams:
        """What the engine runs: ``sampling_params``, or with vLLM's ``use_beam_search`` a beam
        search keeping the ``n`` best beams. Raises ValueError naming a bad field."""
        if not self.use_beam_search:
            return self.sampling_params(max_tokens=max_tokens, logprobs=logprobs, best_of=best_of, defaults=defaults)
        refused = [name for name, unset in _NOT_FOR_BEAMS.items() if getattr(self, name, None) not in unset]
        refused += ["a constraint on the output (structured outputs)"] if self.guided_decoding() else []
        if refused:
            raise ValueError(f"{', '.join(refused)} cannot be used with use_beam_search (beam search does not "
                             "sample); leave them out")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, length_penalty=self.length_penalty,
                                ignore_eos=self.ignore_eos)

    def sampling_params(self, *, max_tokens: int, logprobs: int | None, best_of: int | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """Our ``SamplingParams``; ``defaults`` (the model's generation config, as
        ``SamplingParams`` fields) fill the sampling fields the request leaves out, as in vLLM.
        Raises ValueError naming a bad field."""
        def given(name: str, default):
            value = getattr(self, name) if name in self.model_fields_set else None
            return value if value is not None else (defaults or {}).get(name, default)

        return SamplingParams(
            n=self.n, best_of=best_of, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
            top_k=given("top_k", 0), min_p=given("min_p", 0.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=given("repetition_penalty", 1.0), seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words or (), guided_decoding=self.guided_decoding(),
            prompt_logprobs=self.prompt_logprobs)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON keys) → {token id: bias}, each bias clamped to
    [-100, 100] as OpenAI documents and vLLM does (NaN is left for ``SamplingParams`` to refuse)."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        out[token] = value if math.isnan(value) else min(100.0, max(-100.0, value))
    return out


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: a string, a list of strings, token ids, or lists of them."""

    prompt: str | list[str] | list[NonNegativeInt] | list[list[NonNegativeInt]]
    logprobs: int | None = Field(default=None, ge=0)
    add_special_tokens: bool = True  # the tokenizer's BOS (and the like) around a text prompt
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=0)
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.suffix:
            raise ValueError("suffix is not supported (this server does not fill in the middle)")
        if self.echo_only and self.min_tokens:
            raise ValueError("min_tokens must be 0 when echo asks for max_tokens 0 (nothing is generated)")
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt (and its log-probabilities) and nothing
        generated, how evaluation harnesses score a text; as in OpenAI's legacy API and vLLM."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None

    @model_validator(mode="after")
    def _text_parts_only(self):
        text_content(self.content)
        if self.tool_calls:
            raise ValueError("tool_calls in a message are not supported: tool calling is not supported")
        return self

    def as_template_input(self) -> dict:
        return {"role": self.role, "content": text_content(self.content)}


# Content part types this model can read, and the key that holds each one's text.
_TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def text_content(content) -> str:
    """A message's content (a string, None, or OpenAI content parts) → the text its chat
    template gets: text parts (and refusal parts, which OpenAI sends in assistant turns) joined
    by newlines, as vLLM joins them. Raises ValueError for any other part (images, audio): this model reads text."""
    if not isinstance(content, list):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ValueError(f"content parts of type {kind!r} are not supported: this model reads text only")
        text = part.get(_TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise ValueError(f"a {kind!r} content part needs a string {_TEXT_PARTS[kind]!r}, got {text!r}")
        texts.append(text)
    return "\n".join(texts)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    chat_template: str | None = None  # vLLM's: this request's template instead of the model's
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the template
    add_special_tokens: bool = False  # the tokenizer's BOS (and the like) on top of the template's

    @model_validator(mode="after")
    def _supported(self):
        """Refuse what this server would otherwise ignore and so answer wrongly."""
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.echo:
            raise ValueError("echo is not supported for chat; use /v1/completions with echo")
        if (self.tools and self.tool_choice != "none") or self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool calling is not supported; leave tools out or set tool_choice to 'none'")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True  # with messages, as in a chat request
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body (:func:`error_body`), on every status but 200."""

    error: ErrorDetail


class RequestError(ValueError):
    """A request that cannot be served; ``status`` is the HTTP code (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def error_body(message: str, status: int, kind: str) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def response_id(prefix: str, given: str | None = None) -> str:
    """An id for a response or request, as OpenAI writes them (``cmpl-...``): ``given`` (the
    request's ``request_id``, as vLLM uses it) or a fresh one."""
    return f"{prefix}-{given or uuid.uuid4().hex}"
