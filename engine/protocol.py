"""OpenAI's request bodies (with vLLM's extra sampling fields) and how they map to our params."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat; unknown fields are ignored, as OpenAI's server does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None

    def sampling_params(self, *, max_tokens: int, logprobs: int | None, best_of: int | None = None) -> SamplingParams:
        """Our ``SamplingParams``; raises ValueError naming a bad field."""
        return SamplingParams(
            n=self.n, best_of=best_of, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=_logit_bias(self.logit_bias))


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

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    max_tokens: int | None = 16

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
        return {"role": self.role, "content": content or ""}


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
