"""Iteration-level FCFS scheduling over the paged block manager; pure, like the block manager.

One engine step:

    state, out = schedule(state)
    cache engine: out.blocks_to_swap_out, then out.blocks_to_swap_in, then out.blocks_to_copy
    model: computes the KV of every `out.scheduled` entry; sampler: samples where do_sample
    state = update(state, actions)

Order of block operations. Swap-outs free device blocks that later allocations of the same
step may reuse (as copy targets, swap-in targets or fresh prefill blocks), so the cache engine
must apply `blocks_to_swap_out` first, then `blocks_to_swap_in`, then `blocks_to_copy`, and only
then run the model. A step never both swaps out and swaps in, so host blocks are never reused
within a step; copy sources are always blocks still referenced, never ones freed this step.

`update` first marks every scheduled token computed, then applies the actions by kind, whatever
their order in the tuple: `Append`s (or an `AppendEach`, the Appends, or a multi-step
decode's AppendManys, of many sequences in one action) and `Fork`s (a child copies its parent as it was sampled,
without the parent's own Append), then `Finish`es and `Drop`s. Every sequence sampled this step
needs an `Append`, a `Finish` or a `Drop`. A group may not end an update with more unfinished
sequences than it started with (forks replace sequences that end), which keeps the
`max_num_seqs` budget that admitted it. A sequence whose output reaches `max_tokens`, or whose
length exceeds `max_model_len`, is then finished with FINISHED_LENGTH.

Parallel sampling (n samples, best_of): `add_request(..., num_seqs=n)`. The prompt is computed
once into blocks shared by the n sequences (one scheduled entry listing all n seq_ids); the
engine samples n tokens from that entry's logits and sends one `Append` per sequence. On the
next step each sequence writes its token; the first writers copy-on-write the shared last block.

Beam search (width k): `add_request(..., num_seqs=k, may_fork=True)` (no block is reserved
ahead for beams: a fork would share it only to copy it); the first step takes the top k tokens
of the shared prompt logits, one `Append` per beam. Each later step, for every beam: chosen
once → `Append(seq_id, token)`; chosen m > 1 times → m - 1 `Fork(seq_id, None, token)` plus an
`Append`; not chosen → `Drop(seq_id)` (frees its blocks, removes it from the group); a beam
that ends → `Append` then `Finish(seq_id, FINISHED_STOPPED)`. Children share all parent blocks.
Forks with child_seq_id=None get ids state.next_seq_id, +1, ... in action order.

Multi-step decode: `schedule(state, num_steps=k)` plans, when the step is decodes only (no
prefill, swap, preemption or beam search), `k` decode steps at once: each decode work reserves
the slots of its next `num_steps` tokens (fewer near `max_tokens` or `max_model_len`), the
engine samples them all on the device, and `update` gets one `AppendMany` per sequence with the
tokens it keeps (up to its stop), or one `AppendEach` of them all. The rows' works stay columns
(`ScheduledRows.steps` counts each one's steps). When a reservation does not fit, the plan is one step. With
`reserve_next_block` and nothing waiting that could enter (`SchedulerOutput.queue_tried`), the slots
of the loop after it are reserved too when
they fit, so that the engine can dispatch that loop before this one's tokens are known.

Prefill of a group whose sequences differ (a multi-sequence group preempted by recompute) runs
in two stages: the leading blocks all sequences share are computed once (one entry listing
every seq_id, not sampled), then each sequence's own remainder (one entry per sequence). The
group samples only in a step that completes every sequence, so its sequences stay in lockstep.
"""

import dataclasses
from collections.abc import Iterable

from engine.core import block_manager, decode_rows
from engine.core.scheduler_plan import schedule
from engine.core.scheduler_state import (
    POLICIES,
    PREEMPTION_MODES,
    Action,
    Append,
    AppendEach,
    AppendMany,
    Drop,
    Finish,
    Fork,
    InvalidRequestError,
    ScheduledGroupWork,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerState,
    SchedulerStats,
    SchedulerUsageError,
)
from engine.core.scheduler_update import update
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus, set_unfinished_status

__all__ = [
    "POLICIES",
    "PREEMPTION_MODES",
    "Action",
    "Append",
    "AppendEach",
    "AppendMany",
    "Drop",
    "Finish",
    "Fork",
    "InvalidRequestError",
    "ScheduledGroupWork",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerState",
    "SchedulerStats",
    "SchedulerUsageError",
    "abort",
    "add_request",
    "find_group",
    "initial_state",
    "schedule",
    "stats",
    "update",
]


def initial_state(config: SchedulerConfig) -> SchedulerState:
    """Empty queues over an empty block manager."""
    return SchedulerState(config=config, blocks=block_manager.initial_state(config.block_manager))


def find_group(state: SchedulerState, request_id: str) -> SequenceGroup | None:
    """The live (waiting, running or swapped) group of `request_id`, if any."""
    if request_id not in state.live_ids:
        return None
    rows = state.rows
    if request_id in rows.request_ids:
        return decode_rows.group_at(rows, rows.request_ids.index(request_id))
    live = state.waiting + state.running_groups + state.swapped
    return next((group for group in live if group.request_id == request_id), None)


def add_request(
    state: SchedulerState,
    request_id: str,
    prompt_token_ids: Iterable[int],
    *,
    max_tokens: int,
    num_seqs: int = 1,
    expected_output_len: int | None = None,
    use_prefix_cache: bool = True,
    may_fork: bool = False,
) -> SchedulerState:
    """Queue a request of `num_seqs` sequences sharing the prompt (n / best_of / beam width):
    its group joins the end of `waiting`.
    `use_prefix_cache` False: compute the whole prompt, whatever the prefix cache holds.
    `may_fork`: its updates may fork sequences (beam search), so no block is reserved ahead
    for them (`SchedulerConfig.reserve_next_block`)."""
    config, prompt = state.config, tuple(prompt_token_ids)
    if not prompt:
        raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
    if not 1 <= num_seqs <= config.max_num_seqs:
        raise InvalidRequestError(
            f"request {request_id!r}: num_seqs must be in 1..{config.max_num_seqs} "
            f"(max_num_seqs), got {num_seqs}"
        )
    if max_tokens < 1:
        raise InvalidRequestError(f"request {request_id!r}: max_tokens must be >= 1")
    if request_id in state.live_ids:
        raise InvalidRequestError(f"request id {request_id!r} is in use; pick a unique one")
    reservation = config.block_manager.reservation
    if reservation in ("orca-pow2", "orca-oracle") and (expected_output_len or 0) < 1:
        raise InvalidRequestError(
            f"request {request_id!r}: reservation {reservation!r} needs expected_output_len >= 1"
        )
    seqs = tuple(Sequence(state.next_seq_id + i, prompt) for i in range(num_seqs))
    group = SequenceGroup(
        request_id=request_id,
        seqs=seqs,
        arrival=state.next_arrival,
        max_tokens=max_tokens,
        num_seqs=num_seqs,
        expected_output_len=expected_output_len,
        use_prefix_cache=use_prefix_cache,
        may_fork=may_fork,
    )
    return dataclasses.replace(
        state,
        waiting=state.waiting + (group,),
        next_seq_id=state.next_seq_id + num_seqs,
        next_arrival=state.next_arrival + 1,
        live_ids=state.live_ids.insert(request_id),
    )


def _without(groups: tuple[SequenceGroup, ...], group: SequenceGroup) -> tuple[SequenceGroup, ...]:
    return tuple(other for other in groups if other.request_id != group.request_id)


def abort(state: SchedulerState, request_id: str) -> SchedulerState:
    """Finish `request_id` with FINISHED_ABORTED wherever it is (waiting, running, swapped,
    mid-chunk) and free everything it holds. A request that already left is ignored."""
    group = find_group(state, request_id)
    if group is None:
        return state
    blocks = state.blocks
    for seq in group.unfinished_seqs:
        blocks = block_manager.free(blocks, seq.seq_id)
    return dataclasses.replace(
        state,
        blocks=blocks,
        waiting=_without(state.waiting, group),
        running_groups=_without(state.running_groups, group),
        rows=decode_rows.without(state.rows, [i for i, rid in enumerate(state.rows.request_ids) if rid == request_id]),
        swapped=_without(state.swapped, group),
        finished=state.finished + (set_unfinished_status(group, SequenceStatus.FINISHED_ABORTED),),
        live_ids=state.live_ids.remove(request_id),
    )


def reset_prefix_cache(state: SchedulerState) -> SchedulerState | None:
    """The state with an empty prefix cache, or None while requests run or are swapped out
    (they hold blocks: wait until they finish, or abort them)."""
    if state.num_running or state.swapped or state.pending is not None:
        return None
    return dataclasses.replace(state, blocks=block_manager.reset_prefix_cache(state.blocks))


def stats(state: SchedulerState) -> SchedulerStats:
    """Queue lengths, preemptions, device KV usage and the block manager's accounting."""
    rows = state.rows
    num_tokens = dict(zip(rows.seq_ids.tolist(), (rows.lengths - 1).tolist()))
    num_tokens.update((seq.seq_id, seq.num_computed_tokens)
                      for group in state.running_groups for seq in group.unfinished_seqs)
    blocks = block_manager.stats(state.blocks, num_tokens)
    return SchedulerStats(
        num_running=state.num_running,
        num_waiting=len(state.waiting),
        num_swapped=len(state.swapped),
        num_running_seqs=len(num_tokens),
        num_preemptions=state.num_preemptions,
        num_swap_outs=state.num_swap_outs,
        kv_usage=blocks.device_blocks_used / blocks.device_blocks_total,
        blocks=blocks,
    )
