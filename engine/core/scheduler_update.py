"""update(): record one engine step's results in the scheduler state.

The general path (`engine.core.scheduler_update_general`) applies any step's actions by kind;
the common steps take shorter paths that give the same states: a step of the rows' decodes
(`engine.core.decode_rows`), with the record groups' work if any, recorded from the columns;
and a step of records that each sample one sequence. After the general path, the groups whose
sequences all decode join the rows (a row per sequence); a group of which a sequence stops in
a step of the rows leaves them.
"""

import dataclasses
from collections.abc import Iterable

import numpy as np

from engine.core import block_manager, decode_rows, scheduled_rows
from engine.core.block_manager import BlockManagerState
from engine.core.decode_rows import NO_ROWS
from engine.core.scheduler_state import (
    Action,
    Append,
    AppendEach,
    AppendMany,
    Finish,
    SchedulerState,
    SchedulerUsageError,
    without_ids,
)
from engine.core.scheduler_update_general import (
    action_target,
    expanded,
    reached_length,
    update_in_general,
    update_records,
)
from engine.core.sequence import Sequence, SequenceStatus, by_arrival

__all__ = ["update", "update_in_general"]


def update(state: SchedulerState, actions: Iterable[Action]) -> SchedulerState:
    """Record the step planned by the last schedule(): its tokens are computed, then `actions`
    (the sampler's decisions) apply. Actions on sequences aborted since schedule() are skipped.
    The running groups whose sequences all decode are then held as rows (`engine.core.decode_rows`)."""
    if state.pending is None:
        raise SchedulerUsageError("update() records the step planned by schedule(); call it first")
    actions = list(actions)
    updated = _update_rows(state, actions)
    if updated is not None:
        return updated
    actions = expanded(actions)
    state = state.without_rows()
    updated = _one_token_each(state, actions)
    return _settle(updated if updated is not None else update_in_general(state, actions))


def _settle(state: SchedulerState) -> SchedulerState:
    """`state` with its running groups that qualify (`decode_rows.qualifies`) held as rows:
    of a group of several sequences, once none writes into a block another holds (the
    prompt's last block, shared until each has copied it)."""
    entering, staying, blocks = [], [], state.blocks
    for group in state.running_groups:
        enters = decode_rows.qualifies(group) and (
            len(group.seqs) == 1 or all(block_manager.writes_privately(blocks, seq) for seq in group.seqs))
        (entering if enters else staying).append(group)
    if not entering:
        return state
    return dataclasses.replace(state, running_groups=tuple(staying), rows=decode_rows.enter(state.rows, entering))


def _update_rows(state: SchedulerState, actions: list[Action]) -> SchedulerState | None:
    """`update` for a step planned from the rows as they are (no abort since): each row one
    Append or AppendMany, in the rows' order, and a Finish after it where the sequence stopped
    (or an AppendEach of every row first, and the Finishes of rows after it).
    The rows are recorded from the columns (records made again only for those that filled a
    block or end), the record groups as `update_in_general` does, every block operation in the
    order it makes them: the records' between the rows' where they arrived after every row;
    where not, only in a step in which rows and records do not both fill blocks, nor both end
    sequences (orders that do not matter then). None for any other step (the general path then
    applies the actions, or says what is wrong with them)."""
    rows, works, groups = state.rows, state.pending.scheduled, state.running_groups
    if state.pending_rows is not rows:
        return None
    seq_ids = rows.seq_ids.tolist()
    planned, row_steps, record_works = _row_and_record_works(seq_ids, works, bool(groups))
    new, ended, others = _rows_tokens(rows.seq_ids, row_steps, actions)
    if new is None or (others and not groups):
        return None
    before, rows = rows.lengths, _appended(rows, new, None if planned is None else planned.tables)
    size, caching = state.config.block_manager.block_size, state.config.block_manager.enable_prefix_caching
    filled = np.flatnonzero((rows.lengths - 1) // size > (before - 1) // size).tolist()
    blocks = block_manager.mark_computed(state.blocks, [decode_rows.sequence_at(rows, i) for i in filled])
    at_length = (rows.num_output >= rows.max_tokens) | (rows.lengths > state.config.max_model_len)

    def end_stopped(blocks: BlockManagerState) -> BlockManagerState:
        return block_manager.free_each(blocks, [seq_ids[row] for row in ended])

    def end_at_length(blocks: BlockManagerState) -> BlockManagerState:
        rows = [row for row in np.flatnonzero(at_length).tolist() if row not in ended]
        ended.update(dict.fromkeys(rows, SequenceStatus.FINISHED_LENGTH))
        return block_manager.free_each(blocks, [seq_ids[row] for row in rows])

    if not groups:
        after = dataclasses.replace(state, blocks=end_at_length(end_stopped(blocks)), pending=None)
    else:
        pending = dataclasses.replace(state.pending, scheduled=tuple(record_works))
        records = dataclasses.replace(state, blocks=blocks, rows=NO_ROWS, pending=pending)
        if groups[0].arrival > rows.arrivals[-1]:
            after = update_records(records, others, end_stopped, end_at_length)
        else:
            after = update_records(records, others)
            records_fill = caching and _may_fill(records.blocks, record_works, size)
            records_end = any(seq.seq_id not in after.blocks.seqs for group in groups for seq in group.unfinished_seqs)
            if (filled and records_fill) or ((ended or at_length.any()) and records_end):
                return None
            after = dataclasses.replace(after, blocks=end_at_length(end_stopped(after.blocks)))
    rows, finished, running_on = decode_rows.leave(rows, ended)
    running = by_arrival(after.running_groups + running_on) if running_on else after.running_groups
    after = dataclasses.replace(
        after, rows=rows, running_groups=running, pending_rows=None,
        finished=state.finished + finished + after.finished[len(state.finished):],
        live_ids=without_ids(after.live_ids, finished))
    return _settle(after) if groups else after


def _may_fill(blocks: BlockManagerState, works, size: int) -> bool:
    """Whether marking `works` computed may enter blocks in the prefix cache: one crosses a
    block boundary, or holds a sequence whose cached blocks lag behind its computed ones."""
    for work in works:
        if work.write_end // size > work.start // size:
            return True
        for seq_id in work.seq_ids:
            entry = blocks.seqs.get(seq_id)
            if entry is not None and len(entry.cache_entry_ids) < work.start // size:
                return True
    return False


def _row_and_record_works(seq_ids: list[int], works, has_records: bool):
    """A plan's works as (the rows' works as columns, or None; the steps of each row's work;
    the record groups' works), the rows being those of `seq_ids` (in that order)."""
    planned, record_works = scheduled_rows.rows_of(works)
    if planned is not None:  # the rows' works as columns
        return planned, planned.steps_list(), record_works
    # Without record groups, works beyond the rows' are those of groups aborted since the plan.
    row_works, record_works = (_split_works(seq_ids, works) if has_records or len(works) != len(seq_ids)
                               else (works, ()))
    return None, [work.num_steps for work in row_works], record_works


def _split_works(seq_ids: list[int], works) -> tuple[list, list]:
    """A plan's works: the rows' (of `seq_ids`, one each, in that order) and the record groups'."""
    row_works, record_works = [], []
    for work in works:
        row = len(row_works)
        (row_works if row < len(seq_ids) and work.seq_ids == (seq_ids[row],) else record_works).append(work)
    return row_works, record_works


def _rows_tokens(row_seq_ids: np.ndarray, row_steps: list[int], actions: list[Action]
                 ) -> tuple[list[tuple[int, ...]] | AppendEach | None, dict[int, SequenceStatus], list[Action]]:
    """From the actions on the rows of `row_seq_ids` (in that order, the records' anywhere
    between them), with `row_steps` the steps of the rows' works: each row's new tokens, in
    order (or an `AppendEach` of every row, first, within their steps), and the rows that
    stopped (with the Finish's status); and the other actions. An `AppendEach` that starts
    with every row may go on with the record groups' sequences (`_rows_first`). None for the
    tokens when a row gets none, or an action on a row is out of that order."""
    seq_ids = row_seq_ids.tolist()
    split = _rows_first(actions[0], row_seq_ids) if actions and type(actions[0]) is AppendEach else None
    if split is not None and _fits_steps(split[0], row_steps):
        return _rows_ends(seq_ids, split[0], split[1] + actions[1:])
    new, ended, count, others, ids = [], {}, len(seq_ids), [], None
    for action in expanded(actions):
        kind, row = type(action), len(new)
        if kind is Append and row < count and action.seq_id == seq_ids[row]:
            new.append((action.token_id,))
        elif (kind is AppendMany and row < count and action.seq_id == seq_ids[row]
              and action.fits(row_steps[row])):
            new.append(action.token_ids)
        elif (kind is Finish and row and action.seq_id == seq_ids[row - 1] and row - 1 not in ended
              and action.has_valid_status):
            ended[row - 1] = action.status
        else:
            ids = set(seq_ids) if ids is None else ids
            if action_target(action) in ids:
                return None, ended, others
            others.append(action)
    return (new if len(new) == count else None), ended, others


def _fits_steps(each: AppendEach, row_steps: list[int]) -> bool:
    """Whether `each` gives every row one token (works of one step each), or at least one and
    at most its work's steps."""
    if each.counts is None:
        return max(row_steps, default=1) == 1
    return bool(np.all((each.counts >= 1) & (each.counts <= np.asarray(row_steps))))


def _appended(rows, new: list[tuple[int, ...]] | AppendEach, tables):
    """The rows after each gained its tokens of `new` (`_rows_tokens`'), through `tables`."""
    if type(new) is not AppendEach:
        return decode_rows.appended(rows, new, tables)
    if new.counts is None:
        return decode_rows.appended(rows, new.token_ids, tables)
    return decode_rows.appended_many(rows, new.token_ids, new.counts, tables)


def _rows_first(each: AppendEach, row_seq_ids: np.ndarray) -> tuple[AppendEach, list[Action]] | None:
    """`each` as an `AppendEach` of the rows and the Appends (or AppendManys) of the sequences
    after them (the record groups' that sampled in the step: the output processor gives one
    `AppendEach` of every plain sequence, the rows' first); None unless it starts with the rows."""
    n, ids = len(row_seq_ids), each.seq_ids
    if len(ids) < n or not np.array_equal(ids[:n], row_seq_ids):
        return None
    if len(ids) == n:
        return each, []
    counts = (None, None) if each.counts is None else (each.counts[:n], each.counts[n:])
    rest = AppendEach(ids[n:], each.token_ids[n:], counts[1])
    return AppendEach(ids[:n], each.token_ids[:n], counts[0]), rest.appends()


def _rows_ends(seq_ids: list[int], tokens: AppendEach, actions: list[Action]
               ) -> tuple[AppendEach | None, dict[int, SequenceStatus], list[Action]]:
    """`_rows_tokens` after an `AppendEach` of every row (`tokens`): the Finishes of rows,
    in their order, and the other actions (None for the tokens if one is on a row)."""
    ended, others, row_of = {}, [], None
    for action in actions:
        if type(action) is AppendEach:
            return None, ended, others
        row_of = row_of or {seq_id: row for row, seq_id in enumerate(seq_ids)}
        row = row_of.get(action_target(action))
        if row is None:
            others.append(action)
        elif type(action) is Finish and row not in ended and action.has_valid_status:
            ended[row] = action.status
        else:
            return None, ended, others
    return tokens, ended, others


def _fits_one_token_each(state: SchedulerState, actions: list[Action]) -> bool:
    """Whether the step is `_one_token_each`'s: every running group has one sequence, each
    sampled by its own work (in the same order), and the actions are one Append or AppendMany
    of that sequence each, in that order, within its work's steps."""
    works, running = state.pending.scheduled, state.running_groups
    if not len(works) == len(running) == len(actions):
        return False
    for group, work, action in zip(running, works, actions):
        kind = type(action)
        if (kind is not Append and kind is not AppendMany) or len(group.seqs) != 1 or not work.do_sample:
            return False
        seq = group.seqs[0]
        if (work.request_id != group.request_id or work.seq_ids != (seq.seq_id,) or action.seq_id != seq.seq_id
                or seq.status.is_finished or (kind is AppendMany and not action.fits(work.num_steps))):
            return False
    return True


def _one_token_each(state: SchedulerState, actions: list[Action]) -> SchedulerState | None:
    """`update_in_general` for the common step, in two passes over the groups and no
    dictionary of every sequence: every running group one sequence that sampled and gets its
    tokens (`_fits_one_token_each`); no fork, finish or drop. None for any other step."""
    if not _fits_one_token_each(state, actions):
        return None
    seqs = []
    for group, work, action in zip(state.running_groups, state.pending.scheduled, actions):
        seq = group.seqs[0]
        assert seq.num_computed_tokens == work.start
        new = (action.token_id,) if type(action) is Append else action.token_ids
        # All but the last of several tokens were computed on the device by the steps after the first.
        seqs.append(Sequence(seq.seq_id, seq.prompt_token_ids, seq.output_token_ids + new, seq.status,
                             work.start + len(work.token_ids) + len(new) - 1))
    blocks = block_manager.mark_computed(state.blocks, seqs)
    running, finished, max_model_len = [], [], state.config.max_model_len
    for group, seq in zip(state.running_groups, seqs):
        if reached_length(seq, group.max_tokens, max_model_len):
            seq = dataclasses.replace(seq, status=SequenceStatus.FINISHED_LENGTH)
            blocks = block_manager.free(blocks, seq.seq_id)
            finished.append(group.with_seqs((seq,), in_prefill=False))
        else:
            running.append(group.with_seqs((seq,), in_prefill=False))
    finished = tuple(finished)
    return dataclasses.replace(state, blocks=blocks, running_groups=tuple(running), finished=state.finished + finished,
                               pending=None, pending_rows=None, live_ids=without_ids(state.live_ids, finished))
