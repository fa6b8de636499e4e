"""schedule(): plan one engine step (see `engine.core.scheduler` for the whole protocol)."""

import collections
import dataclasses
import functools

from engine.core import admission, block_manager, block_swap, scheduler_ahead
from engine.core.block_manager import AllocStatus, BlockManagerState
from engine.core.block_pool import blocks_for
from engine.core.decode_rows import NO_ROWS, DecodeRows
from engine.core.records import record
from engine.core.scheduled_rows import PlannedWorks, ScheduledRows
from engine.core.scheduler_decodes import Decodes, plan_rows, tokens_left
from engine.core.scheduler_state import (
    ScheduledGroupWork,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerState,
    SchedulerUsageError,
    without_ids,
)
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus, by_arrival, set_unfinished_status


@record
class _PartialPlan:
    """What schedule() has decided so far in one step: `rows` and `running` run (the groups
    held as rows, and the others as records); the rows' works are `row_works` (columns, first
    in the step's works) when planned from the columns alone, else in `work`."""

    blocks: BlockManagerState
    rows: DecodeRows = NO_ROWS
    row_works: ScheduledRows | None = None
    running: tuple[SequenceGroup, ...] = ()
    work: tuple[ScheduledGroupWork, ...] = ()
    num_tokens: int = 0
    num_seqs: int = 0
    to_waiting: tuple[SequenceGroup, ...] = ()
    to_swapped: tuple[SequenceGroup, ...] = ()
    preempted: tuple[str, ...] = ()
    ignored: tuple[SequenceGroup, ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    copies: tuple[tuple[int, int], ...] = ()


def _group_work(
    blocks: BlockManagerState, group: SequenceGroup, seqs: tuple[Sequence, ...], length: int, do_sample: bool
) -> ScheduledGroupWork:
    """The next `length` uncomputed tokens of seqs[0], written for all of `seqs`, through the
    blocks they need (a prefill's; `scheduler_decodes` makes the decodes' works)."""
    first, size = seqs[0], blocks.config.block_size
    start = first.num_computed_tokens
    table = block_manager.block_table(blocks, first.seq_id)
    return ScheduledGroupWork(
        request_id=group.request_id,
        seq_ids=tuple(seq.seq_id for seq in seqs),
        token_ids=first.tokens(start, start + length),
        start=start,
        block_table=table[: blocks_for(start + length, size)],
        is_prefill=group.in_prefill,
        do_sample=do_sample,
    )


def _prefill_work(
    blocks: BlockManagerState, group: SequenceGroup, budget: int
) -> tuple[ScheduledGroupWork, ...]:
    """Up to `budget` prefill tokens of `group`: first the tokens its sequences share (one
    entry for all), then each sequence's own rest; sampling only when all are complete."""
    seqs = group.unfinished_seqs
    shared = block_manager.num_shared_tokens(blocks, seqs)
    computed = seqs[0].num_computed_tokens
    if computed < shared:
        assert all(seq.num_computed_tokens == computed for seq in seqs)
        length = min(shared - computed, budget)
        if not length:
            return ()
        return (_group_work(blocks, group, seqs, length, computed + length == seqs[0].len),)
    complete = sum(seq.num_uncomputed_tokens for seq in seqs) <= budget
    entries = []
    for seq in seqs:
        length = seq.num_uncomputed_tokens
        if not complete:
            length = min(length - 1, budget)
        if length > 0:
            budget -= length
            entries.append(_group_work(blocks, group, (seq,), length, complete))
    return tuple(entries)


def _add_to_batch(
    step: _PartialPlan,
    groups: tuple[SequenceGroup, ...],
    work: tuple[ScheduledGroupWork, ...],
    blocks: BlockManagerState | None = None,
    copies: tuple[tuple[int, int], ...] = (),
) -> _PartialPlan:
    """Add `groups` and their work to the step (with the block state and copies that work needs)."""
    return dataclasses.replace(
        step,
        blocks=step.blocks if blocks is None else blocks,
        copies=step.copies + copies,
        running=step.running + groups,
        work=step.work + work,
        num_tokens=step.num_tokens + sum(len(w.token_ids) for w in work),
        num_seqs=step.num_seqs + sum(len(group.unfinished_seqs) for group in groups),
    )


def _add_decodes(step: _PartialPlan, decodes: Decodes) -> _PartialPlan:
    """`step` with the groups of `decodes` and their work (its blocks must be the ones they
    started from); the rows' works, if `decodes` holds them as columns, as `row_works`."""
    if not decodes.work and decodes.rows is None:
        return step
    assert decodes.free == block_manager.num_free_device_blocks(decodes.blocks), "the decodes' blocks were miscounted"
    if decodes.rows is not None:
        step = dataclasses.replace(step, row_works=decodes.rows, num_tokens=step.num_tokens + len(decodes.rows))
    return _add_to_batch(step, tuple(decodes.groups), tuple(decodes.work), decodes.blocks, tuple(decodes.copies))


def _schedule_decode(step: _PartialPlan, group: SequenceGroup) -> _PartialPlan:
    """Give every sequence of `group` a writable slot for its last token and schedule that token."""
    decodes = Decodes(step.blocks)
    decodes.add(group)
    return _add_decodes(step, decodes)


def _schedule_prefill_chunk(step: _PartialPlan, group: SequenceGroup, config: SchedulerConfig) -> _PartialPlan:
    """Schedule the group's next prefill chunk; groups admitted later in the step may share the
    full blocks it completes (with prefix caching)."""
    budget = config.max_num_batched_tokens - step.num_tokens
    work = _prefill_work(step.blocks, group, budget)
    blocks, seqs = step.blocks, {seq.seq_id: seq for seq in group.unfinished_seqs}
    for entry in work:
        blocks = block_manager.mark_scheduled(blocks, seqs[entry.seq_ids[0]], entry.context_len)
    return _add_to_batch(step, (group,), work, blocks)


def _schedule_group(step: _PartialPlan, group: SequenceGroup, config: SchedulerConfig) -> _PartialPlan:
    """Schedule the group's next prefill chunk, or its decode tokens."""
    if group.in_prefill:
        return _schedule_prefill_chunk(step, group, config)
    return _schedule_decode(step, group)


def _has_room(step: _PartialPlan, group: SequenceGroup, config: SchedulerConfig) -> bool:
    """Whether the step's sequence and token budgets can take `group` (a prefill needs at
    least one token, a decode one per sequence)."""
    num_seqs = len(group.unfinished_seqs)
    num_tokens = 1 if group.in_prefill else num_seqs
    return (
        step.num_seqs + num_seqs <= config.max_num_seqs
        and step.num_tokens + num_tokens <= config.max_num_batched_tokens
    )


def _reset_for_recompute(group: SequenceGroup) -> SequenceGroup:
    seqs = tuple(
        seq if seq.status.is_finished
        else dataclasses.replace(seq, status=SequenceStatus.WAITING, num_computed_tokens=0)
        for seq in group.seqs
    )
    return dataclasses.replace(group, seqs=seqs, in_prefill=True)


def _free_group(blocks: BlockManagerState, group: SequenceGroup) -> BlockManagerState:
    for seq in group.unfinished_seqs:
        blocks = block_manager.free(blocks, seq.seq_id)
    return blocks


def _preempt(step: _PartialPlan, group: SequenceGroup, mode: str | None) -> _PartialPlan:
    """Swap the group out (mode "swap", or automatic with several sequences) if the host pool
    can take it, else free its blocks to recompute it later."""
    step = dataclasses.replace(step, preempted=step.preempted + (group.request_id,))
    use_swap = mode == "swap" or (mode is None and len(group.unfinished_seqs) > 1)
    if use_swap and block_swap.can_swap_out(step.blocks, group):
        blocks, pairs = block_swap.swap_out(step.blocks, group)
        group = set_unfinished_status(group, SequenceStatus.SWAPPED)
        return dataclasses.replace(
            step, blocks=blocks, to_swapped=step.to_swapped + (group,),
            swap_out=step.swap_out + pairs,
        )
    return dataclasses.replace(
        step, blocks=_free_group(step.blocks, group),
        to_waiting=step.to_waiting + (_reset_for_recompute(group),),
    )


def _schedule_running(state: SchedulerState) -> _PartialPlan:
    """Keep running groups in FCFS order; a decoding group that cannot get its slots preempts
    the most recently arrived groups (itself last). Prefills continue within the token budget
    left after all decodes. Decodes held as rows are planned from their columns
    (`scheduler_decodes.plan_rows`, with the records that decode) unless a block runs short."""
    if len(state.rows):
        decoding = [group for group in state.running_groups if not group.in_prefill]
        decodes = plan_rows(state.rows, state.blocks, decoding)
        if decodes is not None:
            step = _add_decodes(_PartialPlan(blocks=state.blocks, rows=state.rows, num_seqs=len(state.rows)), decodes)
            return _schedule_prefills(step, [group for group in state.running_groups if group.in_prefill],
                                      state.config)
    state = state.without_rows()
    step, queue = _PartialPlan(blocks=state.blocks), collections.deque(state.running_groups)
    prefilling, decodes = [], Decodes(state.blocks)
    while queue:
        group = queue.popleft()
        if group.in_prefill:
            prefilling.append(group)
            continue
        if len(group.seqs) == 1 and decodes.add_single(group):
            continue
        needs = decodes.needs(group)
        if needs > decodes.free:
            step, preempted_itself, needs = _add_decodes(step, decodes), False, None
            while not preempted_itself and not block_manager.can_append_slots(step.blocks, group):
                victim = queue.pop() if queue else group
                step = _preempt(step, victim, state.config.preemption_mode)
                preempted_itself = victim is group
            decodes = Decodes(step.blocks)
            if preempted_itself:
                continue
        decodes.add(group, needs)
    return _schedule_prefills(_add_decodes(step, decodes), prefilling, state.config)


def _schedule_prefills(step: _PartialPlan, groups, config: SchedulerConfig) -> _PartialPlan:
    """`step` with the next prefill chunk of each of `groups`, in order, within its budget."""
    for group in groups:
        step = _schedule_prefill_chunk(step, group, config)
    return step


def _only_decodes(step: _PartialPlan) -> bool:
    """Whether the step decodes and does nothing else: no prefill, swap, preemption or refusal,
    and no group that may fork (beam search chooses its beams on the host at every step)."""
    return ((bool(step.work) or step.row_works is not None)
            and not (step.preempted or step.swap_in or step.swap_out or step.ignored)
            and not any(work.is_prefill for work in step.work) and not any(group.may_fork for group in step.running))


def _ignore(step: _PartialPlan, group: SequenceGroup, reason: str) -> _PartialPlan:
    """Finish a group that can never run, releasing whatever it holds."""
    blocks = _free_group(step.blocks, group)
    group = set_unfinished_status(group, SequenceStatus.FINISHED_IGNORED)
    group = dataclasses.replace(group, ignored_reason=reason)
    return dataclasses.replace(step, blocks=blocks, ignored=step.ignored + (group,))


def _swap_in(step: _PartialPlan, group: SequenceGroup, config: SchedulerConfig) -> _PartialPlan:
    blocks, pairs = block_swap.swap_in(step.blocks, group)
    group = set_unfinished_status(group, SequenceStatus.RUNNING)
    step = dataclasses.replace(step, blocks=blocks, swap_in=step.swap_in + pairs)
    return _schedule_group(step, group, config)


def _admit(step: _PartialPlan, group: SequenceGroup, config: SchedulerConfig) -> _PartialPlan:
    """Allocate the group's blocks (prefix-cache hits count as computed) and start its prefill."""
    blocks, num_cached_tokens = block_manager.allocate(step.blocks, group)
    seqs = tuple(
        seq if seq.status.is_finished
        else dataclasses.replace(
            seq, status=SequenceStatus.RUNNING, num_computed_tokens=num_cached_tokens
        )
        for seq in group.seqs
    )
    group = dataclasses.replace(group, seqs=seqs, in_prefill=True)
    return _schedule_prefill_chunk(dataclasses.replace(step, blocks=blocks), group, config)


def _take_in_order(
    step: _PartialPlan, queue: tuple[SequenceGroup, ...], config: SchedulerConfig, status_of, enter
) -> tuple[_PartialPlan, tuple[SequenceGroup, ...]]:
    """Run groups from the front of `queue` in FCFS order; returns the groups left in it.

    `status_of(blocks, group, config)` gives an AllocStatus and, for NEVER, the reason: such a
    group is ignored. The first group that must wait for blocks or budget stops the loop;
    `enter(step, group, config)` runs the others.
    """
    for index, group in enumerate(queue):
        status, reason = status_of(step.blocks, group, config)
        if status is AllocStatus.NEVER:
            step = _ignore(step, group, reason)
        elif status is AllocStatus.LATER or not _has_room(step, group, config):
            return step, queue[index:]
        else:
            step = enter(step, group, config)
    return step, ()


def schedule(
    state: SchedulerState, *, admit: bool = True, num_steps: int = 1
) -> tuple[SchedulerState, SchedulerOutput]:
    """Plan one step: decodes of running groups (preempting when blocks run out), prefill
    chunks, then, unless this step preempted, swap-ins and admissions (none while any group is
    swapped out; with policy "static", only when nothing runs). `admit` False: no swap-ins or
    admissions this step, whatever fits (the engine's async scheduling defers arrivals by a
    step so as to take a decode step it already ran). `num_steps` > 1: a step of decodes only
    becomes a multi-step decode of up to that many tokens per sequence (see `engine.core.scheduler`)."""
    if state.pending is not None:
        raise SchedulerUsageError(
            "schedule() called twice: record the previous step with update() first"
        )
    config = state.config
    step = _schedule_running(state)
    swapped, waiting = state.swapped, state.waiting
    queue_tried = admit and not step.preempted
    if queue_tried:
        step, swapped = _take_in_order(step, swapped, config, admission.swap_in_status, _swap_in)
        if not swapped and (config.policy == "fcfs" or not (step.running or len(step.rows))):
            step, waiting = _take_in_order(step, waiting, config, admission.admission_status, _admit)
    ahead = config.reserve_next_block and (queue_tried or not (swapped or waiting))
    reserved = None
    works = step.work if step.row_works is None else PlannedWorks(step.row_works, step.work)
    left = functools.partial(tokens_left, step.rows, step.running)  # read only where the columns do not say
    if num_steps > 1 and _only_decodes(step):
        reserved = scheduler_ahead.reserve_steps(step.blocks, works, left, num_steps, config, ahead)
    if reserved is None and ahead and not step.preempted:
        reserved = scheduler_ahead.reserve_next_blocks(step.blocks, works, left, config)
    if reserved is not None:
        step, works = dataclasses.replace(step, blocks=reserved[0]), reserved[1]
    output = SchedulerOutput(
        scheduled=works,
        blocks_to_swap_in=step.swap_in,
        blocks_to_swap_out=step.swap_out,
        blocks_to_copy=step.copies,
        preempted=step.preempted,
        ignored=tuple((group.request_id, group.ignored_reason) for group in step.ignored),
        queue_tried=queue_tried,
    )
    state = dataclasses.replace(
        state,
        blocks=step.blocks,
        waiting=by_arrival(step.to_waiting + waiting),
        running_groups=by_arrival(step.running),
        rows=step.rows,
        swapped=by_arrival(swapped + step.to_swapped),
        finished=step.ignored,
        pending=output,
        pending_rows=step.rows if len(step.rows) else None,
        num_preemptions=state.num_preemptions + len(step.preempted),
        num_swap_outs=state.num_swap_outs + len(step.to_swapped),
        live_ids=without_ids(state.live_ids, step.ignored),
    )
    return state, output
