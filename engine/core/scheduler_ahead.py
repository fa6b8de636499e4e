"""Blocks reserved before tokens need them: the next token's block (async scheduling's
lookaheads) and the slots of a multi-step decode's loops. Part of `schedule()`
(`engine.core.scheduler_plan`); each function takes the step's block state, its works and the
tokens each sequence may still generate, and returns them with the blocks appended and the
works naming them."""

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from engine.core import block_manager, scheduled_rows
from engine.core.block_manager import BlockManagerState
from engine.core.block_pool import blocks_for
from engine.core.scheduled_rows import PlannedWorks, ScheduledRows
from engine.core.scheduler_state import ScheduledGroupWork, SchedulerConfig

Works = Sequence[ScheduledGroupWork]  # a tuple, or PlannedWorks


def reserve_next_blocks(
    blocks: BlockManagerState, works: Sequence[ScheduledGroupWork], tokens_left: Callable[[], Mapping[int, int]],
    config: SchedulerConfig,
) -> tuple[BlockManagerState, Works]:
    """Give each decode whose next token opens a block that block now
    (`SchedulerConfig.reserve_next_block`), in order while the pool has blocks; the decode's
    work then names it. Not for groups that may fork (beam search: a fork would share the
    block only to copy it), and only for a sequence that samples again after this step (within
    max_tokens and max_model_len). `tokens_left()` gives, per sequence of a group that does not
    fork, the tokens it may still generate (called only when a decode opens a block)."""
    size, max_model_len = config.block_manager.block_size, config.max_model_len
    row_works, others = scheduled_rows.rows_of(works)
    opening = [] if row_works is None else _rows_opening(row_works, size, max_model_len)
    opening += [work.seq_ids[0] for work in others if not work.is_prefill
                and len(work.block_table) * size <= work.start + len(work.token_ids) < max_model_len]
    if not opening:  # most steps: every next token's slot is in its table already
        return blocks, works if row_works is not None else tuple(works)
    wanted, left = {}, tokens_left()
    budget = block_manager.num_free_device_blocks(blocks)
    for seq_id in opening:
        if left.get(seq_id, 0) > 1:
            fresh = block_manager.num_fresh_blocks(blocks, seq_id, 1)
            if fresh <= budget:
                wanted[seq_id], budget = 1, budget - fresh
    return _with_blocks(blocks, works, wanted)


def _rows_opening(works: ScheduledRows, size: int, max_model_len: int) -> list[int]:
    """The seq ids of the rows whose next token (after this step's) opens a block, within
    `max_model_len`."""
    return works.rows.seq_ids[~works.next_slot_held(size) & (works.starts + 1 < max_model_len)].tolist()


def reserve_steps(
    blocks: BlockManagerState, works: Sequence[ScheduledGroupWork], tokens_left: Callable[[], Mapping[int, int]],
    num_steps: int, config: SchedulerConfig, ahead: bool,
) -> tuple[BlockManagerState, Works] | None:
    """The decodes `works` (one sequence each) as multi-step decodes of up to `num_steps`
    tokens each (within the sequence's `max_tokens` and `max_model_len`), with the blocks
    their slots need; None when the pool cannot give them all. `tokens_left()` gives, per
    sequence of the works not held as the rows' columns, the tokens it may still generate.
    `ahead` (`SchedulerConfig.reserve_next_block`, the queue tried): also the slots of the
    loop after, when the pool has them all, so that the engine can dispatch that loop before
    this one's tokens are known."""
    row_works, others = scheduled_rows.rows_of(works)
    size, max_model_len = config.block_manager.block_size, config.max_model_len
    left = {} if not others else tokens_left()
    steps, now, later, row_steps = {}, {}, {}, None
    if row_works is not None:
        rows, starts, lengths = row_works.rows, row_works.starts, row_works.table_lengths
        tokens = np.minimum(rows.max_tokens - rows.num_output, max_model_len - starts)
        row_steps = np.minimum(num_steps, tokens)
        for counts, ends in ((now, starts + row_steps), (later, starts + np.minimum(2 * num_steps, tokens))):
            needed = -(-ends // size) - lengths
            opening = np.flatnonzero(needed > 0)
            counts.update(zip(rows.seq_ids[opening].tolist(), needed[opening].tolist()))
    for work in others:
        (seq_id,) = work.seq_ids
        tokens = min(left[seq_id], max_model_len - work.start)
        steps[seq_id] = min(num_steps, tokens)
        now[seq_id] = blocks_for(work.start + steps[seq_id], size) - len(work.block_table)
        later[seq_id] = blocks_for(work.start + min(2 * num_steps, tokens), size) - len(work.block_table)
    for counts in ([later, now] if ahead else [now]):
        counts = {seq_id: n for seq_id, n in counts.items() if n > 0}
        fresh = sum(block_manager.num_fresh_blocks(blocks, seq_id, n) for seq_id, n in counts.items())
        if fresh <= block_manager.num_free_device_blocks(blocks):
            return _with_blocks(blocks, works, counts, steps, row_steps)
    return None


def _with_blocks(
    blocks: BlockManagerState, works: Sequence[ScheduledGroupWork], counts: dict[int, int],
    num_steps: dict[int, int] | None = None, row_steps: np.ndarray | None = None,
) -> tuple[BlockManagerState, Works]:
    """`counts[seq_id]` blocks appended to the listed decodes' tables (their works naming
    them), and the works of `num_steps` (the rows' works: `row_steps`) as multi-step decodes
    of that many steps."""
    if counts:
        blocks = block_manager.append_blocks(blocks, counts)
    row_works, others = scheduled_rows.rows_of(works)
    changed = []
    for work in others:
        seq_id, steps = work.seq_ids[0], (num_steps or {}).get(work.seq_ids[0], 1)
        if seq_id in counts or steps > 1:
            table = block_manager.block_table(blocks, seq_id) if seq_id in counts else work.block_table
            work = work.changed(block_table=table, num_steps=steps)
        changed.append(work)
    if row_works is None:
        return blocks, tuple(changed)
    rows = np.flatnonzero(np.isin(row_works.rows.seq_ids, list(counts))).tolist()
    tables = {i: block_manager.block_table(blocks, int(row_works.rows.seq_ids[i])) for i in rows}
    row_works = row_works.with_tables(tables)
    return blocks, PlannedWorks(row_works if row_steps is None else row_works.with_steps(row_steps), tuple(changed))
