"""Prompts as vLLM's scripts write them: text, token ids, or the dicts ``TextPrompt`` and
``TokensPrompt`` (``{"prompt": "..."}``, ``{"prompt_token_ids": [...]}``)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text (vLLM's ``vllm.inputs.TextPrompt``)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (vLLM's ``vllm.inputs.TokensPrompt``)."""

    prompt_token_ids: list[int]


PromptType = str | Sequence[int] | TextPrompt | TokensPrompt


def prompt_input(prompt: PromptType) -> str | list[int]:
    """The text or token ids a prompt of any of these forms holds."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    try:
        return [operator.index(t) for t in prompt]  # a list, tuple or NumPy array of integers
    except TypeError:
        raise TypeError(f"a prompt is text, token ids, or a {{'prompt': ...}} / {{'prompt_token_ids': ...}} "
                        f"dict; got {type(prompt).__name__}") from None
