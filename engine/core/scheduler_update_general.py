"""The general path of update(): any step's actions checked against it and applied by kind.

Every token the step computed is marked computed (and full blocks enter the prefix cache), then
the sampler's actions apply by kind: Appends and Forks (a child copies its parent as sampled,
without the parent's Append), then Finishes and Drops. `engine.core.scheduler` explains how
parallel sampling and beam search map onto actions. `engine.core.scheduler_update` takes the
common steps by shorter paths that give the same states.
"""

import collections
import dataclasses
from collections.abc import Callable

from engine.core import block_manager
from engine.core.block_manager import BlockManagerState
from engine.core.scheduler_state import (
    Action,
    Append,
    AppendEach,
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


def action_target(action: Action) -> int:
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
        if not action.fits(sampled[action.seq_id]):
            raise SchedulerUsageError(
                f"AppendMany gives sequence {action.seq_id} {len(action.token_ids)} tokens; its "
                f"work's num_steps allows 1 to {sampled[action.seq_id]}"
            )
    appends = set(appended)
    if len(appends) < len(appended):
        twice = [seq_id for seq_id, count in collections.Counter(appended).items() if count > 1]
        raise SchedulerUsageError(f"sequences {twice} got several Appends; Fork extra tokens")
    for action in by_kind[Finish]:
        if not action.has_valid_status:
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


def reached_length(seq: Sequence, max_tokens: int, max_model_len: int) -> bool:
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
            if reached_length(seqs[seq_id], group.max_tokens, max_model_len):
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
    if reached_length(seqs[seq_id], group.max_tokens, max_model_len):
        blocks = _end(blocks, seqs, seq_id, SequenceStatus.FINISHED_LENGTH)
    return blocks, group.with_seqs((seqs[seq_id],), group.in_prefill and seq_id not in sampled)


def expanded(actions: list[Action]) -> list[Action]:
    """`actions` with each `AppendEach` as its Appends."""
    if not any(type(action) is AppendEach for action in actions):
        return actions
    return [each for action in actions
            for each in (action.appends() if type(action) is AppendEach else (action,))]


def update_in_general(state: SchedulerState, actions: list[Action]) -> SchedulerState:
    """`update` for any step: the actions checked against it (SchedulerUsageError for a
    mismatch) and applied by kind; every running group a record after it."""
    return update_records(state.without_rows(), actions)


def update_records(state: SchedulerState, actions: list[Action], after_forks: BlocksStep = _same,
                    before_lengths: BlocksStep = _same) -> SchedulerState:
    """`update_in_general` of a state without rows, with `after_forks` and `before_lengths`
    on the blocks between the forks and the finishes, and before the length limits end
    sequences (where a step that also ran rows ends theirs)."""
    seqs = {seq.seq_id: seq for group in state.running_groups for seq in group.seqs}
    computed, sampled = _computed_counts(state.pending, seqs)
    aborted = {seq_id for work in state.pending.scheduled for seq_id in work.seq_ids} - seqs.keys()
    by_kind = {kind: [] for kind in (Append, AppendMany, Fork, Finish, Drop)}
    for action in expanded(actions):
        if not aborted or action_target(action) not in aborted:
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
