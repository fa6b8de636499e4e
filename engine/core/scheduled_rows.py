"""A step's works with the rows' decodes as columns: what `schedule()` plans for the rows.

Most steps, most works are the decodes of the rows (`engine.core.decode_rows`), one token
each. `ScheduledRows` holds those works as the rows' columns and a block table per row, so
that planning a step, checking that a lookahead computed it and dispatching the step after
cost array operations, not a record per sequence. `PlannedWorks` is a plan's
`SchedulerOutput.scheduled`: the rows' works, then the other works (prefill chunks,
admissions) as records. It is a sequence of `ScheduledGroupWork` like any plan's, made on
first use for the paths that read works one by one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from engine.core.decode_rows import DecodeRows
from engine.core.records import record
from engine.core.scheduler_state import ScheduledGroupWork


@record(eq=False)
class ScheduledRows:
    """The decodes of `rows`, one work each, in the rows' order: row i computes its last token
    (`rows.last_tokens[i]`) at position `starts[i]` (``rows.lengths[i] - 1``) through
    `tables[i]`, its sequence's whole block table (blocks reserved ahead included), in
    `steps[i]` decode steps (a multi-step decode: `engine.multi_step`; None: one each)."""

    rows: DecodeRows
    tables: tuple[tuple[int, ...], ...]
    starts: np.ndarray  # int64 [M]
    steps: np.ndarray | None = None  # int64 [M]

    def __len__(self) -> int:
        return len(self.tables)

    @functools.cached_property
    def table_lengths(self) -> np.ndarray:
        """Blocks in each row's table: int64 [M]."""
        return np.fromiter(map(len, self.tables), np.int64, len(self.tables))

    def next_slot_held(self, block_size: int) -> np.ndarray:
        """Whether each row's table holds the slot of the token after this step's: bool [M]."""
        return self.starts + 1 < self.table_lengths * block_size

    @property
    def num_steps(self) -> int:
        """The most steps any row's work runs."""
        return 1 if self.steps is None or not len(self.steps) else int(self.steps.max())

    def steps_list(self) -> list[int]:
        """Each row's steps."""
        return [1] * len(self) if self.steps is None else self.steps.tolist()

    def works(self) -> tuple[ScheduledGroupWork, ...]:
        """The works as records."""
        rows = self.rows
        return tuple(ScheduledGroupWork(request_id, (seq_id,), (token,), start, table, False, True, steps)
                     for request_id, seq_id, token, start, table, steps in zip(
                         rows.request_ids, rows.seq_ids.tolist(), rows.last_tokens.tolist(), self.starts.tolist(),
                         self.tables, self.steps_list()))

    def with_tables(self, changed: dict[int, tuple[int, ...]]) -> ScheduledRows:
        """These works with row i's table `changed[i]` where given."""
        if not changed:
            return self
        tables = list(self.tables)
        for i, table in changed.items():
            tables[i] = table
        return ScheduledRows(self.rows, tuple(tables), self.starts, self.steps)

    def with_steps(self, steps: np.ndarray) -> ScheduledRows:
        """These works as multi-step decodes of `steps[i]` steps each (int64 [M])."""
        return ScheduledRows(self.rows, self.tables, self.starts, steps)

    def following(self, num_steps: int, steps: np.ndarray) -> ScheduledRows:
        """The works of the multi-step decode after these (each of `num_steps` steps): each row
        `num_steps` positions on, through the same tables, for `steps[i]` steps (int64 [M])."""
        return ScheduledRows(self.rows, self.tables, self.starts + num_steps, steps)

    def same_steps(self, other: ScheduledRows) -> bool:
        """Whether these works run as many steps per row as `other`'s."""
        if self.steps is None or other.steps is None:
            return self.num_steps == other.num_steps == 1
        return np.array_equal(self.steps, other.steps)


def planned(rows: DecodeRows, tables: Sequence[tuple[int, ...]]) -> ScheduledRows:
    """The decodes of `rows` through `tables`, one per row."""
    return ScheduledRows(rows, tuple(tables), rows.lengths - 1)


class PlannedWorks(Sequence):
    """A plan's works: the decodes `rows` (columns), then `others` (records). A sequence of
    `ScheduledGroupWork` equal to the tuple of the same works; the records of the rows' works
    are made on first use."""

    __slots__ = ("rows", "others", "_works")

    def __init__(self, rows: ScheduledRows, others: tuple[ScheduledGroupWork, ...] = ()):
        self.rows, self.others, self._works = rows, tuple(others), None

    @property
    def works(self) -> tuple[ScheduledGroupWork, ...]:
        """Every work as a record, in order."""
        if self._works is None:
            self._works = self.rows.works() + self.others
        return self._works

    def __len__(self) -> int:
        return len(self.rows) + len(self.others)

    def __getitem__(self, index):
        return self.works[index]

    def __iter__(self):
        return iter(self.works)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, PlannedWorks)):
            return self.works == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.works)

    def __add__(self, other):
        return self.works + tuple(other)

    def __radd__(self, other):
        return tuple(other) + self.works

    def __repr__(self) -> str:
        return f"PlannedWorks({len(self.rows)} rows, {len(self.others)} others)"

    def __reduce__(self):
        return tuple, (self.works,)


def rows_of(works: Sequence[ScheduledGroupWork]) -> tuple[ScheduledRows | None, Sequence[ScheduledGroupWork]]:
    """`works` split into the rows' decodes as columns (None when they are not held so) and
    the other works."""
    if isinstance(works, PlannedWorks):
        return works.rows, works.others
    return None, works


def rows_alone(works: Sequence[ScheduledGroupWork]) -> ScheduledRows | None:
    """The rows' decodes as columns when they are all of `works` (no other work); else None."""
    rows, others = rows_of(works)
    return rows if rows is not None and not others else None


def num_tokens(works: Sequence[ScheduledGroupWork]) -> int:
    """The tokens `works` compute in their first step (the rows' one each, from the columns)."""
    rows, others = rows_of(works)
    return (0 if rows is None else len(rows)) + sum(len(work.token_ids) for work in others)
