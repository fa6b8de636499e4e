"""What a request asks for: how to pick tokens and when to stop (vLLM's names and ranges)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import numbers
from collections.abc import Iterable, Mapping

import numpy as np

_GREEDY_EPSILON = 1e-5


class RequestOutputKind(enum.Enum):
    """Which outputs ``LLMEngine.step`` returns for a request (vLLM's): after every step (or
    every ``stream_interval`` tokens, ``EngineConfig``'s, after its first), all of it so far
    (``CUMULATIVE``), only what is new since its previous output (``DELTA``: text,
    tokens and log-probabilities of the completions that changed; prompt log-probabilities in
    the first output only), or only its last (``FINAL_ONLY``, which ``LLM.generate`` asks
    for: a step then builds no output for a request still running)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(frozen=True)
class GuidedDecodingParams:
    """A constraint on what a request generates (vLLM's structured outputs; also named
    ``StructuredOutputsParams``): exactly one of ``json`` (a JSON schema, as a dict or its
    text), ``json_object`` (any JSON object), ``regex``, ``choice`` (the output is one of these
    strings) or ``grammar`` (Lark, or GBNF/EBNF as llama.cpp writes it). JSON may hold
    whitespace between tokens unless ``disable_any_whitespace``, or as ``whitespace_pattern``
    (a regex) allows. ``backend`` is accepted for vLLM's scripts; every constraint runs on
    llguidance. Invalid values raise ``ValueError`` naming the field; an invalid schema,
    regex or grammar is refused when the request is added."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None

    def __post_init__(self):
        owner = "GuidedDecodingParams"
        if isinstance(self.json, Mapping):  # canonical text: one cache entry per schema
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if isinstance(self.choice, Iterable) and not isinstance(self.choice, (str, bytes)):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        _require(len(given) == 1, "json/regex/choice/grammar/json_object", "exactly one of them",
                 given or None, owner)
        for field in ("json", "regex", "grammar", "whitespace_pattern", "backend"):
            value = getattr(self, field)
            _require(value is None or (isinstance(value, str) and value), field, "a non-empty string", value, owner)
        _require(self.choice is None or (isinstance(self.choice, tuple) and self.choice
                                         and all(isinstance(c, str) and c for c in self.choice)),
                 "choice", "a non-empty list of non-empty strings", self.choice, owner)
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise ValueError(f"{owner}.json must be a JSON schema, got text that is not JSON: {error}") from None
            _require(isinstance(schema, (dict, bool)), "json", "a JSON schema (an object)", self.json, owner)

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
                    ) if not self.json_object else "json_object"


StructuredOutputsParams = GuidedDecodingParams  # vLLM's newer name


@dataclasses.dataclass
class SamplingParams:
    """How to generate for one request. Invalid values raise ``ValueError`` naming the field.

    n: completions returned. best_of: candidates generated, the ``n`` with the highest
    cumulative log-probability returned (None: ``n``). temperature: 0 means greedy.
    top_p, top_k (0 or -1 = off), min_p: truncate the distribution. presence_penalty,
    frequency_penalty (OpenAI's, over generated tokens) and repetition_penalty (Hugging Face's,
    over prompt and generated tokens). seed: any integer (taken modulo 2**32); the random draws
    then depend on it alone, not on what else is batched, so runs repeat (the logits of
    different batch shapes can still differ in the last bits, as in vLLM, and a draw that
    lands on a boundary between two tokens can flip). stop / stop_token_ids
    end a completion; the text leaves out the stop string, or the text of the stop token or
    EOS, unless include_stop_str_in_output. ignore_eos keeps going past EOS; min_tokens bans
    EOS and stop tokens, and ignores stop strings, until that many are generated.
    logprobs / prompt_logprobs: how many top alternatives to return per generated / prompt
    token (0 = just the chosen token's). logit_bias: a mapping from token id to a number added
    to that token's logit before anything else (OpenAI's and vLLM's
    ``logit_bias``; -100 in effect bans a token, +100 forces it), stored as sorted
    ``(token, bias)`` pairs; it changes what is sampled, not the log-probabilities reported.
    allowed_token_ids: if given, the only tokens that may be generated (vLLM's; a non-empty
    list of token ids). truncate_prompt_tokens: if given (k >= 1), only the prompt's last k
    tokens are used (vLLM's left truncation). bad_words: words never to generate (vLLM's): the
    last token of each word's tokens (with and without a leading space) is banned whenever the
    tokens generated so far end with the ones before it. detokenize: False leaves the text
    empty and log-probabilities without decoded tokens (token ids only; no stop strings).
    output_kind: which outputs the engine's steps return (``RequestOutputKind``).

    Fields can be set after construction, as in vLLM (``params.max_tokens = 32``); they are
    checked again when a request takes them, and the engine keeps its own :meth:`snapshot`, so a
    change made later never reaches a running request.
    guided_decoding: a constraint every completion follows (``GuidedDecodingParams``: a JSON
    schema, a regex, a choice or a grammar; vLLM's).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: tuple[str, ...] = ()
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self):
        for field in ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                      "truncate_prompt_tokens"):
            value = getattr(self, field)  # NumPy integers (a seed from an RNG, say) are integers too
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                object.__setattr__(self, field, int(value))
        for field in ("stop", "stop_token_ids", "bad_words"):  # a list (one string is a list of one)
            value = getattr(self, field)
            value = (value,) if isinstance(value, str) else () if value is None else value
            object.__setattr__(self, field, tuple(value) if isinstance(value, Iterable) else value)
        object.__setattr__(self, "stop_token_ids", _ints(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.allowed_token_ids, Iterable) and not isinstance(self.allowed_token_ids, (str, bytes)):
            object.__setattr__(self, "allowed_token_ids", _ints(tuple(self.allowed_token_ids)))
        _check(self)

    @functools.cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``logit_bias`` as (int32 token ids, float32 biases), built once per request rather
        than at every step of it."""
        tokens, values = zip(*self.logit_bias) if self.logit_bias else ((), ())
        return np.array(tokens, np.int32), np.array(values, np.float32)

    @functools.cached_property
    def allowed_array(self) -> np.ndarray:
        """``allowed_token_ids`` as int32 (empty when every token is allowed), built once per request."""
        return np.array(self.allowed_token_ids or (), np.int32)

    def truncate(self, token_ids: list[int]) -> list[int]:
        """The prompt this request uses: ``token_ids``, or their last ``truncate_prompt_tokens``."""
        return token_ids[-self.truncate_prompt_tokens:] if self.truncate_prompt_tokens else token_ids

    def clone(self) -> "SamplingParams":
        """A copy (as vLLM's ``clone``), checked again."""
        return dataclasses.replace(self)

    def snapshot(self) -> "SamplingParams":
        """A checked copy that cannot be changed: what the engine keeps of a request's
        parameters. Raises ``ValueError`` naming a field set to a bad value since construction."""
        copy = dataclasses.replace(self)
        object.__setattr__(copy, "_fixed", True)
        return copy

    def __setattr__(self, name, value):
        if getattr(self, "_fixed", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {name}: these are a running request's parameters; change a clone() instead")
        super().__setattr__(name, value)
        for derived in ("logit_bias_arrays", "allowed_array"):  # built from the old values
            self.__dict__.pop(derived, None)

    def bad_word_ids(self, tokenizer) -> tuple[tuple[int, ...], ...]:
        """Each of ``bad_words`` as ``tokenizer``'s token ids, as vLLM reads them: the word
        alone, and with a leading space when that makes different tokens of the same count
        (a word in mid-text)."""
        words = []
        for word in self.bad_words:
            alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            words += [alone] if alone else []
            if alone and spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                words.append(spaced)
        return tuple(words)

    @property
    def num_candidates(self) -> int:
        """Sequences generated: ``best_of``, or ``n`` when it is None (kept unresolved, so
        ``dataclasses.replace(params, n=...)`` moves both)."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        """True when the request takes the most likely token every step."""
        return self.temperature < _GREEDY_EPSILON


def final_only(params):
    """``params`` asking for only the final output (``RequestOutputKind.FINAL_ONLY``), for callers
    that wait for the end anyway; ``BeamSearchParams`` (final only by nature) as they are."""
    if isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.FINAL_ONLY:
        return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return params


def as_deltas(params):
    """``params`` asking for outputs that each hold only what the earlier ones did not
    (``RequestOutputKind.DELTA``), for a stream that sends what is new: each output then costs
    what is new, not the whole output so far. ``BeamSearchParams`` (final only by nature) as
    they are."""
    if isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.DELTA:
        return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    return params


def _require(ok: bool, field: str, allowed: str, value, owner: str = "SamplingParams") -> None:
    if not ok:
        raise ValueError(f"{owner}.{field} must be {allowed}, got {value!r}")


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


_MAX_BIAS = 1e9  # beyond this, a bias divided by a small temperature could overflow float32


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping, or pairs; later pairs win) → sorted (token id, bias) pairs."""
    items = bias.items() if isinstance(bias, Mapping) else bias or ()
    allowed = f"a mapping from non-negative token ids to numbers in [-{_MAX_BIAS:g}, {_MAX_BIAS:g}]"
    _require(isinstance(items, Iterable) and not isinstance(items, (str, bytes)), "logit_bias", allowed, bias)
    out = {}
    for pair in items:
        ok = isinstance(pair, (tuple, list)) and len(pair) == 2
        token, value = pair if ok else (None, None)
        ok = ok and isinstance(token, numbers.Integral) and not isinstance(token, bool) and token >= 0
        _require(ok and _real(value) and abs(value) <= _MAX_BIAS, "logit_bias", allowed, pair)
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


def _ints(values):
    """A tuple's NumPy integers as ints (anything else is left for the checks to name)."""
    if not isinstance(values, tuple):
        return values
    return tuple(int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in values)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(p: SamplingParams) -> None:
    _require(_integer(p.n) and p.n >= 1, "n", "an integer >= 1", p.n)
    _require(p.best_of is None or (_integer(p.best_of) and p.best_of >= p.n), "best_of",
             f"None (= n) or an integer >= n ({p.n})", p.best_of)
    _require(_real(p.temperature) and p.temperature >= 0, "temperature", "a number >= 0", p.temperature)
    _require(_real(p.top_p) and 0 < p.top_p <= 1, "top_p", "in (0, 1]", p.top_p)
    _require(_integer(p.top_k) and p.top_k >= 0, "top_k", "-1, 0 (off) or a positive integer", p.top_k)
    _require(_real(p.min_p) and 0 <= p.min_p <= 1, "min_p", "in [0, 1]", p.min_p)
    _require(_real(p.presence_penalty) and -2 <= p.presence_penalty <= 2, "presence_penalty", "in [-2, 2]",
             p.presence_penalty)
    _require(_real(p.frequency_penalty) and -2 <= p.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]",
             p.frequency_penalty)
    _require(_real(p.repetition_penalty) and 0 < p.repetition_penalty <= 20, "repetition_penalty", "in (0, 20]",
             p.repetition_penalty)
    _require(p.seed is None or _integer(p.seed), "seed", "an integer or None", p.seed)
    _require(isinstance(p.stop, tuple) and all(isinstance(s, str) and s for s in p.stop), "stop",
             "a string or a list of non-empty strings", p.stop)
    _require(isinstance(p.detokenize, bool), "detokenize", "True or False", p.detokenize)
    _require(p.detokenize or not p.stop, "stop", "empty when detokenize is False (stop strings are matched in "
             "the text)", p.stop)
    _require(isinstance(p.bad_words, tuple) and all(isinstance(w, str) and w.strip() for w in p.bad_words),
             "bad_words", "a list of words (non-blank strings)", p.bad_words)
    _require(isinstance(p.stop_token_ids, tuple) and all(_integer(t) and t >= 0 for t in p.stop_token_ids),
             "stop_token_ids", "a list of non-negative token ids", p.stop_token_ids)
    _require(p.max_tokens is None or (_integer(p.max_tokens) and p.max_tokens >= 1), "max_tokens",
             "an integer >= 1 or None", p.max_tokens)
    _require(_integer(p.min_tokens) and 0 <= p.min_tokens <= (p.max_tokens or p.min_tokens), "min_tokens",
             f"an integer in [0, max_tokens ({p.max_tokens})]", p.min_tokens)
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(p, field)
        _require(value is None or (_integer(value) and value >= 0), field,
                 "None or an integer >= 0 (at most the engine's max_logprobs, 20 unless set)", value)
    _require(p.truncate_prompt_tokens is None or (_integer(p.truncate_prompt_tokens)
                                                  and p.truncate_prompt_tokens >= 1),
             "truncate_prompt_tokens", "None or an integer >= 1", p.truncate_prompt_tokens)
    allowed = p.allowed_token_ids
    _require(allowed is None or (isinstance(allowed, tuple) and allowed and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed)), "allowed_token_ids",
        "None or a non-empty list of non-negative token ids", allowed)
    _require(isinstance(p.output_kind, RequestOutputKind), "output_kind", "a RequestOutputKind", p.output_kind)
    _require(p.output_kind is not RequestOutputKind.DELTA or p.num_candidates == p.n, "output_kind",
             "CUMULATIVE or FINAL_ONLY when best_of > n (the n best are known only at the end, so they "
             "cannot be streamed as deltas)", p.output_kind)
    _require(p.guided_decoding is None or isinstance(p.guided_decoding, GuidedDecodingParams), "guided_decoding",
             "None or a GuidedDecodingParams", p.guided_decoding)
    if p.greedy:
        _require(p.num_candidates in (1, p.n), "best_of", "equal to n when temperature is 0 (greedy)", p.best_of)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """Beam search: keep ``beam_width`` candidates per step; score = log-prob / length**length_penalty."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        owner = "BeamSearchParams"
        for field in ("beam_width", "max_tokens"):
            value = getattr(self, field)
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                object.__setattr__(self, field, int(value))
        _require(_integer(self.beam_width) and self.beam_width >= 1, "beam_width", "an integer >= 1",
                 self.beam_width, owner)
        _require(_integer(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1",
                 self.max_tokens, owner)
        _require(_real(self.length_penalty), "length_penalty", "a finite number", self.length_penalty, owner)
