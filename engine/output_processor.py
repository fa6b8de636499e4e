"""Output processing: a step's sampled tokens into each request's progress, and the changed
requests into ``RequestOutput``s (vLLM's ``OutputProcessor``).

    sampled tokens → each request records text, log-probabilities and stops (beam search
    chooses its beams) → the scheduler's actions → ``RequestOutput``s of the changed requests
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from engine import beam_search, plain_rows
from engine.core.scheduler import Append, AppendMany, Drop, Finish, Fork, SequenceStatus
from engine.outputs import RequestOutput, TokenLogprobs, token_logprobs
from engine.request_state import RequestState
from engine.sampling_params import BeamSearchParams, RequestOutputKind
from engine.worker.sampler import prompt_logprobs

# Prompt positions scored by one program: one shape to compile (per number of alternatives),
# at most 15 rows of padding (a row costs a softmax and a top-k over the vocabulary), and a
# step's thousands of positions still take few dispatches.
PROMPT_CHUNK = 16

# vLLM's finish reasons for sequences the scheduler ended; the rest ended by a stop rule.
_FINISH_REASONS = {SequenceStatus.FINISHED_LENGTH: "length", SequenceStatus.FINISHED_IGNORED: "length",
                   SequenceStatus.FINISHED_ABORTED: "abort"}


class OutputProcessor:
    """Records sampled tokens into ``RequestState``s, with ``tokenizer`` (None: no text); counts
    the tokens it records in ``counters.generation_tokens`` (the engine's ``EngineCounters``).
    A streamed request's outputs go out every ``stream_interval`` tokens (``EngineConfig``'s)."""

    def __init__(self, tokenizer, counters, stream_interval: int = 1):
        self.tokenizer = tokenizer
        self.counters = counters
        self.stream_interval = stream_interval
        self._plain: tuple[tuple, plain_rows.PlainRows | None] = ((), None)  # the last rows, and their columns

    def record(self, rows, sampled, requests: dict[str, RequestState], next_child: int, touched) -> list:
        """Record the tokens ``sampled`` (on the host) for ``rows``; the scheduler's actions that
        follow. Forked sequences get ids from ``next_child`` on; ``touched`` gets every request
        with an output due. Rows without log-probabilities, constraints or beams are
        recorded at once (:mod:`engine.plain_rows`); otherwise sampled rows are recorded in one
        pass, in order, and a beam search's rows after them, a request at a time (its step
        chooses among all its beams)."""
        plain = self._plain_rows(rows, requests)
        if plain is not None:
            self.counters.generation_tokens += len(rows)
            return plain_rows.record(plain, sampled.tokens[: len(rows)], touched)
        tokens, logprobs = sampled.tokens[: len(rows)].tolist(), sampled.logprobs[: len(rows)].tolist()
        actions, beams, top = [], {}, None
        for i, row in enumerate(rows):
            request_id = row.request.request_id
            request = touched[request_id] = requests[request_id]
            if request.is_beam_search:
                beams.setdefault(request_id, {})[row.seq_id] = i
                continue
            token, tokenizer = tokens[i], self._detokenizer(request)
            entry = None
            if request.num_logprobs is not None:
                top = top or _TopColumns.of(sampled, slice(0, len(rows)))
                entry = top.entry(i, request.num_logprobs, token, logprobs[i], tokenizer)
            actions.append(Append(row.seq_id, token))
            if request.record(row.seq_id, token, logprobs[i], entry, tokenizer):
                actions.append(plain_rows.finish(request, row.seq_id))
        self.counters.generation_tokens += len(rows) - sum(map(len, beams.values()))
        for request_id, by_seq in beams.items():
            new_actions, next_child = self._beam_step(requests[request_id], by_seq, sampled, next_child)
            actions += new_actions
        return actions

    def _plain_rows(self, rows, requests: dict[str, RequestState]) -> plain_rows.PlainRows | None:
        """``rows`` as :class:`~engine.plain_rows.PlainRows` (kept while a lookahead keeps the
        same rows), or None when they are not all plain."""
        held_rows, plain = self._plain
        if held_rows is not rows:
            plain = plain_rows.of(rows, requests, self.tokenizer)
            self._plain = rows, plain
        elif plain is not None and not plain_rows.still_valid(plain, requests):
            plain = None
        return plain

    def record_steps(self, rows, tokens, sampled, requests: dict[str, RequestState], touched) -> list:
        """Record a multi-step decode's tokens (``tokens`` int32 [rows, k], -1 past a row's
        steps; ``sampled``, the sampler's outputs [k, rows, ...], on the host) in order, each
        sequence up to its stop; the scheduler's actions that follow (the tokens kept). Plain
        rows are recorded at once, as by :meth:`record`."""
        plain = self._plain_rows(rows, requests)
        if plain is not None:
            actions, kept = plain_rows.record_steps(plain, tokens, touched)
            self.counters.generation_tokens += kept
            return actions
        actions = []
        steps = (tokens >= 0).sum(axis=1).tolist()
        all_logprobs = sampled.logprobs.T.tolist()
        for i, (row, row_tokens, logprobs, num_steps) in enumerate(zip(rows, tokens.tolist(), all_logprobs, steps)):
            request = row.request
            touched[request.request_id] = request
            tokenizer = self._detokenizer(request)
            if request.num_logprobs is None:
                kept = request.record_tokens(row.seq_id, row_tokens[:num_steps], logprobs[:num_steps], tokenizer)
            else:
                kept = self._record_with_logprobs(request, row.seq_id, i, row_tokens[:num_steps], sampled, tokenizer)
            self.counters.generation_tokens += kept
            actions.append(AppendMany(row.seq_id, tuple(row_tokens[:kept])))
            if request.seqs[row.seq_id].finish_reason is not None:
                actions.append(plain_rows.finish(request, row.seq_id))
        return actions

    def _record_with_logprobs(self, request: RequestState, seq_id: int, i: int, tokens: list[int], sampled,
                              tokenizer) -> int:
        """Record row ``i``'s ``tokens`` one at a time with their log-probabilities entries, up
        to a stop; returns how many were kept."""
        top = _TopColumns.of(sampled, (slice(None), i))  # this row's steps
        for j, token in enumerate(tokens):
            logprob = float(sampled.logprobs[j, i])
            entry = top.entry(j, request.num_logprobs, token, logprob, tokenizer)
            if request.record(seq_id, token, logprob, entry, tokenizer):
                return j + 1
        return len(tokens)

    def _beam_step(self, request: RequestState, row_of_seq: dict[int, int], sampled, next_child: int):
        """One beam-search step: proposals of every running beam (in the beam search's order),
        then Append / Fork / Drop so the sequences follow the chosen beams."""
        params: BeamSearchParams = request.params
        width = 2 * params.beam_width
        rows = [row_of_seq[seq_id] for seq_id in request.beam_seq_ids]
        proposals = [list(zip(sampled.top_tokens[i, :width].tolist(), sampled.top_logprobs[i, :width].tolist()))
                     for i in rows]
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        request.beams, choices = beam_search.step(
            request.beams, proposals, width=params.beam_width, eos_token_ids=request.eos_token_ids,
            ignore_eos=params.ignore_eos, max_tokens=request.max_tokens, length_penalty=params.length_penalty,
            early_stopping=True)
        self.counters.generation_tokens += len(rows)
        old_ids = request.beam_seq_ids
        if not choices:
            return [Finish(seq_id, SequenceStatus.FINISHED_STOPPED) for seq_id in old_ids], next_child
        actions, new_ids, used = [], [], set()
        for choice in choices:
            parent = old_ids[choice.parent]
            if parent in used:
                actions.append(Fork(parent, next_child, choice.token))
                new_ids.append(next_child)
                next_child += 1
            else:
                actions.append(Append(parent, choice.token))
                new_ids.append(parent)
                used.add(parent)
        actions += [Drop(seq_id) for seq_id in old_ids if seq_id not in used]
        request.beam_seq_ids = new_ids
        return actions, next_child

    def record_prompt_logprobs(self, logits, prompt_rows) -> None:
        """Log-probabilities of each prompt token given the ones before it, recorded once per
        position (a re-prefill after preemption does not record them again). Every request's
        positions in the step (``logits``' rows) are scored together, by one program for each
        :data:`PROMPT_CHUNK` of them."""
        wanted = []  # (request, its logits row, the prompt token after that position)
        for request, work, first_row in prompt_rows:
            recorded = len(request.prompt_logprobs) - 1  # positions done (entry 0 is the first token's None)
            last = len(request.prompt_token_ids) - 1
            positions = range(work.start, work.start + len(work.token_ids))
            wanted += [(request, row, request.prompt_token_ids[position + 1])
                       for row, position in enumerate(positions, start=first_row) if recorded <= position < last]
        if not wanted:
            return
        size = -(-len(wanted) // PROMPT_CHUNK) * PROMPT_CHUNK
        rows, next_tokens = np.zeros(size, np.int32), np.zeros(size, np.int32)  # padding scores row 0
        rows[: len(wanted)] = [row for _, row, _ in wanted]
        next_tokens[: len(wanted)] = [token for _, _, token in wanted]
        num_top = max(max(request.params.prompt_logprobs, 1) for request, _, _ in wanted)
        num_top = min(1 << (num_top - 1).bit_length(), logits.shape[1])  # a few sizes to compile
        chunks = [prompt_logprobs(logits, rows[i: i + PROMPT_CHUNK], next_tokens[i: i + PROMPT_CHUNK], num_top)
                  for i in range(0, size, PROMPT_CHUNK)]  # all dispatched, then read
        chosen, ranks, top_tokens, top_logprobs = (
            np.concatenate([np.asarray(chunk[part]) for chunk in chunks])[: len(wanted)].tolist() for part in range(4))
        top = _TopColumns(ranks, top_tokens, top_logprobs)
        for j, (request, _, token) in enumerate(wanted):  # prompt_logprobs 0: the prompt token's own only
            request.prompt_logprobs.append(
                top.entry(j, request.params.prompt_logprobs, token, chosen[j], self._detokenizer(request)))

    def _detokenizer(self, request: RequestState):
        """The tokenizer that turns ``request``'s tokens into text, or None with ``detokenize=False``."""
        return self.tokenizer if getattr(request.params, "detokenize", True) else None

    def collect(self, finished, requests: dict[str, RequestState], touched: dict[str, RequestState]
                ) -> list[RequestOutput]:
        """Outputs of the changed requests (of those with ``output_kind`` FINAL_ONLY, only the
        finished; of streamed ones, the finished and those :meth:`_stream_due`), with the
        scheduler's ``finished`` groups; finished ones leave ``requests``."""
        for group in finished:
            request = requests.get(group.request_id)
            if request is None:
                continue
            for seq in group.seqs:
                progress = request.seqs.get(seq.seq_id)
                if progress is not None and progress.finish_reason is None and seq.status.is_finished:
                    progress.finish_reason = _FINISH_REASONS.get(seq.status, "stop")
            touched[group.request_id] = request
        outputs = []
        for request_id, request in touched.items():
            finished = request.finished
            if finished or (request.output_kind is not RequestOutputKind.FINAL_ONLY and self._stream_due(request)):
                outputs.append(request.output(self.tokenizer, finished))
            if finished:
                requests.pop(request_id, None)
        return outputs

    def _stream_due(self, request: RequestState) -> bool:
        """Whether a running request's streamed output goes out now: its first at once (the
        first token's latency is what a user waits on), then each time its longest sequence has
        grown by ``stream_interval`` tokens (vLLM's rule). The tokens in between go out with
        the next output (their text decoded then, unless stop strings read it as it came)."""
        if self.stream_interval == 1:
            return True
        longest = max((len(seq.token_ids) for seq in request.seqs.values()), default=0)  # (beams: 0)
        if request.output_at is not None and longest - request.output_at < self.stream_interval:
            return False
        request.output_at = longest
        return True


@dataclasses.dataclass(frozen=True)
class _TopColumns:
    """Ranks and top alternatives, as lists, of the sampler's rows (or one row's steps) or of
    a step's prompt positions, made once for all the entries of a step: a NumPy index per entry
    costs more than the entry."""

    ranks: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]

    @classmethod
    def of(cls, sampled, at) -> _TopColumns:
        """``sampled``'s (``SamplerOutput``, on the host) ranks and top alternatives at index ``at``."""
        return cls(sampled.ranks[at].tolist(), sampled.top_tokens[at].tolist(), sampled.top_logprobs[at].tolist())

    def entry(self, i: int, num_top: int, token: int, logprob: float, tokenizer) -> TokenLogprobs:
        """Item ``i``'s log-probabilities entry: ``token`` (sampled with ``logprob``) and the ``num_top`` best."""
        return token_logprobs(tokenizer, (token, logprob, self.ranks[i]), self.tokens[i][:num_top],
                              self.logprobs[i][:num_top])
