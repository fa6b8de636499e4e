"""The engine's per-request bookkeeping: what each sequence has produced, and when it stops.

The scheduler holds the token ids that decide memory; this side holds what only the user
sees (text, log-probabilities, finish reasons) and applies the stop rules of a request's
``SamplingParams``. It is the one mutable record per request, owned by ``LLMEngine``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import time

import numpy as np

from engine import beam_search, structured_output
from engine.detokenizer import PROMPT_CONTEXT_TOKENS, decode_after, decode_pending, find_stop
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs, token_logprobs
from engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from engine.seq_progress import SeqProgress


@dataclasses.dataclass
class RequestState:
    """One request as the engine sees it. ``seqs`` maps scheduler seq_ids to their progress."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams | BeamSearchParams
    seed: int
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    seqs: dict[int, SeqProgress] = dataclasses.field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    beams: beam_search.BeamState | None = None
    beam_seq_ids: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None
    aborted: bool = False
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None

    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held when first scheduled
    # RequestOutputKind.DELTA: per completion index, (tokens, characters, finished) returned so far
    delivered: dict[int, tuple[int, int, bool]] = dataclasses.field(default_factory=dict)
    has_output: bool = False  # an output went out (DELTA returns prompt_logprobs with the first only)
    output_at: int | None = None  # its longest sequence's tokens at its latest output (stream_interval)

    @classmethod
    def admitted(cls, request_id: str, prompt, token_ids: tuple[int, ...], params, *, seed: int, max_tokens: int,
                 eos_token_ids: tuple[int, ...], bad_word_ids, seq_ids: list[int], grammars) -> RequestState:
        """The record of a request the scheduler just queued with sequences ``seq_ids``: each
        sequence with its progress (and its own copy of a structured-output constraint, from
        ``grammars``), prompt log-probabilities and beams started where the params ask."""
        request = cls(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, seed=seed,
                      max_tokens=max_tokens, eos_token_ids=eos_token_ids, bad_word_ids=bad_word_ids)
        logprob = 0.0 if request.tracks_logprob else None
        guided = getattr(params, "guided_decoding", None)
        request.seqs = {seq_id: SeqProgress(i, cumulative_logprob=logprob,
                                            matcher=None if guided is None else grammars.matcher(guided))
                        for i, seq_id in enumerate(seq_ids)}
        if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        if isinstance(params, BeamSearchParams):
            request.beams = beam_search.start(params.beam_width)
            request.beam_seq_ids = list(seq_ids)
        return request

    def note_computed_prefix(self, start: int) -> None:
        """A prefill of this request starts at position ``start``: on its first, the tokens
        before it came from the prefix cache (vLLM's ``num_cached_tokens``)."""
        if self.num_cached_tokens is None:
            self.num_cached_tokens = start

    @functools.cached_property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @functools.cached_property
    def num_logprobs(self) -> int | None:
        """Top alternatives to report per generated token (None: no logprobs asked)."""
        return None if self.is_beam_search else self.params.logprobs

    @functools.cached_property
    def tracks_logprob(self) -> bool:
        """Whether the sampler computes the log-probability of every token this request
        draws: for its logprobs, to rank beams, or to pick the ``n`` best of ``best_of``
        samples. Other requests report no ``cumulative_logprob`` (None), as vLLM's V1 engine."""
        return (self.is_beam_search or self.params.logprobs is not None
                or self.params.num_candidates > self.params.n)

    @functools.cached_property
    def defers_text(self) -> bool:
        """Whether this request's text is decoded when an output needs it rather than as each
        token is recorded: it has text and nothing reads it as it grows (no stop strings, no
        constraint, which can end a sequence before its token's text); not beam search."""
        params = self.params
        return not self.is_beam_search and params.detokenize and not params.stop and params.guided_decoding is None

    @functools.cached_property
    def steered_by_each_token(self) -> bool:
        """Whether which tokens may come next depends on the tokens just generated (bad words,
        a structured-output constraint), so the host must see every token before the next step
        samples: no lookahead, no multi-step decode."""
        return bool(self.bad_word_ids) or (not self.is_beam_search and self.params.guided_decoding is not None)

    @functools.cached_property
    def sampling_is_static(self) -> bool:
        """Whether the sampler's inputs for a sequence's next token depend on the token before
        it, once ``min_tokens`` is reached, only as the device carries on without the host: the
        step (its random stream) and the penalties' counts (``sampling_rows.next_batch``); not
        with bad words or a constraint (they follow it), nor in beam search (the host chooses)."""
        return not self.is_beam_search and not self.steered_by_each_token

    @functools.cached_property
    def samples_greedily(self) -> bool:
        """Whether each token this request samples is the arg-max of the model's logits while
        nothing is banned (:meth:`banned_tokens`): greedy, without penalties, logit biases,
        allowed tokens or a constraint, and without log-probabilities; not beam search."""
        p = self.params
        return (isinstance(p, SamplingParams) and p.greedy and not self.tracks_logprob
                and not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
                and not p.logit_bias and not len(p.allowed_array) and p.guided_decoding is None)

    def bans_any(self, seq_id: int) -> bool:
        """Whether :meth:`banned_tokens` of ``seq_id`` holds any token (not built when neither
        bad words nor ``min_tokens`` can ban one: most sequences)."""
        if self.is_beam_search:
            return False
        if not self.bad_word_ids and len(self.seqs[seq_id].token_ids) >= self.params.min_tokens:
            return False
        return bool(self.banned_tokens(seq_id))

    @functools.cached_property
    def static_sampling_from(self) -> int:
        """Generated tokens from which a sequence's sampling no longer depends on the token
        before: ``min_tokens``, or a count no sequence reaches unless :attr:`sampling_is_static`."""
        return self.params.min_tokens if self.sampling_is_static else np.iinfo(np.int64).max

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """The tokens that stop a sequence once ``min_tokens`` is reached: EOS (unless
        ``ignore_eos``) and ``stop_token_ids``."""
        params = self.params
        return frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids)

    @property
    def finished(self) -> bool:
        if self.error is not None or self.aborted:
            return True
        if self.is_beam_search:
            return self.beams is not None and self.beams.done
        for seq in self.seqs.values():
            if seq.finish_reason is None:
                return False
        return bool(self.seqs)

    def generated(self, seq_id: int) -> list[int]:
        """Tokens sequence ``seq_id`` has produced (beams are tracked by the beam search instead)."""
        return [] if self.is_beam_search else self.seqs[seq_id].token_ids

    def sample_index(self, seq_id: int) -> int:
        """Which of the request's samples ``seq_id`` is: its random stream."""
        return 0 if self.is_beam_search else self.seqs[seq_id].index

    def matcher(self, seq_id: int):
        """Sequence ``seq_id``'s constraint state (:mod:`engine.structured_output`); None if unconstrained."""
        return None if self.is_beam_search else self.seqs[seq_id].matcher

    def banned_tokens(self, seq_id: int) -> tuple[int, ...]:
        """Tokens this sequence may not produce next: EOS and stop tokens before ``min_tokens``,
        and the last token of every bad word whose other tokens the output ends with (vLLM
        looks at the generated tokens only)."""
        if self.is_beam_search:
            return ()
        generated = self.seqs[seq_id].token_ids
        banned = {word[-1] for word in self.bad_word_ids
                  if len(word) == 1 or tuple(generated[-(len(word) - 1):]) == word[:-1]}
        if len(generated) < self.params.min_tokens:
            banned |= set(self.eos_token_ids) | set(self.params.stop_token_ids)
        return tuple(sorted(banned))

    def record(self, seq_id: int, token: int, logprob: float, step_logprobs: TokenLogprobs | None,
               tokenizer) -> bool:
        """Add a sampled token to a sequence (with its log-probabilities entry, when the request
        asks for them); returns True if the sequence must stop now."""
        seq = self.seqs[seq_id]
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        text_tokenizer = None if self.defers_text else tokenizer
        if text_tokenizer is None and step_logprobs is None and seq.matcher is None:  # the stop rules alone
            self._record_without_text(seq, (token,), (logprob,))
            return seq.finish_reason is not None
        seq.token_ids.append(token)
        if seq.cumulative_logprob is not None:
            seq.cumulative_logprob += logprob
        if step_logprobs is not None:
            seq.logprobs = seq.logprobs or []
            seq.logprobs.append(step_logprobs)
        if seq.matcher is not None and self._follow_constraint(seq, token):
            return True
        new_chars = 0 if text_tokenizer is None else self._decode_pending(seq, text_tokenizer)
        seq.finish_reason, seq.stop_reason = self._stop_reason(seq, token, new_chars)
        return seq.finish_reason is not None

    def record_tokens(self, seq_id: int, tokens: list[int], logprobs: list[float], tokenizer) -> int:
        """Record ``tokens``, sampled one after another (a multi-step decode's row, with each
        one's log-probability, for a request that asks for no log-probabilities entries), up to
        and with the first that stops the sequence; returns how many it kept. The same as
        :meth:`record` on each in turn, at once for the whole row where no text is made as the
        tokens come (no ``tokenizer``, or :attr:`defers_text`) and no constraint follows each token."""
        seq = self.seqs[seq_id]
        if (tokenizer is not None and not self.defers_text) or seq.matcher is not None:
            for kept, (token, logprob) in enumerate(zip(tokens, logprobs), start=1):
                if self.record(seq_id, token, logprob, None, tokenizer):
                    return kept
            return len(tokens)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        return self._record_without_text(seq, tokens, logprobs)

    def _record_without_text(self, seq: SeqProgress, tokens, logprobs) -> int:
        """Add ``tokens`` to ``seq`` up to and with the first that stops it, by the stop rules
        alone (no text, no constraint); returns how many were kept."""
        kept, (seq.finish_reason, seq.stop_reason) = self._first_stop(len(seq.token_ids), tokens)
        seq.token_ids.extend(tokens[:kept])
        if seq.cumulative_logprob is not None:
            for logprob in logprobs[:kept]:  # one at a time, rounded as record() rounds them
                seq.cumulative_logprob += logprob
        return kept

    def _first_stop(self, num_before: int, tokens: list[int]) -> tuple[int, tuple[str | None, str | int | None]]:
        """How many of ``tokens`` a sequence that has ``num_before`` tokens keeps, and why it
        stops after them (``_stop_reason``'s answer, with no text and no constraint)."""
        if tokens and self.stop_token_set.isdisjoint(tokens):  # most rows: the length limit alone
            kept = min(len(tokens), max(self.max_tokens - num_before, 1))
            return kept, ("length", None) if num_before + kept >= self.max_tokens else (None, None)
        eos = () if self.params.ignore_eos else self.eos_token_ids
        for count, token in enumerate(tokens, start=num_before + 1):
            if count >= self.params.min_tokens and token in self.stop_token_set:
                return count - num_before, ("stop", None if token in eos else token)
            if count >= self.max_tokens:
                return count - num_before, ("length", None)
        return len(tokens), (None, None)

    def _decode_pending(self, seq: SeqProgress, tokenizer) -> int:
        """:func:`engine.detokenizer.decode_pending` for ``seq``: the characters its last token added."""
        return decode_pending(seq, tokenizer, self.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:],
                              skip_special_tokens=self.params.skip_special_tokens)

    def _decode_deferred(self, tokenizer) -> None:
        """Bring each sequence's text (:attr:`defers_text`) up to its tokens, as :meth:`record` makes it."""
        for seq in self.seqs.values():
            new_chars = self._decode_pending(seq, tokenizer)
            if seq.finish_reason == "stop":
                self._ends_on_stop_token(seq, seq.token_ids[-1], new_chars)

    def _follow_constraint(self, seq: SeqProgress, token: int) -> bool:
        """Advance ``seq``'s constraint by ``token``; True (the request ends with an error) if
        the constraint allowed no token at all here."""
        error = structured_output.advance(seq.matcher, token)
        if error is None:
            return False
        self.error = f"the output cannot follow its {self.params.guided_decoding.kind} constraint: {error}"
        seq.finish_reason = "abort"
        return True

    def _stop_reason(self, seq: SeqProgress, token: int, new_chars: int) -> tuple[str | None, str | int | None]:
        """Why ``seq`` ends with ``token`` (which added ``new_chars`` to its text), as vLLM
        decides it: nothing but the length limit before ``min_tokens``; then EOS, a stop token
        or a stop string, whose text is cut unless ``include_stop_str_in_output``. A constraint
        that allows nothing more (a complete JSON value, the end of a choice) ends it too."""
        params = self.params
        if self._ends_on_stop_token(seq, token, new_chars):
            return "stop", None if token in self.eos_token_ids and not params.ignore_eos else token
        if len(seq.token_ids) >= params.min_tokens and params.stop:
            found = find_stop(seq.decoded.text, params.stop, new_chars)
            if found is not None:
                index, stop = found
                self._cut_text(seq, index + len(stop) if params.include_stop_str_in_output else index)
                return "stop", stop
        if seq.matcher is not None and seq.matcher.is_stopped():
            return "stop", None
        if len(seq.token_ids) >= self.max_tokens:
            return "length", None
        return None, None

    def _ends_on_stop_token(self, seq: SeqProgress, token: int, new_chars: int) -> bool:
        """Whether ``token`` (``seq``'s last, adding ``new_chars`` to its text) ends it as EOS or a
        stop token, ``min_tokens`` reached; then its text is cut unless ``include_stop_str_in_output``."""
        if len(seq.token_ids) < self.params.min_tokens or token not in self.stop_token_set:
            return False
        if new_chars and not self.params.include_stop_str_in_output:
            self._cut_text(seq, len(seq.decoded.text) - new_chars)
        return True

    @staticmethod
    def _cut_text(seq: SeqProgress, end: int) -> None:
        seq.decoded = dataclasses.replace(seq.decoded, text=seq.decoded.text[:end])

    @functools.cached_property
    def held_back(self) -> int:
        """Characters a running sequence's output withholds: one fewer than the longest stop
        string (they might still turn out to start one)."""
        return 0 if self.is_beam_search or not self.params.stop else max(map(len, self.params.stop)) - 1

    def output(self, tokenizer=None, finished: bool | None = None) -> RequestOutput:
        """A snapshot for the user: the ``n`` best of ``best_of`` once finished, all while running.
        ``tokenizer`` decodes the texts; ``finished``: :attr:`finished`, if the caller has it.
        (A streamed request makes one per step: the common case, one sequence, takes no sorting.)"""
        finished = self.finished if finished is None else finished
        best_of = not self.is_beam_search and finished and self.params.num_candidates > self.params.n
        if self.defers_text and tokenizer is not None:
            self._decode_deferred(tokenizer)
        if self.is_beam_search:
            completions = self._beam_completions(tokenizer)
        elif self.output_kind is RequestOutputKind.DELTA:  # never with best_of > n (add_request refuses it)
            completions = self._new_parts()
        else:
            completions = [seq.completion(self.held_back) for seq in self.seqs.values()]
            if best_of:
                completions = sorted(completions, key=lambda c: -c.cumulative_logprob)[: self.params.n]
                completions = [dataclasses.replace(c, index=i) for i, c in enumerate(completions)]
        if finished and self.finished_time is None:
            self.finished_time = time.monotonic()
        prompt_logprobs = None if self.prompt_logprobs is None else tuple(self.prompt_logprobs)
        if len(completions) > 1:
            completions.sort(key=_INDEX)
        if self.output_kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self.has_output else prompt_logprobs
        self.has_output = True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, tuple(completions), finished,
                             prompt_logprobs, self.error,
                             RequestMetrics(self.arrival_time, self.first_token_time, self.finished_time),
                             self.num_cached_tokens)

    @functools.cached_property
    def output_kind(self) -> RequestOutputKind | None:
        """The params' ``output_kind`` (None for beam search, which returns whole outputs)."""
        return getattr(self.params, "output_kind", None)

    def _new_parts(self) -> list[CompletionOutput]:
        """``RequestOutputKind.DELTA``: of each sequence's completion, only what no earlier output
        returned (text, tokens, their log-probabilities); sequences with nothing new are left
        out. Made from the new part alone, so a streamed request's output per step costs what
        is new, not the whole output so far."""
        deltas = []
        for seq in self.seqs.values():
            tokens, chars, was_finished = self.delivered.get(seq.index, (0, 0, False))
            text, finished = seq.decoded.text, seq.finish_reason is not None
            end = len(text) if finished or not self.held_back else max(0, len(text) - self.held_back)
            if len(seq.token_ids) == tokens and end == chars and finished == was_finished:
                continue
            self.delivered[seq.index] = (len(seq.token_ids), end, finished)
            deltas.append(CompletionOutput(seq.index, text[chars:end], tuple(seq.token_ids[tokens:]),
                                           seq.cumulative_logprob,
                                           None if seq.logprobs is None else tuple(seq.logprobs[tokens:]),
                                           seq.finish_reason, seq.stop_reason))
        return deltas

    def _beam_completions(self, tokenizer) -> list[CompletionOutput]:
        """The best beams, best first; each token's log-probabilities entry holds what its beam
        proposed at that step (the chosen token is always among them)."""
        if self.beams is None or not self.beams.done:
            return []
        beams = beam_search.results(self.beams, self.params.beam_width)
        eos = self.eos_token_ids

        def text(beam) -> str:
            return decode_after(tokenizer, self.prompt_token_ids, beam.tokens) if tokenizer else ""

        return [
            CompletionOutput(index=i, text=text(beam),
                             token_ids=beam.tokens, cumulative_logprob=beam.logprob,
                             logprobs=tuple(_proposals_entry(tokenizer, token, proposed)
                                            for token, proposed in zip(beam.tokens, beam.proposals)),
                             finish_reason="stop" if beam.tokens and beam.tokens[-1] in eos else "length")
            for i, beam in enumerate(beams)
        ]


def _proposals_entry(tokenizer, token: int, proposed) -> TokenLogprobs:
    """A beam's log-probabilities entry for ``token`` from the (token, logprob) pairs its beam
    proposed, best first."""
    rank = next(place for place, (other, _) in enumerate(proposed, start=1) if other == token)
    tokens, logprobs = zip(*proposed)
    return token_logprobs(tokenizer, (token, proposed[rank - 1][1], rank), tokens, logprobs)


_INDEX = operator.attrgetter("index")
