"""A step's decodes given their slots: as records (`Decodes`), or from the rows' columns
(`plan_rows`); part of `schedule()` (`engine.core.scheduler_plan`)."""

import operator
from collections.abc import Iterable, Sequence

import numpy as np

from engine.core import block_manager, decode_rows, scheduled_rows
from engine.core.block_manager import BlockManagerState
from engine.core.decode_rows import DecodeRows
from engine.core.scheduled_rows import ScheduledRows
from engine.core.scheduler_state import ScheduledGroupWork
from engine.core.sequence import Sequence as SeqRecord
from engine.core.sequence import SequenceGroup

_BLOCK_TABLE = operator.attrgetter("block_table")


class Decodes:
    """Decoding groups given their slots since the plan was last updated, with the block state
    after them and the device blocks still available; the plan takes them all in one update.
    (A step's decodes are most of its groups, and adding them one at a time cost a
    copy of the plan each.)"""

    def __init__(self, blocks: BlockManagerState):
        self.blocks, self.groups, self.work, self.copies = blocks, [], [], []
        self.rows: ScheduledRows | None = None  # the rows' works, as columns, before `work` (`plan_rows`)
        self.free = block_manager.num_free_device_blocks(blocks)
        self.block_size = blocks.config.block_size

    def add_single(self, group: SequenceGroup) -> bool:
        """`add` for a group of one sequence (most decodes) when the pool has what it needs,
        which it finds in the same pass; False, and nothing added, when it does not."""
        work = self.single_work(group.request_id, group.seqs[0])
        if work is None:
            return False
        self.work.append(work)
        self.groups.append(group)
        return True

    def single_work(self, request_id: str, seq: SeqRecord) -> ScheduledGroupWork | None:
        """The decode of `seq`, the one sequence of request `request_id`, given a writable
        slot; None, and nothing changed, when the pool lacks the block it needs. The common
        case, a slot in a block only this sequence holds, changes no block state."""
        start = seq.num_computed_tokens
        assert seq.len - start == 1, "a decoding sequence computes one token"
        table = self.blocks.seqs[seq.seq_id].block_table
        if self.slot_needs_block(table, start):
            needs = block_manager.append_needs(self.blocks, (seq,))
            if needs > self.free:
                return None
            self.free -= needs
            self.blocks, copy = block_manager.append_slot(self.blocks, seq)
            if copy:
                self.copies.append(copy)
            table = self.blocks.seqs[seq.seq_id].block_table
        token = seq.output_token_ids[-1:] if seq.output_token_ids else seq.tokens(start, start + 1)
        return ScheduledGroupWork(request_id, (seq.seq_id,), token, start, table, False, True)

    def slot_needs_block(self, table: tuple[int, ...], position: int) -> bool:
        """Whether writing `position` through `table` takes a block: a new one (past the
        table's end), or a copy of a shared one."""
        index = position // self.block_size
        return index == len(table) or self.blocks.device.refcounts[table[index]] > 1

    def needs(self, group: SequenceGroup) -> int:
        """The blocks `add` takes from the pool for `group` (`block_manager.append_needs` on the
        blocks after the groups added so far); it can when they are at most `free`."""
        return block_manager.append_needs(self.blocks, group.unfinished_seqs)

    def add(self, group: SequenceGroup, needs: int | None = None) -> None:
        """Give every sequence of `group` a writable slot for its last token and schedule that
        token (the pool has the blocks, `needs` of them when given)."""
        self.free -= self.needs(group) if needs is None else needs
        for seq in group.unfinished_seqs:
            start = seq.num_computed_tokens
            assert seq.len - start == 1, "a decoding sequence computes one token"
            self.blocks, copy = block_manager.append_slot(self.blocks, seq)
            if copy:
                self.copies.append(copy)
            # Its whole table: blocks reserved ahead too (a lookahead writes there).
            self.work.append(ScheduledGroupWork(group.request_id, (seq.seq_id,), seq.tokens(start, start + 1), start,
                                                self.blocks.seqs[seq.seq_id].block_table, group.in_prefill, True))
        self.groups.append(group)


def plan_rows(rows: DecodeRows, blocks: BlockManagerState, groups: Sequence[SequenceGroup] = ()) -> Decodes | None:
    """The decodes of `rows` and of the decoding record groups `groups` (in arrival order),
    all in arrival order, as the records' path plans them (`Decodes.add_single` for a row:
    the same works and block operations, in the same order). A row is planned from the
    columns; only one whose token starts a block (one to open, reserved ahead, or shared) has
    its record made. Returns them as `Decodes` (whose `groups` are the record groups alone);
    None when the pool lacks a block one needs (then the records' path preempts). Without
    record groups, the rows' works are columns (`Decodes.rows`: `_plan_rows_alone`)."""
    if not groups:
        return _plan_rows_alone(rows, blocks)
    decodes, size, entries = Decodes(blocks), blocks.config.block_size, blocks.seqs
    at = np.searchsorted(rows.arrivals, [group.arrival for group in groups]).tolist()
    starts = (rows.lengths - 1).tolist()
    for i, (request_id, seq_id, start, token) in enumerate(
            zip(rows.request_ids, rows.seq_ids.tolist(), starts, rows.last_tokens.tolist())):
        while at and at[0] == i:
            if not _add_group(decodes, groups[len(groups) - len(at)]):
                return None
            at.pop(0)
        # Within a block, the slot is in the row's last block, which no other sequence holds
        # (only full blocks are shared, by the prefix cache; rows do not fork, and a group's
        # sequences enter the rows once none shares the block it writes). Other rows' and
        # groups' slots change no row's entry, so `entries` holds this one's still.
        table = entries[seq_id].block_table
        if start % size == 0 and decodes.slot_needs_block(table, start):
            work = decodes.single_work(request_id, decode_rows.sequence_at(rows, i))
            if work is None:
                return None
            decodes.work.append(work)
        else:
            decodes.work.append(ScheduledGroupWork(request_id, (seq_id,), (token,), start, table, False, True))
    for group in groups[len(groups) - len(at):]:
        if not _add_group(decodes, group):
            return None
    return decodes


def _plan_rows_alone(rows: DecodeRows, blocks: BlockManagerState) -> Decodes | None:
    """`plan_rows` without record groups: the works as columns. Only the rows whose token
    starts a block are looked at one by one (as `plan_rows` looks at them)."""
    decodes, size, entries = Decodes(blocks), blocks.config.block_size, blocks.seqs
    seq_ids = rows.seq_ids.tolist()
    tables = rows.tables  # as the last step left them, when it planned them as columns
    if tables is None:
        tables = list(map(_BLOCK_TABLE, map(entries.__getitem__, seq_ids)))
    works = scheduled_rows.planned(rows, tables)
    changed = {}
    for i in np.flatnonzero(works.starts % size == 0).tolist():
        if decodes.slot_needs_block(tables[i], int(works.starts[i])):
            work = decodes.single_work(rows.request_ids[i], decode_rows.sequence_at(rows, i))
            if work is None:
                return None
            changed[i] = work.block_table
    decodes.rows = works.with_tables(changed)
    return decodes


def _add_group(decodes: Decodes, group: SequenceGroup) -> bool:
    """Add the decoding record `group` to `decodes` as the records' path does; False when the
    pool lacks its blocks."""
    if len(group.seqs) == 1 and decodes.add_single(group):
        return True
    needs = decodes.needs(group)
    if needs > decodes.free:
        return False
    decodes.add(group, needs)
    return True


def tokens_left(rows: DecodeRows, groups: Iterable[SequenceGroup]) -> dict[int, int]:
    """Per sequence of `rows` and of those of `groups` that do not fork, the tokens it may
    still generate."""
    left = decode_rows.tokens_left(rows)
    left.update((seq.seq_id, group.max_tokens - len(seq.output_token_ids))
                for group in groups if not group.may_fork for seq in group.unfinished_seqs)
    return left
