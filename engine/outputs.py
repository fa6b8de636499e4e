"""What a request returns (vLLM's names): one ``RequestOutput`` with a ``CompletionOutput`` per sample."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

from engine.core.records import record


class Logprob(float):
    """A token's log-probability. It is a float, and carries vLLM's ``Logprob`` fields too:
    ``.logprob``; ``.rank``, the token's place in the model's distribution (1 = the most
    likely); ``.decoded_token``, its text alone (None without a tokenizer)."""

    __slots__ = ("rank", "decoded_token")  # no __dict__ per entry: a third faster to make

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        value = super().__new__(cls, logprob)
        value.rank, value.decoded_token = rank, decoded_token
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


# token id → log-probability, for the chosen token and the requested top alternatives
TokenLogprobs = dict[int, Logprob]


# Per tokenizer, each token's text alone, as decoded once: a log-probabilities entry names the
# sampled token and its alternatives, and ``tokenizer.decode`` costs some 6 us a call.
_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_namer(tokenizer):
    """A function from a token to its text alone, ``tokenizer.decode([token])``, remembered per
    tokenizer (a token's text alone is fixed); None for every token without a ``tokenizer``."""
    if tokenizer is None:
        return lambda token: None
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = _TOKEN_TEXTS[tokenizer] = {}

    def name(token: int) -> str:
        text = texts.get(token)
        if text is None:
            text = texts[token] = tokenizer.decode([token])
        return text

    return name


def token_logprobs(tokenizer, chosen: tuple[int, float, int], top_tokens, top_logprobs) -> TokenLogprobs:
    """One step's entry: the chosen (token, log-probability, rank), then the top alternatives,
    best first (their ranks are 1, 2, ...); each token with its text alone (None without a
    ``tokenizer``)."""
    name = _token_namer(tokenizer)
    token, logprob, rank = chosen
    entry = {token: Logprob(logprob, rank, name(token))}
    for place, (alternative, value) in enumerate(zip(top_tokens, top_logprobs), start=1):
        entry[alternative] = Logprob(value, place, name(alternative))
    return entry


@record
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

    def finished(self) -> bool:
        """Whether this sequence is done (a method, as vLLM's ``CompletionOutput.finished()``)."""
        return self.finish_reason is not None


@record
class RequestOutput:
    """Everything produced so far for one request.

    prompt_logprobs: one entry per prompt token (None for the first, which has no context).
    num_cached_tokens: how many prompt tokens the prefix cache held when the request was first
    scheduled (None before that).
    error: why the request was refused (e.g. prompt longer than max_model_len; then
    ``outputs`` are empty) or stopped part-way (its samples outgrew the KV cache; then
    ``outputs`` hold what they generated); ``finished`` is True either way.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    error: str | None = None
    metrics: "RequestMetrics | None" = None
    num_cached_tokens: int | None = None


@record
class BeamSearchSequence:
    """One hypothesis of a beam search, as vLLM's: ``tokens`` are the prompt's then the
    generated ones, ``text`` decodes them all; ``logprobs`` has, per generated token, the
    log-probabilities of every token its beam proposed at that step (the chosen one among them);
    ``cum_logprob`` sums the chosen tokens' log-probabilities."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@record
class BeamSearchOutput:
    """What ``LLM.beam_search`` returns per prompt (vLLM's type): the ``beam_width`` best
    ``sequences``, best first. ``error``: why the prompt was refused (then no sequences)."""

    sequences: list[BeamSearchSequence]
    error: str | None = None


@record
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds) of a request's milestones."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


def joined_deltas(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive ``RequestOutputKind.DELTA`` outputs of one request as the one delta that says
    what they all say (vLLM's ``RequestOutput.add`` aggregating), in time linear in their size:
    per completion index, the texts, tokens and log-probability entries joined, the rest
    (cumulative log-probability, finish and stop reasons) the last's; the prompt's
    log-probabilities from whichever has them (the first delta); the rest the last's, the
    error the last one given."""
    if len(outputs) == 1:
        return outputs[0]
    parts: dict[int, list[CompletionOutput]] = {}
    for output in outputs:
        for c in output.outputs:
            parts.setdefault(c.index, []).append(c)
    completions = []
    for index in sorted(parts):
        pieces, last = parts[index], parts[index][-1]
        logprobs = None if last.logprobs is None else tuple(
            itertools.chain.from_iterable(c.logprobs or () for c in pieces))
        completions.append(CompletionOutput(
            index, "".join(c.text for c in pieces), tuple(itertools.chain.from_iterable(c.token_ids for c in pieces)),
            last.cumulative_logprob, logprobs, last.finish_reason, last.stop_reason))
    last = outputs[-1]
    return RequestOutput(
        last.request_id, last.prompt, last.prompt_token_ids, tuple(completions), last.finished,
        next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
        next((o.error for o in reversed(outputs) if o.error is not None), None), last.metrics,
        next((o.num_cached_tokens for o in reversed(outputs) if o.num_cached_tokens is not None), None))
