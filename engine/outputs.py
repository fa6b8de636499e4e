"""What a request returns (vLLM's names): one ``RequestOutput`` with a ``CompletionOutput`` per sample."""

from __future__ import annotations

import dataclasses

# token id → log-probability, for the chosen token and the requested top alternatives
TokenLogprobs = dict[int, float]


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence.

    finish_reason: None while generating, then "stop" (EOS, stop token or stop string),
    "length" (max_tokens or the context limit) or "abort"; stop_reason: the stop string or
    token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """Everything produced so far for one request.

    prompt_logprobs: one entry per prompt token (None for the first, which has no context).
    error: why the request was refused (e.g. prompt longer than max_model_len); then
    ``outputs`` are empty and ``finished`` is True.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    error: str | None = None
    metrics: "RequestMetrics | None" = None


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds) of a request's milestones."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
