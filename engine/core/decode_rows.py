"""Running decodes held as columns, a row per sequence: the scheduler's steady state.

Most steps, most running sequences decode one token. Held as records, every step would remake
a `Sequence` and a `SequenceGroup` per sequence (its tokens one longer, its computed count one
more) and walk them all again to find the few that open a block or stop. `DecodeRows` holds
those groups as rows instead, one per sequence: each group as it entered the rows (its tokens
then), the tokens appended since, and the counts a step reads and writes as NumPy columns.
A step changes the columns and appends a token to each row's list; records are made again only
for rows an event touches (a block to open or one filled, a stop) and for the rare paths that
want them all (preemption, abort, stats, tests).

A group of several sequences (parallel sampling: ``n`` or ``best_of``) is as many adjacent
rows, its sequences in their order (`members`: each row's index in its group's sequences).
A group is in the rows whole or not at all: once one of its sequences stops, the group leaves
the rows (`leave`) and runs on as a record.

The tokens a row gained since it entered sit in a list that later states share: a state reads
the first ``num_new[i]`` of row i's list, and a step appends after them. A step from a state
whose lists another step has appended to already (two updates of one state) copies those lists
first, so every state keeps its own tokens.

A group is held as rows (`qualifies`) when every one of its sequences runs and decodes: not in
prefill, not a beam search (its updates fork), and (`engine.core.scheduler_update` checks it
on the blocks) no sequence writing into a block another holds: the copy-on-write of a prompt's
last block happens on the records' path, before the group enters. The rows are in arrival
order, as the running groups are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq

import numpy as np

from engine.core.records import record
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus, by_arrival


def _column(values) -> np.ndarray:
    """A read-only int64 column of `values`."""
    column = np.array(values, dtype=np.int64)
    column.flags.writeable = False
    return column


@record(eq=False)
class DecodeRows:
    """M running decodes, a row per sequence, in arrival order (all columns int64 [M]).

    `groups[i]` is row i's group as it entered the rows, `members[i]` the index of row i's
    sequence in it (a group's rows are adjacent, in its order); `new_tokens[i][: num_new[i]]`
    the tokens that sequence gained since. `lengths` counts each sequence's tokens now (prompt and
    output: the next decode computes position ``lengths - 1``, every token before it computed),
    `num_output` its generated tokens, `last_tokens` its last token. `tables`, when known,
    are the rows' block tables as the last step planned them (which its update leaves as they
    are; None: read them from the block manager): a step that changes none of them reads none.
    They are derived data, not part of the rows' value (equality ignores them).
    """

    groups: tuple[SequenceGroup, ...]
    request_ids: tuple[str, ...]
    seq_ids: np.ndarray
    members: np.ndarray
    arrivals: np.ndarray
    lengths: np.ndarray
    num_output: np.ndarray
    max_tokens: np.ndarray
    last_tokens: np.ndarray
    new_tokens: tuple[list[int], ...]
    num_new: np.ndarray
    tables: tuple[tuple[int, ...], ...] | None = None

    def __len__(self) -> int:
        return len(self.groups)

    def __eq__(self, other) -> bool:
        if not isinstance(other, DecodeRows):
            return NotImplemented
        return (self.groups == other.groups and np.array_equal(self.lengths, other.lengths)
                and _appended(self) == _appended(other))

    def __hash__(self) -> int:
        return hash((self.request_ids, self.lengths.tobytes()))


def _appended(rows: DecodeRows) -> list[list[int]]:
    return [tokens[:n] for tokens, n in zip(rows.new_tokens, rows.num_new.tolist())]


NO_ROWS = DecodeRows((), (), *([_column([])] * 7), (), _column([]))


def qualifies(group: SequenceGroup) -> bool:
    """Whether `group`, running, may be held as rows: every sequence decodes, and no forks
    (and, which the caller checks on the blocks, none writes into a block another holds)."""
    if group.in_prefill or group.may_fork:
        return False
    seqs = group.seqs
    if len(seqs) == 1:  # most groups
        return seqs[0].status is SequenceStatus.RUNNING
    return all(seq.status is SequenceStatus.RUNNING for seq in seqs)


def _of(groups: Seq[SequenceGroup]) -> DecodeRows:
    """Rows of `groups` (which qualify, in order), a row per sequence, as they enter."""
    members = [(group, i, seq) for group in groups for i, seq in enumerate(group.seqs)]
    return DecodeRows(
        tuple(group for group, _, _ in members), tuple(group.request_id for group, _, _ in members),
        _column([seq.seq_id for _, _, seq in members]), _column([i for _, i, _ in members]),
        _column([group.arrival for group, _, _ in members]), _column([seq.len for _, _, seq in members]),
        _column([len(seq.output_token_ids) for _, _, seq in members]),
        _column([group.max_tokens for group, _, _ in members]),
        _column([(seq.output_token_ids or seq.prompt_token_ids)[-1] for _, _, seq in members]),
        tuple([] for _ in members), _column([0] * len(members)))


def enter(rows: DecodeRows, groups: Seq[SequenceGroup]) -> DecodeRows:
    """`rows` with `groups` (which qualify) added as rows, all in arrival order."""
    if not groups:
        return rows
    for group in groups:
        for seq in group.seqs:
            assert seq.num_computed_tokens == seq.len - 1, "a decoding sequence computes one token"
    added = _of(groups)
    if not len(rows):
        return added
    order = None  # most often the groups arrived after every row: end to end is in order
    if added.arrivals[0] < rows.arrivals[-1]:
        order = np.argsort(np.concatenate([rows.arrivals, added.arrivals]), kind="stable")
    return DecodeRows(*(_joined(getattr(rows, field.name), getattr(added, field.name), order)
                        for field in dataclasses.fields(DecodeRows) if field.name != "tables"))


def _joined(first, second, order: np.ndarray | None):
    """Two rows' column (an array or a tuple), end to end, then taken in `order` if given."""
    if isinstance(first, np.ndarray):
        joined = np.concatenate([first, second])
        return _column(joined if order is None else joined[order])
    joined = first + second
    return joined if order is None else tuple(joined[i] for i in order.tolist())


def without(rows: DecodeRows, dropped: Iterable[int]) -> DecodeRows:
    """The rows but those at the indices `dropped` (every row of each group they touch)."""
    keep = np.ones(len(rows), bool)
    keep[list(dropped)] = False
    if keep.all():
        return rows
    index = np.flatnonzero(keep).tolist()
    return DecodeRows(
        tuple(rows.groups[i] for i in index), tuple(rows.request_ids[i] for i in index),
        *(_column(column[keep]) for column in (rows.seq_ids, rows.members, rows.arrivals, rows.lengths,
                                               rows.num_output, rows.max_tokens, rows.last_tokens)),
        tuple(rows.new_tokens[i] for i in index), _column(rows.num_new[keep]),
        None if rows.tables is None else tuple(rows.tables[i] for i in index))


def appended(rows: DecodeRows, new: Seq[tuple[int, ...]] | np.ndarray,
             tables: tuple[tuple[int, ...], ...] | None = None) -> DecodeRows:
    """The rows after row i's sequence gained the tokens `new[i]` (its last token computed too:
    every token but the new last one is); `new` an int64 array [M] when each gained one. Their
    block tables are `tables` (the step's, if it planned them as columns; else unknown)."""
    if isinstance(new, np.ndarray):
        return _appended_one_each(rows, new, tables)
    lists, num_new, copies = rows.new_tokens, rows.num_new.tolist(), None
    for i, tokens in enumerate(new):
        held = lists[i]
        if len(held) != num_new[i]:  # another state's step appended here: keep those tokens out
            if copies is None:
                copies = list(lists)
            held = copies[i] = held[: num_new[i]]
        held.extend(tokens)
    counts = np.fromiter(map(len, new), np.int64, len(new))
    lasts = np.array([tokens[-1] if tokens else -1 for tokens in new], np.int64)
    lasts = np.where(counts > 0, lasts, rows.last_tokens)
    return _moved_on(rows, counts, lasts, lists if copies is None else tuple(copies), tables)


def _appended_one_each(rows: DecodeRows, tokens: np.ndarray, tables) -> DecodeRows:
    """`appended` of one token per row (`tokens`, int64 [M])."""
    lists = rows.new_tokens
    if any(map(int.__ne__, map(len, lists), rows.num_new.tolist())):  # see `appended`
        return appended(rows, [(token,) for token in tokens.tolist()], tables)
    for held, token in zip(lists, tokens.tolist()):
        held.append(token)
    return _moved_on(rows, 1, tokens, lists, tables)


def appended_many(rows: DecodeRows, tokens: np.ndarray, counts: np.ndarray,
                  tables: tuple[tuple[int, ...], ...] | None = None) -> DecodeRows:
    """`appended` of a multi-step decode's tokens: row i's sequence gained ``tokens[i, :counts[i]]``
    (tokens int64 [M, k]; counts int64 [M], each at least 1)."""
    lists, token_lists, count_list = rows.new_tokens, tokens.tolist(), counts.tolist()
    if any(map(int.__ne__, map(len, lists), rows.num_new.tolist())):  # see `appended`
        return appended(rows, [tuple(row[:count]) for row, count in zip(token_lists, count_list)], tables)
    width = tokens.shape[1]
    for held, row, count in zip(lists, token_lists, count_list):
        held.extend(row if count == width else row[:count])
    return _moved_on(rows, counts, tokens[np.arange(len(counts)), counts - 1], lists, tables)


def _moved_on(rows: DecodeRows, counts, lasts, lists: tuple[list[int], ...], tables) -> DecodeRows:
    """The rows after row i gained `counts[i]` tokens (ending in `lasts[i]`), held in `lists`,
    with block tables `tables`."""
    return DecodeRows(
        rows.groups, rows.request_ids, rows.seq_ids, rows.members, rows.arrivals, _column(rows.lengths + counts),
        _column(rows.num_output + counts), rows.max_tokens, _column(lasts), lists, _column(rows.num_new + counts),
        tables)


def sequence_at(rows: DecodeRows, i: int, status: SequenceStatus = SequenceStatus.RUNNING) -> Sequence:
    """Row i's sequence as a record: with `status`, and every token but the last computed."""
    seq, n = rows.groups[i].seqs[rows.members[i]], int(rows.num_new[i])
    output = seq.output_token_ids + tuple(rows.new_tokens[i][:n]) if n else seq.output_token_ids
    return Sequence(seq.seq_id, seq.prompt_token_ids, output, status, int(rows.lengths[i]) - 1)


def group_span(rows: DecodeRows, i: int) -> range:
    """The rows of row i's group (adjacent, in its sequences' order)."""
    first = i - int(rows.members[i])
    return range(first, first + len(rows.groups[i].seqs))


def group_at(rows: DecodeRows, i: int, ended: Mapping[int, SequenceStatus] | None = None) -> SequenceGroup:
    """Row i's group as a record: each of its rows' sequences (`sequence_at`) running, or with
    the status `ended` gives its row."""
    span, ended = group_span(rows, i), ended or {}
    seqs = tuple(sequence_at(rows, row, ended.get(row, SequenceStatus.RUNNING)) for row in span)
    return rows.groups[i].with_seqs(seqs, in_prefill=False)


def all_groups(rows: DecodeRows) -> tuple[SequenceGroup, ...]:
    """Every row's group as a record, in order."""
    return tuple(group_at(rows, i) for i in first_rows(rows))


def first_rows(rows: DecodeRows) -> list[int]:
    """The first row of each group, in order."""
    members = rows.members
    if not members.any():  # most often: every group one sequence
        return list(range(len(members)))
    return np.flatnonzero(members == 0).tolist()


def num_groups(rows: DecodeRows) -> int:
    """The groups held as rows."""
    return len(rows) - int(np.count_nonzero(rows.members))


def leave(rows: DecodeRows, ended: Mapping[int, SequenceStatus]
          ) -> tuple[DecodeRows, tuple[SequenceGroup, ...], tuple[SequenceGroup, ...]]:
    """The groups of the rows `ended` (row -> the status its sequence stopped with) out of
    the rows: (the rows left, the groups with every sequence ended, the others, which run on
    as records), both in arrival order."""
    if not ended:
        return rows, (), ()
    firsts = sorted({row - int(rows.members[row]) for row in ended})
    groups = [group_at(rows, first, ended) for first in firsts]
    dropped = [row for first in firsts for row in group_span(rows, first)]
    return (without(rows, dropped), tuple(group for group in groups if group.is_finished),
            tuple(group for group in groups if not group.is_finished))


def merged(rows: DecodeRows, groups: tuple[SequenceGroup, ...]) -> tuple[SequenceGroup, ...]:
    """The rows' groups and `groups` (in arrival order) as one tuple in arrival order."""
    if not len(rows):
        return groups
    if not groups:
        return all_groups(rows)
    return by_arrival(all_groups(rows) + groups)


def tokens_left(rows: DecodeRows) -> dict[int, int]:
    """Per row's seq_id, the tokens its sequence may still generate (`max_tokens` bounds them)."""
    return dict(zip(rows.seq_ids.tolist(), (rows.max_tokens - rows.num_output).tolist()))
