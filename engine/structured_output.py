"""Structured outputs: a request's constraint (``GuidedDecodingParams``) as a token mask per step.

llguidance (the grammar engine vLLM uses too) compiles a JSON schema, regex, choice or
grammar against the tokenizer into a matcher, which gives the tokens that may come next as a
bitmask and follows each token the sequence takes. Compiled grammars are cached per
constraint; every sequence gets its own copy of one.

    add_request → ``Grammars.matcher`` per sequence (refused with ``ValueError`` if invalid)
    each step   → ``fill_bitmasks`` for the batch's constrained rows (while the model runs)
    each token  → ``advance``; a finished grammar ends the sequence
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from engine.sampling_params import GuidedDecodingParams

log = logging.getLogger(__name__)

_CACHED_GRAMMARS = 256  # compiled constraints kept per tokenizer
_JSON_OBJECT = '{"type": "object"}'


def grammar_text(guided: GuidedDecodingParams) -> str:
    """llguidance's grammar for ``guided`` (not yet checked: see :meth:`Grammars.matcher`).
    Raises ``ValueError`` for a GBNF grammar that does not convert to Lark."""
    if guided.json is not None or guided.json_object:
        options = {"whitespace_flexible": not guided.disable_any_whitespace}
        if guided.whitespace_pattern is not None:
            options["whitespace_pattern"] = guided.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(guided.json or _JSON_OBJECT, overrides=options)
    if guided.choice is not None:
        return llguidance.grammar_from("choice", list(guided.choice))
    if guided.regex is not None:
        return llguidance.grammar_from("regex", guided.regex)
    return llguidance.grammar_from("grammar", guided.grammar)


class Grammars:
    """Compiles constraints for one tokenizer and model vocabulary, and caches them (by the
    constraint, up to ``_CACHED_GRAMMARS``). Safe to call from several threads (the server
    checks requests off the engine's thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._cache: OrderedDict[GuidedDecodingParams, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @functools.cached_property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (about 0.5 s to build, so built on first use)."""
        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos)

    def matcher(self, guided: GuidedDecodingParams) -> llguidance.LLMatcher:
        """A fresh matcher for ``guided``, at the start of the output. Raises ``ValueError``
        with llguidance's message for a schema, regex or grammar it cannot compile."""
        with self._lock:
            compiled = self._cache.get(guided)
            if compiled is not None:
                self._cache.move_to_end(guided)
        if compiled is None:
            compiled = self._compile(guided)
            with self._lock:
                self._cache[guided] = compiled
                while len(self._cache) > _CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, guided: GuidedDecodingParams) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(guided)
        except ValueError as error:
            raise ValueError(f"invalid {guided.kind} constraint: {error}") from None
        compiled = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise ValueError(f"invalid {guided.kind} constraint: {compiled.get_error().strip()}")
        return compiled


def bitmask_width(vocab_size: int) -> int:
    """int32 words in one row's mask: a bit per token of the model's vocabulary."""
    return llguidance.numpy.get_bitmask_shape(1, vocab_size)[1]


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def fill_bitmasks(matchers: list[tuple[int, llguidance.LLMatcher]], bitmask: np.ndarray) -> None:
    """Write each ``(row, matcher)``'s allowed next tokens into ``bitmask`` (int32 [rows,
    words], bit t % 32 of word t // 32 set where token t may come next; rows not listed are left
    as they are), on llguidance's threads."""
    llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(m, row) for row, m in matchers], bitmask)


def advance(matcher: llguidance.LLMatcher, token: int) -> str | None:
    """Follow ``token`` in ``matcher``; an error message if the grammar does not allow it (the
    sampler can only pick such a token when the grammar allows none at all), else None."""
    if matcher.consume_token(token):
        return None
    return matcher.get_error().strip() or f"the constraint does not allow token {token} here"
