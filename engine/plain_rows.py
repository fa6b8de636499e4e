"""A decode step's tokens (or a multi-step decode's) recorded at once, for rows without
log-probabilities, constraints or beams.

Most steps sample one token for each of the same sequences as the step before (the
lookaheads of :mod:`engine.async_scheduling` keep their rows). When none of them makes
log-probabilities or follows a constraint's state, or chooses beams, most tokens are recorded
by the stop rules alone: a token stops its sequence only at ``max_tokens``, or if it is a stop
token (EOS included). :class:`PlainRows` holds what those rules read, made once for a tuple
of rows and kept while they are the same; :func:`record` then appends every token, asks NumPy
which rows may stop, and gives only those the whole :meth:`RequestState.record`. A row whose
request reads its text as it grows (stop strings: ``RequestState.defers_text`` is False) may
stop at any token, so it always gets the whole record, with the tokenizer; the others' text
is made when an output needs it. The scheduler gets one ``AppendEach`` for all the rows (and a
``Finish`` for each that stopped) instead of an ``Append`` each. :func:`record_steps` does the
same with a multi-step decode's tokens (``engine.multi_step``), up to k per row.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence

import numpy as np

from engine.core.records import record as frozen_record
from engine.core.scheduler import AppendEach, Finish, SequenceStatus
from engine.request_state import RequestState
from engine.sampling_params import RequestOutputKind
from engine.seq_progress import SeqProgress


@frozen_record(eq=False)
class PlainRows:
    """The rows ``rows`` (``sampling_rows.Row``s, M of them) as columns, row by row: their
    request ids and requests, their sequences' progress and its token lists (which recording
    appends to in place), seq ids and ``max_tokens`` (int64 [M]), which rows read their text as
    it grows (bool [M]) and the tokenizer they read it with; every row's stop tokens together
    (int64 [S], sorted), the requests whose outputs may go out at any step (not ``FINAL_ONLY``),
    and those still without a first token time."""

    rows: tuple
    request_ids: tuple[str, ...]
    requests: tuple[RequestState, ...]
    progress: tuple[SeqProgress, ...]
    token_lists: tuple[list[int], ...]
    seq_ids: np.ndarray
    max_tokens: np.ndarray
    reads_text: np.ndarray
    tokenizer: object
    stop_tokens: np.ndarray
    streamed: tuple[RequestState, ...]
    first_token_pending: list[RequestState]


def of(rows: Sequence, requests: dict[str, RequestState], tokenizer) -> PlainRows | None:
    """``rows`` as :class:`PlainRows`, or None unless each is plain: not beam search, no
    log-probabilities (nor a cumulative one), no constraint, not finished. ``tokenizer``
    (None: no text) makes the text of rows that read it as it grows."""
    found = tuple(requests.get(row.request.request_id) for row in rows)
    if not rows or any(request is None or request.is_beam_search or request.tracks_logprob for request in found):
        return None
    progress = tuple(request.seqs[row.seq_id] for request, row in zip(found, rows))
    if any(seq.matcher is not None or seq.finish_reason is not None for seq in progress):
        return None
    distinct = tuple({request.request_id: request for request in found}.values())
    stops = sorted(set().union(*(request.stop_token_set for request in distinct)))
    return PlainRows(
        tuple(rows), tuple(request.request_id for request in found), found, progress,
        tuple(seq.token_ids for seq in progress),
        np.fromiter((row.seq_id for row in rows), np.int64, len(rows)),
        np.fromiter((request.max_tokens for request in found), np.int64, len(found)),
        np.fromiter((_reads_text(request, tokenizer) for request in found), bool, len(found)), tokenizer,
        np.array(stops, np.int64),
        tuple(request for request in distinct if request.output_kind is not RequestOutputKind.FINAL_ONLY),
        [request for request in distinct if request.first_token_time is None])


def _reads_text(request: RequestState, tokenizer) -> bool:
    """Whether ``request``'s stop rules read its text as each token comes (it has text, and a
    stop string)."""
    return tokenizer is not None and request.params.detokenize and not request.defers_text


def still_valid(plain: PlainRows, requests: dict[str, RequestState]) -> bool:
    """Whether ``plain``'s requests are still the engine's (none aborted or replaced)."""
    return all(map(operator.is_, map(requests.get, plain.request_ids), plain.requests))


def record(plain: PlainRows, tokens: np.ndarray, touched: dict[str, RequestState]) -> list:
    """Record ``tokens`` (int [M], on the host), row i's for row i's sequence; the scheduler's
    actions that follow. ``touched`` gets the requests with an output due: the streamed ones,
    and those with a row that may have stopped."""
    _note_first_tokens(plain)
    lists = plain.token_lists
    before = np.fromiter(map(len, lists), np.int64, len(lists))
    may_stop = (before + 1 >= plain.max_tokens) | plain.reads_text
    if plain.stop_tokens.size:
        may_stop |= np.isin(tokens, plain.stop_tokens)
    token_list = tokens.tolist()
    actions = [AppendEach(plain.seq_ids, np.asarray(tokens, np.int64))]
    if not may_stop.any():
        for held, token in zip(lists, token_list):
            held.append(token)
    else:
        for i, (held, token, stop) in enumerate(zip(lists, token_list, may_stop.tolist())):
            if stop:
                actions += _record_one(plain, i, token, touched)
            else:
                held.append(token)
    for request in plain.streamed:
        touched[request.request_id] = request
    return actions


def record_steps(plain: PlainRows, tokens: np.ndarray, touched: dict[str, RequestState]) -> tuple[list, int]:
    """Record a multi-step decode's ``tokens`` (int [M, k], on the host, -1 past a row's
    steps), row i's in order for row i's sequence, each up to its stop; the scheduler's actions
    that follow, and how many tokens were kept. ``touched`` as :func:`record`'s."""
    _note_first_tokens(plain)
    lists, tokens = plain.token_lists, np.asarray(tokens, np.int64)
    counts = (tokens >= 0).sum(axis=1)
    before = np.fromiter(map(len, lists), np.int64, len(lists))
    may_stop = (before + counts >= plain.max_tokens) | plain.reads_text
    if plain.stop_tokens.size:
        may_stop |= np.isin(tokens, plain.stop_tokens).any(axis=1)
    finishes, width = [], tokens.shape[1]
    for i, (held, row, count, stop) in enumerate(zip(lists, tokens.tolist(), counts.tolist(), may_stop.tolist())):
        if stop:
            request, seq_id = plain.requests[i], plain.rows[i].seq_id
            touched[request.request_id] = request
            counts[i] = request.record_tokens(seq_id, row[:count], [0.0] * count, _text_tokenizer(plain, i))
            if request.seqs[seq_id].finish_reason is not None:
                finishes.append(finish(request, seq_id))
        else:
            held.extend(row if count == width else row[:count])
    for request in plain.streamed:
        touched[request.request_id] = request
    return [AppendEach(plain.seq_ids, tokens, counts), *finishes], int(counts.sum())


def _note_first_tokens(plain: PlainRows) -> None:
    """Give the requests still without a first token time this one."""
    if plain.first_token_pending:
        now = time.monotonic()
        for request in plain.first_token_pending:
            if request.first_token_time is None:
                request.first_token_time = now
        plain.first_token_pending.clear()


def _record_one(plain: PlainRows, i: int, token: int, touched: dict[str, RequestState]) -> list:
    """Record ``token`` for row ``i`` by its request's own rules; a Finish if it stops the sequence."""
    request, seq_id = plain.requests[i], plain.rows[i].seq_id
    touched[request.request_id] = request
    return [finish(request, seq_id)] if request.record(seq_id, token, 0.0, None, _text_tokenizer(plain, i)) else []


def _text_tokenizer(plain: PlainRows, i: int):
    """The tokenizer that makes row ``i``'s text as it records (None: its text waits, or it has none)."""
    return plain.tokenizer if plain.reads_text[i] else None


def finish(request: RequestState, seq_id: int) -> Finish:
    """The scheduler's end of a sequence that stopped (a stop rule, or its max_tokens)."""
    reason = request.seqs[seq_id].finish_reason
    return Finish(seq_id, SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH)
