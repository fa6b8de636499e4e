"""Async scheduling: the next decode step, dispatched before this one's tokens reach the host.

While the device runs step N, the host would otherwise wait for N's tokens, record them,
schedule N+1, build its arrays and dispatch it, with the device idle all that time (about a
quarter of a single-sequence step here). Instead, right after dispatching N, the engine
dispatches a *lookahead* step N+1 whose input tokens are N's sampled tokens still on the
device, then records N while N+1 runs. When the scheduler next decides, it normally decides
exactly the lookahead's work, and the engine takes the lookahead's tokens instead of running
the step again; otherwise the lookahead is dropped. Requests that arrive meanwhile enter a
step later (``LLMEngine._plan``) rather than drop it: a step of device time for every running
request, against the host's turnaround between two steps for the new ones.

A lookahead is only dispatched when it cannot disagree with the scheduler except by a
sequence stopping at N (a stop token, EOS, an abort): a decode-only step, no admissions at
N+1 (nothing waits or is swapped out, or step N admitted all that fit, so that the rest waits
until a sequence ends: ``SchedulerState.queue_settled``, which is most steps of a server
under load), no sequence at its length limit, every next token's slot already in its block
table (in its last token's block, or in the next block, which the scheduler reserves a step
early: ``SchedulerConfig.reserve_next_block``; so no allocation, preemption or
copy-on-write), and no sampling input that depends on the token still on the device in a
way only the host can follow (bad words, a constraint, ``min_tokens`` still to reach) or on
the host's choices (beam search). Penalties count it: the lookahead's sampling parameters
write it into the tokens they count, on the device (``sampling_rows.next_batch``), while
their array has room (it is a power of two wide; when full, the host builds a wider one).
Dropping one is harmless: it wrote KV only one slot past each sequence's context, in a block
the sequence alone holds, where nothing reads before the slot is written again.

A lookahead whose work lost some sequences is dropped, not taken in part: its rows of
sequences that ended would go on into the next lookahead, writing KV past their freed blocks,
and the smaller batch the scheduler planned computes its logits differently in the last bits
(another program), so async scheduling would no longer give exactly the outputs without it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import numpy as np

from engine.core import scheduled_rows
from engine.core.records import record
from engine.core.scheduled_rows import PlannedWorks, ScheduledRows
from engine.core.scheduler import ScheduledGroupWork, SchedulerOutput, SchedulerState
from engine.request_state import RequestState
from engine.worker import sampling_rows
from engine.worker.model_runner import ModelRunner, StepInputs
from engine.worker.sampler import SamplerOutput, SamplingBatch
from engine.worker.sampling_rows import Row


@record
class InFlightStep:
    """A step's sampling, dispatched, its outputs not yet read: its rows, and the sampler's
    device arrays (whose first rows are ``rows``, in order); the model's inputs and the
    sampler's parameters, None when the tokens are the decode program's arg-max (what a
    lookahead after it starts from); the next decode's inputs if the decode program computed
    them (``ModelOutput.next_inputs``), and the block tables its inputs hold (those that
    decode's slots were found in). ``rows_in_order``: row i reads logits row i (as a
    lookahead's rows do)."""

    rows: tuple[Row, ...]
    sampled: SamplerOutput
    inputs: StepInputs
    batch: SamplingBatch | None
    next_inputs: StepInputs | None
    block_tables: tuple[tuple[int, ...], ...]  # those of ``inputs``, one per row
    rows_in_order: bool = False


@record
class Lookahead:
    """A decode step (or a multi-step decode's loop: ``engine.multi_step``) dispatched before
    the scheduler decided it, and its sampling. Its works are ``works``, each ``positions_on``
    positions after its ``start`` (placeholder tokens): a single-step lookahead keeps the works
    of the step before it (as the plan held them: the rows' as columns), rather than remaking
    every one of them each step."""

    works: Sequence[ScheduledGroupWork]  # a tuple, or the plan's PlannedWorks
    in_flight: object  # InFlightStep, or multi_step.InFlightSteps
    positions_on: int = 0


def dispatch_next(runner: ModelRunner, kv_caches, works: Sequence[ScheduledGroupWork], in_flight: InFlightStep
                  ) -> tuple[Lookahead | None, list]:
    """Dispatch the decode after ``works`` (see :func:`eligible`), its input tokens
    ``in_flight``'s samples on the device. Returns the lookahead (None when the step picked its
    logits rows, padded its samples to another size, or its penalties have no room for its
    tokens: ``sampling_rows.next_batch``) and the caches after it."""
    tokens, inputs = in_flight.sampled.tokens, in_flight.inputs
    if inputs.pick or tokens.shape != inputs.input_ids.shape:
        return None, kv_caches
    batch = None if in_flight.batch is None else sampling_rows.next_batch(in_flight.batch, tokens)
    if in_flight.batch is not None and batch is None:
        return None, kv_caches
    next_inputs = in_flight.next_inputs if in_flight.next_inputs is not None else runner.advance(inputs)
    tables = block_tables(works)
    if tables != in_flight.block_tables:  # the scheduler reserved blocks since: the next slots may be there
        next_inputs = runner.with_tables_of(next_inputs, works)
    inputs = next_inputs.replace(input_ids=tokens)
    out, kv_caches = runner.run(inputs, kv_caches)
    if batch is None:  # the same program as ``in_flight``'s, so the arg-max is there
        sampled = sampling_rows.model_argmax(out.argmax)
    else:
        sampled = sampling_rows.dispatch_next(out.logits, batch)
    rows = in_flight.rows
    if not in_flight.rows_in_order and any(row.logits_row != i for i, row in enumerate(rows)):
        rows = tuple(dataclasses.replace(row, logits_row=i) for i, row in enumerate(rows))
    in_flight = InFlightStep(rows, sampled, inputs, batch, out.next_inputs, tables, rows_in_order=True)
    return Lookahead(works if isinstance(works, PlannedWorks) else tuple(works), in_flight, positions_on=1), kv_caches


def block_tables(works: Sequence[ScheduledGroupWork]) -> tuple[tuple[int, ...], ...]:
    """Each work's block table, in order (the rows' as they are held)."""
    planned, others = scheduled_rows.rows_of(works)
    if planned is None:
        return tuple(work.block_table for work in works)
    return planned.tables + tuple(work.block_table for work in others)


def eligible(works: Sequence[ScheduledGroupWork], requests: dict[str, RequestState], state: SchedulerState,
             block_size: int) -> bool:
    """Whether the step after ``works`` (this step's scheduled work) can be dispatched now (see
    the module's docstring); ``state`` is the scheduler's after this step's ``schedule``."""
    if not state.queue_settled or not works:
        return False
    planned, others = scheduled_rows.rows_of(works)
    if planned is not None and not _rows_eligible(planned, requests, block_size):
        return False
    for work in others:
        request = requests.get(work.request_id)
        if (request is None or work.is_prefill or not work.do_sample or len(work.token_ids) != 1
                or len(work.seq_ids) != 1 or not sampling_is_static(request, work.seq_ids[0])
                or work.start + 1 >= len(work.block_table) * block_size  # the next token's slot is not held
                or len(request.generated(work.seq_ids[0])) + 1 >= request.max_tokens):
            return False
    return True


_STATIC_FROM = operator.attrgetter("static_sampling_from")


def static_sampling_from(rows, requests: dict[str, RequestState]) -> np.ndarray | None:
    """Each of the decode rows' ``RequestState.static_sampling_from`` (int64 [M]), or None when
    a row's request is no longer the engine's (aborted since)."""
    try:
        return np.fromiter(map(_STATIC_FROM, map(requests.__getitem__, rows.request_ids)), np.int64, len(rows))
    except KeyError:
        return None


def _rows_eligible(planned: ScheduledRows, requests: dict[str, RequestState], block_size: int) -> bool:
    """`eligible`'s rules for the rows' decodes, from their columns (a row's generated tokens
    are its sequence's output count in the scheduler's rows)."""
    rows = planned.rows
    static_from = static_sampling_from(rows, requests)
    if static_from is None:
        return False
    return bool(np.all((rows.num_output >= static_from) & (rows.num_output + 1 < rows.max_tokens)
                       & planned.next_slot_held(block_size)))


def sampling_is_static(request: RequestState, seq_id: int) -> bool:
    """Whether the sampler's inputs for ``seq_id``'s next token do not depend on this step's
    token: the request's sampling does not (:attr:`RequestState.sampling_is_static`), and
    ``min_tokens`` is reached (the step after this one must not ban EOS)."""
    return len(request.generated(seq_id)) >= request.static_sampling_from


def computed(lookahead: Lookahead, plan: SchedulerOutput) -> bool:
    """Whether ``lookahead`` computed exactly the step ``plan`` plans: the same works, through
    the same blocks (the plan's tables may hold a block more, reserved since for later tokens)."""
    works, on = lookahead.works, lookahead.positions_on
    if (plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.blocks_to_copy or plan.preempted
            or len(plan.scheduled) != len(works)):
        return False
    (planned_rows, planned_others), (ran_rows, ran_others) = (scheduled_rows.rows_of(plan.scheduled),
                                                              scheduled_rows.rows_of(works))
    if planned_rows is not None and ran_rows is not None and len(planned_rows) == len(ran_rows):
        if not _rows_computed(ran_rows, planned_rows, on):
            return False
        pairs = zip(planned_others, ran_others)
    else:
        pairs = zip(plan.scheduled, works)
    for planned, work in pairs:
        table = work.block_table
        if (planned.start != work.start + on or planned.seq_ids != work.seq_ids
                or planned.request_id != work.request_id or planned.num_steps != work.num_steps
                or planned.is_prefill != work.is_prefill or planned.do_sample != work.do_sample
                or planned.block_table[: len(table)] != table):
            return False
    return True


def _rows_computed(ran: ScheduledRows, planned: ScheduledRows, on: int) -> bool:
    """`computed` for the rows' decodes, from their columns: the same rows, ``on`` positions
    on, as many steps each, through the same blocks (the planned tables may hold more)."""
    if not (ran.rows.request_ids == planned.rows.request_ids and np.array_equal(ran.rows.seq_ids, planned.rows.seq_ids)
            and np.array_equal(planned.starts, ran.starts + on) and planned.same_steps(ran)):
        return False
    return planned.tables == ran.tables or all(
        table[: len(before)] == before for table, before in zip(planned.tables, ran.tables) if table is not before)
