"""A step's decodes given their slots: as records (`Decodes`), or from the rows' columns
(`plan_rows`); part of `schedule()` (`engine.core.scheduler_plan`)."""

from collections.abc import Iterable

from engine.core import block_manager, decode_rows
from engine.core.block_manager import BlockManagerState
from engine.core.decode_rows import DecodeRows
from engine.core.scheduler_state import ScheduledGroupWork
from engine.core.sequence import SequenceGroup


class Decodes:
    """Decoding groups given their slots since the plan was last updated, with the block state
    after them and the device blocks still available; the plan takes them all in one update.
    (A step's decodes are most of its groups, and adding them one at a time cost a
    copy of the plan each.)"""

    def __init__(self, blocks: BlockManagerState):
        self.blocks, self.groups, self.work, self.copies = blocks, [], [], []
        self.free = block_manager.num_free_device_blocks(blocks)
        self.block_size = blocks.config.block_size

    def add_single(self, group: SequenceGroup) -> bool:
        """`add` for a group of one sequence (most decodes) when the pool has what it needs,
        which it finds in the same pass; False, and nothing added, when it does not. The common
        case, a slot in a block only this sequence holds, changes no block state."""
        (seq,) = group.seqs
        start = seq.num_computed_tokens
        assert seq.len - start == 1, "a decoding sequence computes one token"
        table, index = self.blocks.seqs[seq.seq_id].block_table, start // self.block_size
        if index == len(table) or self.blocks.device.refcounts[table[index]] > 1:  # a new block, or a copy
            needs = block_manager.append_needs(self.blocks, group.seqs)
            if needs > self.free:
                return False
            self.free -= needs
            self.blocks, copy = block_manager.append_slot(self.blocks, seq)
            if copy:
                self.copies.append(copy)
            table = self.blocks.seqs[seq.seq_id].block_table
        token = seq.output_token_ids[-1:] if seq.output_token_ids else seq.tokens(start, start + 1)
        self.work.append(ScheduledGroupWork(group.request_id, (seq.seq_id,), token, start, table, False, True))
        self.groups.append(group)
        return True

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


def plan_rows(rows: DecodeRows, blocks: BlockManagerState
              ) -> tuple[BlockManagerState, tuple[ScheduledGroupWork, ...], tuple[tuple[int, int], ...]] | None:
    """The decodes of `rows`, as `Decodes.add_single` plans each (the same works and block
    operations, in the same order), from the columns: only a row whose token starts a block
    (one to open, reserved ahead, or shared) reads its record. Returns the blocks after them,
    their works and the copies they need; None when the pool lacks a block one needs (then the
    records' path preempts)."""
    size, entries, works, copies, free = blocks.config.block_size, blocks.seqs, [], [], None
    starts = (rows.lengths - 1).tolist()
    for i, (request_id, seq_id, start, token) in enumerate(
            zip(rows.request_ids, rows.seq_ids.tolist(), starts, rows.last_tokens.tolist())):
        table = entries[seq_id].block_table
        # Within a block, the slot is in the row's last block, which no other sequence holds
        # (only full blocks are shared, by the prefix cache; rows do not fork).
        if start % size == 0 and (start // size == len(table) or blocks.device.refcounts[table[start // size]] > 1):
            free = block_manager.num_free_device_blocks(blocks) if free is None else free
            seq = decode_rows.sequence_at(rows, i)
            needs = block_manager.append_needs(blocks, (seq,))
            if needs > free:
                return None
            free -= needs
            blocks, copy = block_manager.append_slot(blocks, seq)
            if copy:
                copies.append(copy)
            table = blocks.seqs[seq_id].block_table
        works.append(ScheduledGroupWork(request_id, (seq_id,), (token,), start, table, False, True))
    assert free is None or free == block_manager.num_free_device_blocks(blocks), "the rows' blocks were miscounted"
    return blocks, tuple(works), tuple(copies)


def tokens_left(rows: DecodeRows, groups: Iterable[SequenceGroup]) -> dict[int, int]:
    """Per sequence of `rows` and of those of `groups` that do not fork, the tokens it may
    still generate."""
    left = decode_rows.tokens_left(rows)
    left.update((seq.seq_id, group.max_tokens - len(seq.output_token_ids))
                for group in groups if not group.may_fork for seq in group.unfinished_seqs)
    return left
