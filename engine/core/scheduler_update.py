"""update(): record one engine step's results in the scheduler state.

Every token the step computed is marked computed (and full blocks enter the prefix cache), then
the sampler's actions apply by kind: Appends and Forks (a child copies its parent as sampled,
without the parent's Append), then Finishes and Drops. `engine.core.scheduler` explains how
parallel sampling and beam search map onto actions.
"""

import collections
import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

from engine.core import block_manager, decode_rows
from engine.core.block_manager import BlockManagerState
from engine.core.decode_rows import NO_ROWS
from engine.core.scheduler_state import (
    Action,
    Append,
    AppendMany,
    Drop,
    Finish,
    Fork,
    SchedulerOutput,
    SchedulerState,
    SchedulerUsageError,
    without_ids,
)
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus

Seqs = dict[int, Sequence]
BlocksStep = Callable[[BlockManagerState], BlockManagerState]


def _same(blocks: BlockManagerState) -> BlockManagerState:
    return blocks


def _computed_counts(output: SchedulerOutput, seqs: Seqs) -> tuple[dict[int, int], dict[int, int]]:
    """num_computed_tokens after the step's first model step, per scheduled sequence still
    running; and the sequences sampled, with the most tokens each may get (its `num_steps`)."""
    computed, sampled = {}, {}
    for work in output.scheduled:
        for seq_id in work.seq_ids:
            seq = seqs.get(seq_id)
            if seq is not None and not seq.status.is_finished:
                assert seq.num_computed_tokens == work.start
                computed[seq_id] = work.start + len(work.token_ids)
                if work.do_sample:
                    sampled[seq_id] = work.num_steps
    return computed, sampled


def _target(action: Action) -> int:
    return action.parent_seq_id if isinstance(action, Fork) else action.seq_id


def _child_ids(forks: list[Fork], next_seq_id: int) -> list[int]:
    """Ids for the forks' children: the explicit ones, else the next free ids in order."""
    ids = []
    for fork in forks:
        child_id = next_seq_id if fork.child_seq_id is None else fork.child_seq_id
        if child_id < next_seq_id or child_id in ids:
            raise SchedulerUsageError(
                f"Fork child_seq_id {child_id} is in use; pass None to get a fresh id"
            )
        ids.append(child_id)
        next_seq_id = child_id + 1
    return ids


def _check(by_kind: dict, sampled: dict[int, int], live: set[int]) -> None:
    """Raise SchedulerUsageError unless the actions fit the step that was scheduled."""
    appended = [action.seq_id for action in by_kind[Append] + by_kind[AppendMany]]
    targets = appended + [fork.parent_seq_id for fork in by_kind[Fork]]
    if not sampled.keys() >= set(targets):
        seq_id = next(seq_id for seq_id in targets if seq_id not in sampled)
        raise SchedulerUsageError(
            f"sequence {seq_id} was not sampled this step; Append or Fork only "
            f"sequences from scheduled entries with do_sample"
        )
    for action in by_kind[AppendMany]:
        if not 1 <= len(action.token_ids) <= sampled[action.seq_id]:
            raise SchedulerUsageError(
                f"AppendMany gives sequence {action.seq_id} {len(action.token_ids)} tokens; its "
                f"work's num_steps allows 1 to {sampled[action.seq_id]}"
            )
    appends = set(appended)
    if len(appends) < len(appended):
        twice = [seq_id for seq_id, count in collections.Counter(appended).items() if count > 1]
        raise SchedulerUsageError(f"sequences {twice} got several Appends; Fork extra tokens")
    for action in by_kind[Finish]:
        if not action.status.is_finished or action.status is SequenceStatus.FINISHED_IGNORED:
            raise SchedulerUsageError(f"Finish needs a FINISHED_* status, got {action.status}")
    ended = {action.seq_id for action in by_kind[Finish] + by_kind[Drop]}
    if ended - live:
        raise SchedulerUsageError(f"sequences {sorted(ended - live)} are not running")
    missing = sampled.keys() - appends - ended
    if missing:
        raise SchedulerUsageError(
            f"sampled sequences {sorted(missing)} need an Append, Finish or Drop"
        )


def _end(blocks: BlockManagerState, seqs: Seqs, seq_id: int, status: SequenceStatus):
    seqs[seq_id] = dataclasses.replace(seqs[seq_id], status=status)
    return block_manager.free(blocks, seq_id)


def _apply(
    blocks: BlockManagerState, seqs: Seqs, computed: dict[int, int], by_kind: dict, child_ids: list,
    after_forks: BlocksStep,
) -> tuple[BlockManagerState, dict[int, int], set[int]]:
    """Apply computed counts, forks, appends, finishes and drops to `seqs` (in place), with
    `after_forks` on the blocks between the forks and the finishes; returns the block state,
    each child's parent id, and the dropped ids."""
    child_outputs = [
        seqs[fork.parent_seq_id].output_token_ids + (fork.token_id,) for fork in by_kind[Fork]
    ]
    tokens = {append.seq_id: (append.token_id,) for append in by_kind[Append]}
    tokens.update((append.seq_id, append.token_ids) for append in by_kind[AppendMany])
    for seq_id, num_computed in computed.items():
        seq, new = seqs[seq_id], tokens.get(seq_id, ())
        # All but the last of several tokens were computed on the device by the steps after the first.
        num_computed += max(len(new) - 1, 0)
        # A new record, as dataclasses.replace makes it but at a third of its cost.
        seqs[seq_id] = Sequence(seq.seq_id, seq.prompt_token_ids, seq.output_token_ids + new, seq.status,
                                num_computed)
    blocks = block_manager.mark_computed(blocks, [seqs[seq_id] for seq_id in computed])
    parents = {}
    for fork, child_id, output in zip(by_kind[Fork], child_ids, child_outputs):
        parent = seqs[fork.parent_seq_id]
        seqs[child_id] = dataclasses.replace(parent, seq_id=child_id, output_token_ids=output)
        blocks = block_manager.fork(blocks, parent.seq_id, child_id)
        parents[child_id] = parent.seq_id
    blocks = after_forks(blocks)
    for finish in by_kind[Finish]:
        blocks = _end(blocks, seqs, finish.seq_id, finish.status)
    for drop in by_kind[Drop]:
        blocks = block_manager.free(blocks, drop.seq_id)
    return blocks, parents, {drop.seq_id for drop in by_kind[Drop]}


def _reached_length(seq: Sequence, max_tokens: int, max_model_len: int) -> bool:
    """Whether an unfinished `seq` has generated max_tokens or outgrown max_model_len."""
    if seq.status.is_finished:
        return False
    return len(seq.output_token_ids) >= max_tokens or seq.len > max_model_len


def _regroup(
    state: SchedulerState, seqs: Seqs, parents: dict[int, int], dropped: set[int], sampled: dict[int, int]
) -> tuple[BlockManagerState, tuple[SequenceGroup, ...], tuple[SequenceGroup, ...]]:
    """Rebuild the running groups from `seqs`; finish sequences that reached max_tokens or
    max_model_len; split off the groups with nothing left to generate."""
    blocks, running, finished = state.blocks, [], []
    children = collections.defaultdict(list)
    for child_id, parent_id in parents.items():
        children[parent_id].append(child_id)
    max_model_len = state.config.max_model_len
    for group in state.running_groups:
        if len(group.seqs) == 1 and not (children or dropped):  # most groups: one sequence, kept
            blocks, group = _regroup_one(blocks, group, seqs, sampled, max_model_len)
            (finished if group.seqs[0].status.is_finished else running).append(group)
            continue
        ids = [seq.seq_id for seq in group.seqs]
        if children or dropped:
            ids += [child for seq_id in ids for child in children.get(seq_id, ())]
            ids = [seq_id for seq_id in ids if seq_id not in dropped]
        for seq_id in ids:
            if _reached_length(seqs[seq_id], group.max_tokens, max_model_len):
                blocks = _end(blocks, seqs, seq_id, SequenceStatus.FINISHED_LENGTH)
        num_before = len(group.unfinished_seqs)
        group = group.with_seqs(tuple(seqs[seq_id] for seq_id in ids),
                                in_prefill=group.in_prefill and not sampled.keys() & set(ids))
        if len(group.unfinished_seqs) > num_before:
            raise SchedulerUsageError(
                f"request {group.request_id!r} would grow from {num_before} to "
                f"{len(group.unfinished_seqs)} running sequences; Fork only as many sequences "
                f"as Finish or Drop in the same update"
            )
        if not group.seqs:
            raise SchedulerUsageError(
                f"request {group.request_id!r} would lose all its sequences; Finish the last "
                f"one instead of dropping it"
            )
        (finished if group.is_finished else running).append(group)
    return blocks, tuple(running), tuple(finished)


def _regroup_one(
    blocks: BlockManagerState, group: SequenceGroup, seqs: Seqs, sampled: dict[int, int], max_model_len: int
) -> tuple[BlockManagerState, SequenceGroup]:
    """`_regroup` for a group of one sequence, in an update that forks and drops nothing."""
    seq_id = group.seqs[0].seq_id
    if _reached_length(seqs[seq_id], group.max_tokens, max_model_len):
        blocks = _end(blocks, seqs, seq_id, SequenceStatus.FINISHED_LENGTH)
    return blocks, group.with_seqs((seqs[seq_id],), group.in_prefill and seq_id not in sampled)


def update(state: SchedulerState, actions: Iterable[Action]) -> SchedulerState:
    """Record the step planned by the last schedule(): its tokens are computed, then `actions`
    (the sampler's decisions) apply. Actions on sequences aborted since schedule() are skipped.
    The running groups that decode one sequence are then held as rows (`engine.core.decode_rows`)."""
    if state.pending is None:
        raise SchedulerUsageError("update() records the step planned by schedule(); call it first")
    actions = list(actions)
    updated = _update_rows(state, actions)
    if updated is not None:
        return updated
    state = state.without_rows()
    updated = _one_token_each(state, actions)
    return _settle(updated if updated is not None else update_in_general(state, actions))


def _settle(state: SchedulerState) -> SchedulerState:
    """`state` with its running groups that qualify (`decode_rows.qualifies`) held as rows."""
    entering = [group for group in state.running_groups if decode_rows.qualifies(group)]
    if not entering:
        return state
    return dataclasses.replace(
        state, running_groups=tuple(group for group in state.running_groups if not decode_rows.qualifies(group)),
        rows=decode_rows.enter(state.rows, entering))


def _update_rows(state: SchedulerState, actions: list[Action]) -> SchedulerState | None:
    """`update` for a step planned from the rows as they are (no abort since), whose record
    groups, if any, arrived after every row (so the rows' works and actions come first): each
    row one Append or AppendMany, in the rows' order, and a Finish after it where the sequence
    stopped. The rows are recorded from the columns (records made again only for those that
    filled a block or end), the records as `update_in_general` does, each block operation in
    the order it makes them. None for any other step (the general path then applies the
    actions, or says what is wrong with them)."""
    rows, works, groups = state.rows, state.pending.scheduled, state.running_groups
    if state.pending_rows is not rows or (groups and groups[0].arrival < rows.arrivals[-1]):
        return None
    new, ended = _rows_tokens(rows, works, actions)
    if new is None:
        return None
    others = actions[len(new) + len(ended):]
    if others and not groups:
        return None
    if others:
        ids = set(rows.seq_ids.tolist())
        if any(_target(action) in ids for action in others):
            return None
    before, rows = rows.lengths, decode_rows.appended(rows, new)
    filled = np.flatnonzero((rows.lengths - 1) // state.config.block_manager.block_size
                            > (before - 1) // state.config.block_manager.block_size).tolist()
    blocks = block_manager.mark_computed(state.blocks, [decode_rows.sequence_at(rows, i) for i in filled])
    seq_ids, max_model_len = rows.seq_ids.tolist(), state.config.max_model_len

    def end_stopped(blocks: BlockManagerState) -> BlockManagerState:
        for row in ended:
            blocks = block_manager.free(blocks, seq_ids[row])
        return blocks

    def end_at_length(blocks: BlockManagerState) -> BlockManagerState:
        for row in np.flatnonzero((rows.num_output >= rows.max_tokens) | (rows.lengths > max_model_len)).tolist():
            if row not in ended:
                ended[row] = SequenceStatus.FINISHED_LENGTH
                blocks = block_manager.free(blocks, seq_ids[row])
        return blocks

    if groups:
        pending = dataclasses.replace(state.pending, scheduled=works[len(rows):])
        after = _update_records(dataclasses.replace(state, blocks=blocks, rows=NO_ROWS, pending=pending), others,
                                end_stopped, end_at_length)
    else:
        after = dataclasses.replace(state, blocks=end_at_length(end_stopped(blocks)), pending=None)
    finished = tuple(decode_rows.group_at(rows, row, ended[row]) for row in sorted(ended))
    if ended:
        keep = np.ones(len(rows), bool)
        keep[list(ended)] = False
        rows = decode_rows.kept(rows, keep)
    after = dataclasses.replace(
        after, rows=rows, pending_rows=None, finished=state.finished + finished + after.finished[len(state.finished):],
        live_ids=without_ids(after.live_ids, finished))
    return _settle(after) if groups else after


def _rows_tokens(rows: decode_rows.DecodeRows, works, actions: list[Action]
                 ) -> tuple[list[tuple[int, ...]] | None, dict[int, SequenceStatus]]:
    """From the leading actions that are the rows': each row's new tokens, in order, and the
    rows that stopped (with the Finish's status); None for the tokens when a row gets none."""
    seq_ids, new, ended, count = rows.seq_ids.tolist(), [], {}, len(rows)
    for action in actions:
        kind, row = type(action), len(new)
        if kind is Append and row < count and action.seq_id == seq_ids[row]:
            new.append((action.token_id,))
        elif (kind is AppendMany and row < count and action.seq_id == seq_ids[row]
              and 1 <= len(action.token_ids) <= works[row].num_steps):
            new.append(action.token_ids)
        elif (kind is Finish and row and action.seq_id == seq_ids[row - 1] and row - 1 not in ended
              and action.status.is_finished and action.status is not SequenceStatus.FINISHED_IGNORED):
            ended[row - 1] = action.status
        else:
            break
    return (new if len(new) == count else None), ended


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
                or seq.status.is_finished or (kind is AppendMany and not 1 <= len(action.token_ids) <= work.num_steps)):
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
        if _reached_length(seq, group.max_tokens, max_model_len):
            seq = dataclasses.replace(seq, status=SequenceStatus.FINISHED_LENGTH)
            blocks = block_manager.free(blocks, seq.seq_id)
            finished.append(group.with_seqs((seq,), in_prefill=False))
        else:
            running.append(group.with_seqs((seq,), in_prefill=False))
    finished = tuple(finished)
    return dataclasses.replace(state, blocks=blocks, running_groups=tuple(running), finished=state.finished + finished,
                               pending=None, pending_rows=None, live_ids=without_ids(state.live_ids, finished))


def update_in_general(state: SchedulerState, actions: list[Action]) -> SchedulerState:
    """`update` for any step: the actions checked against it (SchedulerUsageError for a
    mismatch) and applied by kind; every running group a record after it."""
    return _update_records(state.without_rows(), actions)


def _update_records(state: SchedulerState, actions: list[Action], after_forks: BlocksStep = _same,
                    before_lengths: BlocksStep = _same) -> SchedulerState:
    """`update_in_general` of a state without rows, with `after_forks` and `before_lengths`
    on the blocks between the forks and the finishes, and before the length limits end
    sequences (where a step that also ran rows ends theirs)."""
    seqs = {seq.seq_id: seq for group in state.running_groups for seq in group.seqs}
    computed, sampled = _computed_counts(state.pending, seqs)
    aborted = {seq_id for work in state.pending.scheduled for seq_id in work.seq_ids} - seqs.keys()
    by_kind = {kind: [] for kind in (Append, AppendMany, Fork, Finish, Drop)}
    for action in actions:
        if not aborted or _target(action) not in aborted:
            by_kind[type(action)].append(action)
    child_ids = _child_ids(by_kind[Fork], state.next_seq_id)
    live = {seq_id for seq_id, seq in seqs.items() if not seq.status.is_finished}
    _check(by_kind, sampled, live | set(child_ids))
    blocks, parents, dropped = _apply(state.blocks, seqs, computed, by_kind, child_ids, after_forks)
    state = dataclasses.replace(state, blocks=before_lengths(blocks))
    blocks, running, finished = _regroup(state, seqs, parents, dropped, sampled)
    return dataclasses.replace(
        state,
        blocks=blocks,
        running_groups=running,
        finished=state.finished + finished,
        pending=None,
        pending_rows=None,
        next_seq_id=max([state.next_seq_id] + [child_id + 1 for child_id in child_ids]),
        live_ids=without_ids(state.live_ids, finished),
    )
